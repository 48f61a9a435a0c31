"""Real-time waits of the test suite, all scaled from one factor.

A test waits for real time only where the outside world takes it (a process starting, a kernel event, a socket
the kubelet simulator polls for). Every such timeout is written as `scaled(seconds)`: the time it takes on an idle
machine with room to spare. On a slower or busier machine set DRA_AGENT_TEST_TIME_FACTOR (e.g. 3) and every wait
of the suite stretches with it; nothing else decides how long a test may wait.
"""

from __future__ import annotations

import os

__all__ = ["FACTOR", "scaled"]

FACTOR = float(os.environ.get("DRA_AGENT_TEST_TIME_FACTOR", "1") or "1")


def scaled(seconds: float) -> float:
    """`seconds` of real time, stretched by the suite's time factor."""
    return seconds * FACTOR
