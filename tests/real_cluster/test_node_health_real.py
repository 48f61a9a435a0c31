"""A device's health as the real kubelet shows it in the pod that uses it: an Xid from the simulated NVML turns the
pod's `allocatedResourcesStatus` for the GPU Unhealthy, with the agent's message, through the health stream the
kubelet opened; the GPU is tainted in its slice; once it recovers the pod shows it Healthy again and the taint
goes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from simulator.nvml.control import request
from tests.real_cluster.cluster_env import GPU, NODE, RealCluster, poll
from tests.real_cluster.node_env import agent_on_real_node, running_pod, sleeper
from tests.real_cluster.objects import claim, exactly
from tests.support.timing import scaled

pytestmark = pytest.mark.xdist_group("real-node")

GPU_ZERO = "gpu-0000-18-00-0"  # the device the selector below picks
ONLY_GPU_ZERO = 'device.attributes["resource.kubernetes.io"].pciBusID == "0000:18:00.0"'
# Recovery of a reset GPU is found by probing it; a short period keeps the test short.
RECHECK = {"nvidia-gpu": {"recheckSeconds": 0.3}}


def health_in_pod(cluster: RealCluster, namespace: str, name: str) -> dict[str, tuple[str, str]]:
    """The pod's allocatedResourcesStatus, as (health, message) by resource ID, for every claim of its container."""
    found = cluster.kubectl.get("pod", name, "-n", namespace) or {}
    shown: dict[str, tuple[str, str]] = {}
    for container in found.get("status", {}).get("containerStatuses", []):
        for entry in container.get("allocatedResourcesStatus", []):
            for resource in entry.get("resources", []):
                shown[resource["resourceID"]] = (resource.get("health", ""), resource.get("message", ""))
    return shown


def gpu_taints(cluster: RealCluster, device: str) -> list[dict[str, Any]]:
    slices = cluster.kubectl.json("get", "resourceslices",
                                  f"--field-selector=spec.driver={GPU},spec.nodeName={NODE}")["items"]
    return [t for s in slices for d in s["spec"].get("devices", []) if d["name"] == device for t in d.get("taints", [])]


async def test_an_xid_turns_the_pods_gpu_unhealthy_and_recovery_turns_it_back(real_node: RealCluster,
                                                                              node_root: Path) -> None:
    async with agent_on_real_node(real_node, node_root, backend_config=RECHECK) as agent:
        sim_root = agent.settings.sim_root
        assert sim_root is not None
        ns = await real_node.namespace("health")
        await real_node.apply([claim(ns, "gpu", [exactly("gpu", GPU, selectors=[ONLY_GPU_ZERO])]),
                               sleeper(real_node, ns, "gpu", {"gpu": "gpu"})])
        await running_pod(real_node, ns, "gpu")
        # The kubelet names the status after the pod's claim and the device by the first CDI device ID the agent
        # returned for it (driver/pool/device only for a device without one).
        uid = (await real_node.allocated(ns, "gpu"))["metadata"]["uid"]
        [spec_file] = agent.settings.cdi_dir.glob(f"*{uid}*.json")
        spec = json.loads(spec_file.read_text())
        [device] = spec["devices"]
        resource = f"{spec['kind']}={device['name']}"
        [entry] = (await real_node.get("pod", "gpu", "-n", ns))["status"]["containerStatuses"][0].get(
            "allocatedResourcesStatus", [{}])
        assert entry.get("name") == "claim:gpu", entry

        def shown(health: str) -> tuple[str, str] | None:
            now = health_in_pod(real_node, ns, "gpu").get(resource)
            return now if now is not None and now[0] == health else None
        await poll(lambda: shown("Healthy"), timeout=scaled(30), what="the pod's GPU shown Healthy")

        await poll(lambda: all(g["registered_events"] for g in request(sim_root, {"op": "list"})["gpus"]) or None,
                   timeout=scaled(30), what="NVML events watched on every GPU")
        assert request(sim_root, {"op": "xid", "gpu": "0", "xid": 79})["delivered"] >= 1
        _, message = await poll(lambda: shown("Unhealthy"), timeout=scaled(60), what="the pod's GPU shown Unhealthy")
        assert message.startswith("Xid 79"), message
        [taint] = await poll(lambda: gpu_taints(real_node, GPU_ZERO) or None, timeout=scaled(30),
                             what="the GPU tainted in its slice")
        assert (taint["key"], taint.get("value"), taint["effect"]) == (f"{GPU}/xid", "79", "NoSchedule")
        # NoSchedule: the pod that runs on it keeps running.
        await running_pod(real_node, ns, "gpu", timeout=scaled(5))

        request(sim_root, {"op": "reset", "gpu": "0"})
        await poll(lambda: shown("Healthy"), timeout=scaled(60), what="the pod's GPU shown Healthy again")
        await poll(lambda: not gpu_taints(real_node, GPU_ZERO), timeout=scaled(30), what="the taint removed")
