"""Crash points for crash-consistency tests: the process kills itself with SIGKILL at a named point.

Active only when DRA_AGENT_FAILPOINTS lists point names (comma-separated); read once at import, so the check
on the prepare path is a set lookup. Never set it in production.
"""

from __future__ import annotations

import os
import signal

__all__ = ["METADATA_POINTS", "MIG_POINTS", "MIG_WHOLE_POINTS", "MPS_POINTS", "POINTS", "VFIO_POINTS", "failpoint"]

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
"""The core's points, around the checkpoint and the CDI spec."""

METADATA_POINTS = ("prepare-after-metadata",)
"""The core's point with device metadata on: after the metadata files and their specs, before the claim's spec."""

MIG_POINTS = ("mig-after-gpu-instance", "mig-after-compute-instance")
"""nvidia-mig's points, between the NVML calls that make a MIG device and the ledger records of them."""

MIG_WHOLE_POINTS = ("mig-whole-after-intent", "mig-whole-after-mode-off")
"""nvidia-mig's points for a whole GPU in MIG mode: after the intent record, and after MIG mode went off."""

MPS_POINTS = ("mps-after-intent", "mps-after-spawn", "mps-after-quit")
"""nvidia-gpu's points for an MPS control daemon: after its journal entry (before it starts), after it started
(before it answers or has its limits), and after it was asked to quit (before its folder and entry go)."""

VFIO_POINTS = ("vfio-after-intent", "vfio-after-binding")
"""vfio-pci passthrough's points: after the intent record, and after the rebinding before the bound record."""

_ACTIVE = frozenset(p for p in os.environ.get("DRA_AGENT_FAILPOINTS", "").split(",") if p)


def failpoint(name: str) -> None:
    """Die here, as `kill -9` would kill the agent, when this point is active."""
    if name in _ACTIVE:
        os.kill(os.getpid(), signal.SIGKILL)
