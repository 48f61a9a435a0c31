"""NVML's health-event API for the health watcher: the GPUs to watch, one event set, and the probe that tells
whether NVML answers normally for a GPU. Every call blocks; only the watcher's thread makes them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, TypeVar

import pynvml

from backends.nvidia.nvml import NvmlError
from backends.topology import TopologyError, normalize_bus_id

__all__ = [
    "GPU_IS_LOST",
    "NOT_FOUND",
    "NOT_SUPPORTED",
    "EventSet",
    "NvmlEvent",
    "WatchedGpu",
    "probe",
    "watched_gpus",
]

_T = TypeVar("_T")

GPU_IS_LOST: int = pynvml.NVML_ERROR_GPU_IS_LOST
NOT_FOUND: int = pynvml.NVML_ERROR_NOT_FOUND
NOT_SUPPORTED: int = pynvml.NVML_ERROR_NOT_SUPPORTED


def _call(name: str, fn: Callable[..., _T], *args: Any) -> _T:
    try:
        return fn(*args)
    except pynvml.NVMLError as e:
        raise NvmlError(name, e) from None


def _key(handle: Any) -> int:
    """A device handle's pointer value: how an event names its GPU."""
    value: int | None = ctypes.cast(handle, ctypes.c_void_p).value
    return value or 0


@dataclass(frozen=True)
class WatchedGpu:
    """A GPU as the watcher knows it: UUID, PCI address (sysfs form) and NVML handle."""

    uuid: str
    bus_id: str
    handle: Any
    key: int


def _describe(handle: Any) -> WatchedGpu:
    pci = _call("nvmlDeviceGetPciInfo", pynvml.nvmlDeviceGetPciInfo, handle)
    raw = pci.busId.decode() if isinstance(pci.busId, bytes) else str(pci.busId)
    try:
        bus_id = normalize_bus_id(raw)
    except TopologyError:
        bus_id = raw
    return WatchedGpu(_call("nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID, handle), bus_id, handle, _key(handle))


def watched_gpus() -> list[WatchedGpu]:
    """The GPUs NVML enumerates now; one that does not answer is left out (discovery reports it)."""
    gpus: list[WatchedGpu] = []
    for index in range(_call("nvmlDeviceGetCount", pynvml.nvmlDeviceGetCount)):
        try:
            gpus.append(_describe(_call("nvmlDeviceGetHandleByIndex", pynvml.nvmlDeviceGetHandleByIndex, index)))
        except NvmlError:
            continue
    return gpus


def probe(uuid: str) -> WatchedGpu:
    """The GPU with `uuid`, after checking that NVML answers normally for it (a handle and a memory query);
    raises NvmlError (GPU_IS_LOST, NOT_FOUND, ...) when it does not."""
    handle = _call("nvmlDeviceGetHandleByUUID", pynvml.nvmlDeviceGetHandleByUUID, uuid)
    _call("nvmlDeviceGetMemoryInfo", pynvml.nvmlDeviceGetMemoryInfo, handle)
    return _describe(handle)


@dataclass(frozen=True)
class NvmlEvent:
    """One event as nvmlEventSetWait returns it; `key` names the GPU (see WatchedGpu.key)."""

    key: int
    event_type: int
    data: int
    gpu_instance: int
    compute_instance: int


class EventSet:
    """One NVML event set; free it before NVML shuts down."""

    def __init__(self) -> None:
        self._set = _call("nvmlEventSetCreate", pynvml.nvmlEventSetCreate)

    def register(self, gpu: WatchedGpu, wanted: int) -> int:
        """Register `gpu` for the `wanted` event types it supports; the types registered (0: none supported).

        Raises NvmlError, e.g. NOT_SUPPORTED from a driver too old for events, GPU_IS_LOST."""
        try:
            supported = pynvml.nvmlDeviceGetSupportedEventTypes(gpu.handle)
        except pynvml.NVMLError_NotSupported:
            supported = 0
        except pynvml.NVMLError as e:
            raise NvmlError("nvmlDeviceGetSupportedEventTypes", e) from None
        mask = int(wanted) & int(supported)
        if mask:
            _call("nvmlDeviceRegisterEvents", pynvml.nvmlDeviceRegisterEvents, gpu.handle, mask, self._set)
        return mask

    def wait(self, timeout_ms: int) -> NvmlEvent | None:
        """The next event, or None when none came within `timeout_ms`; raises NvmlError (e.g. GPU_IS_LOST)."""
        try:
            data = pynvml.nvmlEventSetWait_v2(self._set, timeout_ms)
        except pynvml.NVMLError_Timeout:
            return None
        except pynvml.NVMLError as e:
            raise NvmlError("nvmlEventSetWait_v2", e) from None
        return NvmlEvent(_key(data.device), int(data.eventType), int(data.eventData), int(data.gpuInstanceId),
                         int(data.computeInstanceId))

    def free(self) -> None:
        """Release the set; failures are ignored (NVML may already be gone)."""
        with suppress(pynvml.NVMLError):
            pynvml.nvmlEventSetFree(self._set)
