"""The API server's time formats (agent/kube/times.py): what it reads as a Time and as a MicroTime, and the moment
each names."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from agent.kube.times import instant, is_micro_time, is_rfc3339
from tests.support.time_cases import TIMES


@pytest.mark.parametrize(("value", "time", "micro"), TIMES)
def test_the_servers_verdict_on_each_time(value: str, time: bool, micro: bool) -> None:
    assert (is_rfc3339(value), is_micro_time(value)) == (time, micro)


def test_values_of_other_types_are_no_times() -> None:
    for value in (None, 12, 1.5, ["2026-05-01T12:00:00Z"], {"time": "2026-05-01T12:00:00Z"}):
        assert not is_rfc3339(value) and not is_micro_time(value)


def test_the_same_moment_written_two_ways_is_one_instant() -> None:
    assert instant("2026-05-01T12:00:00Z") == instant("2026-05-01T14:30:00+02:30") == instant("2026-05-01T12:00:00,0Z")
    assert instant("2026-05-01T12:00:00.123456Z", micro=True) == instant("2026-05-01T11:00:00.123456-01:00", micro=True)
    assert instant("2026-05-01T12:00:00.000001Z", micro=True) != instant("2026-05-01T12:00:00.000000Z", micro=True)
    # A Time keeps microseconds (the server compares to the microsecond at most).
    assert instant("2026-05-01T12:00:00.1234569Z") == instant("2026-05-01T12:00:00.123456Z")
    assert instant("2026-05-01T12:00:00Z", micro=True) is None and instant("not a time") is None


@given(st.datetimes(timezones=st.timezones()))
def test_instants_count_the_moments_they_name(moment: datetime) -> None:
    offset = moment.utcoffset()
    assume(offset is not None and offset % timedelta(minutes=1) == timedelta(0))  # the API's offsets: minutes
    assert offset is not None
    minutes = abs(offset) // timedelta(minutes=1)
    sign = "-" if offset < timedelta(0) else "+"
    zone = f"{sign}{minutes // 60:02d}:{minutes % 60:02d}"
    text = f"{moment.year:04d}" + moment.strftime("-%m-%dT%H:%M:%S.%f") + zone
    start = instant("0001-01-01T00:00:00.000000Z", micro=True)
    assert start is not None
    assert instant(text, micro=True) == start + (moment - datetime(1, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)
