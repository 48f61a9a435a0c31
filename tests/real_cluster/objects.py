"""The objects a workload author writes, as plain data: claims, claim templates and pods that use them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["claim", "exactly", "pod", "template"]

RESOURCE_V1 = "resource.k8s.io/v1"
# No registry exists here: the image is never pulled. On the cluster without a kubelet nothing runs it; on the
# node with one, pods name the images imported there (`cluster.images`).
IMAGE = "pause:never-pulled"


def exactly(name: str, device_class: str, *, selectors: Sequence[str] = (), count: int | None = None,
            capacity: Mapping[str, str] | None = None, admin: bool = False) -> dict[str, Any]:
    """One device request of a claim."""
    spec: dict[str, Any] = {"deviceClassName": device_class}
    if selectors:
        spec["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    if count is not None:
        spec["allocationMode"] = "ExactCount"
        spec["count"] = count
    if capacity:
        spec["capacity"] = {"requests": dict(capacity)}
    if admin:
        spec["adminAccess"] = True
    return {"name": name, "exactly": spec}


def _devices(requests: Sequence[dict[str, Any]], constraints: Sequence[dict[str, Any]] = (),
             config: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": list(requests)}
    if constraints:
        devices["constraints"] = list(constraints)
    if config:
        devices["config"] = list(config)
    return devices


def claim(namespace: str, name: str, requests: Sequence[dict[str, Any]], *,
          constraints: Sequence[dict[str, Any]] = (), config: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    return {"apiVersion": RESOURCE_V1, "kind": "ResourceClaim",
            "metadata": {"namespace": namespace, "name": name},
            "spec": {"devices": _devices(requests, constraints, config)}}


def template(namespace: str, name: str, requests: Sequence[dict[str, Any]], *,
             constraints: Sequence[dict[str, Any]] = (), config: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    return {"apiVersion": RESOURCE_V1, "kind": "ResourceClaimTemplate",
            "metadata": {"namespace": namespace, "name": name},
            "spec": {"spec": {"devices": _devices(requests, constraints, config)}}}


def pod(namespace: str, name: str, *, claims: Mapping[str, str] | None = None,
        templates: Mapping[str, str] | None = None, limits: Mapping[str, str] | None = None, image: str = IMAGE,
        command: Sequence[str] = (), host_network: bool = False) -> dict[str, Any]:
    """A pod whose one container uses every claim it names: `claims` maps the pod's claim names to existing
    ResourceClaims, `templates` to ResourceClaimTemplates; `limits` asks for extended resources. On a node that runs
    pods: `image` (never pulled), its `command`, and whether it uses the host's network."""
    resource_claims = [{"name": k, "resourceClaimName": v} for k, v in (claims or {}).items()]
    resource_claims += [{"name": k, "resourceClaimTemplateName": v} for k, v in (templates or {}).items()]
    container: dict[str, Any] = {"name": "main", "image": image, "imagePullPolicy": "Never"}
    if command:
        container["command"] = list(command)
    resources: dict[str, Any] = {}
    if resource_claims:
        resources["claims"] = [{"name": c["name"]} for c in resource_claims]
    if limits:
        resources["limits"] = dict(limits)
    if resources:
        container["resources"] = resources
    spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container],
                            "terminationGracePeriodSeconds": 0}
    if resource_claims:
        spec["resourceClaims"] = resource_claims
    if host_network:
        spec["hostNetwork"] = True
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"namespace": namespace, "name": name}, "spec": spec}
