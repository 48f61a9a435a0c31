"""Real-time waits of the test suite, all scaled from one factor.

A test waits for real time only where the outside world takes it (a process starting, a kernel event, a socket
the kubelet simulator polls for). Every such timeout is written as `scaled(seconds)`: the time it takes on an idle
machine with room to spare. On a slower or busier machine set DRA_AGENT_TEST_TIME_FACTOR (e.g. 3) and every wait
of the suite stretches with it; nothing else decides how long a test may wait. The factor is the one the kubelet
simulator, the test API server and the conformance kit use (simulator/timing.py).
"""

from __future__ import annotations

from simulator.timing import ENV, FACTOR, scaled

__all__ = ["ENV", "FACTOR", "scaled"]
