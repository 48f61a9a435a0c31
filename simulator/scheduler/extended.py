"""Extended resources backed by DRA (KEP-5004), without I/O: which DeviceClass serves a name such as
``nvidia.com/gpu``, and the one ResourceClaim the scheduler makes for a pod that asks for such names in its
containers' ``resources``, with the ``pod.status.extendedResourceClaimStatus`` that tells the kubelet about it.

What the scheduler's DRA plugin does (``pkg/scheduler/framework/plugins/dynamicresources/extended*.go``):

- Every DeviceClass serves its implicit name ``deviceclass.resource.kubernetes.io/<class>``, and its
  ``spec.extendedResourceName`` if set. When classes share a name, the newest class serves it; on equal creation
  times, the lexically first class name.
- On a node whose ``status.allocatable`` has the resource (a device plugin advertises it), the device plugin
  serves it, not DRA. A name no class serves and the node does not have makes the pod unschedulable there.
- One claim per pod, owned by it, annotated ``resource.kubernetes.io/extended-resource-claim: "true"``, named
  ``<pod>-extended-resources-<random>``; one ``exactly`` request (``ExactCount``) per container and resource,
  named ``container-<i>-request-<j>``: ``i`` indexes init containers then containers, ``j`` the resource among
  the container's requests sorted by name.

Left out: pod-level resources, reusing an init container's devices in a later container, and the accounting
of what a device plugin's resources already hold on the node (its allocatable is compared with this pod alone).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from agent.kube.quantity import parse_quantity
from simulator.apiserver.deviceclasses import is_extended_resource_name
from simulator.scheduler.allocation import Unallocatable

__all__ = ["ANNOTATION", "IMPLICIT_PREFIX", "ExtendedClaim", "ResourceRequest", "class_mapping",
           "is_dra_extended_resource_name", "plan_extended_claim", "pod_claim_status"]

ANNOTATION = "resource.kubernetes.io/extended-resource-claim"
IMPLICIT_PREFIX = "deviceclass.resource.kubernetes.io/"

JsonObject = dict[str, Any]


def is_dra_extended_resource_name(name: str) -> bool:
    """An extended resource name, or an implicit DeviceClass name (which lives in kubernetes.io and so is not
    an extended resource name by the core rules)."""
    return is_extended_resource_name(name) or name.startswith(IMPLICIT_PREFIX)


def _created(device_class: Mapping[str, Any]) -> str:
    # RFC 3339 times of one format sort as strings; a class without one counts as the oldest.
    return str((device_class.get("metadata") or {}).get("creationTimestamp") or "")


def _name(device_class: Mapping[str, Any]) -> str:
    return str((device_class.get("metadata") or {}).get("name") or "")


def class_mapping(classes: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Resource name → the DeviceClass that serves it."""
    implicit: dict[str, str] = {}
    explicit: dict[str, Mapping[str, Any]] = {}
    for device_class in classes:
        implicit[IMPLICIT_PREFIX + _name(device_class)] = _name(device_class)
        wanted = (device_class.get("spec") or {}).get("extendedResourceName")
        if isinstance(wanted, str) and wanted:
            held = explicit.get(wanted)
            newer = held is None or _created(device_class) > _created(held) or (
                _created(device_class) == _created(held) and _name(device_class) < _name(held))
            if newer:
                explicit[wanted] = device_class
    return {**implicit, **{name: _name(c) for name, c in explicit.items()}}


@dataclass(frozen=True)
class ResourceRequest:
    """One container's ask for one extended resource that DRA serves on the node: one request of the claim."""

    container: str
    container_index: int  # among init containers, then containers
    resource: str
    position: int  # the resource's index among the container's requests, sorted by name
    count: int
    device_class: str

    @property
    def request_name(self) -> str:
        return f"container-{self.container_index}-request-{self.position}"

    def mapping(self) -> dict[str, str]:
        """An entry of ``extendedResourceClaimStatus.requestMappings``."""
        return {"containerName": self.container, "resourceName": self.resource, "requestName": self.request_name}


@dataclass(frozen=True)
class ExtendedClaim:
    """What the scheduler makes for a pod on a node: the claim to create and the requests behind it."""

    claim: JsonObject
    requests: tuple[ResourceRequest, ...]

    def request(self, name: str) -> ResourceRequest | None:
        return next((r for r in self.requests if r.request_name == name), None)


def _containers(pod: Mapping[str, Any]) -> list[tuple[Mapping[str, Any], bool]]:
    spec = pod.get("spec") or {}
    return [(c, True) for c in spec.get("initContainers") or ()] + [(c, False) for c in spec.get("containers") or ()]


def _requests(container: Mapping[str, Any], problems: list[str]) -> dict[str, Fraction]:
    """The container's requests as the API server leaves them: a resource given only as a limit is requested at
    that limit. The API server refuses a pod whose extended resources are not whole, or whose requests and limits
    of one differ: with no pod API here, the scheduler reports it."""
    resources = container.get("resources") or {}
    limits, requests = dict(resources.get("limits") or {}), dict(resources.get("requests") or {})
    where = f"container {container.get('name')}"
    found: dict[str, Fraction] = {}
    for name in sorted(set(requests) | set(limits)):
        try:
            value = parse_quantity(str(requests.get(name, limits.get(name))))
            limit = parse_quantity(str(limits[name])) if name in limits else value
        except ValueError as e:
            problems.append(f"{where}: {name}: {e}")
            continue
        found[name] = value
        if is_dra_extended_resource_name(name) and (value.denominator != 1 or value < 0 or value != limit):
            problems.append(f"{where}: {name}: an extended resource is asked as a whole number with requests "
                            f"equal to limits, not requests {requests.get(name)} and limits {limits.get(name)}")
    return found


def _allocatable(node: str | Mapping[str, Any]) -> dict[str, Fraction]:
    if isinstance(node, str):
        return {}
    found = {}
    for name, value in ((node.get("status") or {}).get("allocatable") or {}).items():
        try:
            found[str(name)] = parse_quantity(str(value))
        except ValueError:
            continue
    return found


def _pod_total(asked: Sequence[tuple[bool, Mapping[str, Fraction]]], resource: str) -> Fraction:
    """What a pod needs of a resource on the node: init containers run one at a time, before the others."""
    regular = sum((r.get(resource, Fraction(0)) for init, r in asked if not init), Fraction(0))
    return max([regular, *(r.get(resource, Fraction(0)) for init, r in asked if init)])


def plan_extended_claim(pod: Mapping[str, Any], classes: Iterable[Mapping[str, Any]],
                        node: str | Mapping[str, Any]) -> ExtendedClaim | None:  # fmt: skip
    """The claim for the pod's extended resources that DRA serves on ``node`` (a name or a Node object), or None
    when DRA serves none of them there. Raises :class:`Unallocatable` when the pod asks for a resource that
    neither a DeviceClass nor the node's allocatable (a device plugin) provides, or more of a device plugin's
    resource than the node has."""
    meta = pod.get("metadata") or {}
    node_name = node if isinstance(node, str) else str((node.get("metadata") or {}).get("name", ""))
    mapping = class_mapping(classes)
    allocatable = _allocatable(node)
    problems: list[str] = []
    asked = [(init, _requests(c, problems)) for c, init in _containers(pod)]
    containers = [c for c, _ in _containers(pod)]
    requests: list[ResourceRequest] = []
    by_plugin: set[str] = set()
    for index, (container, (_, wanted)) in enumerate(zip(containers, asked, strict=True)):
        for position, resource in enumerate(sorted(wanted)):
            count = wanted[resource]
            if not is_dra_extended_resource_name(resource) or count <= 0 or count.denominator != 1:
                continue
            if resource in mapping and not allocatable.get(resource):
                requests.append(ResourceRequest(str(container.get("name")), index, resource, position, int(count),
                                                mapping[resource]))  # fmt: skip
            elif resource in allocatable:
                by_plugin.add(resource)
            else:
                problems.append(f"container {container.get('name')}: {resource}: no DeviceClass serves it (as its "
                                f"extendedResourceName, or as {IMPLICIT_PREFIX}<class>) and node {node_name} does "
                                f"not have it in its allocatable (no device plugin advertises it)")  # fmt: skip
    for resource in sorted(by_plugin):
        total = _pod_total(asked, resource)
        if total > allocatable[resource]:
            problems.append(f"Insufficient {resource}: the pod asks {total}, node {node_name} has "
                            f"{allocatable[resource]} (served by a device plugin, not DRA)")  # fmt: skip
    if problems:
        raise Unallocatable([f"pod {meta.get('namespace', 'default')}/{meta.get('name')}: {p}" for p in problems])
    if not requests:
        return None
    requests.sort(key=lambda r: r.request_name)
    owner = {"apiVersion": "v1", "kind": "Pod", "name": meta.get("name"), "uid": meta.get("uid"),
             "controller": True, "blockOwnerDeletion": True}  # fmt: skip
    claim: JsonObject = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"generateName": f"{meta.get('name')}-extended-resources-",
                     "namespace": meta.get("namespace") or "default", "ownerReferences": [owner],
                     "annotations": {ANNOTATION: "true"}},
        "spec": {"devices": {"requests": [
            {"name": r.request_name, "exactly": {"deviceClassName": r.device_class, "allocationMode": "ExactCount",
                                                 "count": r.count}} for r in requests]}},
    }  # fmt: skip
    return ExtendedClaim(claim, tuple(requests))


def pod_claim_status(claim_name: str, plan: ExtendedClaim) -> JsonObject:
    """``pod.status.extendedResourceClaimStatus``: the claim, and which request serves which container's resource."""
    return {"resourceClaimName": claim_name, "requestMappings": [r.mapping() for r in plan.requests]}
