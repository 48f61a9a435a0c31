"""A pod asking `nvidia.com/gpu: 1`, end to end: `dra-agent run` publishes a node's GPUs, the scheduler's
extended-resource claim is allocated from them, and the kubelet simulator prepares it over the agent's socket like
any claim: the container gets that GPU's device node. Then the pods that cannot be placed: more GPUs than the node
has, and a resource nothing serves."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from backends.contract import ClaimRef
from simulator.apiserver.server import TestApiServer
from simulator.kubelet import KubeletSimulator
from simulator.kubelet_connection import Plugin
from simulator.scheduler.allocation import Unallocatable
from simulator.scheduler.allocator import Allocator
from simulator.scheduler.pods import release_pod, schedule_pod
from tests.support.agent_env import NODE, AgentProcess, settings_for, wait_until
from tests.support.allocation_env import device_classes
from tests.support.timing import scaled

GPU = "gpu.nvidia.com"


@dataclass
class Cluster:
    server: TestApiServer
    allocator: Allocator
    plugin: Plugin
    cdi_dir: Path

    def gpus(self) -> dict[str, dict[str, Any]]:
        return {d["name"]: d for s in self.server.objects("resourceslices") for d in s["spec"].get("devices") or ()}


@pytest.fixture
async def cluster(scratch: Path) -> AsyncIterator[Cluster]:
    """An 8-GPU node served by `dra-agent run`, the shipped DeviceClasses, the kubelet simulator and the allocator."""
    async with TestApiServer() as server:
        server.add_node(NODE)
        for device_class in device_classes():
            server.put_object("deviceclasses", device_class)
        settings = settings_for(scratch, server.write_kubeconfig(scratch / "kubeconfig"), "dgx-h100",
                                backends=("nvidia-gpu",))  # fmt: skip
        agent = AgentProcess(settings)
        assert settings.kubeconfig is not None
        allocator = await Allocator.connect(settings.kubeconfig)
        try:
            await agent.start()
            async with KubeletSimulator(settings.registry_dir) as kubelet:
                plugin = await kubelet.wait_for_plugin(GPU, timeout=scaled(30))
                await wait_until(lambda: sum(len(s["spec"].get("devices") or ())
                                             for s in server.objects("resourceslices")) == 8, timeout=scaled(30))
                yield Cluster(server, allocator, plugin, settings.cdi_dir)
        finally:
            await allocator.close()
            await agent.stop()


def pod(name: str, resources: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": {"containers": [{"name": "cuda", "image": "cuda", "resources": {"limits": resources}}]}}


async def test_a_pod_asking_nvidia_gpu_gets_a_gpu_prepared_by_the_agent(cluster: Cluster) -> None:
    scheduled = await schedule_pod(cluster.allocator, pod("trainer", {"nvidia.com/gpu": "1"}), node=NODE)
    assert scheduled.claim is not None and scheduled.allocation is not None
    (result,) = scheduled.allocation.results
    gpu = cluster.gpus()[result.device]
    assert gpu["attributes"]["type"] == {"string": "gpu"}
    mapping = scheduled.pod["status"]["extendedResourceClaimStatus"]
    assert mapping["resourceClaimName"] == scheduled.claim_name
    # The kubelet finds the claim through the pod's status and prepares it like any other.
    meta = scheduled.claim["metadata"]
    ref = ClaimRef(meta["uid"], meta["namespace"], mapping["resourceClaimName"])
    answer = (await cluster.plugin.prepare([ref]))[ref.uid]
    assert not answer.error, answer.error
    (device,) = answer.devices
    assert device.device == result.device and device.request_names == (mapping["requestMappings"][0]["requestName"],)
    (cdi_id,) = device.cdi_device_ids
    (spec_file,) = cluster.cdi_dir.glob(f"*{ref.uid}*")
    spec = json.loads(spec_file.read_text())
    kind, _, name = cdi_id.partition("=")
    assert spec["kind"] == kind
    (entry,) = [d for d in spec["devices"] if d["name"] == name]
    nodes = {n["path"] for n in entry["containerEdits"].get("deviceNodes") or ()}
    assert f"/dev/nvidia{gpu['attributes']['minor']['int']}" in nodes, nodes
    # The pod ends: unprepared, its claim released and deleted.
    assert (await cluster.plugin.unprepare([ref]))[ref.uid] == ""
    assert not list(cluster.cdi_dir.glob(f"*{ref.uid}*"))
    await release_pod(cluster.allocator, scheduled)
    assert cluster.server.objects("resourceclaims") == []


async def test_nine_gpus_or_an_unknown_resource_are_unschedulable_and_say_why(cluster: Cluster) -> None:
    with pytest.raises(Unallocatable) as nine:
        await schedule_pod(cluster.allocator, pod("greedy", {"nvidia.com/gpu": "9"}), node=NODE)
    (reason,) = nine.value.reasons
    assert reason.startswith("pod default/greedy: container cuda asks 9 nvidia.com/gpu (DeviceClass gpu.nvidia.com")
    assert "needs 9 device(s); 8 devices of class gpu.nvidia.com on node node-a" in reason
    with pytest.raises(Unallocatable) as unknown:
        await schedule_pod(cluster.allocator, pod("fpga", {"example.com/fpga": "1"}), node=NODE)
    (reason,) = unknown.value.reasons
    assert reason.startswith("pod default/fpga: container cuda: example.com/fpga: no DeviceClass serves it")
    assert cluster.server.objects("resourceclaims") == [], "nothing is left behind"
    # The node's GPUs are all still free: eight one-GPU pods fit.
    for index in range(8):
        await schedule_pod(cluster.allocator, pod(f"one-{index}", {"nvidia.com/gpu": "1"}), node=NODE)
    assert len(cluster.server.objects("resourceclaims")) == 8
