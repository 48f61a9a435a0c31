"""Aggregation of repeated Events into series, and the pace of their writes; pure, with the time passed in.

Two occurrences are the same Event (isomorphic) when they share the object, type, reason, action and note; the
recorder's controller and instance are the same for all it writes. client-go's events recorder leaves the note
out of its key; here it is in, because one object (the Node) carries Events about many devices and one claim can
fail for different reasons: without the note, the second GPU to fail would only raise the count of the first
one's Event. An occurrence within `window` seconds (client-go: 6 minutes) of the previous one joins its series:
`series.count` and `series.lastObservedTime` grow instead of a new Event being made. Later, a new Event starts.

Writes: a new Event at once; the first repeat (count 2) at once, as client-go does; further repeats at most one
write per `heartbeat` seconds, each with the latest count (client-go writes them only every 30 minutes and when
the series ends, so `kubectl describe` shows "x2" for most of a long failure). Every write of a series renews the
Event's time to live in the API server (one hour by default), so a series that goes on stays visible.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from agent.events.rules import micro_time

__all__ = ["SERIES_WINDOW", "Occurrences", "SeriesCache", "TokenBucket"]

SERIES_WINDOW = 360.0
"""Seconds after an occurrence within which the next isomorphic one joins its series (client-go's 6 minutes)."""


@dataclass(eq=False)
class Occurrences:
    """One Event and how often it happened; what the API server has of it. Times: `seen` and `written_at` on the
    monotonic clock the recorder passes in, `observed` as the MicroTime of the last occurrence."""

    body: dict[str, Any]
    """The Event as first created: metadata (name, namespace), eventTime, type, reason, note..."""
    seen: float
    observed: str
    count: int = 1
    written: int = 0
    """Occurrences the server's copy counts: 0 before it is created."""
    written_at: float | None = None
    pending: bool = field(default=False, repr=False)

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])

    @property
    def namespace(self) -> str:
        return str(self.body["metadata"]["namespace"])

    def series(self) -> dict[str, Any]:
        return {"count": self.count, "lastObservedTime": self.observed}

    def create_body(self) -> dict[str, Any]:
        """The Event to create: with its series when it already repeated (a create after the series began)."""
        return {**self.body, "series": self.series()} if self.count > 1 else dict(self.body)

    def due(self, heartbeat: float) -> float | None:
        """When the next write may be made (a time on the recorder's clock), or None when the server is current."""
        if self.written == 0 or (self.written == 1 < self.count):
            return float("-inf")  # a new Event, or a series just begun: at once
        if self.count > self.written:
            return (self.written_at or 0.0) + heartbeat
        return None

    def mark_written(self, count: int, now: float) -> None:
        self.written, self.written_at = count, now


class SeriesCache:
    """The Events seen recently, by their key; at most `capacity`, the least recently seen forgotten first."""

    def __init__(self, window: float = SERIES_WINDOW, capacity: int = 4096) -> None:
        self.window = window
        self.capacity = capacity
        self._entries: dict[Hashable, Occurrences] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def observe(self, key: Hashable, now: float, wall: float,
                make: Callable[[], dict[str, Any]]) -> Occurrences:
        """Count one occurrence: into the series of `key` when within the window, else as a new Event (`make`
        builds its body). `now` is monotonic seconds, `wall` seconds since the epoch."""
        entry = self._entries.pop(key, None)
        if entry is not None and now - entry.seen <= self.window:
            entry.count += 1
            entry.seen, entry.observed = now, micro_time(wall)
        else:
            entry = Occurrences(make(), now, micro_time(wall))
        self._entries[key] = entry  # re-inserted: the dict's order is the order of the last occurrences
        while len(self._entries) > self.capacity:
            del self._entries[next(iter(self._entries))]
        return entry


class TokenBucket:
    """At most `burst` writes at once and `rate` per second on average."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self._tokens = float(burst)
        self._at: float | None = None

    def take(self, now: float) -> float:
        """Take a token; the seconds to wait before using it (0 when one was there)."""
        if self._at is not None:
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.rate)
        self._at = now
        self._tokens -= 1
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate
