"""Consumable capacity (KEP-5075) as the scheduler counts it: what a request takes of a device's capacities.

A device published with ``allowMultipleAllocations: true`` may be allocated to many claims at once; each
allocation is a share that consumes an amount of every capacity of the device: the amount its request names in
``exactly.capacity.requests``, rounded up by the capacity's ``requestPolicy`` (the next step of ``validRange``,
the next entry of ``validValues``, at least ``min``), or the policy's ``default`` when it names none (the whole
capacity when there is no policy). The shares of a device never take more than its capacity. A device without
``allowMultipleAllocations`` is allocated whole, as before; a capacity request only keeps it from matching when
the device has less than asked.

Pure: works on devices as published (JSON) and requests as parsed quantities. Rounding matches upstream
``k8s.io/dynamic-resource-allocation/structured`` (``CalculateConsumedCapacity`` and ``violatesPolicy``) for
integer amounts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from agent.kube.quantity import format_quantity, parse_quantity

__all__ = ["capacities", "consumption", "is_shareable", "quantity_text", "round_up", "whole_device_fits"]

JsonObject = Mapping[str, Any]


def is_shareable(device: JsonObject) -> bool:
    """Whether the device may be allocated more than once (``allowMultipleAllocations``)."""
    return device.get("allowMultipleAllocations") is True


def capacities(device: JsonObject) -> dict[str, Fraction]:
    """The device's capacity values by name."""
    return {name: parse_quantity(str(entry["value"])) for name, entry in (device.get("capacity") or {}).items()}


def _quantity(value: Any) -> Fraction | None:
    return None if value is None else parse_quantity(str(value))


def round_up(requested: Fraction, policy: JsonObject | None) -> Fraction:
    """``requested`` rounded up to an amount the policy allows (unchanged when no amount above it exists; the
    caller then finds it out of policy)."""
    if not policy:
        return requested
    valid_range, valid_values = policy.get("validRange"), policy.get("validValues")
    if valid_range and valid_range.get("min") is not None:
        low, step = parse_quantity(str(valid_range["min"])), _quantity(valid_range.get("step"))
        if requested <= low:
            return low
        if step is None or step <= 0:
            return requested
        return low + math.ceil((requested - low) / step) * step
    if valid_values:
        for value in sorted(parse_quantity(str(v)) for v in valid_values):
            if value >= requested:
                return value
    return requested


def _out_of_policy(amount: Fraction, policy: JsonObject | None) -> str | None:
    if not policy:
        return None
    valid_range, valid_values = policy.get("validRange"), policy.get("validValues")
    if valid_range and valid_range.get("min") is not None:
        high = _quantity(valid_range.get("max"))
        if high is not None and amount > high:
            return f"more than the largest share, {quantity_text(high)}"
        return None
    if valid_values and amount not in {parse_quantity(str(v)) for v in valid_values}:
        return f"more than the largest share, {quantity_text(max(parse_quantity(str(v)) for v in valid_values))}"
    return None


def consumption(requested: Mapping[str, Fraction], device: JsonObject) -> dict[str, Fraction] | str:
    """What one share of a shareable ``device`` takes of each of its capacities for a request asking
    ``requested``; or why the device cannot give such a share at all."""
    entries: Mapping[str, Any] = device.get("capacity") or {}
    missing = sorted(set(requested) - set(entries))
    if missing:
        return f"has no capacity {', '.join(missing)}"
    taken: dict[str, Fraction] = {}
    for name, entry in entries.items():
        policy, total = entry.get("requestPolicy"), parse_quantity(str(entry["value"]))
        if name not in requested:
            default = _quantity((policy or {}).get("default"))
            taken[name] = default if default is not None else total
            continue
        amount = round_up(requested[name], policy)
        problem = _out_of_policy(amount, policy)
        if problem is None and amount > total:
            problem = f"more than the device has, {quantity_text(total)}"
        if problem is not None:
            shown = quantity_text(requested[name])
            return f"{name} {shown} is {problem}"
        taken[name] = amount
    return taken


def whole_device_fits(requested: Mapping[str, Fraction], device: JsonObject) -> str | None:
    """Why a device allocated whole cannot serve a capacity request (it has less than asked), or None."""
    have = capacities(device)
    for name, amount in sorted(requested.items()):
        if name not in have:
            return f"has no capacity {name}"
        if amount > have[name]:
            return f"{name} {quantity_text(amount)} is more than the device has, {quantity_text(have[name])}"
    return None


def quantity_text(value: Fraction) -> str:
    """A quantity as the API writes it: binary suffixes where exact, milli units for fractions."""
    if value.denominator == 1 and value >= 0:
        return format_quantity(int(value))
    milli = math.ceil(value * 1000)
    return f"{milli}m"
