"""Structured allocation of one ResourceClaim on one node, without I/O: what the scheduler's DRA plugin does
(``k8s.io/dynamic-resource-allocation/structured``), for tests, benchmarks and the demo.

``allocate(claim, classes=..., slices=..., allocated=..., node=...)`` returns an :class:`Allocation` (the results,
the ``status.allocation`` to write, explanations) or raises :class:`Unallocatable` with reasons a person can act
on; a selector this CEL environment cannot compile raises :class:`simulator.scheduler.cel.CelError`.

Supported: ``exactly`` (ExactCount, All) and ``firstAvailable`` requests, class and request CEL selectors,
``matchAttribute`` and ``distinctAttribute`` constraints, shared counters, device taints and request tolerations,
``adminAccess``, class and claim configuration, node-local, node-selector and all-nodes slices, consumable
capacity (``exactly.capacity.requests`` on devices with ``allowMultipleAllocations``: results carry a fresh
``shareID`` and the ``consumedCapacity``, see :mod:`simulator.scheduler.capacity`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, ClassVar

from agent.kube.quantity import parse_quantity, served_form
from simulator.scheduler.capacity import consumption, is_shareable, quantity_text, whole_device_fits
from simulator.scheduler.cel import CelError, Selector, compile_selector, device_value
from simulator.scheduler.explain import Funnel, diagnose, explain
from simulator.scheduler.pools import Candidate, Inventory, JsonObject, gather, usage
from simulator.scheduler.search import Choice, Constraint, Pick, Search, TooManyCombinations

__all__ = ["Allocation", "DeviceResult", "Unallocatable", "allocate"]


class Unallocatable(Exception):
    """The claim cannot be allocated on the node; ``reasons`` say why, one finding each."""

    def __init__(self, reasons: Sequence[str]) -> None:
        self.reasons = list(reasons)
        super().__init__("; ".join(self.reasons))


@dataclass(frozen=True)
class DeviceResult:
    """One allocated device, as an entry of ``status.allocation.devices.results``."""

    request: str  # "<request>" or "<request>/<sub-request>"
    driver: str
    pool: str
    device: str
    admin_access: bool = False
    share_id: str | None = None  # a share of a shareable device
    consumed: Mapping[str, str] = field(default_factory=dict)  # its consumedCapacity, as written


@dataclass
class Allocation:
    """A claim's allocation: ``status`` is the value for the claim's ``status.allocation``."""

    node: str
    results: list[DeviceResult]
    status: dict[str, Any]
    explanation: list[str] = field(default_factory=list)


def _tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    key, operator = toleration.get("key", ""), toleration.get("operator") or "Equal"
    if key and key != taint.get("key"):
        return False
    if operator == "Exists":
        return True
    return bool(key) and operator == "Equal" and (toleration.get("value") or "") == (taint.get("value") or "")


def _refusing_taint(device: Candidate, tolerations: Sequence[Mapping[str, Any]]) -> str | None:
    """The first NoSchedule/NoExecute taint no toleration covers (other effects never keep a device away)."""
    for taint in device.device.get("taints") or ():
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not any(_tolerates(t, taint) for t in tolerations):
            value = f"={taint['value']}" if taint.get("value") else ""
            return f"{taint.get('key')}{value}:{taint['effect']}"
    return None


# --- reading the claim ------------------------------------------------------------------------------------


def _choice(request: str, parent: str, spec: Mapping[str, Any], admin_allowed: bool, problems: list[str]) -> Choice:
    where = f"request {request}"
    mode = spec.get("allocationMode") or "ExactCount"
    count = spec.get("count", 1) if mode == "ExactCount" else 0
    if mode not in ("ExactCount", "All"):
        problems.append(f"{where}: allocationMode {mode!r} is not supported (ExactCount or All)")
    elif mode == "ExactCount" and (not isinstance(count, int) or isinstance(count, bool) or count < 1):
        problems.append(f"{where}: count must be a positive integer, not {count!r}")
    if not spec.get("deviceClassName"):
        problems.append(f"{where}: deviceClassName is required")
    capacity: dict[str, Fraction] = {}
    raw_capacity = spec.get("capacity")
    if raw_capacity is not None:
        wanted = raw_capacity.get("requests") if isinstance(raw_capacity, Mapping) else None
        if not isinstance(wanted, Mapping):
            problems.append(f"{where}: capacity must be {{requests: {{<name>: <quantity>}}}}")
        for name, amount in (wanted or {}).items():
            try:
                capacity[str(name)] = parse_quantity(str(amount))
            except ValueError as e:
                problems.append(f"{where}: capacity request {name}: {e}")
    if spec.get("adminAccess") and not admin_allowed:
        problems.append(f"{where}: adminAccess is not allowed in a sub-request")
    selectors = []
    for index, selector in enumerate(spec.get("selectors") or ()):
        expression = (selector.get("cel") or {}).get("expression") if isinstance(selector, Mapping) else None
        if not expression:
            problems.append(f"{where}: selector #{index} has no CEL expression (the only selector type)")
        else:
            selectors.append(str(expression))
    return Choice(request, parent, str(spec.get("deviceClassName", "")), mode, count if isinstance(count, int) else 1,
                  bool(spec.get("adminAccess")), tuple(spec.get("tolerations") or ()), tuple(selectors),
                  capacity=capacity)  # fmt: skip


def _read_claim(claim: JsonObject) -> tuple[list[list[Choice]], list[Constraint]]:
    devices = (claim.get("spec") or {}).get("devices") or {}
    problems: list[str] = []
    requests: list[list[Choice]] = []
    names: set[str] = set()
    for index, request in enumerate(devices.get("requests") or ()):
        name = str(request.get("name") or f"#{index}")
        if name in names:
            problems.append(f"request {name}: the name is used twice")
        names.add(name)
        if bool(request.get("exactly")) == bool(request.get("firstAvailable")):
            problems.append(f"request {name}: needs exactly one of 'exactly' and 'firstAvailable'")
        elif request.get("exactly"):
            requests.append([_choice(name, name, request["exactly"], True, problems)])
        else:
            subs = [_choice(f"{name}/{sub.get('name')}", name, sub, False, problems)
                    for sub in request["firstAvailable"]]
            names.update(s.request for s in subs)
            requests.append(subs)
    constraints = []
    for index, constraint in enumerate(devices.get("constraints") or ()):
        kinds = [k for k in ("matchAttribute", "distinctAttribute") if constraint.get(k)]
        if len(kinds) != 1:
            problems.append(f"constraint #{index}: needs exactly one of matchAttribute and distinctAttribute")
            continue
        scope = frozenset(constraint.get("requests") or ())
        for unknown in sorted(scope - names):
            problems.append(f"constraint #{index}: names request {unknown!r}, which the claim does not have")
        if "/" not in constraint[kinds[0]]:
            problems.append(f"constraint #{index}: {kinds[0]} must be a fully qualified name (domain/name), "
                            f"not {constraint[kinds[0]]!r}")  # fmt: skip
        constraints.append(Constraint(kinds[0], str(constraint[kinds[0]]), scope))
    if problems:
        raise Unallocatable(problems)
    return requests, constraints


# --- matching devices to requests -------------------------------------------------------------------------


class _Matcher:
    """Selector results per (expression, device content), kept across allocations: evaluating CEL is the
    costly part (about a millisecond each), and the same slices are allocated from again and again."""

    _results: ClassVar[dict[tuple[str, str], bool | CelError]] = {}
    _LIMIT = 200_000

    def __init__(self) -> None:
        self._keys: dict[int, str] = {}
        self._values: dict[int, Any] = {}

    def _key(self, device: Candidate) -> str:
        if id(device) not in self._keys:
            seen = {k: device.device.get(k) for k in ("attributes", "capacity", "allowMultipleAllocations")}
            # The name too: an error message names the device it happened on.
            self._keys[id(device)] = f"{device.driver}\0{device.name}\0{json.dumps(seen, sort_keys=True)}"
        return self._keys[id(device)]

    def matches(self, selector: Selector, device: Candidate) -> bool | CelError:
        key = (selector.expression, self._key(device))
        result = self._results.get(key)
        if result is None:
            try:
                if id(device) not in self._values:
                    self._values[id(device)] = device_value(device.device, device.driver)
                result = selector.matches(self._values[id(device)])
            except CelError as e:
                result = CelError(selector.expression, f"{e.problem} (on {device.name})")
            except ValueError as e:  # an attribute value CEL cannot hold: the device matches nothing
                result = CelError(selector.expression, f"{e} (on {device.name})")
            if len(self._results) >= self._LIMIT:
                self._results.clear()
            self._results[key] = result
        return result


def _filter(devices: list[Candidate], selector: Selector, matcher: _Matcher, funnel: Funnel) -> list[Candidate]:
    kept = []
    for device in devices:
        result = matcher.matches(selector, device)
        if isinstance(result, CelError):
            count, first = funnel.errors.get(selector.expression, (0, result.problem))
            funnel.errors[selector.expression] = (count + 1, first)
        elif result:
            kept.append(device)
    return kept


def _match(choice: Choice, classes: Mapping[str, JsonObject], inventory: Inventory, matcher: _Matcher) -> Funnel:
    funnel = Funnel(on_node=len(inventory.devices))
    devices = list(inventory.devices)
    for index, selector in enumerate((classes[choice.class_name].get("spec") or {}).get("selectors") or ()):
        expression = (selector.get("cel") or {}).get("expression") if isinstance(selector, Mapping) else None
        if not expression:
            raise Unallocatable([f"device class {choice.class_name}: selector #{index} has no CEL expression"])
        devices = _filter(devices, compile_selector(str(expression)), matcher, funnel)
    funnel.by_class = len(devices)
    for expression in choice.selectors:
        devices = _filter(devices, compile_selector(expression), matcher, funnel)
        funnel.selectors.append((expression, len(devices)))
    devices = _with_capacity(choice, devices, funnel)
    choice.candidates = devices
    for device in devices:
        taint = _refusing_taint(device, choice.tolerations)
        if taint:
            choice.untolerated[device.key] = taint
    return funnel


def _with_capacity(choice: Choice, devices: list[Candidate], funnel: Funnel) -> list[Candidate]:
    """The devices that can serve the choice's capacity request at all, each shareable one with what its share
    would take; the others go into the funnel with the reason."""
    kept = []
    for device in devices:
        if is_shareable(device.device) and not choice.admin:
            share = consumption(choice.capacity, device.device)
            if isinstance(share, str):
                funnel.capacity[device.name] = share
                continue
            choice.shares[device.key] = share
        elif choice.capacity and (problem := whole_device_fits(choice.capacity, device.device)) is not None:
            funnel.capacity[device.name] = problem
            continue
        kept.append(device)
    if choice.capacity:
        funnel.selectors.append(("capacity requests", len(kept)))
    return kept


# --- the result -------------------------------------------------------------------------------------------


def _node_selector(picks: Sequence[Pick]) -> dict[str, Any] | None:
    """Where the allocation can be used: the node, when any device is local to one (as upstream)."""
    for pick in picks:
        if pick.device.node_local:
            field_ = {"key": "metadata.name", "operator": "In", "values": [pick.device.node_local]}
            return {"nodeSelectorTerms": [{"matchFields": [field_]}]}
    term: dict[str, list[Any]] = {}
    for pick in picks:
        selector_terms = (pick.device.node_selector or {}).get("nodeSelectorTerms") or [{}]
        for kind in ("matchFields", "matchExpressions"):
            for requirement in selector_terms[0].get(kind) or ():
                if requirement not in term.setdefault(kind, []):
                    term[kind].append(requirement)
    return {"nodeSelectorTerms": [term]} if any(term.values()) else None


def _status(claim: JsonObject, requests: Sequence[Sequence[Choice]], classes: Mapping[str, JsonObject],
            picks: Sequence[Pick]) -> dict[str, Any]:  # fmt: skip
    results = []
    for pick in picks:
        entry: dict[str, Any] = {"request": pick.choice.request, "driver": pick.device.driver,
                                 "pool": pick.device.pool, "device": pick.device.name}  # fmt: skip
        if pick.choice.admin:
            entry["adminAccess"] = True
        if pick.choice.tolerations:
            entry["tolerations"] = [dict(t) for t in pick.choice.tolerations]
        if pick.consumed is not None:
            entry["shareID"] = str(uuid.uuid4())
            # As the API server stores what the scheduler writes: in its own form.
            entry["consumedCapacity"] = {name: served_form(quantity_text(amount))
                                         for name, amount in sorted(pick.consumed.items())}
        results.append(entry)
    chosen = [next((p.choice for p in picks if p.choice in choices), None) for choices in requests]
    config: list[dict[str, Any]] = []
    by_class: dict[str, list[str]] = {}
    for choice in chosen:
        if choice is not None:
            by_class.setdefault(choice.class_name, []).append(choice.request)
    for class_name, names in by_class.items():
        for entry in (classes[class_name].get("spec") or {}).get("config") or ():
            config.append({"source": "FromClass", "requests": names, **{k: v for k, v in entry.items()}})
    chosen_names = {c.request for c in chosen if c} | {c.parent for c in chosen if c}
    for entry in ((claim.get("spec") or {}).get("devices") or {}).get("config") or ():
        named = entry.get("requests") or []
        if not named or chosen_names & set(named):
            config.append({"source": "FromClaim", **entry})
    devices: dict[str, Any] = {"results": results}
    if config:
        devices["config"] = config
    status: dict[str, Any] = {"devices": devices}
    selector = _node_selector(picks)
    if selector is not None:
        status["nodeSelector"] = selector
    return status


def allocate(
    claim: JsonObject,
    *,
    classes: Iterable[JsonObject],
    slices: Iterable[JsonObject],
    allocated: Iterable[JsonObject] = (),
    node: str | JsonObject,
    max_steps: int = 100_000,
) -> Allocation:
    """Allocate ``claim`` (a resource.k8s.io/v1 ResourceClaim) on ``node`` (a name or a Node object, whose labels
    node selectors are matched against).

    ``classes`` are the DeviceClasses, ``slices`` every ResourceSlice of the cluster, ``allocated`` what other
    claims hold: ResourceClaim objects (their ``status.allocation``; the claim itself is skipped, and their names
    appear in reasons) or bare ``status.allocation`` dicts. ``max_steps`` bounds the search.
    """
    node_name = node if isinstance(node, str) else str((node.get("metadata") or {}).get("name", ""))
    labels = {} if isinstance(node, str) else dict((node.get("metadata") or {}).get("labels") or {})
    requests, constraints = _read_claim(claim)
    by_name = {str((c.get("metadata") or {}).get("name")): c for c in classes}
    missing = sorted({c.class_name for cs in requests for c in cs if c.class_name and c.class_name not in by_name})
    if missing:
        raise Unallocatable([f"device class {name} does not exist" for name in missing])
    inventory = gather(slices, node_name, labels)
    meta = claim.get("metadata") or {}
    held = usage(allocated, inventory, skip=(str(meta.get("namespace", "default")), str(meta.get("name"))))
    matcher = _Matcher()
    funnels = {c.request: _match(c, by_name, inventory, matcher) for cs in requests for c in cs}
    search = Search(requests, constraints, held.holders, held.left(inventory), held.capacity_left(inventory),
                    max_steps=max_steps)
    try:
        picks = search.run()
    except TooManyCombinations as e:
        raise Unallocatable([f"too many combinations: {e}; narrow the selectors or constraints"]) from None
    if picks is None:
        raise Unallocatable(diagnose(requests, funnels, constraints, inventory, held, search.steps))
    status = _status(claim, requests, by_name, picks)
    results = [DeviceResult(r["request"], r["driver"], r["pool"], r["device"], bool(r.get("adminAccess")),
                            r.get("shareID"), dict(r.get("consumedCapacity") or {}))
               for r in status["devices"]["results"]]  # fmt: skip
    return Allocation(node_name, results, status,
                      explain(requests, funnels, constraints, inventory, held, picks))  # fmt: skip
