"""MIG on simulated nodes for tests: the dgx-h100 profile with every GPU in MIG mode, and the settings that put
nvidia-mig in dynamic mode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from simulator.node.variants import in_mig_mode

DYNAMIC = {"nvidia-mig": {"mode": "dynamic"}}
"""`backend_config` for nvidia-mig in dynamic mode (MIG devices made at prepare)."""


def dgx_h100_in_mig_mode(folder: Path, made: dict[int, list[dict[str, Any]]] | None = None) -> Path:
    """The dgx-h100 profile with every GPU in MIG mode: no MIG device yet, or those `made` by an operator (by the
    position of the GPU entry in the profile)."""
    return in_mig_mode("dgx-h100", folder, made)
