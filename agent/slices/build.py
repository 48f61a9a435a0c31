"""Desired ResourceSlices of one pool: a pure function of its devices and counter sets.

Devices are sorted by name (slice order drives the scheduler's first-fit choice, and a stable order keeps
restarts from rewriting slices) and chunked within the API limits: at most 128 devices per slice, 64 when a
device of the slice has taints or consumes counters; counter sets go into slices of their own, at most 8 each.
A device the API server would reject is left out, with the reason, instead of failing the whole pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from agent.kube.names import is_label_value
from agent.kube.quantity import format_quantity
from agent.slices.device_rules import validate_device
from agent.slices.rules import MAX_COUNTER_SETS, MAX_DEVICES_PER_SLICE, MAX_DEVICES_WITH_TAINTS_OR_COUNTERS
from backends.attributes import attribute_json
from backends.contract import AttributeValue, CapacityPolicy, CounterSet, Device

__all__ = [
    "API_VERSION",
    "MANAGED_BY",
    "PoolSlices",
    "device_body",
    "pool_slices",
    "slice_index",
    "slice_labels",
    "slice_name_prefix",
]

API_VERSION = "resource.k8s.io/v1"
MANAGED_BY = "dra-agent"


@dataclass(frozen=True)
class PoolSlices:
    """The slices of one pool and the devices that could not be published."""

    driver: str
    slices: tuple[dict[str, Any], ...]
    rejected: tuple[str, ...] = ()

    @property
    def device_count(self) -> int:
        return sum(len(s["spec"].get("devices", ())) for s in self.slices)


def attribute_body(value: AttributeValue) -> dict[str, Any]:
    """The API form of one attribute value."""
    return attribute_json(value)


def device_body(device: Device, taints: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """The API form of one device (spec.devices[] entry)."""
    body: dict[str, Any] = {"name": device.name}
    attributes = device.published_attributes()
    if attributes:
        body["attributes"] = {key: attribute_body(attributes[key]) for key in sorted(attributes)}
    if device.allow_multiple_allocations:
        body["allowMultipleAllocations"] = True
    unknown = sorted(device.capacity_policies.keys() - device.capacity.keys())
    if unknown:
        raise ValueError(f"request policies for capacities it does not have: {', '.join(unknown)}")
    if device.capacity:
        body["capacity"] = {key: _capacity_body(device.capacity[key], device.capacity_policies.get(key))
                            for key in sorted(device.capacity)}
    if device.consumes_counters:
        body["consumesCounters"] = [
            {"counterSet": c.counter_set, "counters": {k: {"value": format_quantity(v)} for k, v in c.counters.items()}}
            for c in device.consumes_counters
        ]
    if taints:
        body["taints"] = list(taints)
    return body


def _capacity_body(value: int, policy: CapacityPolicy | None) -> dict[str, Any]:
    body: dict[str, Any] = {"value": format_quantity(value)}
    if policy is None:
        return body
    request_policy: dict[str, Any] = {"default": format_quantity(policy.default)}
    if policy.valid_values:
        request_policy["validValues"] = [format_quantity(v) for v in policy.valid_values]
    elif policy.valid_range is not None:
        bounds = {"min": policy.valid_range.min, "max": policy.valid_range.max, "step": policy.valid_range.step}
        request_policy["validRange"] = {k: format_quantity(v) for k, v in bounds.items() if v is not None}
    body["requestPolicy"] = request_policy
    return body


def _counter_set_body(counter_set: CounterSet) -> dict[str, Any]:
    return {
        "name": counter_set.name,
        "counters": {k: {"value": format_quantity(counter_set.counters[k])} for k in sorted(counter_set.counters)},
    }


def _chunks(bodies: Iterable[dict[str, Any]], taintable: bool) -> list[list[dict[str, Any]]]:
    """Fill slices in order; a slice holding a tainted or counter-consuming device takes at most 64, and so
    does every slice of a `taintable` pool."""
    chunks: list[list[dict[str, Any]]] = []
    current: list[dict[str, Any]] = []
    reduced = False
    for body in bodies:
        heavy = taintable or bool(body.get("taints") or body.get("consumesCounters"))
        limit = MAX_DEVICES_WITH_TAINTS_OR_COUNTERS if (reduced or heavy) else MAX_DEVICES_PER_SLICE
        if len(current) >= limit:
            chunks.append(current)
            current, reduced = [], False
        current.append(body)
        reduced = reduced or heavy
    if current:
        chunks.append(current)
    return chunks


def pool_slices(
    driver: str,
    node_name: str,
    devices: Sequence[Device],
    counter_sets: Sequence[CounterSet] = (),
    *,
    taints: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    taints_supported: bool = True,
    counters_supported: bool = True,
    shares_supported: bool = True,
    taintable: bool = False,
    generation: int = 0,
) -> PoolSlices:
    """Every ResourceSlice of the pool `node_name` of `driver`, in publishing order.

    `taints` maps device names to their DRA device taints. Where the cluster drops taints (its DRADeviceTaints
    gate is off), `taints_supported` False leaves a tainted device out instead: not offered beats offered as
    healthy. Where it drops counters (DRAPartitionableDevices off), `counters_supported` False leaves out the
    counter sets and the devices that consume them: without counters the scheduler could hand out
    overlapping partitions. Where it drops consumable capacity (DRAConsumableCapacity off),
    `shares_supported` False publishes shareable devices as ordinary ones (each allocated whole, to one claim at
    a time), which is what the server would store anyway. Taints with effect None are informational: without
    taint support they are dropped and the device stays.

    `taintable` fills every slice to 64 devices, the limit for slices with a tainted device, so that a device
    becoming tainted or healthy again rewrites its own slice only, instead of moving devices between slices
    (which rewrites the whole pool under a new generation).
    """
    rejected: list[str] = []
    bodies: list[dict[str, Any]] = []
    for device in sorted(devices, key=lambda d: d.name):
        device_taints = (taints or {}).get(device.name, ())
        if not taints_supported:
            device_taints = [t for t in device_taints if t.get("effect") != "None"]
        if device.consumes_counters and not counters_supported:
            rejected.append(f"{device.name}: consumes counters, and this cluster cannot publish counters; left out")
            continue
        if device_taints and not taints_supported:
            rejected.append(f"{device.name}: tainted ({', '.join(t['key'] for t in device_taints)}), and this "
                            "cluster cannot publish taints; left out until it recovers")
            continue
        if device.allow_multiple_allocations and not shares_supported:
            device = replace(device, allow_multiple_allocations=False, capacity_policies={})
        try:
            body = device_body(device, [dict(t) for t in device_taints])
        except ValueError as e:
            rejected.append(f"{device.name}: {e}")
            continue
        errors = validate_device(body)
        if errors:
            rejected.append(f"{device.name}: " + "; ".join(errors))
            continue
        bodies.append(body)
    counter_bodies = [_counter_set_body(c) for c in sorted(counter_sets, key=lambda c: c.name)
                      if counters_supported]
    specs: list[dict[str, Any]] = [
        {"sharedCounters": counter_bodies[i : i + MAX_COUNTER_SETS]}
        for i in range(0, len(counter_bodies), MAX_COUNTER_SETS)
    ]
    specs.extend({"devices": chunk} for chunk in _chunks(bodies, taintable))
    if not specs:
        specs.append({})  # an empty pool still gets one slice, so the pool is seen as present
    labels = slice_labels(driver, node_name)
    slices = tuple(
        {
            "apiVersion": API_VERSION,
            "kind": "ResourceSlice",
            "metadata": {"generateName": slice_name_prefix(index, driver, node_name), "labels": dict(labels)},
            "spec": {
                "driver": driver,
                "nodeName": node_name,
                "pool": {"name": node_name, "generation": generation, "resourceSliceCount": len(specs)},
                **content,
            },
        }
        for index, content in enumerate(specs)
    )
    return PoolSlices(driver, slices, tuple(rejected))


def slice_name_prefix(index: int, driver: str, node_name: str) -> str:
    """`generateName` of the pool's slice at `index`: `<index, 5+ hex digits>-<driver>-<node>-`.

    The index comes first so it survives the server cutting long prefixes to 58 characters, and so the slices
    sort by name in publishing order (the scheduler tries slices in name order). The server appends 5 random
    characters; the publisher matches existing slices to desired ones by this index.
    """
    return f"{index:05x}-{driver}-{node_name}-"


def slice_index(name: str) -> int | None:
    """The index a slice's name starts with, or None for a name this scheme did not make."""
    head, sep, _ = name.partition("-")
    if not sep or len(head) < 5 or any(c not in "0123456789abcdef" for c in head):
        return None
    return int(head, 16)


def slice_labels(driver: str, node_name: str) -> dict[str, str]:
    """Labels that say who publishes a slice (the node's only when it fits a label value)."""
    labels = {"app.kubernetes.io/managed-by": MANAGED_BY, "dra-agent.io/driver": driver}
    if is_label_value(node_name):
        labels["dra-agent.io/node"] = node_name
    return labels
