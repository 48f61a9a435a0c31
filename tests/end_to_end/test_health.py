"""Device health end to end: a `dra-agent run` process on a simulated node, events injected from outside the way
the hardware would raise them (NVML through the node's control socket, uevents through umockdev), observed where
users see them: the kubelet's health stream, the slices' taints, prepare answers, the agent's log."""

from __future__ import annotations

import json
import socket
import urllib.request
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.kubelet.services import HealthStatus
from simulator.apiserver.server import TestApiServer
from simulator.kubelet import HealthView, KubeletSimulator
from simulator.kubelet_connection import Plugin
from simulator.nvml.control import request
from simulator.udev.hotplug import UdevInjector
from tests.support.agent_env import NODE, AgentProcess, allocate, settings_for, wait_until
from tests.support.timing import scaled
from tests.support.udev_env import preload_env

GPU = "gpu.nvidia.com"
NIC = "sriov.dra-agent.io"
# The "mixed" node: GPU 0 whole (0000:03:00.0), GPU 1 carved into three MIG devices, two CX-7 PFs with 4 VFs each.
WHOLE_GPU = "gpu-0000-03-00-0"
MIG_PREFIX = "gpu-0000-07-00-0-mig-"
PF, PF_NETDEV = "0000:04:00.0", "enp4s0f0np0"
PF_VFS = {f"vf-0000-04-00-{f}" for f in range(1, 5)}


@dataclass
class Node:
    server: TestApiServer
    kubelet: KubeletSimulator
    agent: AgentProcess
    root: Path
    metrics_address: str

    def devices(self, driver: str) -> set[str]:
        return {d["name"] for s in self.slices(driver) for d in s["spec"].get("devices", ())}

    def slices(self, driver: str) -> list[dict[str, Any]]:
        return [s for s in self.server.objects("resourceslices") if s["spec"]["driver"] == driver]

    def taints(self, driver: str) -> dict[str, list[tuple[str, str, str]]]:
        return {d["name"]: [(t["key"], t.get("value", ""), t["effect"]) for t in d["taints"]]
                for s in self.slices(driver) for d in s["spec"].get("devices", ()) if d.get("taints")}

    def nvml(self, op: str, gpu: str, **fields: Any) -> dict[str, Any]:
        return request(self.root, {"op": op, "gpu": gpu, **fields})

    def nvml_list(self) -> list[dict[str, Any]]:
        gpus: list[dict[str, Any]] = request(self.root, {"op": "list"})["gpus"]
        return gpus

    def udev(self) -> UdevInjector:
        return UdevInjector(self.root)

    def node_events(self, reason: str) -> list[dict[str, Any]]:
        """The Events on the Node with this reason."""
        return [e for e in self.server.events() if e["regarding"].get("kind") == "Node" and e["reason"] == reason]

    def metrics(self) -> dict[str, float]:
        """The agent's /metrics samples, by their text form (`name{labels}`)."""
        with urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=scaled(5)) as response:
            text = response.read().decode()
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    def log_lines(self) -> list[dict[str, Any]]:
        lines = []
        for line in self.agent.output().splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue
        return lines


@pytest.fixture
async def node(scratch: Path) -> AsyncIterator[Node]:
    async with AsyncExitStack() as stack:
        server = await stack.enter_async_context(TestApiServer())
        server.add_node(NODE)
        settings = settings_for(scratch, server.write_kubeconfig(scratch / "kubeconfig"), "mixed", log_level="info",
                                metrics_address=f"127.0.0.1:{_free_port()}")
        assert settings.sim_root is not None
        preload_env(settings.sim_root)  # skips without umockdev
        # Recovery of a GPU that was reset is found by probing it; a short period keeps the test short.
        config = {"nvidia-gpu": {"recheckSeconds": 0.3}, "nvidia-mig": {"recheckSeconds": 0.3}}
        agent = AgentProcess(settings, env={"DRA_AGENT_BACKEND_CONFIG": json.dumps(config)})
        await agent.start()
        stack.push_async_callback(agent.stop)
        kubelet = await stack.enter_async_context(KubeletSimulator(settings.registry_dir))
        result = Node(server, kubelet, agent, settings.sim_root, str(settings.metrics_address))
        try:
            await kubelet.wait_for_plugin(GPU, timeout=scaled(30))
            await kubelet.wait_for_plugin(NIC, timeout=scaled(30))
            await wait_until(lambda: result.devices(GPU) and result.devices(NIC), timeout=scaled(30))
            # Watching has begun once NVML has every GPU registered for its events.
            await wait_until(lambda: all(g["registered_events"] for g in result.nvml_list()), timeout=scaled(30))
        except BaseException:
            print(agent.output())
            raise
        yield result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def health_is(devices: set[str], status: HealthStatus) -> Callable[[HealthView], bool]:
    return lambda view: all(view.get((NODE, d)) is not None and view[(NODE, d)].health == status for d in devices)


async def prepare_error(node: Node, plugin: Plugin, name: str, driver: str, device: str) -> str:
    claim = allocate(node.server, name, [("r", driver, device)])
    return (await plugin.prepare([claim]))[claim.uid].error


async def test_xid_79_taints_the_gpu_refuses_prepares_until_it_is_reset(node: Node) -> None:
    plugin = node.kubelet.plugin(GPU)
    everything = node.devices(GPU)
    await node.kubelet.wait_for_health(GPU, health_is(everything, HealthStatus.HEALTHY), timeout=scaled(10))

    assert node.nvml("xid", "0", xid=79)["delivered"] >= 1
    view = await node.kubelet.wait_for_health(GPU, health_is({WHOLE_GPU}, HealthStatus.UNHEALTHY), timeout=scaled(5))
    assert view[(NODE, WHOLE_GPU)].message == "Xid 79: GPU has fallen off the bus"
    assert health_is(everything - {WHOLE_GPU}, HealthStatus.HEALTHY)(view), "only the failed GPU"
    await wait_until(lambda: node.taints(GPU) == {WHOLE_GPU: [(f"{GPU}/xid", "79", "NoSchedule")]}, timeout=scaled(5))
    error = await prepare_error(node, plugin, "after-xid", GPU, WHOLE_GPU)
    assert error == f"not prepared, unhealthy device(s): {WHOLE_GPU}: Xid 79: GPU has fallen off the bus"
    metrics = node.metrics()
    assert metrics['dra_agent_nvidia_xids_total{code="79"}'] == 1
    assert metrics[f'dra_agent_device_health{{device="{WHOLE_GPU}",driver="{GPU}",health="Unhealthy"}}'] == 1
    assert metrics[f'dra_agent_device_health_changes_total{{cause="xid",driver="{GPU}",health="Unhealthy"}}'] == 1
    assert metrics[f'dra_agent_health_stream_clients{{driver="{GPU}"}}'] == 1
    assert metrics[f'dra_agent_node_requests_total{{driver="{GPU}",operation="prepare",outcome="error"}}'] == 1

    await wait_until(lambda: node.node_events("DeviceUnhealthy"), timeout=scaled(5))
    (tainted,) = node.node_events("DeviceUnhealthy")
    assert tainted["type"] == "Warning"
    assert tainted["note"] == (f"Device {WHOLE_GPU} of driver {GPU} is unhealthy: Xid 79: GPU has fallen off the "
                               f"bus; tainted {GPU}/xid=79:NoSchedule")
    await wait_until(lambda: [e for e in node.server.events() if e["reason"] == "PrepareFailed"], timeout=scaled(5))
    (refused,) = [e for e in node.server.events() if e["reason"] == "PrepareFailed"]
    assert refused["regarding"]["name"] == "after-xid" and error in refused["note"]

    node.nvml("reset", "0")
    await node.kubelet.wait_for_health(GPU, health_is(everything, HealthStatus.HEALTHY), timeout=scaled(10))
    await wait_until(lambda: node.taints(GPU) == {}, timeout=scaled(5))
    assert await prepare_error(node, plugin, "after-reset", GPU, WHOLE_GPU) == ""
    await wait_until(lambda: node.node_events("DeviceRecovered"), timeout=scaled(5))
    (recovered,) = node.node_events("DeviceRecovered")
    assert recovered["type"] == "Normal"
    assert recovered["note"] == f"Device {WHOLE_GPU} of driver {GPU} is healthy again; taint {GPU}/xid=79:NoSchedule " \
                                "removed"
    assert len(node.node_events("DeviceUnhealthy")) == 1, "the other GPUs stayed healthy"


async def test_xid_79_on_a_mig_gpu_makes_its_mig_devices_unhealthy(node: Node) -> None:
    migs = {d for d in node.devices(GPU) if d.startswith(MIG_PREFIX)}
    assert len(migs) == 3
    node.nvml("xid", "1", xid=79)
    view = await node.kubelet.wait_for_health(GPU, health_is(migs, HealthStatus.UNHEALTHY), timeout=scaled(5))
    assert view[(NODE, WHOLE_GPU)].health == HealthStatus.HEALTHY
    await wait_until(lambda: set(node.taints(GPU)) == migs, timeout=scaled(5))
    assert all(t == [(f"{GPU}/xid", "79", "NoSchedule")] for t in node.taints(GPU).values())
    node.nvml("reset", "1")
    await node.kubelet.wait_for_health(GPU, health_is(migs, HealthStatus.HEALTHY), timeout=scaled(10))
    await wait_until(lambda: node.taints(GPU) == {}, timeout=scaled(5))


async def test_an_ignored_xid_is_logged_at_info_and_taints_nothing(node: Node) -> None:
    assert node.nvml("xid", "0", xid=13)["delivered"] >= 1

    def logged() -> list[dict[str, Any]]:
        return [r for r in node.log_lines() if r.get("event") == "GPU event changes no health"]

    await wait_until(lambda: logged(), timeout=scaled(5))
    assert logged()[0]["level"] == "info" and "13" in logged()[0]["detail"]
    # A later event proves the Xid 13 was handled before it, and changed nothing on the way.
    node.nvml("xid", "0", xid=48)
    await node.kubelet.wait_for_health(GPU, health_is({WHOLE_GPU}, HealthStatus.UNHEALTHY), timeout=scaled(5))
    await wait_until(lambda: WHOLE_GPU in node.taints(GPU), timeout=scaled(5))
    assert node.taints(GPU) == {WHOLE_GPU: [(f"{GPU}/xid", "48", "NoSchedule")]}


async def test_pf_link_down_makes_its_vfs_unhealthy_and_up_healthy(node: Node) -> None:
    plugin = node.kubelet.plugin(NIC)
    others = node.devices(NIC) - PF_VFS
    node.udev().link_down(PF_NETDEV)
    view = await node.kubelet.wait_for_health(NIC, health_is(PF_VFS, HealthStatus.UNHEALTHY), timeout=scaled(5))
    assert health_is(others, HealthStatus.HEALTHY)(view)
    assert PF_NETDEV in view[(NODE, sorted(PF_VFS)[0])].message
    await wait_until(lambda: set(node.taints(NIC)) == PF_VFS, timeout=scaled(5))
    error = await prepare_error(node, plugin, "on-a-dead-link", NIC, sorted(PF_VFS)[0])
    assert error.startswith("not prepared, unhealthy device(s)")

    node.udev().link_up(PF_NETDEV)
    await node.kubelet.wait_for_health(NIC, health_is(PF_VFS, HealthStatus.HEALTHY), timeout=scaled(5))
    await wait_until(lambda: node.taints(NIC) == {}, timeout=scaled(5))


async def test_pci_remove_of_a_nic_takes_its_vfs_out_of_the_slices_and_add_brings_them_back(node: Node) -> None:
    before = node.devices(NIC)
    assert before >= PF_VFS
    node.udev().pci_remove(PF)
    await wait_until(lambda: node.devices(NIC) == before - PF_VFS, timeout=scaled(5))
    node.udev().pci_add(PF)
    await wait_until(lambda: node.devices(NIC) == before, timeout=scaled(5))
    view = await node.kubelet.wait_for_health(NIC, health_is(before, HealthStatus.HEALTHY), timeout=scaled(5))
    assert len(view) >= len(before)
