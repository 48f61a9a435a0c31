"""What the demo's scenarios ask for and how they show it: DeviceClasses, ResourceClaim specs, and the tables
that show an allocation or a node's devices with the attributes that decided it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from typing import Any

import yaml

from simulator.demo.cluster import DemoCluster
from simulator.demo.story import Story
from simulator.scheduler.allocation import Allocation

JsonObject = dict[str, Any]
VFIO = {"apiVersion": "dra-agent.io/v1alpha1", "kind": "VfioConfig"}


def device_classes() -> list[JsonObject]:
    """The DeviceClasses the project ships (deploy/base/30-deviceclasses.yaml)."""
    text = (resources.files("simulator.demo") / "manifests" / "deviceclasses.yaml").read_text()
    return [doc for doc in yaml.safe_load_all(text) if doc]


def cel(expression: str) -> JsonObject:
    return {"cel": {"expression": expression}}


def request(name: str, device_class: str, *, selectors: Sequence[str] = (), count: int | None = None,
            all_devices: bool = False, tolerations: Sequence[JsonObject] = ()) -> JsonObject:
    """One request of a claim: `exactly` this class, optionally narrowed by CEL selectors."""
    exactly: JsonObject = {"deviceClassName": device_class}
    if selectors:
        exactly["selectors"] = [cel(s) for s in selectors]
    if all_devices:
        exactly["allocationMode"] = "All"
    elif count is not None:
        exactly["count"] = count
    if tolerations:
        exactly["tolerations"] = list(tolerations)
    return {"name": name, "exactly": exactly}


def claim_spec(*requests: JsonObject, match: str | None = None, config: Sequence[JsonObject] = ()) -> JsonObject:
    """A ResourceClaim's spec; `match` names an attribute all requests' devices must share."""
    devices: JsonObject = {"requests": list(requests)}
    if match is not None:
        devices["constraints"] = [{"requests": [r["name"] for r in requests], "matchAttribute": match}]
    if config:
        devices["config"] = list(config)
    return {"devices": devices}


def opaque(driver: str, requests: Sequence[str], parameters: Mapping[str, Any]) -> JsonObject:
    return {"requests": list(requests), "opaque": {"driver": driver, "parameters": dict(parameters)}}


def attribute(device: Mapping[str, Any], name: str, domain: str | None = None) -> Any:
    """A published attribute's value, by its bare name (the driver's domain) or qualified name."""
    attributes = device.get("attributes") or {}
    value = attributes.get(name) or (attributes.get(f"{domain}/{name}") if domain else None)
    return next(iter(value.values())) if isinstance(value, Mapping) and value else None


def capacity(device: Mapping[str, Any], name: str) -> str:
    value = (device.get("capacity") or {}).get(name)
    return str(value["value"]) if isinstance(value, Mapping) else ""


def devices_by_name(cluster: DemoCluster, node: str) -> dict[tuple[str, str], JsonObject]:
    """(driver, device name) → the device as published on the node."""
    return {(s["spec"]["driver"], d["name"]): d for s in cluster.slices(node)
            for d in s["spec"].get("devices") or ()}


def show_claim(story: Story, name: str, spec: JsonObject) -> None:
    story.document({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
                    "spec": spec})


def show_allocation(story: Story, cluster: DemoCluster, node: str, allocation: Allocation,
                    columns: Sequence[str] = ("resource.kubernetes.io/pcieRoot",)) -> list[JsonObject]:
    """The devices picked, one row each with the named attributes; the allocator's reasons below. Returns the
    published devices, in result order."""
    published = devices_by_name(cluster, node)
    rows, picked = [], []
    for result in allocation.results:
        device = published.get((result.driver, result.device), {})
        picked.append(device)
        rows.append([result.request, result.device, *(_shown(device, c) for c in columns)])
    story.table(["request", "device", *(_short(c) for c in columns)], rows)
    for line in allocation.explanation:
        story.detail(line)
    return picked


def _shown(device: Mapping[str, Any], column: str) -> str:
    if column.startswith("capacity:"):
        return capacity(device, column.split(":", 1)[1])
    value = attribute(device, column)
    return "" if value is None else str(value)


def _short(column: str) -> str:
    return column.split(":", 1)[1] if column.startswith("capacity:") else column.rsplit("/", 1)[-1]


def cdi_summary(spec: Mapping[str, Any]) -> list[list[str]]:
    """Rows of what a CDI spec gives a container: per device (by its name within the spec's kind), its nodes,
    mounts and environment."""
    rows = []
    common = spec.get("containerEdits") or {}
    for device in spec.get("devices") or ():
        edits = device.get("containerEdits") or {}
        rows.append([device["name"], _edits(edits)])  # the kind (k8s.<driver>/claim) is the same for all
    if common:
        rows.append(["(every device)", _edits(common)])
    return rows


def _edits(edits: Mapping[str, Any]) -> str:
    parts = [n["path"] for n in edits.get("deviceNodes") or ()]
    parts += [f"env {e.split('=', 1)[0]}" for e in edits.get("env") or ()]
    mounts = edits.get("mounts") or ()
    if mounts:
        parts.append(f"{len(mounts)} mount(s)")
    hooks = edits.get("hooks") or ()
    if hooks:
        parts.append(f"{len(hooks)} hook(s)")
    parts += [f"interface {n['hostInterfaceName']} as {n['name']}" for n in edits.get("netDevices") or ()]
    return ", ".join(parts) or "-"


def names(items: Iterable[Any]) -> str:
    return ", ".join(str(i) for i in items)
