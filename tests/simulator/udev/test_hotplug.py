"""Injecting udev events into a simulated node: the tree changes as the kernel changes it and comes back exactly,
the uevents are in libudev's wire format, bad requests are refused; running without umockdev."""

from __future__ import annotations

import ctypes.util
import json
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from agent.node.host import open_host
from agent.node.udev import open_udev_monitor
from backends.sriov.backend import SriovNicBackend
from backends.topology import device_name
from backends.tpu import TpuBackend
from simulator.node.node import SimulatedNode
from simulator.udev import preload as udev_preload
from simulator.udev.delivery import Uevent, send
from simulator.udev.hotplug import InjectionError, UdevInjector, main
from tests.support.agent_env import settings_for
from tests.support.node_tree_env import dangling_links, inventory, tree
from tests.support.udev_env import preload_env


async def test_pci_remove_takes_a_pf_with_its_vfs_and_add_restores_it(
        sim_node: Callable[[str], SimulatedNode]) -> None:
    node = sim_node("mixed")
    nic = node.plan.nics[0]
    before, vfs_before = tree(node.root), await inventory(node, SriovNicBackend())
    injection = UdevInjector(node.root).pci_remove(nic.bus_id)
    for function in (nic.bus_id, *(vf.bus_id for vf in nic.vfs)):
        assert not (node.sysfs / "bus/pci/devices" / function).exists()
        assert not (node.sysfs / "bus/pci/drivers" / nic.model.driver / function).exists()
    for netdev in (nic.netdev, *(vf.netdev for vf in nic.vfs if vf.netdev)):
        assert not (node.sysfs / "class/net" / netdev).is_symlink()
    assert not list((node.dev / "infiniband").glob(f"uverbs{nic.rdma_index}"))
    assert not dangling_links(node.root), "every link to what went is gone too"
    removed = [(e.action, e.subsystem, os.path.basename(e.devpath)) for e in injection.events]
    assert removed[-1] == ("remove", "pci", nic.bus_id), "the PF last"
    assert removed.index(("remove", "pci", nic.vfs[0].bus_id)) < removed.index(("remove", "net", nic.netdev))
    assert await inventory(node, SriovNicBackend()) == vfs_before - {device_name("vf", v.bus_id) for v in nic.vfs}

    added = UdevInjector(node.root).pci_add(nic.bus_id)
    assert [e.devpath for e in added.events] == [e.devpath for e in injection.events][::-1], "parents first"
    assert {e.action for e in added.events} == {"add"}
    assert tree(node.root) == before
    assert await inventory(node, SriovNicBackend()) == vfs_before


@pytest.mark.parametrize("kind", ["root port", "vfio TPU", "accel TPU"])
def test_pci_remove_and_add_leave_the_tree_as_it_was(sim_node: Callable[[str], SimulatedNode], kind: str) -> None:
    node = sim_node("mixed")
    tpu = {t.interface: t for t in node.plan.tpus}
    bus_id = {"root port": node.plan.functions[0].bus_id, "vfio TPU": tpu["vfio"].bus_id,
              "accel TPU": tpu["accel"].bus_id}[kind]
    function = next(f for f in node.plan.functions if f.bus_id == bus_id)
    before = tree(node.root)
    UdevInjector(node.root).pci_remove(bus_id)
    after = tree(node.root)
    assert f"sys/kernel/iommu_groups/{function.iommu_group}" not in after, "an emptied IOMMU group goes"
    if kind == "vfio TPU":
        assert f"dev/vfio/{function.iommu_group}" not in after
        assert f"sys/class/vfio/{function.iommu_group}" not in after
    if kind == "accel TPU":
        assert f"dev/accel{tpu['accel'].index}" not in after
    UdevInjector(node.root).pci_add(bus_id)
    assert tree(node.root) == before


async def test_link_down_and_up(sim_node: Callable[[str], SimulatedNode]) -> None:
    node = sim_node("mixed")
    nic = node.plan.nics[0]
    folder = node.sysfs / "class/net" / nic.netdev
    before = tree(node.root)
    (event,) = UdevInjector(node.root).link_down(nic.bus_id).events
    assert (event.action, event.subsystem, event.properties["INTERFACE"]) == ("change", "net", nic.netdev)
    assert [(folder / f).read_text() for f in ("operstate", "carrier", "speed")] == ["down\n", "0\n", "-1\n"]
    UdevInjector(node.root).link_down(nic.netdev)  # again: still down, the speed it had is kept
    assert await inventory(node, SriovNicBackend()), "a PF with its link down keeps its VFs published"
    UdevInjector(node.root).link_up(nic.netdev)
    assert tree(node.root) == before


async def test_node_remove_and_add(sim_node: Callable[[str], SimulatedNode]) -> None:
    node = sim_node("mixed")
    vfio = next(t for t in node.plan.tpus if t.interface == "vfio")
    group = next(f.iommu_group for f in node.plan.functions if f.bus_id == vfio.bus_id)
    before = tree(node.root)
    (event,) = UdevInjector(node.root).node_remove(vfio.bus_id).events
    assert (event.action, event.subsystem, event.properties["DEVNAME"]) == ("remove", "vfio", f"vfio/{group}")
    assert not (node.dev / "vfio" / str(group)).exists()
    assert device_name("tpu", vfio.bus_id) in await inventory(node, TpuBackend()), "the chip is still there"
    UdevInjector(node.root).node_add(vfio.bus_id)
    assert tree(node.root) == before


@pytest.mark.parametrize(
    ("action", "message"),
    [
        (lambda i: i.pci_remove("0000:99:00.0"), "no PCI function 0000:99:00.0 on the simulated node"),
        (lambda i: i.pci_remove("not-an-address"), "'not-an-address' is not a PCI address"),
        (lambda i: i.pci_add("0000:04:00.0"), "PCI function 0000:04:00.0 was not removed"),
        (lambda i: (i.pci_remove("0000:04:00.0"), i.pci_remove("0000:04:00.0")), "0000:04:00.0 is already removed"),
        (lambda i: i.link_down("eth42"), "no network interface 'eth42'"),
        (lambda i: i.link_up("0000:00:01.0"), "0000:00:01.0 has no network interface"),
        (lambda i: i.node_remove("0000:04:00.0"), "neither an accel device nor a vfio group"),
        (lambda i: (i.node_remove("0000:0a:00.0"), i.node_remove("0000:0a:00.0")), "already removed"),
        (lambda i: (i.pci_remove("0000:00:01.0"), i.pci_add("0000:04:00.0")), "was not removed"),
    ],
)
def test_impossible_injections_are_refused(sim_node: Callable[[str], SimulatedNode],
                                           action: Callable[[UdevInjector], object], message: str) -> None:
    node = sim_node("mixed")
    with pytest.raises(InjectionError, match=message.replace("(", r"\(")):
        action(UdevInjector(node.root))


def test_a_child_cannot_come_back_before_its_parent(sim_node: Callable[[str], SimulatedNode]) -> None:
    node = sim_node("mixed")
    inject = UdevInjector(node.root)
    nic = node.plan.nics[0]
    port = next(f.path[-2] for f in node.plan.functions if f.bus_id == nic.bus_id)
    inject.pci_remove(nic.vfs[0].bus_id)
    inject.pci_remove(port)
    with pytest.raises(InjectionError, match="add what holds it first"):
        inject.pci_add(nic.vfs[0].bus_id)
    inject.pci_add(port)
    inject.pci_add(nic.vfs[0].bus_id)


def test_cli(sim_node: Callable[[str], SimulatedNode], capsys: pytest.CaptureFixture[str]) -> None:
    node = sim_node("mixed")
    nic = node.plan.nics[0]
    assert main(["--sim-root", str(node.root), "link-down", nic.netdev]) == 0
    assert capsys.readouterr().out == f"link-down {nic.netdev}: 1 uevent(s) (change net {nic.netdev}) to 0 monitor(s)\n"
    assert main(["--sim-root", str(node.root), "pci-remove", "0000:99:00.0"]) == 2
    assert "udev_events: no PCI function 0000:99:00.0" in capsys.readouterr().err
    assert main(["--sim-root", str(node.root.parent), "pci-remove", nic.bus_id]) == 2
    assert "holds no simulated node" in capsys.readouterr().err
    # As a module, the way docs/simulated-node.md shows it.
    done = subprocess.run([sys.executable, "-m", "simulator.udev.hotplug", "--sim-root", str(node.root),
                           "pci-remove", nic.bus_id], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and done.stdout.startswith(f"pci-remove {nic.bus_id}: "), done.stderr


def test_uevents_reach_a_listener_in_libudevs_format(sim_node: Callable[[str], SimulatedNode]) -> None:
    node = sim_node("mixed")
    nic = node.plan.nics[0]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(str(node.root / "event7"))
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        stale.bind(str(node.root / "event8"))
        stale.close()  # what a killed agent leaves behind
        assert UdevInjector(node.root).link_down(nic.netdev).listeners == 1
        message = listener.recv(4096)
    assert not (node.root / "event8").exists(), "a stale socket is cleaned up"
    prefix, magic, size, offset, length = struct.unpack("=8sIIII", message[:24])
    assert (prefix, socket.ntohl(magic), size, offset) == (b"libudev\0", 0xFEEDCAFE, 40, 40)
    # The subsystem hash (bytes 24-28) feeds libudev's socket filter: the monitors of
    # tests/end_to_end/test_udev_health.py filter by subsystem, so a wrong hash would starve them.
    properties = dict(p.split("=", 1) for p in message[offset : offset + length].decode().split("\0") if p)
    assert properties["ACTION"] == "change" and properties["SUBSYSTEM"] == "net"
    assert properties["DEVPATH"] == "/" + os.path.relpath(os.path.realpath(node.sysfs / "class/net" / nic.netdev),
                                                          os.path.realpath(node.sysfs))
    assert int(properties["SEQNUM"]) > 0
    assert Uevent("add", "/devices/x", "pci").encode(5).endswith(b"SEQNUM=5\0")


def test_a_listener_that_goes_while_events_are_sent_misses_them_alone(tmp_path: Path) -> None:
    """A monitor closed between the connect and the send (its process killed): the others get every event."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as going, \
            socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as staying:
        going.bind(str(tmp_path / "event1"))
        staying.bind(str(tmp_path / "event2"))

        class Closing(Uevent):
            def encode(self, seqnum: int) -> bytes:
                going.close()  # after send() connected to it, before the message goes out
                return super().encode(seqnum)

        events = [Closing("add", "/devices/x", "pci"), Uevent("remove", "/devices/x", "pci")]
        assert send(tmp_path, events) == 1
        staying.setblocking(False)
        actions = [dict(p.split("=", 1) for p in staying.recv(4096)[40:].decode().split("\0") if p)["ACTION"]
                   for _ in events]
    assert actions == ["add", "remove"]


def test_libudev_accepts_the_simulated_tree(sim_node: Callable[[str], SimulatedNode]) -> None:
    """Under the preload, pyudev enumerates the node's devices with their parents and nodes."""
    node = sim_node("mixed")
    script = ("import json, pyudev; c = pyudev.Context(); print(json.dumps({s: sorted(d.sys_name for d in "
              "c.list_devices(subsystem=s)) for s in ('pci', 'net', 'accel', 'vfio')}));"
              "d = pyudev.Devices.from_name(c, 'accel', 'accel0'); print(json.dumps([d.device_node, "
              "d.find_parent('pci').sys_name]))")
    done = subprocess.run([sys.executable, "-c", script], env=preload_env(node.root), capture_output=True,
                          text=True, check=True)
    listed, accel = (json.loads(line) for line in done.stdout.splitlines())
    assert listed["pci"] == sorted(f.bus_id for f in node.plan.functions)
    assert set(listed["net"]) == {n for nic in node.plan.nics for n in (nic.netdev, *(v.netdev for v in nic.vfs))}
    assert len(listed["accel"]) == 2 and len(listed["vfio"]) == 1
    first = next(t for t in node.plan.tpus if t.interface == "accel")
    assert accel == ["/dev/accel0", first.bus_id]


# Without umockdev -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["/dev/shm/node", "/sys/node", "/proc/node"])
def test_a_node_reached_below_a_device_tree_is_refused(where: str) -> None:
    tree = "/" + where.split("/")[1]
    with pytest.raises(udev_preload.UdevPreloadError, match=f"lies below {tree}.*keep the node elsewhere"):
        udev_preload.environment(Path(where))


def test_without_umockdev_no_preload_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    with pytest.raises(udev_preload.UdevPreloadError, match="umockdev is not installed"):
        udev_preload.environment(tmp_path)
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("re-executed without umockdev"))
    assert "umockdev is not installed" in (udev_preload.reexec_for(tmp_path) or "")


def test_agent_run_reexecutes_under_the_preload_and_runs_on_without_it(monkeypatch: pytest.MonkeyPatch,
                                                                        scratch: Path) -> None:
    settings = settings_for(scratch, scratch / "kubeconfig", "gke-g2-l4")
    monkeypatch.setattr(sys, "argv", [str(Path(sys.prefix) / "bin/dra-agent"), "run", "--simulate", "gke-g2-l4"])
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, str(Path(sys.prefix) / "bin/dra-agent"), "run"])
    monkeypatch.delenv("UMOCKDEV_DIR", raising=False)

    class Executed(Exception):
        pass

    def execve(path: str, argv: list[str], env: dict[str, str]) -> None:
        raise Executed(path, argv, env)

    monkeypatch.setattr(os, "execve", execve)
    with pytest.raises(Executed) as executed, open_host(settings):
        pass
    path, argv, env = executed.value.args
    assert path == sys.executable and argv[1:] == [str(Path(sys.prefix) / "bin/dra-agent"), "run"]
    assert env["LD_PRELOAD"].split(":")[0] == udev_preload.PRELOAD
    assert settings.sim_root is not None
    assert env["UMOCKDEV_DIR"] == str(settings.sim_root.resolve())

    # Without umockdev the same process runs on, and says why there are no udev events.
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    with capture_logs() as logs, open_host(settings) as host:
        assert host.profile == "gke-g2-l4"
        assert open_udev_monitor(host) is None, "a simulated node outside umockdev gets no monitor"
    warnings = {log["event"]: log for log in logs if log["log_level"] == "warning"}
    assert "umockdev is not installed" in warnings["simulated node without udev events"]["reason"]
    assert any(w.startswith("no udev events on this simulated node") for w in warnings)
