"""What a node offers to the allocator: its devices from complete, valid pools, their counters, and what other
claims already hold.

A pool is (driver, pool name). Only the slices of its newest generation count; the pool is usable when all
``resourceSliceCount`` of them are present and it is valid (no device or counter-set name twice, every counter a
device consumes exists). Devices are ordered by slice name, then by their place in the slice, as upstream.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cached_property
from typing import Any

from agent.kube.quantity import parse_quantity
from simulator.scheduler.capacity import capacities, is_shareable

__all__ = ["Candidate", "Inventory", "Usage", "claim_label", "gather", "node_matches", "usage"]

DeviceKey = tuple[str, str, str]  # driver, pool, device
SetKey = tuple[str, str, str]  # driver, pool, counter set
JsonObject = Mapping[str, Any]


@dataclass(frozen=True, eq=False)
class Candidate:
    """One device of a usable pool, as published, with where it came from."""

    driver: str
    pool: str
    name: str
    slice_name: str
    device: JsonObject
    node_local: str | None  # the node name when the slice (or device) is bound to one node
    node_selector: JsonObject | None

    @property
    def key(self) -> DeviceKey:
        return (self.driver, self.pool, self.name)

    @property
    def label(self) -> str:
        return self.name

    @cached_property
    def drawn(self) -> dict[SetKey, dict[str, Fraction]]:
        """Counter amounts this device draws, by counter set (read-only)."""
        drawn: dict[SetKey, dict[str, Fraction]] = {}
        for entry in self.device.get("consumesCounters") or ():
            amounts = drawn.setdefault((self.driver, self.pool, entry["counterSet"]), {})
            for name, counter in (entry.get("counters") or {}).items():
                amounts[name] = amounts.get(name, Fraction(0)) + parse_quantity(counter["value"])
        return drawn

    def attribute(self, name: str) -> tuple[str, Any] | None:
        """An attribute by fully qualified name ((type, value)), also under its bare name in the driver's domain."""
        attributes = self.device.get("attributes") or {}
        value = attributes.get(name)
        domain, _, ident = name.partition("/")
        if value is None and domain == self.driver:
            value = attributes.get(ident)
        if not isinstance(value, Mapping) or len(value) != 1:
            return None
        ((kind, v),) = value.items()
        return (kind, tuple(v) if isinstance(v, list) else v)


@dataclass
class Inventory:
    """The devices a node can be given, the counters of their pools, and why some pools are left out."""

    node: str
    devices: list[Candidate] = field(default_factory=list)
    counters: dict[SetKey, dict[str, Fraction]] = field(default_factory=dict)
    by_key: dict[DeviceKey, Candidate] = field(default_factory=dict)  # every device of a usable pool
    incomplete: list[str] = field(default_factory=list)  # pools on this node left out: "driver/pool: why"
    invalid: list[str] = field(default_factory=list)


def _slice_name(obj: JsonObject) -> str:
    meta = obj.get("metadata") or {}
    return str(meta.get("name") or meta.get("generateName") or "")


def _requirement(req: JsonObject, value: str | None) -> bool:
    op, values = req.get("operator"), list(req.get("values") or ())
    if op == "In":
        return value in values
    if op == "NotIn":
        return value not in values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if op in ("Gt", "Lt") and value is not None and len(values) == 1:
        try:
            a, b = int(value), int(values[0])
        except ValueError:
            return False
        return a > b if op == "Gt" else a < b
    return False


def node_matches(selector: JsonObject, node: str, labels: Mapping[str, str]) -> bool:
    """A core/v1 NodeSelector: any term matches when all its requirements do."""
    for term in selector.get("nodeSelectorTerms") or ():
        exprs, fields = term.get("matchExpressions") or (), term.get("matchFields") or ()
        if not exprs and not fields:
            continue  # an empty term matches nothing
        if all(_requirement(r, labels.get(r.get("key", ""))) for r in exprs) and all(
            _requirement(r, node if r.get("key") == "metadata.name" else None) for r in fields
        ):
            return True
    return False


def _placement(spec: JsonObject, node: str, labels: Mapping[str, str]) -> tuple[bool, str | None, Any]:
    """Whether a slice (or a device with per-device node selection) is on ``node``, and how it is bound."""
    if spec.get("nodeName"):
        return spec["nodeName"] == node, spec["nodeName"], None
    if spec.get("allNodes"):
        return True, None, None
    if spec.get("nodeSelector"):
        return node_matches(spec["nodeSelector"], node, labels), None, spec["nodeSelector"]
    return False, None, None


def gather(slices: Iterable[JsonObject], node: str, labels: Mapping[str, str] | None = None) -> Inventory:
    """The inventory of ``node`` from every ResourceSlice of the cluster."""
    labels = {"kubernetes.io/hostname": node, **(labels or {})}
    inventory = Inventory(node)
    pools: dict[tuple[str, str], list[JsonObject]] = defaultdict(list)
    for obj in slices:
        spec = obj.get("spec") or {}
        pool = spec.get("pool") or {}
        pools[(str(spec.get("driver", "")), str(pool.get("name", "")))].append(obj)
    for (driver, pool_name), members in sorted(pools.items()):
        newest = max(int(s["spec"]["pool"].get("generation", 0)) for s in members)
        current = sorted((s for s in members if int(s["spec"]["pool"].get("generation", 0)) == newest),
                         key=_slice_name)  # fmt: skip
        here = [s for s in current if _on_node(s["spec"], node, labels)]
        if not here:
            continue
        pool_id = f"{driver}/{pool_name}"
        expected = max(int(s["spec"]["pool"].get("resourceSliceCount", 1)) for s in current)
        if len(current) != expected:
            inventory.incomplete.append(
                f"pool {pool_id} is incomplete: {len(current)} of {expected} slices of generation {newest} "
                "published; its devices are not used until the rest arrive")
            continue
        problem = _add_pool(inventory, driver, pool_name, current, node, labels)
        if problem:
            inventory.invalid.append(f"pool {pool_id} is invalid: {problem}; its devices are not used")
    return inventory


def _on_node(spec: JsonObject, node: str, labels: Mapping[str, str]) -> bool:
    if spec.get("perDeviceNodeSelection"):
        return any(_placement(d, node, labels)[0] for d in spec.get("devices") or ())
    return _placement(spec, node, labels)[0]


def _add_pool(inventory: Inventory, driver: str, pool: str, members: Sequence[JsonObject], node: str,
              labels: Mapping[str, str]) -> str | None:  # fmt: skip
    counters: dict[SetKey, dict[str, Fraction]] = {}
    found: dict[DeviceKey, Candidate] = {}
    mine: list[Candidate] = []
    for obj in members:
        spec = obj["spec"]
        for counter_set in spec.get("sharedCounters") or ():
            key = (driver, pool, counter_set["name"])
            if key in counters:
                return f"counter set {counter_set['name']} appears twice"
            counters[key] = {n: parse_quantity(c["value"]) for n, c in (counter_set.get("counters") or {}).items()}
        per_device = bool(spec.get("perDeviceNodeSelection"))
        for device in spec.get("devices") or ():
            on, local, selector = _placement(device if per_device else spec, node, labels)
            candidate = Candidate(driver, pool, device["name"], _slice_name(obj), device, local, selector)
            if candidate.key in found:
                return f"device {device['name']} appears twice"
            found[candidate.key] = candidate
            if on:
                mine.append(candidate)
    for candidate in found.values():
        for set_key, amounts in candidate.drawn.items():
            missing = [n for n in amounts if n not in counters.get(set_key, {})]
            if set_key not in counters or missing:
                what = f"counter {missing[0]} of set" if set_key in counters else "counter set"
                what += f" {set_key[2]}"
                return f"device {candidate.name} consumes {what}, which the pool does not have"
    inventory.counters.update(counters)
    inventory.by_key.update(found)
    inventory.devices.extend(mine)
    return None


# --- what other claims hold -------------------------------------------------------------------------------


def claim_label(obj: JsonObject) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', 'default')}/{meta.get('name', '?')}" if meta.get("name") else "an allocation"


@dataclass
class Usage:
    """Devices held by other claims (admin access does not hold), the counters they draw, and the capacity their
    shares of shareable devices take."""

    holders: dict[DeviceKey, list[str]] = field(default_factory=dict)
    consumed: dict[SetKey, dict[str, Fraction]] = field(default_factory=dict)
    consumers: dict[SetKey, list[str]] = field(default_factory=dict)
    shared: dict[DeviceKey, dict[str, Fraction]] = field(default_factory=dict)  # capacity taken by shares
    sharers: dict[DeviceKey, list[str]] = field(default_factory=dict)

    def capacity_left(self, inventory: Inventory) -> dict[DeviceKey, dict[str, Fraction]]:
        """The capacity still free on each shareable device."""
        return {key: {name: total - self.shared.get(key, {}).get(name, Fraction(0))
                      for name, total in capacities(candidate.device).items()}
                for key, candidate in inventory.by_key.items() if is_shareable(candidate.device)}

    def left(self, inventory: Inventory) -> dict[SetKey, dict[str, Fraction]]:
        """The counters still free in each set."""
        return {key: {name: total - self.consumed.get(key, {}).get(name, Fraction(0)) for name, total in set_.items()}
                for key, set_ in inventory.counters.items()}  # fmt: skip


def usage(allocated: Iterable[JsonObject], inventory: Inventory, skip: tuple[str, str] | None = None) -> Usage:
    """What ``allocated`` holds: ResourceClaim objects (their ``status.allocation``; ``skip`` is a
    (namespace, name) to leave out) or bare ``status.allocation`` dicts."""
    used = Usage()
    for item in allocated:
        if "devices" in item and "metadata" not in item:
            allocation, label = item, "an allocation"
        else:
            meta = item.get("metadata") or {}
            if skip is not None and (meta.get("namespace", "default"), meta.get("name")) == skip:
                continue
            allocation, label = (item.get("status") or {}).get("allocation") or {}, claim_label(item)
        for result in (allocation.get("devices") or {}).get("results") or ():
            if result.get("adminAccess"):
                continue
            key = (result.get("driver", ""), result.get("pool", ""), result.get("device", ""))
            candidate = inventory.by_key.get(key)
            if result.get("shareID") and candidate is not None and is_shareable(candidate.device):
                taken = used.shared.setdefault(key, {})
                for name, amount in (result.get("consumedCapacity") or {}).items():
                    taken[name] = taken.get(name, Fraction(0)) + parse_quantity(str(amount))
                used.sharers.setdefault(key, []).append(label)
                continue
            used.holders.setdefault(key, []).append(label)
            for set_key, amounts in (candidate.drawn if candidate else {}).items():
                drawn = used.consumed.setdefault(set_key, {})
                for name, amount in amounts.items():
                    drawn[name] = drawn.get(name, Fraction(0)) + amount
                if label not in used.consumers.setdefault(set_key, []):
                    used.consumers[set_key].append(label)
    return used
