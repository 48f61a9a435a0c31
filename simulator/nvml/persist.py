"""A kept simulated node's GPU state on disk: MIG modes, GPU and compute instances and compute modes outlive the
agent process, as they outlive it on hardware (until a reboot or a driver reload), so a restarted agent finds what
it made."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from simulator.nvml.state import ComputeInstance, GpuInstance, SimGpu

__all__ = ["load_mig_state", "save_mig_state"]


def save_mig_state(gpus: Sequence[SimGpu], path: Path) -> None:
    """Write every GPU's MIG mode, instances and compute mode (atomically: a process killed mid-write leaves the old
    state)."""
    state = [{
        "bus_id": gpu.bus_id, "mig_enabled": gpu.mig_enabled, "mig_pending": gpu.mig_pending,
        "compute_mode": gpu.compute_mode,
        "gpu_instances": [{
            "id": gi.id, "profile": gi.profile.name, "start": gi.start,
            "compute_instances": [{"id": ci.id, "profile_id": ci.profile_id, "slices": ci.slices, "start": ci.start}
                                  for ci in gi.compute_instances.values()],
        } for gi in gpu.gpu_instances.values()],
    } for gpu in gpus]
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text(json.dumps(state))
    os.replace(temp, path)


def load_mig_state(gpus: Sequence[SimGpu], path: Path) -> bool:
    """Put the saved state back onto the GPUs of the same node; False when nothing was saved."""
    try:
        state: list[dict[str, Any]] = json.loads(path.read_text())
    except FileNotFoundError:
        return False
    by_bus = {gpu.bus_id: gpu for gpu in gpus}
    for saved in state:
        gpu = by_bus[saved["bus_id"]]
        gpu.mig_enabled, gpu.mig_pending = saved["mig_enabled"], saved["mig_pending"]
        gpu.compute_mode = saved.get("compute_mode", 0)  # absent from states saved before it was kept
        gpu.gpu_instances = {
            gi["id"]: GpuInstance(gi["id"], gpu.model.mig_profile(gi["profile"]), gi["start"], {
                ci["id"]: ComputeInstance(ci["id"], ci["profile_id"], ci["slices"], ci["start"])
                for ci in gi["compute_instances"]
            })
            for gi in saved["gpu_instances"]
        }
    return True
