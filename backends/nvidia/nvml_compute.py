"""NVML calls for GPU sharing and for MIG mode changes of a whole GPU: compute mode, MIG mode, and the GPU instances
that keep a GPU in MIG mode. Blocking, like everything that calls NVML: run in a worker thread, in a session."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import pynvml

from backends.nvidia.nvml import NvmlError, _call

__all__ = [
    "COMPUTE_MODE_NAMES",
    "DEFAULT",
    "EXCLUSIVE_PROCESS",
    "IN_USE",
    "NOT_FOUND",
    "NOT_SUPPORTED",
    "NO_PERMISSION",
    "MigMode",
    "compute_mode",
    "gpu_instance_count",
    "mig_mode",
    "minor_number",
    "set_compute_mode",
    "set_mig_mode",
]

DEFAULT: int = pynvml.NVML_COMPUTEMODE_DEFAULT
EXCLUSIVE_PROCESS: int = pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
COMPUTE_MODE_NAMES = {pynvml.NVML_COMPUTEMODE_DEFAULT: "Default", pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD:
                      "ExclusiveThread", pynvml.NVML_COMPUTEMODE_PROHIBITED: "Prohibited",
                      pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: "ExclusiveProcess"}
IN_USE: int = pynvml.NVML_ERROR_IN_USE
NOT_FOUND: int = pynvml.NVML_ERROR_NOT_FOUND
NO_PERMISSION: int = pynvml.NVML_ERROR_NO_PERMISSION
NOT_SUPPORTED: int = pynvml.NVML_ERROR_NOT_SUPPORTED
_ARCH_HOPPER: int = pynvml.NVML_DEVICE_ARCH_HOPPER


def _handle(bus_id: str) -> Any:
    return _call("nvmlDeviceGetHandleByPciBusId", pynvml.nvmlDeviceGetHandleByPciBusId, bus_id)


def compute_mode(bus_id: str) -> int:
    mode: int = _call("nvmlDeviceGetComputeMode", pynvml.nvmlDeviceGetComputeMode, _handle(bus_id))
    return mode


def set_compute_mode(bus_id: str, mode: int) -> None:
    _call("nvmlDeviceSetComputeMode", pynvml.nvmlDeviceSetComputeMode, _handle(bus_id), mode)


def minor_number(bus_id: str) -> int:
    """N of /dev/nvidiaN; NVML says it may change with a MIG mode change, so it is read again after one."""
    minor: int = _call("nvmlDeviceGetMinorNumber", pynvml.nvmlDeviceGetMinorNumber, _handle(bus_id))
    return minor


@dataclass(frozen=True)
class MigMode:
    """A GPU's MIG mode now and after its next reset, and whether it changes MIG mode without a reset."""

    enabled: bool
    pending: bool  # a change waits for a GPU reset
    resetless: bool  # Hopper and newer apply a MIG mode change at once

    @property
    def settled(self) -> bool:
        return not self.pending


def mig_mode(bus_id: str) -> MigMode:
    handle = _handle(bus_id)
    current, pending = _call("nvmlDeviceGetMigMode", pynvml.nvmlDeviceGetMigMode, handle)
    arch = _call("nvmlDeviceGetArchitecture", pynvml.nvmlDeviceGetArchitecture, handle)
    enabled = current == pynvml.NVML_DEVICE_MIG_ENABLE
    return MigMode(enabled, pending != current, arch >= _ARCH_HOPPER)


def set_mig_mode(bus_id: str, enabled: bool) -> None:
    """Ask for MIG mode on or off; an activation status other than success (RESET_REQUIRED, IN_USE) is an error
    of nvmlDeviceSetMigMode, as a failed call is."""
    mode = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE
    status = _call("nvmlDeviceSetMigMode", pynvml.nvmlDeviceSetMigMode, _handle(bus_id), mode)
    if status != pynvml.NVML_SUCCESS:
        raise NvmlError("nvmlDeviceSetMigMode", pynvml.NVMLError(status))


def gpu_instance_count(bus_id: str) -> int:
    """How many GPU instances exist on a GPU in MIG mode (any profile, whoever made them)."""
    handle = _handle(bus_id)
    total = 0
    for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, index)
        except pynvml.NVMLError:
            continue  # profile index not offered by this GPU
        array = (pynvml.c_nvmlGpuInstance_t * max(1, info.instanceCount))()
        count = ctypes.c_uint(0)
        try:
            pynvml.nvmlDeviceGetGpuInstances(handle, info.id, array, ctypes.byref(count))
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
            continue  # MIG is off: no instances
        except pynvml.NVMLError as e:
            raise NvmlError("nvmlDeviceGetGpuInstances", e) from None
        total += count.value
    return total
