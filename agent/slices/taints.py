"""Device taints from device health: the one rule that turns a device's state into what its slice says.

- unhealthy → `<driver>/<cause>=<value>` with effect NoSchedule: no new claims get the device, running pods
  keep it; NoExecute instead for the causes an operator lists (pods using the device are evicted);
- unknown (the agent cannot watch the device) → `<driver>/<cause>` (default `unmonitored`) with effect None:
  informational, scheduling goes on;
- healthy → no taint.

Keys live under the driver's own domain, as KEP-5055 recommends; a cause or value the API would refuse
(not a DNS label / label value) is replaced by a generic key or left out, so a backend cannot break a slice.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from agent.kube.names import is_dns_label, is_label_value
from agent.node.health_board import DeviceState
from backends.contract import Health

__all__ = ["TaintPolicy", "device_taints"]

UNHEALTHY_CAUSE = "unhealthy"
UNKNOWN_CAUSE = "unmonitored"


@dataclass(frozen=True)
class TaintPolicy:
    """How hard unhealthy devices are tainted."""

    no_execute: frozenset[str] = frozenset()
    """Causes (e.g. "gpu-lost") whose taint evicts the pods using the device."""

    @classmethod
    def of(cls, no_execute: Collection[str]) -> TaintPolicy:
        return cls(frozenset(no_execute))


def device_taints(driver: str, states: Mapping[str, DeviceState],
                  policy: TaintPolicy = TaintPolicy()) -> dict[str, list[dict[str, str]]]:
    """Device name → its taints, for the devices that need any."""
    taints: dict[str, list[dict[str, str]]] = {}
    for device, state in states.items():
        if state.health is Health.HEALTHY:
            continue
        unknown = state.health is Health.UNKNOWN
        cause = state.cause if is_dns_label(state.cause) else (UNKNOWN_CAUSE if unknown else UNHEALTHY_CAUSE)
        effect = "None" if unknown else "NoExecute" if cause in policy.no_execute else "NoSchedule"
        taint = {"key": f"{driver}/{cause}", "effect": effect}
        if state.value and is_label_value(state.value):
            taint["value"] = state.value
        taints[device] = [taint]
    return taints
