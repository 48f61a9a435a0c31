"""The demo's extended-resource scenario (KEP-5004): a pod that asks `nvidia.com/gpu: 1`, as it would of NVIDIA's
device plugin, gets a GPU through DRA; a pod asking one GPU more than the node has, and one asking a resource
nothing serves, are refused with the reason."""

from __future__ import annotations

from typing import Any

from simulator.demo.claims import attribute, show_allocation
from simulator.demo.cluster import DemoCluster
from simulator.demo.scenarios import show_prepared, show_reasons
from simulator.demo.story import Story
from simulator.scheduler.allocation import Unallocatable
from simulator.scheduler.extended import ANNOTATION
from simulator.scheduler.pods import release_pod, schedule_pod

GPU = "gpu.nvidia.com"
JsonObject = dict[str, Any]


def gpu_pod(name: str, resources: dict[str, str]) -> JsonObject:
    """A pod with one container that asks for extended resources, as a device-plugin user writes it."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": {"containers": [{"name": "cuda", "image": "cuda:12.9.0-base-ubuntu24.04",
                                     "command": ["nvidia-smi"], "resources": {"limits": resources}}]}}  # fmt: skip


async def extended_gpu(cluster: DemoCluster, story: Story, node: str) -> None:
    classes = {c["metadata"]["name"]: c for c in cluster.server.objects("deviceclasses")}
    named = (classes.get(GPU, {}).get("spec") or {}).get("extendedResourceName")
    story.say(f"The DeviceClass {GPU} carries extendedResourceName: {named}. A pod written for NVIDIA's device "
              "plugin, asking nvidia.com/gpu in its container's resources and naming no ResourceClaim, gets a GPU "
              "through DRA: the scheduler makes one ResourceClaim for the pod, with one request per container and "
              "resource, and allocates it; the kubelet finds that claim in the pod's status and the agent prepares "
              "it like any other.")
    pod = gpu_pod("cuda-job", {"nvidia.com/gpu": "1"})
    story.document(pod)
    story.step(f"Schedule the pod on node {node}:")
    scheduled = await schedule_pod(cluster.allocator, pod, node=node)
    claim, allocation = scheduled.claim, scheduled.allocation
    if not story.check(claim is not None and allocation is not None, "the scheduler made a claim for the pod",
                       otherwise="DRA serves none of the pod's resources there"):
        return
    assert claim is not None and allocation is not None
    story.document({"metadata": {k: claim["metadata"][k] for k in ("name", "annotations")}, "spec": claim["spec"]})
    requests = claim["spec"]["devices"]["requests"]
    story.check(claim["metadata"].get("annotations") == {ANNOTATION: "true"} and [r["name"] for r in requests] ==
                ["container-0-request-0"] and requests[0]["exactly"]["deviceClassName"] == GPU,
                f"one claim, annotated {ANNOTATION}, with request container-0-request-0 for class {GPU}",
                otherwise=str(claim["metadata"].get("annotations")) + str(requests))  # fmt: skip
    (picked,) = show_allocation(story, cluster, node, allocation, ("type", "productName", "minor"))
    story.check(attribute(picked, "type") == "gpu", f"allocated a whole GPU: {allocation.results[0].device}",
                otherwise=f"type {attribute(picked, 'type')}")
    story.detail("the pod's status tells the kubelet which claim and request serve which container:")
    status = scheduled.pod["status"]["extendedResourceClaimStatus"]
    story.document({"extendedResourceClaimStatus": status}, indent=6)
    name = str(status["resourceClaimName"])
    answers = await cluster.prepare(name, node)
    await show_prepared(cluster, story, node, name, answers)
    nodes = cluster.nodes[node].cdi_nodes(claim["metadata"]["uid"])
    minor = attribute(picked, "minor")
    story.check(f"/dev/nvidia{minor}" in nodes, f"the container gets the GPU's device node /dev/nvidia{minor}",
                otherwise=", ".join(sorted(nodes)))
    await _refused(cluster, story, node)
    errors = await cluster.unprepare(name, node)
    await release_pod(cluster.allocator, scheduled)
    story.check(not any(errors.values()) and cluster.server.get_object("resourceclaims", name) is None,
                "the pod is gone: its claim is unprepared, released and deleted", otherwise=str(errors))


async def _refused(cluster: DemoCluster, story: Story, node: str) -> None:
    """More GPUs than the node has, and a resource no class and no device plugin serves: refused, no claim left."""
    gpus = len([d for d in cluster.devices(node, GPU) if attribute(d, "type") == "gpu"])
    for pod, what, resource, count, cause in (
        ("too-many-gpus", f"one GPU more than node {node} has", "nvidia.com/gpu", gpus + 1,
         f"needs {gpus + 1} device(s)"),
        ("fpga-job", "a resource no DeviceClass and no device plugin serves", "example.com/fpga", 1,
         "no DeviceClass serves it"),
    ):  # fmt: skip
        story.step(f"A pod asking {resource}: {count}, {what}:")
        before = len(cluster.server.objects("resourceclaims"))
        try:
            await schedule_pod(cluster.allocator, gpu_pod(pod, {resource: str(count)}), node=node)
            story.fail(f"a pod asking {resource}: {count} was placed on {node}")
        except Unallocatable as e:
            show_reasons(story, e)
            story.check(any(cause in r for r in e.reasons) and len(cluster.server.objects("resourceclaims")) == before,
                        f"unschedulable, the scheduler says why ({cause}), and no claim is left behind",
                        otherwise="; ".join(e.reasons))  # fmt: skip
