"""The agent as operators run it: deploy/'s DaemonSet with the agent's own image, its pod run by the node's real
kubelet and containerd. The pod becomes Ready, registers with the kubelet through its plugin registry, publishes
the node's slices, prepares a pod's GPU claim and unprepares it when the pod goes; a rolling update hands the node
to the new pod, which unprepares a claim the old one prepared."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from agent.kubelet.plugin import socket_paths
from cluster.agent_image import AgentImage
from tests.real_cluster.agent_pod_env import AgentDaemonSet, agent_daemonset
from tests.real_cluster.cluster_env import GPU, NODE, RealCluster, poll
from tests.real_cluster.node_env import reported, reporter
from tests.real_cluster.objects import claim, exactly
from tests.support.timing import scaled

pytestmark = pytest.mark.xdist_group("real-node")

LIST_GPUS = "ls -l /dev/nvidia*"


def gpu_nodes(log: str) -> list[str]:
    """The GPU device nodes (character devices) a pod's `ls -l /dev/nvidia*` shows."""
    return re.findall(r"^c\S+ .* (/dev/nvidia\d+)$", log, re.MULTILINE)


def claims_logged(daemonset: AgentDaemonSet, pod: str, event: str) -> list[str]:
    """The uids of the claims the agent in `pod` logged `event` ("prepared claim", "unprepared claim") for."""
    return [line["claim"].rpartition(":")[2] for line in daemonset.log(pod)
            if line.get("event") == event and line.get("driver") == GPU]


async def gpu_pod(cluster: RealCluster, namespace: str, name: str) -> tuple[str, str]:
    """A pod with a one-GPU claim that lists its GPU, running; the claim's uid and the pod's listing."""
    await cluster.apply([claim(namespace, name, [exactly("gpu", GPU)]),
                         reporter(cluster, namespace, name, {"gpu": name}, LIST_GPUS)])
    log = await reported(cluster, namespace, name, timeout=scaled(180))
    uid: str = (await cluster.allocated(namespace, name))["metadata"]["uid"]
    return uid, log


async def delete_pod(cluster: RealCluster, namespace: str, name: str) -> None:
    await cluster.run("delete", "pod", name, "-n", namespace, "--wait=true", f"--timeout={scaled(120):.0f}s")


def registered(kubelet_log: str, endpoint: Path) -> bool:
    """The kubelet's log says it registered the GPU driver's plugin at `endpoint`."""
    return any('"Registered DRA plugin"' in line and f'driverName="{GPU}"' in line and f'endpoint="{endpoint}"' in line
               for line in kubelet_log.splitlines())


def published_devices(cluster: RealCluster) -> list[str]:
    slices: dict[str, Any] = cluster.kubectl.get(
        "resourceslices", "", f"--field-selector=spec.driver={GPU},spec.nodeName={NODE}") or {}
    return sorted(d["name"] for s in slices.get("items", []) for d in s["spec"].get("devices", []))


async def test_the_daemonsets_pod_serves_the_node(real_node: RealCluster, agent_image: AgentImage,
                                                  node_root: Path) -> None:
    assert real_node.worker is not None and real_node.worker.kubelet is not None
    kubelet = real_node.worker.kubelet
    # The slices other tests' agents left are gone: those found later are the pod's.
    await real_node.run("delete", "resourceslices", f"--field-selector=spec.driver={GPU},spec.nodeName={NODE}")
    before = kubelet.log.stat().st_size
    async with agent_daemonset(real_node, node_root, agent_image) as daemonset:
        pod = await daemonset.ready_pod()
        name, uid = pod["metadata"]["name"], pod["metadata"]["uid"]
        [container] = pod["status"]["containerStatuses"]
        assert container["image"] == agent_image.name and container["ready"], container
        # Registered through the plugin registry, its sockets named after its pod; the kubelet dials the DRA
        # socket below its plugins folder.
        dra, registration = socket_paths(GPU, kubelet.plugins_dir, kubelet.registry_dir, uid)
        assert registration.is_socket() and dra.is_socket(), sorted(map(str, kubelet.registry_dir.iterdir()))
        assert registered(kubelet.log.read_text(errors="replace")[before:], dra)
        assert GPU in {line.get("driver") for line in daemonset.log(name)
                       if line.get("event") == "registered with the kubelet"}
        # The node's eight GPUs published (dgx-h100), read from the simulated node's sysfs and NVML library.
        assert len(await poll(lambda: published_devices(real_node) or None, timeout=scaled(60),
                              what="the node's slices")) == 8

        ns = await real_node.namespace("agent-pod")
        claim_uid, listing = await gpu_pod(real_node, ns, "gpu")
        assert len(gpu_nodes(listing)) == 1, listing
        assert daemonset.specs(claim_uid), "no CDI spec of the claim"
        assert daemonset.histories(GPU) == {claim_uid: ["started", "completed"]}
        assert claims_logged(daemonset, name, "prepared claim") == [claim_uid]

        await delete_pod(real_node, ns, "gpu")
        assert daemonset.specs(claim_uid) == []
        assert daemonset.histories(GPU) == {claim_uid: ["started", "completed", "removed"]}
        assert claims_logged(daemonset, name, "unprepared claim") == [claim_uid]


async def test_a_rolling_update_hands_the_node_to_the_new_pod(real_node: RealCluster, agent_image: AgentImage,
                                                              node_root: Path) -> None:
    assert real_node.worker is not None and real_node.worker.kubelet is not None
    kubelet = real_node.worker.kubelet
    async with agent_daemonset(real_node, node_root, agent_image) as daemonset:
        old = (await daemonset.ready_pod())["metadata"]["name"]
        ns = await real_node.namespace("agent-pod-update")
        before_uid, listing = await gpu_pod(real_node, ns, "before")
        assert len(gpu_nodes(listing)) == 1, listing
        assert claims_logged(daemonset, old, "prepared claim") == [before_uid]

        log_size = kubelet.log.stat().st_size
        await daemonset.roll("1")
        new_pod = await daemonset.ready_pod(not_named=old)
        new = new_pod["metadata"]["name"]
        # The old pod gone, the new one serving (on this node one after the other: cluster.agent_daemonset says
        # why).
        await poll(lambda: [p["metadata"]["name"] for p in daemonset.pods()] == [new] or None,
                   timeout=scaled(120), what="the old agent pod gone")
        dra, _ = socket_paths(GPU, kubelet.plugins_dir, kubelet.registry_dir, new_pod["metadata"]["uid"])
        assert registered(kubelet.log.read_text(errors="replace")[log_size:], dra)

        # The claim the old pod prepared is unprepared by the new one, and a new claim prepared by it.
        after_uid, listing = await gpu_pod(real_node, ns, "after")
        assert len(gpu_nodes(listing)) == 1, listing
        assert claims_logged(daemonset, new, "prepared claim") == [after_uid]
        await delete_pod(real_node, ns, "before")
        assert daemonset.specs(before_uid) == []
        assert claims_logged(daemonset, new, "unprepared claim") == [before_uid]
        assert daemonset.histories(GPU)[before_uid] == ["started", "completed", "removed"]
        assert daemonset.histories(GPU)[after_uid] == ["started", "completed"]
        # Nothing left for the kubelet to unprepare once the DaemonSet is gone.
        await delete_pod(real_node, ns, "after")
        assert daemonset.specs(after_uid) == []
        assert daemonset.histories(GPU)[after_uid] == ["started", "completed", "removed"]
