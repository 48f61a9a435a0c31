"""The compute-mode entry points of the simulated NVML: `nvmlDeviceGetComputeMode` and `nvmlDeviceSetComputeMode`.

As nvml.h describes them: a physical GPU has one compute mode (DEFAULT: any number of processes share it,
time-sliced; EXCLUSIVE_PROCESS: one process at a time; PROHIBITED: none); EXCLUSIVE_THREAD is no longer
supported. A MIG device has no compute mode of its own (NOT_SUPPORTED). The mode outlives the agent process, so a
kept node saves it with the rest of the GPUs' state.
"""

from __future__ import annotations

from typing import Any

from simulator.nvml.marshal import HandleKind, LibraryCore, Target, on_handle, out, uint
from simulator.nvml.state import NvmlReturn

__all__ = ["COMPUTE_MODES", "ComputeModeSymbols"]

_DEFAULT, _EXCLUSIVE_THREAD, _PROHIBITED, _EXCLUSIVE_PROCESS = 0, 1, 2, 3
COMPUTE_MODES = (_DEFAULT, _PROHIBITED, _EXCLUSIVE_PROCESS)
"""The modes a GPU accepts (NVML_COMPUTEMODE_*)."""


class ComputeModeSymbols(LibraryCore):
    """Compute mode of the physical GPUs."""

    @on_handle(HandleKind.GPU, HandleKind.MIG_DEVICE)
    def nvmlDeviceGetComputeMode(self, t: Target, mode: Any) -> int:
        if t.mig:
            return NvmlReturn.ERROR_NOT_SUPPORTED
        out(mode).value = t.gpu.compute_mode
        return NvmlReturn.SUCCESS

    @on_handle(HandleKind.GPU, HandleKind.MIG_DEVICE)
    def nvmlDeviceSetComputeMode(self, t: Target, mode: Any) -> int:
        if t.mig:
            return NvmlReturn.ERROR_NOT_SUPPORTED
        wanted = uint(mode)
        if wanted == _EXCLUSIVE_THREAD:
            return NvmlReturn.ERROR_NOT_SUPPORTED  # support removed from the driver
        if wanted not in COMPUTE_MODES:
            return NvmlReturn.ERROR_INVALID_ARGUMENT
        t.gpu.compute_mode = wanted
        self._state_changed()
        return NvmlReturn.SUCCESS

    def compute_mode(self, index: int) -> int:
        """The compute mode of GPU `index` (test-facing)."""
        with self._lock:
            return self._gpus[index].compute_mode

    def set_compute_mode(self, index: int, mode: int) -> None:
        """Set GPU `index`'s compute mode as an operator's `nvidia-smi -c` would (test-facing)."""
        if mode not in COMPUTE_MODES:
            raise ValueError(f"compute mode {mode} is not one of {COMPUTE_MODES}")
        with self._lock:
            self._gpus[index].compute_mode = mode
            self._state_changed()
