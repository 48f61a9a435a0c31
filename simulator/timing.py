"""Real-time waits of the test doubles and kits, all scaled from one factor.

The simulator's stand-ins (the kubelet, the test API server, the simulated kernel and NVML, the demo) and the
conformance kit wait for real time only where the other side takes it (a plugin answering, an agent starting, a
uevent arriving). Each such wait is written as `scaled(seconds)`: the time it takes on an idle machine with room
to spare. On a slower or busier machine set DRA_AGENT_TEST_TIME_FACTOR (e.g. 3) and every wait stretches with it.
The project's own test suite (tests/support/timing.py) and plugin authors' suites read the same factor through this
module.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["ENV", "FACTOR", "factor", "scaled"]

ENV = "DRA_AGENT_TEST_TIME_FACTOR"


def factor(environ: Mapping[str, str] | None = None) -> float:
    """The time factor DRA_AGENT_TEST_TIME_FACTOR sets (1 when unset or empty); it must be a positive number."""
    raw = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not raw:
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{ENV}={raw!r} must be a positive number")
    return value


FACTOR = factor()


def scaled(seconds: float) -> float:
    """`seconds` of real time, stretched by the time factor."""
    return seconds * FACTOR
