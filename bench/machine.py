"""The machine's state while a benchmark runs, printed with its figures: this VM's speed varies over a day and
with other work on it, so a figure means something only beside these."""

from __future__ import annotations

import os
import time

__all__ = ["conditions"]


def _loop_ms() -> float:
    """A fixed pure-Python loop (5 M additions), the fastest of three: the interpreter's speed right now."""
    best = float("inf")
    for _ in range(3):
        began = time.perf_counter()
        total = 0
        for i in range(5_000_000):
            total += i
        best = min(best, time.perf_counter() - began)
    return best * 1000


def conditions() -> str:
    one, five, fifteen = os.getloadavg()
    return (f"machine: {os.cpu_count()} CPUs, load average {one:.2f} / {five:.2f} / {fifteen:.2f}, "
            f"reference loop {_loop_ms():.0f} ms")
