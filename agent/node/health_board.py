"""The health of one driver's devices: what its backends last reported, and who waits for changes.

Devices start healthy. A backend's `HealthEvent` replaces a device's state; a device that leaves the pool
while claims still use it reads as unhealthy ("removed") until those claims are unprepared, so the pods
using it show it in their status. Every change bumps `version` and wakes the waiters (the kubelet's health
streams and the publisher's taints).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from backends.contract import Health, HealthEvent

__all__ = ["HEALTHY", "REMOVED", "DeviceState", "HealthBoard"]


@dataclass(frozen=True)
class DeviceState:
    """One device's health as last reported; `since` is when it last changed (seconds since the epoch)."""

    health: Health = Health.HEALTHY
    reason: str = ""
    cause: str = ""
    value: str = ""
    since: float = 0.0

    def same_as(self, other: DeviceState) -> bool:
        """Equal but for the time: a repeated report is not a change."""
        return (self.health, self.reason, self.cause, self.value) == (other.health, other.reason, other.cause,
                                                                      other.value)


HEALTHY = DeviceState()

REMOVED = "removed"
"""The cause for a device that left the node while claims still used it."""


class HealthBoard:
    """The health of one driver's devices."""

    def __init__(self, devices: Iterable[str] = ()) -> None:
        self._devices: frozenset[str] = frozenset(devices)
        self._states: dict[str, DeviceState] = {}
        self.in_use: Callable[[], Collection[str]] = frozenset
        """The devices prepared for claims now (those gone from the pool are reported as removed)."""
        self.version = 0
        self._changed = asyncio.Event()  # replaced on every change: waiters hold the one of their version

    @property
    def devices(self) -> frozenset[str]:
        """The devices in the pool now."""
        return self._devices

    def state(self, device: str) -> DeviceState:
        """The device's state; a device that left the pool reads as removed."""
        if device not in self._devices:
            return self._states.get(device) or DeviceState(Health.UNHEALTHY, "the device is no longer on the node",
                                                           REMOVED)
        return self._states.get(device, HEALTHY)

    def states(self) -> dict[str, DeviceState]:
        """Every reported device: those in the pool, and those gone while still in use; sorted by name."""
        return {d: self.state(d) for d in sorted(self._devices.union(self.in_use()))}

    def unhealthy(self) -> dict[str, DeviceState]:
        """The devices in the pool that are not healthy (what the slices carry taints for)."""
        return {d: s for d in sorted(self._devices) if (s := self.state(d)).health is not Health.HEALTHY}

    def apply(self, event: HealthEvent) -> DeviceState | None:
        """Record a backend's report; the new state when it changed anything, else None."""
        new = DeviceState(event.health, event.reason, event.cause, event.value, time.time())
        old = self._states.get(event.device, HEALTHY)
        if new.same_as(old):
            return None
        if new.same_as(HEALTHY):
            self._states.pop(event.device, None)
        else:
            self._states[event.device] = new
        self._bump()
        return new

    def set_devices(self, devices: Collection[str]) -> None:
        """The pool changed (hot-plug): keep the states of the devices that stay."""
        devices = frozenset(devices)
        if devices == self._devices:
            return
        gone = self._devices - devices
        self._devices = devices
        for device in gone:
            self._states.pop(device, None)  # if it comes back, it comes back healthy until told otherwise
        self._bump()

    async def wait_changed(self, version: int, timeout: float) -> int:
        """Wait until `version` is out of date or `timeout` passes; the current version."""
        if self.version == version:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation that comes as the
            # event is set, and a stream being stopped would carry on.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._changed.wait()
        return self.version

    def _bump(self) -> None:
        self.version += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
