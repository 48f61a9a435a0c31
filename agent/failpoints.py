"""Crash points for crash-consistency tests: the process kills itself with SIGKILL at a named point.

Active only when DRA_AGENT_FAILPOINTS lists point names (comma-separated); read once at import, so the check
on the prepare path is a set lookup. Never set it in production.
"""

from __future__ import annotations

import os
import signal

__all__ = ["POINTS", "failpoint"]

POINTS = (
    "prepare-before-started",
    "prepare-after-started",
    "prepare-after-backends",
    "prepare-after-cdi",
    "prepare-after-completed",
    "unprepare-before-backends",
    "unprepare-after-backends",
    "unprepare-after-cdi",
    "unprepare-after-removed",
)

_ACTIVE = frozenset(p for p in os.environ.get("DRA_AGENT_FAILPOINTS", "").split(",") if p)


def failpoint(name: str) -> None:
    """Die here, as `kill -9` would kill the agent, when this point is active."""
    if name in _ACTIVE:
        os.kill(os.getpid(), signal.SIGKILL)
