"""The time formats of the Kubernetes API as its server reads them: a Time (RFC 3339 in seconds: a condition's
`lastTransitionTime`, a taint's `timeAdded`) and a MicroTime (an Event's `eventTime`: six fractional digits).

The server decodes both with Go's `time.Parse` and the layouts `2006-01-02T15:04:05Z07:00` and
`2006-01-02T15:04:05.000000Z07:00`, which differ from RFC 3339 in both directions:

- `T` and `Z` in upper case only (RFC 3339 also allows `t` and `z`);
- the hour may have one digit (`T1:00:00Z`); the year has four digits, the others two;
- fractional seconds follow `.` or `,`: any number of digits in a Time; exactly six in a MicroTime, where Go's
  integer parsing also takes a sign and five digits (`.+12345`);
- an offset `+hh:mm` may reach 24 hours and 60 minutes (Go's range check is "greater than", not "at least");
- the day must exist in its month (year 0 is a leap year); the hour is 0-23, minutes and seconds 0-59.

A value the server cannot read fails the whole request before any validation: 400 for a JSON body, 500 for a
server-side apply. Predicates accept any object, so raw JSON values can be passed.
"""

from __future__ import annotations

import re

__all__ = ["MICRO_TIME_LAYOUT", "TIME_LAYOUT", "instant", "is_micro_time", "is_rfc3339"]

TIME_LAYOUT = "2006-01-02T15:04:05Z07:00"
MICRO_TIME_LAYOUT = "2006-01-02T15:04:05.000000Z07:00"

_DATE_TIME = r"(?P<y>\d{4})-(?P<mo>\d\d)-(?P<d>\d\d)T(?P<h>\d\d?):(?P<mi>\d\d):(?P<s>\d\d)"
_ZONE = r"(?P<zone>Z|[+-]\d\d:\d\d)"
_TIME = re.compile(_DATE_TIME + r"(?:[.,](?P<frac>\d+))?" + _ZONE)
_MICRO_TIME = re.compile(_DATE_TIME + r"[.,](?P<frac>\d{6}|\+\d{5})" + _ZONE)
_DAYS = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


def is_rfc3339(value: object) -> bool:
    """A Time the server can read."""
    return _parse(value, _TIME) is not None


def is_micro_time(value: object) -> bool:
    """A MicroTime the server can read."""
    return _parse(value, _MICRO_TIME) is not None


def instant(value: object, *, micro: bool = False) -> int | None:
    """The moment a Time (a MicroTime with `micro`) names, as microseconds since 0000-01-01T00:00:00Z, so two
    values compare as the server compares them; None when the server cannot read it."""
    return _parse(value, _MICRO_TIME if micro else _TIME)


def _parse(value: object, layout: re.Pattern[str]) -> int | None:
    match = layout.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        return None
    year, month, day = int(match["y"]), int(match["mo"]), int(match["d"])
    hour, minute, second = int(match["h"]), int(match["mi"]), int(match["s"])
    leap = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
    if not 1 <= month <= 12 or not 1 <= day <= _DAYS[month - 1] + (month == 2 and leap):
        return None
    if hour > 23 or minute > 59 or second > 59:
        return None
    offset = 0
    if (zone := match["zone"]) != "Z":
        zone_hours, zone_minutes = int(zone[1:3]), int(zone[4:6])
        if zone_hours > 24 or zone_minutes > 60:
            return None
        offset = (zone_hours * 60 + zone_minutes) * (-1 if zone[0] == "-" else 1)
    # Counted by hand: Python's datetime has no year 0, which Go reads.
    leap_years_before = (year + 3) // 4 - (year + 99) // 100 + (year + 399) // 400
    days = year * 365 + leap_years_before + sum(_DAYS[: month - 1]) + (month > 2 and leap) + day - 1
    seconds = ((days * 24 + hour) * 60 + minute - offset) * 60 + second
    micros = int(match["frac"].lstrip("+").ljust(6, "0")[:6]) if match["frac"] else 0
    return seconds * 1_000_000 + micros
