"""What the NVIDIA health watcher has told the backends, kept where its thread and every backend's event loop
reach it under one lock: the subscribers, each GPU's recent events, and which GPUs are reported lost or
unmonitored until they recover. A backend that subscribes late hears all of it first.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import Counter

from backends.nvidia.health_rules import GpuEvent, GpuLost, GpuRecovered, GpuUnmonitored, Notice

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from structlog.typing import FilteringBoundLogger

__all__ = ["Notices", "Reported", "Subscriber"]

_HISTORY = 16  # events kept per GPU until it recovers, for a backend that subscribes later


@dataclass(eq=False)
class Subscriber:
    """A backend's end: `deliver` runs on `loop` for every notice."""

    loop: asyncio.AbstractEventLoop
    deliver: Callable[[Notice], None]
    recheck_seconds: float
    log: FilteringBoundLogger
    registry: CollectorRegistry | None = None


@dataclass(frozen=True)
class Reported:
    """A GPU reported lost or unmonitored, until it recovers."""

    notice: GpuLost | GpuUnmonitored
    permanent: bool = False  # the GPU cannot deliver events at all: nothing to re-check


class Notices:
    """The subscribers and what they were told; every method is safe from any thread."""

    def __init__(self, log: FilteringBoundLogger) -> None:
        self._log = log
        self._lock = threading.Lock()
        self._subscribers: list[Subscriber] = []
        self._reported: dict[str, Reported] = {}
        self._history: dict[str, deque[GpuEvent]] = {}
        self._xids = Counter("dra_agent_nvidia_xids", "Xid errors NVML reported, by code", ["code"], registry=None)
        self._registries: list[CollectorRegistry] = []

    def add(self, sub: Subscriber) -> None:
        """Add a subscriber and tell it what is known already: recent events, then what is still reported."""
        with self._lock:
            self._subscribers.append(sub)
            if sub.registry is not None and not any(r is sub.registry for r in self._registries):
                try:
                    sub.registry.register(self._xids)
                    self._registries.append(sub.registry)
                except ValueError as e:  # another watcher of this process is still stopping
                    sub.log.warning("Xid counter not registered", reason=str(e))
            for events in self._history.values():
                for event in events:
                    sub.loop.call_soon_threadsafe(sub.deliver, event)
            for reported in self._reported.values():
                sub.loop.call_soon_threadsafe(sub.deliver, reported.notice)

    def remove(self, sub: Subscriber) -> bool:
        """Remove a subscriber; True when it was the last one."""
        with self._lock:
            if sub in self._subscribers:
                self._subscribers.remove(sub)
            return not self._subscribers

    def close(self) -> None:
        """Take the Xid counter out of the registries it was added to."""
        with self._lock:
            for registry in self._registries:
                registry.unregister(self._xids)
            self._registries.clear()

    def event(self, notice: GpuEvent, *, xid: bool) -> None:
        """An NVML event on a GPU: kept in its history (until it recovers) and told to every subscriber."""
        if xid:
            self._xids.labels(code=str(notice.data)).inc()
        with self._lock:
            self._history.setdefault(notice.uuid, deque(maxlen=_HISTORY)).append(notice)
            self._emit_locked(notice)

    def report(self, uuid: str, notice: GpuLost | GpuUnmonitored, permanent: bool = False) -> None:
        """The GPU is lost or not watched: tell the subscribers once (a lost GPU stays lost until it answers)."""
        with self._lock:
            old = self._reported.get(uuid)
            if old is not None and (isinstance(old.notice, GpuLost) or old.notice == notice):
                return
            self._reported[uuid] = Reported(notice, permanent)
            self._emit_locked(notice)
        self._log.warning("GPU health not watched" if isinstance(notice, GpuUnmonitored) else "GPU lost",
                          gpu=uuid, detail=notice.detail)

    def recovered(self, uuid: str, everything: bool, suspected: bool) -> None:
        """End what was reported for the GPU (with `everything`, its event history too) and say so, if anything
        was reported or a backend `suspected` it."""
        with self._lock:
            reported = self._reported.pop(uuid, None)
            if everything:
                self._history.pop(uuid, None)
            if reported is None and not suspected:
                return
            self._emit_locked(GpuRecovered(uuid, everything))
        self._log.info("GPU answers NVML normally again", gpu=uuid)

    def reported(self, uuid: str) -> Reported | None:
        with self._lock:
            return self._reported.get(uuid)

    def reported_gpus(self) -> set[str]:
        with self._lock:
            return set(self._reported)

    def passing(self) -> set[str]:
        """GPUs reported for a reason that may pass (lost, or unmonitored for now): worth probing again."""
        with self._lock:
            return {u for u, r in self._reported.items() if not r.permanent}

    def recheck_seconds(self) -> float:
        """How often sick GPUs are probed: the most impatient subscriber's wish."""
        with self._lock:
            return min((s.recheck_seconds for s in self._subscribers), default=30.0)

    def _emit_locked(self, notice: Notice) -> None:
        for sub in self._subscribers:
            with suppress(RuntimeError):  # that event loop is closed: its backend is going away
                sub.loop.call_soon_threadsafe(sub.deliver, notice)
