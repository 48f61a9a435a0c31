"""What to write so that a pool's slices in the API server become the desired ones: a pure plan.

Existing slices are matched to desired ones by the index their name starts with. Obsolete slices (an older
generation, a name without an index, an index beyond the desired count, a second slice with one index) are
deleted. The pool generation stays when at most one existing slice changes and none must be created (one update
is atomic for readers); otherwise it goes up by one and every kept slice is rewritten with it, so readers never
mix two versions of the pool. Comparison is semantic: quantities by value (the server stores them in canonical
form), taint times ignored and kept.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.kube.quantity import same_quantity
from agent.slices.build import slice_index

__all__ = ["Plan", "plan_pool"]

Obj = dict[str, Any]


@dataclass(frozen=True)
class Plan:
    """Writes in the order to make them: deletes, updates, creates."""

    generation: int
    deletes: tuple[Obj, ...] = ()
    updates: tuple[Obj, ...] = ()
    creates: tuple[Obj, ...] = ()

    @property
    def writes(self) -> int:
        return len(self.deletes) + len(self.updates) + len(self.creates)


def plan_pool(desired: Sequence[Mapping[str, Any]], existing: Sequence[Mapping[str, Any]],
              owner: Sequence[Mapping[str, Any]] = ()) -> Plan:
    """The writes that turn `existing` (this node's slices of one driver) into `desired` (pool_slices order)."""
    top = max((_generation(s) for s in existing), default=0)
    matched: dict[int, Mapping[str, Any]] = {}
    obsolete: list[Mapping[str, Any]] = []
    for obj in sorted(existing, key=lambda s: s["metadata"]["name"]):
        index = slice_index(obj["metadata"]["name"])
        if _generation(obj) < top or index is None or index >= len(desired) or index in matched:
            obsolete.append(obj)
        else:
            matched[index] = obj
    bodies = [_body(d, matched.get(i), owner) for i, d in enumerate(desired)]
    changed_spec = [i for i in matched if not _same_spec(bodies[i]["spec"], matched[i]["spec"])]
    to_create = [i for i in range(len(desired)) if i not in matched]
    bump = bool(to_create) or len(changed_spec) > 1
    generation = top + 1 if bump and existing else top
    updates, creates = [], []
    for i, body in enumerate(bodies):
        body["spec"]["pool"]["generation"] = generation
        current = matched.get(i)
        if current is None:
            creates.append(body)
        elif bump or i in changed_spec or not _same_metadata(body, current):
            updates.append(body)
    return Plan(generation, tuple(dict(o) for o in obsolete), tuple(updates), tuple(creates))


def _generation(obj: Mapping[str, Any]) -> int:
    value = obj.get("spec", {}).get("pool", {}).get("generation", 0)
    return value if isinstance(value, int) else 0


def _body(desired: Mapping[str, Any], current: Mapping[str, Any] | None, owner: Sequence[Mapping[str, Any]]) -> Obj:
    """The object to write for a desired slice: with the existing slice's name and resourceVersion when it
    replaces one, the owner, and the times of taints that stay."""
    meta: Obj = {k: v for k, v in desired["metadata"].items() if k != "name"}
    spec: Obj = {**desired["spec"], "pool": dict(desired["spec"]["pool"])}
    if owner:
        meta["ownerReferences"] = [dict(o) for o in owner]
    if current is not None:
        meta.pop("generateName", None)
        meta["name"] = current["metadata"]["name"]
        meta["resourceVersion"] = current["metadata"]["resourceVersion"]
        spec = _keep_taint_times(spec, current["spec"])
    return {**desired, "metadata": meta, "spec": spec}


def _keep_taint_times(spec: Obj, current: Mapping[str, Any]) -> Obj:
    """A taint that stays keeps the time it was added (the server set it when it first appeared)."""
    times = {
        (d.get("name"), *_taint(t)): t["timeAdded"]
        for d in current.get("devices") or () for t in d.get("taints") or () if t.get("timeAdded")
    }
    if not times or not any(d.get("taints") for d in spec.get("devices") or ()):
        return spec

    def timed(device: str, taint: Mapping[str, Any]) -> Obj:
        known = times.get((device, *_taint(taint)))
        return {**taint, "timeAdded": known} if known and not taint.get("timeAdded") else dict(taint)

    devices = [{**d, "taints": [timed(d["name"], t) for t in d["taints"]]} if d.get("taints") else d
               for d in spec["devices"]]
    return {**spec, "devices": devices}


def _same_metadata(body: Mapping[str, Any], current: Mapping[str, Any]) -> bool:
    """Our labels and owner are in place (other labels and annotations are left to whoever set them)."""
    labels = current["metadata"].get("labels") or {}
    if any(labels.get(k) != v for k, v in body["metadata"].get("labels", {}).items()):
        return False
    return _owners(body) == _owners(current) if "ownerReferences" in body["metadata"] else True


def _owners(obj: Mapping[str, Any]) -> list[tuple[Any, ...]]:
    return [(o.get("kind"), o.get("name"), o.get("uid"), o.get("controller"))
            for o in obj["metadata"].get("ownerReferences") or ()]


def _same_spec(desired: Mapping[str, Any], existing: Mapping[str, Any]) -> bool:
    """Semantic equality of the fields the agent writes (the pool generation aside)."""
    if set(desired) != set(k for k, v in existing.items() if v is not None):
        return False
    for key, value in desired.items():
        other = existing[key]
        if key == "pool":
            if (value.get("name"), value.get("resourceSliceCount")) != (other.get("name"),
                                                                         other.get("resourceSliceCount")):
                return False
        elif key == "devices":
            if len(value) != len(other) or not all(_same_device(a, b) for a, b in zip(value, other, strict=True)):
                return False
        elif key == "sharedCounters":
            if len(value) != len(other) or not all(
                    a.get("name") == b.get("name") and _same_quantities(a.get("counters"), b.get("counters"))
                    for a, b in zip(value, other, strict=True)):
                return False
        elif value != other:
            return False
    return True


def _same_device(desired: Mapping[str, Any], existing: Mapping[str, Any]) -> bool:
    if set(desired) != set(k for k, v in existing.items() if v not in (None, [], {})):
        return False
    for key, value in desired.items():
        other = existing[key]
        if key == "capacity":
            if not _same_quantities(value, other):
                return False
        elif key == "consumesCounters":
            if len(value) != len(other) or not all(
                    a.get("counterSet") == b.get("counterSet") and _same_quantities(a.get("counters"),
                                                                                    b.get("counters"))
                    for a, b in zip(value, other, strict=True)):
                return False
        elif key == "taints":
            if [_taint(t) for t in value] != [_taint(t) for t in other]:
                return False
        elif value != other:
            return False
    return True


def _taint(taint: Mapping[str, Any]) -> tuple[Any, ...]:
    return taint.get("key"), taint.get("value") or "", taint.get("effect")


def _same_quantities(a: Any, b: Any) -> bool:
    """Maps of name → {value: quantity}, compared by value."""
    if not isinstance(a, Mapping) or not isinstance(b, Mapping) or set(a) != set(b):
        return False
    try:
        return all(same_quantity(str(a[k]["value"]), str(b[k]["value"])) for k in a)
    except (KeyError, TypeError, ValueError):
        return False
