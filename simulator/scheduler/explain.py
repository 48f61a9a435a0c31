"""Words for people: why an allocation came out as it did, and why a claim cannot be allocated.

Explanations trace each request through its class, its selectors, taints, other claims and counters; failure
reasons name the first place where a request falls short, or the constraint no candidates can satisfy together.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from agent.kube.quantity import format_quantity
from simulator.scheduler.pools import Candidate, DeviceKey, Inventory, SetKey, Usage
from simulator.scheduler.search import MAX_RESULTS, Choice, Constraint, Pick

__all__ = ["Funnel", "diagnose", "explain"]


@dataclass
class Funnel:
    """How many devices of the node a choice keeps at each selector, and the selector errors met."""

    on_node: int
    by_class: int = 0
    selectors: list[tuple[str, int]] = field(default_factory=list)  # request selector, devices left after it
    errors: dict[str, tuple[int, str]] = field(default_factory=dict)  # expression -> (devices, first error)
    capacity: dict[str, str] = field(default_factory=dict)  # device -> why it cannot serve the capacity request


def _names(items: Iterable[str], limit: int = 4) -> str:
    unique = list(dict.fromkeys(items))
    shown = ", ".join(unique[:limit])
    return shown + (f" and {len(unique) - limit} more" if len(unique) > limit else "")


def _amount(value: Fraction) -> str:
    if value.denominator == 1 and value >= 0:
        return format_quantity(int(value))
    return f"{float(value):g}"


def _value(value: tuple[str, Any]) -> str:
    return str(value[1]).lower() if value[0] == "bool" else str(value[1])


def _funnel_text(choice: Choice, funnel: Funnel, node: str) -> str:
    text = f"class {choice.class_name} matches {funnel.by_class} of {funnel.on_node} devices on node {node}"
    for expression, left in funnel.selectors:
        text += f"; selector {expression!r} keeps {left}"
    for expression, (count, error) in funnel.errors.items():
        text += f"; selector {expression!r} failed on {count} device(s): {error}"
    return text


@dataclass
class _Standing:
    """A choice's candidates against what other claims hold and the counters they left."""

    available: list[Candidate] = field(default_factory=list)
    held: dict[str, list[str]] = field(default_factory=dict)  # device -> claims
    tainted: dict[str, str] = field(default_factory=dict)  # device -> taint
    short: dict[SetKey, set[str]] = field(default_factory=dict)  # counter set -> counters a candidate lacks
    short_devices: list[str] = field(default_factory=list)
    full: dict[str, str] = field(default_factory=dict)  # shareable device -> what its shares leave


def _standing(choice: Choice, usage: Usage, left: Mapping[SetKey, Mapping[str, Fraction]],
              capacity_left: Mapping[DeviceKey, Mapping[str, Fraction]] | None = None) -> _Standing:
    standing = _Standing()
    for device in choice.candidates:
        share = None if choice.admin else choice.shares.get(device.key)
        room = (capacity_left or {}).get(device.key, {})
        if share is not None and device.key not in usage.holders and any(
                a > room.get(n, Fraction(0)) for n, a in share.items()):
            over = sorted(n for n, a in share.items() if a > room.get(n, Fraction(0)))
            standing.full[device.name] = ", ".join(
                f"{n} {_amount(share[n])} asked, {_amount(room.get(n, Fraction(0)))} left" for n in over
            ) + f" (shared by {_names(usage.sharers.get(device.key, []))})"
            continue
        if device.key in choice.untolerated:
            standing.tainted[device.name] = choice.untolerated[device.key]
            continue
        if not choice.admin and device.key in usage.holders:
            standing.held[device.name] = usage.holders[device.key]
            continue
        lacking = {} if choice.admin else {
            set_key: {n for n, a in amounts.items() if a > left.get(set_key, {}).get(n, Fraction(0))}
            for set_key, amounts in device.drawn.items()}  # fmt: skip
        if any(lacking.values()):
            for set_key, names in lacking.items():
                standing.short.setdefault(set_key, set()).update(names)
            standing.short_devices.append(device.name)
            continue
        standing.available.append(device)
    return standing


def _shortfall(choice: Choice, funnel: Funnel, standing: _Standing, usage: Usage, node: str) -> list[str]:
    """Why this choice alone cannot be satisfied; empty when it can."""
    label, n = f"request {choice.request}", len(choice.candidates)
    if choice.mode == "All" and n > MAX_RESULTS:
        return [f"{label}: asks for all {n} matching devices; a claim can be given at most {MAX_RESULTS}"]
    if choice.count > MAX_RESULTS:
        return [f"{label}: asks for {choice.count} devices; a claim can be given at most {MAX_RESULTS}"]
    enough = len(standing.available) == n > 0 if choice.mode == "All" else len(standing.available) >= choice.count
    if enough:
        return []
    wanted = "all matching devices" if choice.mode == "All" else f"{choice.count} device(s)"
    if funnel.by_class == 0:
        reasons = [f"{label}: no device of class {choice.class_name} on node {node} "
                   f"(of {funnel.on_node} devices there)"]  # fmt: skip
    elif n == 0 or (n < choice.count and choice.mode != "All"):
        last, kept = funnel.by_class, f"{funnel.by_class} devices of class {choice.class_name}"
        reasons = [f"{label}: needs {wanted}; {kept} on node {node}"]
        for expression, left in funnel.selectors:
            if expression == "capacity requests":
                why = _names(f"{d} {problem}" for d, problem in funnel.capacity.items())
                reasons[0] += f", {left} of {last} can serve its capacity requests ({why})"
            else:
                reasons[0] += f", {left} of {last} match selector {expression!r}"
            last = left
    else:
        parts = []
        if standing.held:
            claims = _names(c for holders in standing.held.values() for c in holders)
            parts.append(f"{len(standing.held)} in use by {claims}")
        if standing.tainted:
            taints = _names(f"{d} ({t})" for d, t in standing.tainted.items())
            parts.append(f"{len(standing.tainted)} tainted and not tolerated: {taints}")
        if standing.short_devices:
            parts.append(f"{len(standing.short_devices)} without the counters they need")
        if standing.full:
            full = _names(f"{d}: {why}" for d, why in standing.full.items())
            parts.append(f"{len(standing.full)} without enough capacity left: {full}")
        reasons = [f"{label}: needs {wanted}; {n} match its class and selectors, "
                   f"{len(standing.available)} available ({'; '.join(parts)})"]  # fmt: skip
    for set_key, counters in sorted(standing.short.items()):
        consumers = usage.consumers.get(set_key) or ["nothing else (the device needs more than the set has)"]
        reasons.append(f"counters: {set_key[2]} (pool {set_key[1]}): {_names(sorted(counters), 6)} "
                       f"exhausted by claims {_names(consumers)}")  # fmt: skip
    for expression, (count, error) in funnel.errors.items():
        reasons.append(f"{label}: selector {expression!r} failed on {count} device(s): {error}")
    return reasons


def _constraint_reason(constraint: Constraint, scope: Sequence[tuple[Choice, _Standing]]) -> str | None:
    """Why no set of available candidates satisfies one constraint, if that is visible on its own."""
    attribute = constraint.attribute
    if constraint.kind == "distinctAttribute":
        values = {d.attribute(attribute) for _, s in scope for d in s.available} - {None}
        need = sum(c.needed for c, _ in scope)
        if len(values) < need:
            shown = _names(sorted(_value(v) for v in values if v is not None))
            return (f"distinctAttribute {attribute} over {', '.join(c.request for c, _ in scope)}: {need} devices "
                    f"need different values, the candidates have {len(values)} ({shown or 'none'})")  # fmt: skip
        return None
    common: set[Any] | None = None
    previous: list[tuple[Choice, Counter[Any]]] = []
    for choice, standing in scope:
        found = [d.attribute(attribute) for d in standing.available]
        counts = Counter(v for v in found if v is not None)
        lacking = len(found) - sum(counts.values())
        fits = {v for v, k in counts.items() if k >= choice.needed}
        shown = _names(sorted(_value(v) for v in counts))
        note = f"; {lacking} lack the attribute" if lacking else ""
        if not fits:
            return (f"request {choice.request}: needs {choice.needed} device(s) with one {attribute}; "
                    f"no value has that many available ({shown or 'none'}{note})")  # fmt: skip
        if common is not None and not (common & fits):
            before = previous[-1][0].request
            earlier = _names(sorted(_value(v) for v in common))
            return (f"request {choice.request}: {len(standing.available)} candidate devices; none on the same "
                    f"{attribute} as a free {before} ({before}s on {earlier}; free {choice.request}s on "
                    f"{shown or 'nothing'}{note})")  # fmt: skip
        common = fits if common is None else common & fits
        previous.append((choice, counts))
    return None


def diagnose(requests: Sequence[Sequence[Choice]], funnels: Mapping[str, Funnel], constraints: Sequence[Constraint],
             inventory: Inventory, usage: Usage, steps: int) -> list[str]:  # fmt: skip
    """Reasons, for a new user, why no allocation exists."""
    left, capacity_left = usage.left(inventory), usage.capacity_left(inventory)
    reasons: list[str] = []
    chosen: list[tuple[Choice, _Standing]] = []
    for choices in requests:
        feasible, why = None, []
        for choice in choices:
            standing = _standing(choice, usage, left, capacity_left)
            problems = _shortfall(choice, funnels[choice.request], standing, usage, inventory.node)
            if choice.mode == "All" and inventory.incomplete:
                problems.insert(0, f"request {choice.request}: asks for all devices, but a pool is incomplete")
            if not problems:
                feasible = feasible or (choice, standing)
            why.extend(problems)
        if feasible is None:
            reasons.extend(why)
        else:
            chosen.append(feasible)
    if not reasons:
        for constraint in constraints:
            scope = [(c, s) for c, s in chosen if constraint.applies(c)]
            reason = _constraint_reason(constraint, scope)
            if reason:
                reasons.append(reason)
    if not reasons:
        reasons.append(f"no combination of the candidates satisfies the constraints and counters together "
                       f"(tried {steps} device placements)")  # fmt: skip
    return reasons + inventory.incomplete + inventory.invalid


def explain(requests: Sequence[Sequence[Choice]], funnels: Mapping[str, Funnel], constraints: Sequence[Constraint],
            inventory: Inventory, usage: Usage, picks: Sequence[Pick]) -> list[str]:  # fmt: skip
    """What was allocated and why: each request's path to its devices, the constraints' values, the counters."""
    lines: list[str] = []
    for choices in requests:
        mine = [p for p in picks if p.choice in choices]
        choice = mine[0].choice if mine else choices[0]
        standing = _standing(choice, usage, usage.left(inventory), usage.capacity_left(inventory))
        text = f"request {choice.request}: "
        if len(choices) > 1:
            place = choices.index(choice) + 1
            text += f"sub-request {place} of {len(choices)}"
            text += " (the ones before cannot be satisfied with the rest); " if place > 1 else "; "
        text += _funnel_text(choice, funnels[choice.request], inventory.node)
        if choice.admin:
            text += "; admin access (devices in use are allowed)"
        else:
            text += f"; {len(standing.available)} available"
        got = [p.device.name + (" (share: " + ", ".join(f"{n} {_amount(a)}" for n, a in sorted(p.consumed.items()))
                                + ")" if p.consumed is not None else "") for p in mine]
        lines.append(f"{text} -> {', '.join(got) or 'nothing'}")
    chosen_names = [p.choice.request for p in picks]
    for constraint in constraints:
        under = [p for p in picks if constraint.applies(p.choice)]
        names = ", ".join(dict.fromkeys(n for n in chosen_names if any(p.choice.request == n for p in under)))
        values = [v for v in (p.device.attribute(constraint.attribute) for p in under) if v is not None]
        shown = _value(values[0]) if constraint.kind == "matchAttribute" and values else \
            ", ".join(_value(v) for v in values)
        lines.append(f"{constraint.kind} {constraint.attribute} = {shown or '(no devices)'} for {names or 'none'}")
    drawn: dict[SetKey, dict[str, Fraction]] = {}
    for pick in picks:
        for set_key, amounts in ({} if pick.choice.admin else pick.device.drawn).items():
            for name, amount in amounts.items():
                drawn.setdefault(set_key, {})[name] = drawn.get(set_key, {}).get(name, Fraction(0)) + amount
    left = usage.left(inventory)
    for set_key, amounts in sorted(drawn.items()):
        used = ", ".join(f"{n} {_amount(a)} ({_amount(left[set_key][n] - a)} left)" for n, a in sorted(amounts.items()))
        lines.append(f"counters {set_key[2]} (pool {set_key[1]}): {used}")
    return lines + inventory.incomplete + inventory.invalid
