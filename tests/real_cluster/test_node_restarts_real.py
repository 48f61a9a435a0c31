"""Restarts on the node as the real kubelet and containerd go through them: the kubelet restarted (it wipes the
node's slices when it starts, the agent publishes them again, running pods keep their devices, new pods start); the
agent killed while pods start (every pod starts once, nothing leaks)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.real_cluster.cluster_env import GPU, NODE, KubectlError, RealCluster, poll
from tests.real_cluster.node_env import agent_on_real_node, running_pod, sleeper
from tests.real_cluster.objects import claim, exactly
from tests.timing import scaled

pytestmark = pytest.mark.xdist_group("real-cluster")


def node_slices(cluster: RealCluster, driver: str) -> dict[str, dict[str, Any]]:
    """The node's slices of `driver` by uid."""
    found = cluster.kubectl.json("get", "resourceslices",
                                 f"--field-selector=spec.nodeName={NODE},spec.driver={driver}")["items"]
    return {s["metadata"]["uid"]: s for s in found}


def gpus_in_log(log: str) -> list[str]:
    """The GPU device nodes a pod's last listing (a line per listing, see `gpu_lister`) shows."""
    lines = [line for line in log.splitlines() if line.startswith("gpus:")]
    return lines[-1].split()[1:] if lines else []


def gpu_lister(cluster: RealCluster, namespace: str, name: str) -> dict[str, Any]:
    """A pod with claim `name` that lists its GPU device nodes every second until deleted."""
    made = sleeper(cluster, namespace, name, {"gpu": name})
    made["spec"]["containers"][0]["command"] = [
        "sh", "-c", "while true; do echo gpus: $(ls /dev | grep '^nvidia[0-9]'); sleep 1; done"]
    return made


async def test_a_restarted_kubelet_wipes_the_slices_and_the_agent_publishes_them_again(
        real_node: RealCluster, node_root: Path) -> None:
    worker = real_node.worker
    assert worker is not None and worker.kubelet is not None
    async with agent_on_real_node(real_node, node_root) as agent:
        ns = await real_node.namespace("kubelet-restart")
        await real_node.apply([claim(ns, "before", [exactly("gpu", GPU)]), gpu_lister(real_node, ns, "before")])
        running = await running_pod(real_node, ns, "before")
        [container] = running["status"]["containerStatuses"]
        before_uid = (await real_node.allocated(ns, "before"))["metadata"]["uid"]
        published = await asyncio.to_thread(node_slices, real_node, GPU)
        assert published

        await asyncio.to_thread(worker.restart_kubelet, timeout=scaled(120))
        real_node.loopback.watch(worker.pids())

        # Every slice the agent had published was deleted, and the agent made them again: the same devices.
        def republished() -> dict[str, dict[str, Any]] | None:
            now = node_slices(real_node, GPU)
            return now if now and not set(now) & set(published) else None
        again = await poll(republished, timeout=scaled(60), what="the node's slices wiped and published again")
        devices = sorted(d["name"] for s in again.values() for d in s["spec"]["devices"])
        assert devices == sorted(d["name"] for s in published.values() for d in s["spec"]["devices"])

        # The running pod kept its container (not restarted) and its GPU; its claim is still prepared.
        def listed() -> list[str] | None:
            try:  # the API server reaches the restarted kubelet for the log once it knows the pod again
                log = real_node.kubectl.run("logs", "before", "-n", ns, "--since=3s")
            except KubectlError:
                return None
            return gpus_in_log(log) or None
        assert len(await poll(listed, timeout=scaled(30), what="the running pod's GPU listing")) == 1
        now = await real_node.get("pod", "before", "-n", ns)
        [status] = now["status"]["containerStatuses"]
        assert (status["containerID"], status["restartCount"]) == (container["containerID"], 0), status
        assert agent.on_node(before_uid), "the running pod's claim was unprepared"

        # A pod started after the restart gets a GPU of its own.
        await real_node.apply([claim(ns, "after", [exactly("gpu", GPU)]), gpu_lister(real_node, ns, "after")])
        await running_pod(real_node, ns, "after")
        def after_listed() -> list[str] | None:
            return gpus_in_log(real_node.kubectl.run("logs", "after", "-n", ns)) or None
        [after_gpu] = await poll(after_listed, timeout=scaled(30), what="the new pod's GPU listing")
        assert [after_gpu] != await poll(listed, timeout=scaled(30), what="the running pod's GPU listing")
