"""Aggregation of repeated Events into series and the pace of their writes (agent/events/series.py): pure, the
time passed in."""

from __future__ import annotations

from typing import Any

import pytest

from agent.events.series import Occurrences, SeriesCache, TokenBucket


def body(name: str = "my-claim.1") -> dict[str, Any]:
    """An Event as first made (what the series logic reads of it)."""
    return {"metadata": {"name": name, "namespace": "team-a"}, "reason": "PrepareFailed", "note": "no such device"}


def test_an_isomorphic_event_within_the_window_joins_the_series() -> None:
    cache = SeriesCache(window=360.0)
    first = cache.observe("k", now=100.0, wall=1777636800.0, make=body)
    assert (first.count, first.observed) == (1, "2026-05-01T12:00:00.000000Z")
    again = cache.observe("k", now=459.0, wall=1777637159.5, make=lambda: pytest.fail("no new Event"))
    assert again is first and again.count == 2 and again.observed == "2026-05-01T12:05:59.500000Z"
    assert again.create_body()["series"] == {"count": 2, "lastObservedTime": "2026-05-01T12:05:59.500000Z"}
    assert "series" not in again.body, "the Event as first made stays as it was"
    # The window runs from the last occurrence: this one is 359 s after the previous one.
    assert cache.observe("k", now=818.0, wall=1777637518.0, make=body).count == 3


def test_after_the_window_a_new_event_starts() -> None:
    cache = SeriesCache(window=360.0)
    first = cache.observe("k", now=100.0, wall=0.0, make=body)
    later = cache.observe("k", now=460.5, wall=360.5, make=lambda: body("my-claim.2"))
    assert later is not first and later.count == 1 and later.name == "my-claim.2"


def test_other_keys_are_other_events_and_the_cache_is_bounded() -> None:
    cache = SeriesCache(window=360.0, capacity=3)
    a = cache.observe(("claim", "error one"), 0.0, 0.0, body)
    b = cache.observe(("claim", "error two"), 1.0, 1.0, body)
    assert a is not b and a.count == b.count == 1
    cache.observe("c", 2.0, 2.0, body)
    cache.observe(("claim", "error one"), 3.0, 3.0, body)  # seen again: now the most recent
    cache.observe("d", 4.0, 4.0, body)  # one too many: the least recently seen ("error two") goes
    assert len(cache) == 3
    assert cache.observe(("claim", "error one"), 5.0, 5.0, body) is a and a.count == 3
    assert cache.observe(("claim", "error two"), 6.0, 6.0, body) is not b


def test_when_a_write_is_due() -> None:
    entry = Occurrences(body(), seen=0.0, observed="2026-05-01T12:00:00.000000Z")
    assert entry.due(heartbeat=60.0) == float("-inf"), "a new Event: at once"
    entry.mark_written(1, now=10.0)
    assert entry.due(60.0) is None, "the server is current"
    entry.count = 2
    assert entry.due(60.0) == float("-inf"), "a series just begun: at once, as client-go does"
    entry.mark_written(2, now=11.0)
    entry.count = 5
    assert entry.due(60.0) == 71.0, "further counts: one heartbeat after the last write"
    entry.mark_written(5, now=80.0)
    assert entry.due(60.0) is None


def test_token_bucket() -> None:
    bucket = TokenBucket(rate=10.0, burst=3)
    assert [bucket.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(0.0) == pytest.approx(0.1)
    assert bucket.take(0.0) == pytest.approx(0.2)
    assert bucket.take(10.0) == 0.0, "refilled (up to the burst) after a quiet while"
