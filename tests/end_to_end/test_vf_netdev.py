"""`VfConfig.netDevice` end to end: `dra-agent run`'s agent on a simulated dgx-h100 node, the kubelet simulator over
the real socket, the test API server. The CDI spec moves the VF's interface into the pod (cdiVersion 1.1.0), the
checkpoint record carries the network data and facts, each refusal fails its own claim only and leaves nothing
behind, and an interface still in another network namespace is refused until the simulated kernel returns it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.claims.checkpoint import Checkpoint
from agent.claims.records import ClaimRecord
from agent.settings import Settings
from backends.contract import ClaimRef, NetworkData
from simulator.kubelet import KubeletSimulator
from simulator.node.procfs import ROUTE_HEADER
from simulator.udev.hotplug import UdevInjector
from simulator.udev.netns_moves import netns_leave, netns_return
from tests.support.agent_env import agent_in_process, allocate, wait_until
from tests.support.cdi_schema import cdi_schema_errors

SRIOV = "sriov.dra-agent.io"
API = "dra-agent.io/v1alpha1"
VFS = {n: (f"0000:19:00.{n + 1}", f"vf-0000-19-00-{n + 1}", f"enp25s0f0v{n}") for n in range(4)}


def net_device(name: str, requests: tuple[str, ...] = ("nic",), source: str = "FromClaim") -> dict[str, Any]:
    return {"source": source, "requests": list(requests),
            "opaque": {"driver": SRIOV, "parameters": {"apiVersion": API, "kind": "VfConfig",
                                                       "netDevice": {"name": name}}}}


def spec_of(settings: Settings, uid: str) -> dict[str, Any] | None:
    found = list(settings.cdi_dir.glob(f"*{uid}*"))
    return yaml.safe_load(found[0].read_text()) if found else None


def records(settings: Settings, scratch: Path) -> dict[str, ClaimRecord]:
    """The driver's checkpoint as a new agent would read it (from a copy: the running agent keeps writing)."""
    sim = settings.sim_root
    assert sim is not None
    copy = scratch / "checkpoint-copy.journal"
    shutil.copyfile(settings.state_dir / SRIOV / "checkpoint.journal", copy)
    checkpoint = Checkpoint(copy, (sim / "proc/sys/kernel/random/boot_id").read_text().strip())
    checkpoint.load()
    claims = dict(checkpoint.claims)
    checkpoint.close()
    copy.unlink()
    return claims


def mac_of(sim: Path, bus_id: str) -> str:
    net = sim / "sys/bus/pci/devices" / bus_id / "net"
    return (net / os.listdir(net)[0] / "address").read_text().strip()


def driver_of(sim: Path, bus_id: str) -> str | None:
    link = sim / "sys/bus/pci/devices" / bus_id / "driver"
    return os.path.basename(os.readlink(link)) if link.is_symlink() else None


async def test_a_vf_claim_asking_for_net1_gets_its_interface_moved_into_the_pod(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100") as env, KubeletSimulator(env.settings.registry_dir) as kubelet:
        sim = env.settings.sim_root
        assert sim is not None
        bus_id, device, netdev = VFS[0]
        # A permanent global IPv6 address on the VF, with the subnet route the kernel makes for it.
        net = sim / "proc/1/net"
        with (net / "if_inet6").open("a") as f:
            f.write(f"20010db8000000000000000000000005 2a 40 00 80 {netdev:>8}\n")
        with (net / "ipv6_route").open("a") as f:
            f.write(f"20010db8000000000000000000000000 40 {'0' * 32} 00 {'0' * 32} 00000100 00000001 00000000 "
                    f"00000001 {netdev:>8}\n")
        plugin = await kubelet.wait_for_plugin(SRIOV)
        claim = allocate(env.server, "pod-net", [("nic", SRIOV, device)], [net_device("net1")])
        plain = allocate(env.server, "plain", [("nic", SRIOV, VFS[1][1])])
        results = await plugin.prepare([claim, plain])
        assert results[claim.uid].error == "" and results[plain.uid].error == ""

        spec = spec_of(env.settings, claim.uid)
        assert spec is not None
        assert spec["cdiVersion"] == "1.1.0"
        assert [d["containerEdits"].get("netDevices") for d in spec["devices"]] == [
            [{"hostInterfaceName": netdev, "name": "net1"}]]
        assert cdi_schema_errors(spec) == []
        plain_spec = spec_of(env.settings, plain.uid)
        assert plain_spec is not None and plain_spec["cdiVersion"] != "1.1.0", "no netDevices, no 1.1.0"
        assert all("netDevices" not in d["containerEdits"] for d in plain_spec["devices"])

        mac = mac_of(sim, bus_id)
        saved = records(env.settings, scratch)
        (record,) = saved[claim.uid].devices
        assert record.network == NetworkData(interface_name="net1", hardware_address=mac, ips=("2001:db8::5/64",))
        assert record.facts == {"resource.kubernetes.io/pciBusID": bus_id, "pfName": "enp25s0f0np0",
                                "netdev": netdev, "macAddress": mac}
        (other,) = saved[plain.uid].devices
        assert other.network is None
        assert other.facts == {"resource.kubernetes.io/pciBusID": VFS[1][0], "pfName": "enp25s0f0np0",
                               "netdev": VFS[1][2], "macAddress": mac_of(sim, VFS[1][0])}

        # Nothing to undo: the runtime moved the interface, the kernel brings it back.
        assert (await plugin.unprepare([claim, plain])) == {claim.uid: "", plain.uid: ""}
        assert spec_of(env.settings, claim.uid) is None


def _write_sysfs(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)


async def test_each_refusal_fails_its_own_claim_and_leaves_nothing(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100") as env, KubeletSimulator(env.settings.registry_dir) as kubelet:
        sim = env.settings.sim_root
        assert sim is not None
        devices = sim / "sys/bus/pci/devices"
        # VF 1 on vfio-pci (bound by hand), VF 2 unbound: neither has an interface.
        # One write at a time: both unbinds go to mlx5_core's unbind file.
        _write_sysfs(devices / VFS[1][0] / "driver_override", "vfio-pci")
        for bus_id in (VFS[1][0], VFS[2][0]):
            _write_sysfs(devices / bus_id / "driver/unbind", bus_id)
            await wait_until(lambda bus_id=bus_id: driver_of(sim, bus_id) is None)
        _write_sysfs(sim / "sys/bus/pci/drivers_probe", VFS[1][0])
        await wait_until(lambda: driver_of(sim, VFS[1][0]) == "vfio-pci")
        # VF 3's interface carries a route of the host.
        (sim / "proc/1/net/route").write_text(
            f"{ROUTE_HEADER}\n{VFS[3][2]}\t0000090A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0\n")
        plugin = await kubelet.wait_for_plugin(SRIOV)
        vfio = {"source": "FromClass", "requests": ["nic"],
                "opaque": {"driver": SRIOV, "parameters": {"apiVersion": API, "kind": "VfioConfig"}}}
        claims: dict[str, tuple[ClaimRef, str]] = {
            "vfio-and-netdev": (allocate(env.server, "both", [("nic", SRIOV, VFS[0][1])], [vfio, net_device("net1")]),
                                "VfioConfig binds the VF to vfio-pci"),
            "on-vfio": (allocate(env.server, "on-vfio", [("nic", SRIOV, VFS[1][1])], [net_device("net1")]),
                        "the VF is bound to vfio-pci and has no network interface"),
            "no-netdev": (allocate(env.server, "unbound", [("nic", SRIOV, VFS[2][1])], [net_device("net1")]),
                          "the VF has no network interface to move into the pod (no driver is bound to it)"),
            "routes": (allocate(env.server, "routed", [("nic", SRIOV, VFS[3][1])], [net_device("net1")]),
                       f"its interface {VFS[3][2]} carries routes of the host (10.9.0.0/16)"),
            "same-name": (allocate(env.server, "twice",
                                   [("a", SRIOV, "vf-0000-1d-00-1"), ("b", SRIOV, "vf-0000-1d-00-2")],
                                   [net_device("net1", ("a", "b"))]),
                          "same interface name in the pod more than once: 'net1' for vf-0000-1d-00-1 and "
                          "vf-0000-1d-00-2"),
        }
        good = allocate(env.server, "good", [("nic", SRIOV, "vf-0000-1d-00-3")], [net_device("net1")])
        results = await plugin.prepare([good] + [c for c, _ in claims.values()])
        assert results[good.uid].error == "", "one claim's refusal fails no other"
        saved = records(env.settings, scratch)
        for what, (claim, expected) in claims.items():
            assert expected in results[claim.uid].error, (what, results[claim.uid].error)
            assert spec_of(env.settings, claim.uid) is None, what
            assert claim.uid not in saved, what
        assert driver_of(sim, VFS[0][0]) == "mlx5_core", "a refused VfioConfig binds nothing"
        assert good.uid in saved


async def test_interface_names_are_taken_as_the_kernel_takes_them_and_templates_numbered(scratch: Path) -> None:
    """A name the kernel would refuse fails its claim with the field named and nothing written; one it takes goes
    into the CDI spec as asked; templates get distinct numbers, which the claim's network data reports."""
    async with agent_in_process(scratch, "dgx-h100") as env, KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await kubelet.wait_for_plugin(SRIOV)
        refused = {
            "netà": "VfConfig.netDevice.name: an interface name cannot contain whitespace as the kernel reads it, "
                    "byte by byte (bytes 0x09 to 0x0d, 0x20 and 0xa0): 'netà' has 'à' (bytes c3 a0)",
            "lo": "VfConfig.netDevice.name: 'lo' is the loopback interface, which every network namespace has",
        }
        bad = {name: allocate(env.server, f"bad-{i}", [("nic", SRIOV, VFS[i][1])], [net_device(name)])
               for i, name in enumerate(refused)}
        wide = allocate(env.server, "wide", [("nic", SRIOV, VFS[2][1])], [net_device("\u2003x")])
        numbered = allocate(env.server, "numbered", [("a", SRIOV, VFS[3][1]), ("b", SRIOV, "vf-0000-1d-00-1")],
                            [net_device("net%d", ("a", "b"))])
        results = await plugin.prepare([*bad.values(), wide, numbered])
        saved = records(env.settings, scratch)
        for name, claim in bad.items():
            assert refused[name] in results[claim.uid].error, results[claim.uid].error
            assert "Value error" not in results[claim.uid].error
            assert spec_of(env.settings, claim.uid) is None and claim.uid not in saved, name

        assert results[wide.uid].error == ""
        spec = spec_of(env.settings, wide.uid)
        assert spec is not None
        assert spec["devices"][0]["containerEdits"]["netDevices"] == [{"hostInterfaceName": VFS[2][2],
                                                                       "name": "\u2003x"}]

        assert results[numbered.uid].error == ""
        spec = spec_of(env.settings, numbered.uid)
        assert spec is not None and cdi_schema_errors(spec) == []
        names = [n["name"] for d in spec["devices"] for n in d["containerEdits"].get("netDevices", ())]
        assert sorted(names) == ["net0", "net1"]
        network = [d.network.interface_name for d in saved[numbered.uid].devices if d.network is not None]
        assert sorted(network) == ["net0", "net1"]


@pytest.mark.parametrize("back_as", ["net1", None])
async def test_an_interface_still_in_a_pods_namespace_is_refused_until_it_is_back(scratch: Path,
                                                                                    back_as: str | None) -> None:
    async with agent_in_process(scratch, "dgx-h100") as env, KubeletSimulator(env.settings.registry_dir) as kubelet:
        sim = env.settings.sim_root
        assert sim is not None
        bus_id, device, netdev = VFS[0]
        injector = UdevInjector(sim)
        plugin = await kubelet.wait_for_plugin(SRIOV)
        # A pod had it as net1; its namespace is being torn down.
        netns_leave(injector, netdev)
        assert (sim / "sys/bus/pci/devices" / bus_id / "net").is_dir()
        claim = allocate(env.server, "next-pod", [("nic", SRIOV, device)], [net_device("net1")])
        error = (await plugin.prepare([claim]))[claim.uid].error
        assert "the VF's network interface is not back in the host's network namespace yet" in error
        assert spec_of(env.settings, claim.uid) is None and claim.uid not in records(env.settings, scratch)

        # The namespace is gone: the kernel moves the interface back, under the name it had in the pod.
        netns_return(injector, bus_id, back_as)
        name = back_as or netdev
        assert (await plugin.prepare([claim]))[claim.uid].error == "", "the kubelet's retry succeeds"
        spec = spec_of(env.settings, claim.uid)
        assert spec is not None
        assert spec["devices"][0]["containerEdits"]["netDevices"] == [{"hostInterfaceName": name, "name": "net1"}]
        (record,) = records(env.settings, scratch)[claim.uid].devices
        assert record.facts["netdev"] == name
        assert record.network is not None and record.network.hardware_address == mac_of(sim, bus_id)


async def test_a_vf_passed_through_tells_its_address_pf_and_mac(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100") as env, KubeletSimulator(env.settings.registry_dir) as kubelet:
        sim = env.settings.sim_root
        assert sim is not None
        bus_id, device, _ = VFS[0]
        mac = mac_of(sim, bus_id)
        plugin = await kubelet.wait_for_plugin(SRIOV)
        vfio = {"source": "FromClaim", "requests": ["nic"],
                "opaque": {"driver": SRIOV, "parameters": {"apiVersion": API, "kind": "VfioConfig"}}}
        claim = allocate(env.server, "dpdk", [("nic", SRIOV, device)], [vfio])
        assert (await plugin.prepare([claim]))[claim.uid].error == ""
        assert driver_of(sim, bus_id) == "vfio-pci"
        (record,) = records(env.settings, scratch)[claim.uid].devices
        assert record.network is None
        assert record.facts == {"resource.kubernetes.io/pciBusID": bus_id, "pfName": "enp25s0f0np0",
                                "macAddress": mac}, "read before the bind took the interface away; no host name"
        assert (await plugin.unprepare([claim]))[claim.uid] == ""
