"""Device health as the kubelet's health stream reports it.

Every message is the driver's complete device list (the kubelet keeps only what each message says, and marks
a device Unknown when no message mentions it within its timeout). A message goes out on connect, at once on
every change of the board, and every half timeout even when nothing changed. Concurrent streams (a kubelet
restarting, two kubelet instances during an upgrade) each get the same lists.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence

from agent.kubelet.services import DeviceHealthReport, HealthStatus
from agent.node.health_board import HealthBoard
from backends.contract import Health

__all__ = ["DEFAULT_TIMEOUT", "HealthStream"]

DEFAULT_TIMEOUT = 30
"""Seconds the kubelet waits for news of a device before it reads as Unknown (its default)."""

_STATUS = {Health.HEALTHY: HealthStatus.HEALTHY, Health.UNHEALTHY: HealthStatus.UNHEALTHY,
           Health.UNKNOWN: HealthStatus.UNKNOWN}


class HealthStream:
    """Full device lists for one driver's pool, from its health board."""

    def __init__(self, pool: str, board: HealthBoard, timeout: int = DEFAULT_TIMEOUT,
                 on_clients: Callable[[int], None] = lambda clients: None) -> None:
        self._pool = pool
        self._board = board
        self._timeout = timeout
        self._on_clients = on_clients
        self.clients = 0
        self.messages = 0

    def snapshot(self) -> list[DeviceHealthReport]:
        now = int(time.time())  # the kubelet stamps reports with their arrival anyway
        return [DeviceHealthReport(pool=self._pool, device=device, health=_STATUS[state.health], last_updated=now,
                                   timeout_seconds=self._timeout, message=state.reason)
                for device, state in self._board.states().items()]

    async def watch(self) -> AsyncIterator[Sequence[DeviceHealthReport]]:
        self.clients += 1
        self._on_clients(self.clients)
        try:
            version = self._board.version
            while True:
                self.messages += 1
                yield self.snapshot()
                version = await self._board.wait_changed(version, self._timeout / 2)
        finally:
            self.clients -= 1
            self._on_clients(self.clients)
