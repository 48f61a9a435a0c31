"""The slices the agent publishes, as the real API server stores them: every device with its topology, owned by the
Node; updated when a GPU fails (a device taint the server accepts and the real scheduler honours: a claim for that
GPU waits) and again when it recovers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from simulator.nvml.control import request
from tests.real_cluster.cluster_env import GPU, NODE, SRIOV, RealCluster, agent_on_node, poll
from tests.real_cluster.objects import claim, exactly, pod
from tests.support.agent_env import metrics_of
from tests.support.timing import scaled

pytestmark = pytest.mark.xdist_group("real-cluster")

GPU_ZERO = "gpu-0000-18-00-0"
ONLY_GPU_ZERO = 'device.attributes["resource.kubernetes.io"].pciBusID == "0000:18:00.0"'
# Recovery of a reset GPU is found by probing it; a short period keeps the test short.
RECHECK = {"nvidia-gpu": {"recheckSeconds": 0.3}}


def stored(cluster: RealCluster, driver: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = cluster.kubectl.json(
        "get", "resourceslices", f"--field-selector=spec.driver={driver},spec.nodeName={NODE}")["items"]
    return found


def taints(cluster: RealCluster) -> dict[str, list[tuple[str, str, str]]]:
    return {d["name"]: [(t["key"], t.get("value", ""), t["effect"]) for t in d["taints"]]
            for s in stored(cluster, GPU) for d in s["spec"].get("devices", ()) if d.get("taints")}


async def test_published_slices_are_stored_whole_and_owned_by_the_node(real_cluster: RealCluster,
                                                                      node_root: Path) -> None:
    async with agent_on_node(real_cluster, node_root) as agent:
        metrics = metrics_of(agent.metrics)
        for driver, count in ((GPU, 8), (SRIOV, 64)):
            slices = stored(real_cluster, driver)
            devices = [d for s in slices for d in s["spec"]["devices"]]
            assert len(devices) == count == metrics[f'dra_agent_published_devices{{driver="{driver}"}}']
            assert all("resource.kubernetes.io/pcieRoot" in d["attributes"] for d in devices)
            for slice_ in slices:
                [owner] = slice_["metadata"]["ownerReferences"]
                assert (owner["kind"], owner["name"], owner["uid"]) == ("Node", NODE, real_cluster.node_uid)


async def test_a_failed_gpu_is_tainted_and_the_scheduler_keeps_claims_off_it(real_cluster: RealCluster,
                                                                            node_root: Path) -> None:
    async with agent_on_node(real_cluster, node_root, backend_config=RECHECK) as agent:
        sim_root = agent.settings.sim_root
        assert sim_root is not None
        await poll(lambda: all(g["registered_events"] for g in request(sim_root, {"op": "list"})["gpus"]) or None,
                   timeout=scaled(30), what="NVML events watched on every GPU")
        assert request(sim_root, {"op": "xid", "gpu": "0", "xid": 79})["delivered"] >= 1
        await poll(lambda: taints(real_cluster) == {GPU_ZERO: [(f"{GPU}/xid", "79", "NoSchedule")]} or None,
                   timeout=scaled(30), what="the failed GPU tainted in the stored slice")

        ns = await real_cluster.namespace("tainted")
        await real_cluster.apply([claim(ns, "wants-zero", [exactly("gpu", GPU, selectors=[ONLY_GPU_ZERO])]),
                                  pod(ns, "wants-zero", claims={"gpu": "wants-zero"})])
        message = await real_cluster.unschedulable(ns, "wants-zero")
        assert "cannot allocate all claims" in message, message

        request(sim_root, {"op": "reset", "gpu": "0"})
        await poll(lambda: taints(real_cluster) == {} or None, timeout=scaled(30),
                   what="the taint removed once the GPU recovered")
        await agent.prepare_pod(ns, "wants-zero")
