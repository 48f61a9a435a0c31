"""Scheduling a pod's extended resources onto a node against an API server, as the scheduler's DRA plugin does
for KEP-5004: create the pod's extended-resource claim, allocate it through :class:`Allocator`, reserve it for
the pod, and give the pod its ``status.extendedResourceClaimStatus``; or release it all again.

The test API server serves no Pods: a pod here is a core/v1 Pod object the caller holds, and the pod this
returns is that object as the scheduler and kubelet would leave it (``spec.nodeName``, the status field). The
claim is a real object in the API server, so the agent and the kubelet simulator see an ordinary allocated
claim. When the claim cannot be allocated it is deleted again, as the scheduler's Unreserve step does.
"""

from __future__ import annotations

import copy
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.kube.client import KubeClient, KubeError
from agent.kube.paths import DEVICE_CLASSES, NODES, RESOURCE_CLAIMS, api_path
from simulator.scheduler.allocation import Allocation, Unallocatable
from simulator.scheduler.allocator import Allocator
from simulator.scheduler.cel import CelError
from simulator.scheduler.extended import ExtendedClaim, plan_extended_claim, pod_claim_status

__all__ = ["ScheduledPod", "release_pod", "schedule_pod"]

JsonObject = dict[str, Any]


@dataclass
class ScheduledPod:
    """A pod placed on a node: the pod with its node and status, and its allocated claim if DRA serves any of
    its extended resources there."""

    pod: JsonObject
    node: str
    claim: JsonObject | None = None
    allocation: Allocation | None = None
    plan: ExtendedClaim | None = None

    @property
    def claim_name(self) -> str | None:
        return None if self.claim is None else str(self.claim["metadata"]["name"])


async def _node(kube: KubeClient, node: str) -> str | JsonObject:
    try:
        found: JsonObject = await kube.request("GET", api_path(NODES, name=node), what=f"get node {node}")
    except KubeError as e:
        if e.status == 404:
            return node
        raise
    return found


def _explained(error: Unallocatable, plan: ExtendedClaim, pod: str) -> Unallocatable:
    """The allocator's reasons, with each request named by the container and resource it stands for."""
    reasons = []
    for reason in error.reasons:
        found = re.match(r"request ([^:/ ]+)(.*)", reason)
        request = plan.request(found.group(1)) if found else None
        if found and request is not None:
            reason = (f"container {request.container} asks {request.count} {request.resource} (DeviceClass "
                      f"{request.device_class}, claim request {request.request_name}){found.group(2)}")
        reasons.append(f"pod {pod}: {reason}")
    return Unallocatable(reasons)


async def schedule_pod(allocator: Allocator, pod: Mapping[str, Any], *, node: str) -> ScheduledPod:
    """Place ``pod`` on ``node``: its extended resources that DRA serves there get one allocated claim.

    Raises :class:`Unallocatable` with reasons when the pod does not fit (nothing is left in the API server),
    :class:`CelError` for a class selector that cannot be compiled and :class:`KubeError` when the API server
    fails."""
    placed = copy.deepcopy(dict(pod))
    meta = placed.setdefault("metadata", {})
    meta.setdefault("namespace", "default")
    meta.setdefault("uid", str(uuid.uuid4()))
    namespace = str(meta["namespace"])
    kube = await allocator.client()
    listed = await kube.request("GET", api_path(DEVICE_CLASSES), what="list deviceclasses")
    plan = plan_extended_claim(placed, listed.get("items") or [], await _node(kube, node))
    placed.setdefault("spec", {})["nodeName"] = node
    if plan is None:
        return ScheduledPod(placed, node)
    created: JsonObject = await kube.request("POST", api_path(RESOURCE_CLAIMS, namespace), body=plan.claim,
                                             what=f"create the extended-resource claim of pod {meta.get('name')}")
    name = str(created["metadata"]["name"])
    try:
        allocation = await allocator.allocate(namespace, name, node=node)
        claim = await _reserve(kube, namespace, name, placed)
    except Unallocatable as e:
        await _delete(kube, namespace, name)
        raise _explained(e, plan, f"{namespace}/{meta.get('name')}") from None
    except (CelError, KubeError):
        await _delete(kube, namespace, name)
        raise
    placed.setdefault("status", {})["extendedResourceClaimStatus"] = pod_claim_status(name, plan)
    return ScheduledPod(placed, node, claim, allocation, plan)


async def _reserve(kube: KubeClient, namespace: str, name: str, pod: Mapping[str, Any]) -> JsonObject:
    """``status.reservedFor`` the pod, as the scheduler writes it when binding."""
    claim: JsonObject = await kube.request("GET", api_path(RESOURCE_CLAIMS, namespace, name),
                                           what="read the extended-resource claim")
    meta = pod["metadata"]
    status = claim.setdefault("status", {})
    status["reservedFor"] = [{"resource": "pods", "name": meta["name"], "uid": meta["uid"]}]
    reserved: JsonObject = await kube.request("PUT", api_path(RESOURCE_CLAIMS, namespace, name, "status"), body=claim,
                                              what="reserve the extended-resource claim for its pod")
    return reserved


async def _delete(kube: KubeClient, namespace: str, name: str) -> None:
    try:
        await kube.request("DELETE", api_path(RESOURCE_CLAIMS, namespace, name),
                           what="delete the extended-resource claim")
    except KubeError as e:
        if e.status != 404:
            raise


async def release_pod(allocator: Allocator, scheduled: ScheduledPod) -> None:
    """The pod is gone: its claim's allocation is released and the claim deleted (the pod owns it)."""
    if scheduled.claim is None:
        return
    meta = scheduled.claim["metadata"]
    await allocator.deallocate(meta["namespace"], meta["name"])
    kube = await allocator.client()
    await _delete(kube, meta["namespace"], meta["name"])
