"""Times chosen at the edges of what the API server reads as a Time (RFC 3339: a condition's lastTransitionTime)
and as a MicroTime (an Event's eventTime), with its verdict for each. Shared by the fast tier's test of
agent/kube/times.py and the real API server's tests of Events and claim status conditions, which send each one."""

from __future__ import annotations

__all__ = ["TIMES"]

TIMES: list[tuple[str, bool, bool]] = [
    ("2026-05-01T12:00:00Z", True, False),
    ("2026-05-01T12:00:00.123456Z", True, True),
    ("2026-05-01T12:00:00.5Z", True, False),
    ("2026-05-01T12:00:00.12345Z", True, False),
    ("2026-05-01T12:00:00.1234567Z", True, False),
    ("2026-05-01T12:00:00.1234567891234Z", True, False),
    ("2026-05-01T12:00:00,123456Z", True, True),  # a comma before the fraction
    ("2026-05-01T12:00:00.123456+02:00", True, True),
    ("2026-05-01T12:00:00.123456-00:00", True, True),
    ("2026-05-01T12:00:00+05:30", True, False),
    ("2026-05-01T1:00:00.123456Z", True, True),  # a one-digit hour
    ("2026-05-01T12:00:00.123456+24:60", True, True),  # offsets up to 24 h and 60 min
    ("2026-05-01T12:00:00.123456+24:61", False, False),
    ("2026-05-01T12:00:00.123456+25:00", False, False),
    ("2026-05-01T12:00:00.+12345Z", False, True),  # Go's integer parsing takes the sign in six "digits"
    ("2026-05-01T12:00:00.-12345Z", False, False),
    ("2026-05-01t12:00:00.123456Z", False, False),  # RFC 3339 allows lower case t and z; Go does not
    ("2026-05-01T12:00:00.123456z", False, False),
    ("2026-05-01T12:00:00z", False, False),
    ("2026-05-01 12:00:00.123456Z", False, False),
    ("2026-05-01T12:00:00.123456", False, False),
    ("2026-05-01T12:00:00.123456+0200", False, False),
    ("2024-02-29T12:00:00.123456Z", True, True),
    ("2026-02-29T12:00:00.123456Z", False, False),
    ("0000-02-29T00:00:00.000000Z", True, True),  # year 0, a leap year
    ("2026-05-01T24:00:00.123456Z", False, False),
    ("2026-05-01T12:00:60.123456Z", False, False),  # no leap second
    ("2026-05-01T12:0:00.123456Z", False, False),
    ("2026-05-01T001:00:00.123456Z", False, False),
    ("2026-05-01T12:00:00.123456Z ", False, False),
    ("", False, False),
]
"""(value, read as a Time, read as a MicroTime)."""
