"""Device health as the kubelet's health stream reports it.

Every message is the driver's complete device list (the kubelet keeps only what each message says, and marks
a device Unknown when no message mentions it within its timeout), sent on connect and then every half timeout
even when nothing changed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence

from agent.kubelet_api import DeviceHealthReport, HealthStatus

__all__ = ["DEFAULT_TIMEOUT", "HealthStream"]

DEFAULT_TIMEOUT = 30
"""Seconds the kubelet waits for news of a device before it reads as Unknown (its default)."""


class HealthStream:
    """Full device lists for one driver's pool; all devices are reported healthy."""

    def __init__(self, pool: str, devices: Callable[[], Sequence[str]], timeout: int = DEFAULT_TIMEOUT) -> None:
        self._pool = pool
        self._devices = devices
        self._timeout = timeout
        self.clients = 0

    def snapshot(self) -> list[DeviceHealthReport]:
        now = int(time.time())
        return [DeviceHealthReport(pool=self._pool, device=d, health=HealthStatus.HEALTHY, last_updated=now,
                                   timeout_seconds=self._timeout) for d in self._devices()]

    async def watch(self) -> AsyncIterator[Sequence[DeviceHealthReport]]:
        self.clients += 1
        try:
            while True:
                yield self.snapshot()
                await asyncio.sleep(self._timeout / 2)
        finally:
            self.clients -= 1
