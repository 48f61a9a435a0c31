"""udev events end to end: events injected into a simulated node reach the agent's monitor (real pyudev, real
libudev, through umockdev's preload) and the backends turn them into health events and device-set changes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from backends.topology import device_name
from simulator.apiserver.server import TestApiServer
from simulator.node.node import SimulatedNode
from simulator.udev.hotplug import UdevInjector
from tests.support.agent_env import NODE, AgentProcess, settings_for, wait_until
from tests.support.timing import scaled
from tests.support.udev_env import Watcher, preload_env


@pytest.mark.parametrize("source", ["kernel", "udev"])
async def test_monitor_dispatches_injected_events(sim_node: Callable[[str], SimulatedNode], source: str) -> None:
    node = sim_node("mixed")
    pf = node.plan.nics[0]
    async with Watcher(node.root, "--source", source, "--backends", "tpu") as watcher:
        UdevInjector(node.root).link_down(pf.netdev)
        assert await watcher.expect(lambda m: "udev" in m) == {"udev": ["change", "net", pf.netdev]}
        UdevInjector(node.root).pci_remove(pf.vfs[0].bus_id)
        seen = [await watcher.expect(lambda m: "udev" in m) for _ in range(2)]
        assert [m["udev"] for m in seen] == [["remove", "net", pf.vfs[0].netdev], ["remove", "pci", pf.vfs[0].bus_id]]


async def test_a_failing_handler_does_not_stop_dispatch(sim_node: Callable[[str], SimulatedNode]) -> None:
    node = sim_node("mixed")
    first, second = node.plan.nics[0], node.plan.nics[1]
    async with Watcher(node.root, "--fail-on", first.netdev, "--backends", "tpu") as watcher:
        inject = UdevInjector(node.root)
        inject.link_down(first.netdev)
        inject.link_down(second.netdev)
        seen = [(await watcher.expect(lambda m: "udev" in m))["udev"] for _ in range(2)]
        assert seen == [["change", "net", first.netdev], ["change", "net", second.netdev]]
    assert f"handler fails on {first.netdev}" in watcher.errors()
    assert "udev event handler failed" in watcher.errors()


async def test_link_down_makes_the_pfs_vfs_unhealthy_until_it_is_up(sim_node: Callable[[str], SimulatedNode]) -> None:
    node = sim_node("mixed")
    nic, other = node.plan.nics[0], node.plan.nics[1]
    vfs = [device_name("vf", vf.bus_id) for vf in nic.vfs]
    async with Watcher(node.root, "--backends", "sriov-nic") as watcher:
        UdevInjector(node.root).link_down(nic.netdev)
        for vf in vfs:
            message = await watcher.health(vf, "Unhealthy")
            assert message["health"][2:] == ["link-down", f"PF {nic.netdev} ({nic.bus_id}) link is down"]
        UdevInjector(node.root).link_up(nic.netdev)
        for vf in vfs:
            assert (await watcher.health(vf, "Healthy"))["health"][2] == ""
        health = [m["health"][0] for m in watcher.taken() if "health" in m]
        assert not {device_name("vf", vf.bus_id) for vf in other.vfs} & set(health), "only that PF's VFs"


async def test_a_pf_down_at_start_is_reported(sim_node: Callable[[str], SimulatedNode]) -> None:
    node = sim_node("mixed")
    nic = node.plan.nics[1]
    UdevInjector(node.root).link_down(nic.bus_id)
    async with Watcher(node.root, "--backends", "sriov-nic") as watcher:
        for vf in nic.vfs:
            await watcher.health(device_name("vf", vf.bus_id), "Unhealthy")


async def test_pci_remove_and_add_change_the_vfs(sim_node: Callable[[str], SimulatedNode]) -> None:
    node = sim_node("mixed")
    nic = node.plan.nics[0]
    vfs = {device_name("vf", vf.bus_id) for vf in nic.vfs}
    async with Watcher(node.root, "--backends", "sriov-nic") as watcher:
        before = watcher.started_with["sriov-nic"]
        assert vfs < before
        UdevInjector(node.root).pci_remove(nic.bus_id)
        assert set(await watcher.devices("sriov-nic")) == before - vfs
        UdevInjector(node.root).pci_add(nic.bus_id)
        assert set(await watcher.devices("sriov-nic")) == before
        changes = [m["changed"] for m in watcher.taken() if "changed" in m]
        assert changes[0].startswith(f"PCI remove {nic.vfs[0].bus_id}"), "VFs go before their PF"


async def test_tpu_node_and_pci_events(sim_node: Callable[[str], SimulatedNode]) -> None:
    node = sim_node("mixed")
    accel, vfio = next(t for t in node.plan.tpus if t.interface == "accel"), node.plan.tpus[-1]
    assert vfio.interface == "vfio"
    inject = UdevInjector(node.root)
    async with Watcher(node.root, "--backends", "tpu") as watcher:
        for chip, path in ((accel, f"/dev/accel{accel.index}"), (vfio, "/dev/vfio/")):
            name = device_name("tpu", chip.bus_id)
            inject.node_remove(chip.bus_id)
            message = await watcher.health(name, "Unhealthy")
            assert message["health"][2] == "device-node-missing" and path in message["health"][3]
            inject.node_add(chip.bus_id)
            await watcher.health(name, "Healthy")
        before = watcher.started_with["tpu"]
        inject.pci_remove(vfio.bus_id)
        assert set(await watcher.devices("tpu")) == before - {device_name("tpu", vfio.bus_id)}
        inject.pci_add(vfio.bus_id)
        assert set(await watcher.devices("tpu")) == before


async def test_a_simulated_agent_process_runs_under_the_preload(scratch: Path) -> None:
    """`dra-agent run --simulate --sim-root` re-executes itself under umockdev: its libudev sees the node."""
    async with TestApiServer() as server:
        server.add_node(NODE)
        settings = settings_for(scratch, server.write_kubeconfig(scratch / "kubeconfig"), "tpu-v5e-8")
        assert settings.sim_root is not None
        preload_env(settings.sim_root)  # skips without umockdev
        agent = AgentProcess(settings)
        try:
            await agent.start()
            await wait_until(lambda: server.objects("resourceslices"), timeout=scaled(30))
            assert agent.process is not None
            proc = Path(f"/proc/{agent.process.pid}")
            environ = dict(e.split("=", 1) for e in proc.joinpath("environ").read_text().split("\0") if "=" in e)
            assert environ["UMOCKDEV_DIR"] == str(settings.sim_root.resolve())
            assert "libumockdev-preload" in proc.joinpath("maps").read_text()
        finally:
            await agent.stop()
        assert "simulated node without udev events" not in agent.output()
