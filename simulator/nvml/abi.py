"""The simulated libnvidia-ml's entry points: each NVML C function the simulation implements, with its parameters
as nvml.h declares them, and what each argument is to the NVML server that runs the call.

The library (`library`) forwards every call as the raw argument words; the server (`server`) turns
each into what pynvml would have passed the simulation in-process: a number, a handle, or a ctypes object filled
from and written back to the calling process's memory. The struct types are pynvml's, whose layouts are
nvml.h's. A call's symbol travels as its position in `SYMBOLS`; `DIGEST` names this table, so that a library
built from another table is refused rather than misread.
"""

from __future__ import annotations

import ctypes
import hashlib
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, TypeAlias

import pynvml

__all__ = ["DIGEST", "ERROR_STRINGS", "MAX_ARGS", "MAX_ARRAY", "SIGNATURES", "SYMBOLS", "CType", "Kind", "Param"]

MAX_ARGS = 8
"""The most parameters an entry point has (and the request's fixed argument slots)."""
MAX_ARRAY = 64
"""Elements of an output array the server offers the simulation (more than any GPU has instances or placements)."""


class Kind(Enum):
    """How an argument reaches the simulation."""

    UINT = auto()  # a number (also enums)
    ULL = auto()  # a 64-bit number (event type masks)
    HANDLE = auto()  # an opaque handle (device, GPU or compute instance, event set): its pointer value
    IN = auto()  # a struct the caller filled, read from its memory
    OUT = auto()  # a value or struct the call fills, written back to the caller's memory when changed
    INOUT = auto()  # a versioned struct: the caller's `version` read, the struct written back when changed
    STRING = auto()  # NUL-terminated text read from the caller (a UUID, a PCI bus id)
    BUFFER = auto()  # a text buffer whose size in bytes is the next argument, written back on success
    ARRAY = auto()  # an array the call fills; its element count is what the call leaves in its last argument

    @property
    def c_type(self) -> str:
        """The parameter's type in the exported C function (every pointer is one machine word)."""
        return _C_TYPES.get(self, "void *")


_C_TYPES = {Kind.UINT: "unsigned int", Kind.ULL: "unsigned long long", Kind.IN: "const void *",
            Kind.STRING: "const char *", Kind.BUFFER: "char *"}


CType: TypeAlias = "type[ctypes._SimpleCData[Any]] | type[ctypes.Structure]"
"""A C type as ctypes names it (`c_uint`, `c_void_p`, a struct class)."""


@dataclass(frozen=True)
class Param:
    kind: Kind
    ctype: CType | None = None
    """The C object behind a pointer (IN, OUT, INOUT, ARRAY elements)."""


def _v(kind: Kind) -> Param:
    return Param(kind)


def _p(kind: Kind, ctype: CType) -> Param:
    return Param(kind, ctype)


_H, _U = _v(Kind.HANDLE), _v(Kind.UINT)
_OUT_UINT, _OUT_INT = _p(Kind.OUT, ctypes.c_uint), _p(Kind.OUT, ctypes.c_int)
_OUT_HANDLE = _p(Kind.OUT, ctypes.c_void_p)
_TEXT = (_v(Kind.BUFFER), _U)

SIGNATURES: dict[str, tuple[Param, ...]] = {
    "nvmlInitWithFlags": (_U,),
    "nvmlShutdown": (),
    "nvmlSystemGetDriverVersion": _TEXT,
    "nvmlSystemGetNVMLVersion": _TEXT,
    "nvmlSystemGetCudaDriverVersion": (_OUT_INT,),
    "nvmlSystemGetCudaDriverVersion_v2": (_OUT_INT,),
    "nvmlDeviceGetCount_v2": (_OUT_UINT,),
    "nvmlDeviceGetHandleByIndex_v2": (_U, _OUT_HANDLE),
    "nvmlDeviceGetHandleByUUID": (_v(Kind.STRING), _OUT_HANDLE),
    "nvmlDeviceGetHandleByPciBusId_v2": (_v(Kind.STRING), _OUT_HANDLE),
    "nvmlDeviceGetIndex": (_H, _OUT_UINT),
    "nvmlDeviceGetUUID": (_H, *_TEXT),
    "nvmlDeviceGetName": (_H, *_TEXT),
    "nvmlDeviceGetSerial": (_H, *_TEXT),
    "nvmlDeviceGetBrand": (_H, _OUT_UINT),
    "nvmlDeviceGetMinorNumber": (_H, _OUT_UINT),
    "nvmlDeviceGetPciInfo_v3": (_H, _p(Kind.OUT, pynvml.nvmlPciInfo_t)),
    "nvmlDeviceGetMemoryInfo": (_H, _p(Kind.OUT, pynvml.c_nvmlMemory_t)),
    "nvmlDeviceGetMemoryInfo_v2": (_H, _p(Kind.INOUT, pynvml.c_nvmlMemory_v2_t)),
    "nvmlDeviceGetArchitecture": (_H, _OUT_UINT),
    "nvmlDeviceGetCudaComputeCapability": (_H, _OUT_INT, _OUT_INT),
    "nvmlDeviceGetNumaNodeId": (_H, _OUT_UINT),
    "nvmlDeviceGetAttributes_v2": (_H, _p(Kind.OUT, pynvml.c_nvmlDeviceAttributes)),
    "nvmlDeviceGetComputeMode": (_H, _OUT_UINT),
    "nvmlDeviceSetComputeMode": (_H, _U),
    "nvmlDeviceGetMigMode": (_H, _OUT_UINT, _OUT_UINT),
    "nvmlDeviceSetMigMode": (_H, _U, _OUT_INT),
    "nvmlDeviceGetGpuInstanceProfileInfo": (_H, _U, _p(Kind.OUT, pynvml.c_nvmlGpuInstanceProfileInfo_t)),
    "nvmlDeviceGetGpuInstanceProfileInfoV": (_H, _U, _p(Kind.INOUT, pynvml.c_nvmlGpuInstanceProfileInfo_v2_t)),
    "nvmlDeviceGetGpuInstanceProfileInfoByIdV": (_H, _U, _p(Kind.INOUT, pynvml.c_nvmlGpuInstanceProfileInfo_v2_t)),
    "nvmlDeviceGetGpuInstancePossiblePlacements_v2": (_H, _U, _p(Kind.ARRAY, pynvml.c_nvmlGpuInstancePlacement_t),
                                                      _OUT_UINT),
    "nvmlDeviceGetGpuInstanceRemainingCapacity": (_H, _U, _OUT_UINT),
    "nvmlDeviceCreateGpuInstance": (_H, _U, _OUT_HANDLE),
    "nvmlDeviceCreateGpuInstanceWithPlacement": (_H, _U, _p(Kind.IN, pynvml.c_nvmlGpuInstancePlacement_t),
                                                 _OUT_HANDLE),
    "nvmlDeviceGetGpuInstances": (_H, _U, _p(Kind.ARRAY, ctypes.c_void_p), _OUT_UINT),
    "nvmlDeviceGetGpuInstanceById": (_H, _U, _OUT_HANDLE),
    "nvmlGpuInstanceGetInfo": (_H, _p(Kind.OUT, pynvml.c_nvmlGpuInstanceInfo_t)),
    "nvmlGpuInstanceDestroy": (_H,),
    "nvmlGpuInstanceGetComputeInstanceProfileInfo": (_H, _U, _U,
                                                     _p(Kind.OUT, pynvml.c_nvmlComputeInstanceProfileInfo_t)),
    "nvmlGpuInstanceGetComputeInstanceProfileInfoV": (_H, _U, _U,
                                                      _p(Kind.INOUT, pynvml.c_nvmlComputeInstanceProfileInfo_v2_t)),
    "nvmlGpuInstanceGetComputeInstanceRemainingCapacity": (_H, _U, _OUT_UINT),
    "nvmlGpuInstanceGetComputeInstancePossiblePlacements": (
        _H, _U, _p(Kind.ARRAY, pynvml.c_nvmlComputeInstancePlacement_t), _OUT_UINT),
    "nvmlGpuInstanceCreateComputeInstance": (_H, _U, _OUT_HANDLE),
    "nvmlGpuInstanceGetComputeInstances": (_H, _U, _p(Kind.ARRAY, ctypes.c_void_p), _OUT_UINT),
    "nvmlGpuInstanceGetComputeInstanceById": (_H, _U, _OUT_HANDLE),
    "nvmlComputeInstanceGetInfo_v2": (_H, _p(Kind.OUT, pynvml.c_nvmlComputeInstanceInfo_t)),
    "nvmlComputeInstanceDestroy": (_H,),
    "nvmlDeviceIsMigDeviceHandle": (_H, _OUT_UINT),
    "nvmlDeviceGetGpuInstanceId": (_H, _OUT_UINT),
    "nvmlDeviceGetComputeInstanceId": (_H, _OUT_UINT),
    "nvmlDeviceGetMaxMigDeviceCount": (_H, _OUT_UINT),
    "nvmlDeviceGetMigDeviceHandleByIndex": (_H, _U, _OUT_HANDLE),
    "nvmlDeviceGetDeviceHandleFromMigDeviceHandle": (_H, _OUT_HANDLE),
    "nvmlEventSetCreate": (_OUT_HANDLE,),
    "nvmlDeviceGetSupportedEventTypes": (_H, _p(Kind.OUT, ctypes.c_ulonglong)),
    "nvmlDeviceRegisterEvents": (_H, _v(Kind.ULL), _H),
    "nvmlEventSetWait_v2": (_H, _p(Kind.OUT, pynvml.c_nvmlEventData_t), _U),
    "nvmlEventSetFree": (_H,),
}

SYMBOLS: tuple[str, ...] = tuple(sorted(SIGNATURES))
"""The entry points in the order their numbers follow."""

ERROR_STRINGS: dict[int, str] = {
    pynvml.NVML_SUCCESS: "Success",
    pynvml.NVML_ERROR_UNINITIALIZED: "Uninitialized",
    pynvml.NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    pynvml.NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    pynvml.NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    pynvml.NVML_ERROR_ALREADY_INITIALIZED: "Already Initialized",
    pynvml.NVML_ERROR_NOT_FOUND: "Not Found",
    pynvml.NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size",
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    pynvml.NVML_ERROR_TIMEOUT: "Timeout",
    pynvml.NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    pynvml.NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: "RM has detected an NVML/RM version mismatch",
    pynvml.NVML_ERROR_IN_USE: "In use by another client",
    pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES: "Insufficient resources",
    pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH: "Argument version mismatch",
    pynvml.NVML_ERROR_UNKNOWN: "Unknown Error",
}
"""What `nvmlErrorString` answers, which the library answers itself (it returns a pointer to static text)."""


def _digest() -> str:
    def describe(param: Param) -> str:
        ctype = param.ctype
        return f"{param.kind.name}:{ctype.__name__}:{ctypes.sizeof(ctype)}" if ctype else param.kind.name

    text = "\n".join(f"{name}({', '.join(describe(p) for p in SIGNATURES[name])})" for name in SYMBOLS)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


DIGEST = _digest()
