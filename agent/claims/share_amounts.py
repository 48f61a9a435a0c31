"""Whether the amounts a share of a device takes suit the device as it is published: each of its
`consumedCapacity` no more than the device has, and one the capacity's request policy allows.

The scheduler writes no other amounts (k8s.io/dynamic-resource-allocation rounds a request below the policy's
minimum up to the minimum, one above it up to the minimum plus whole steps, gives a claim that names no amount the
default, and never allocates an amount above the maximum or off the policy's values). An allocation written by hand
can hold any amount the API server stores; one the policy does not allow is refused before anything is prepared,
naming the field and the policy.

Pure: works on an allocation result read from the claim (agent/claims/read.py) and the device as its backend
reported it.
"""

from __future__ import annotations

import json

from agent.claims.read import DeviceAllocation
from agent.kube.quantity import format_quantity
from backends.contract import CapacityPolicy, Device

__all__ = ["describe_policy", "share_problem"]


def share_problem(result: DeviceAllocation, device: Device) -> str | None:
    """What is wrong with the amounts of a share of `device`, led by the field; None when nothing is.

    A capacity the device does not have is left alone: it takes nothing of the device."""
    for name, amount in sorted(result.consumed.items()):
        capacity = device.capacity.get(name)
        if capacity is None:
            continue
        where = f"{result.path}.consumedCapacity.{name}"
        shown = json.dumps(result.written.get(name, str(amount)))
        policy = device.capacity_policies.get(name)
        problem = _against(amount, policy) if policy is not None else None
        if problem is not None and policy is not None:
            return (f"{where}: {shown} {problem} of {device.name}'s requestPolicy for {name} "
                    f"({describe_policy(policy)})")
        if amount > capacity:
            return f"{where}: {shown} is more than device {device.name} has of {name} ({format_quantity(capacity)})"
    return None


def describe_policy(policy: CapacityPolicy) -> str:
    """A request policy as the ResourceSlice states it, e.g. `validRange: min 1Gi, max 79Gi, step 1Gi; default
    79Gi`."""
    if policy.valid_range is None:
        allowed = "validValues: " + ", ".join(format_quantity(v) for v in policy.valid_values)
    else:
        bounds = {"min": policy.valid_range.min, "max": policy.valid_range.max, "step": policy.valid_range.step}
        allowed = "validRange: " + ", ".join(f"{k} {format_quantity(v)}" for k, v in bounds.items() if v is not None)
    return f"{allowed}; default {format_quantity(policy.default)}"


def _against(amount: int, policy: CapacityPolicy) -> str | None:
    """How `amount` breaks the policy, as the scheduler's check of a rounded request (violatesPolicy) sees it."""
    if amount == policy.default:
        return None
    valid_range = policy.valid_range
    if valid_range is None:
        return None if amount in policy.valid_values else "is not one of the valid values"
    if amount < valid_range.min:
        return "is below the minimum"
    if valid_range.max is not None and amount > valid_range.max:
        return "is above the maximum"
    if valid_range.step is not None and (amount - valid_range.min) % valid_range.step:
        return "is not the minimum plus whole steps"
    return None
