"""The NVIDIA backends' window onto NVML: the only module that imports pynvml.

NVML is loaded by its full path from the driver root (`use_driver_root`, `backends.nvidia.driver_root`), never by
name from the agent's own library path, which in a container is the image's. The library is process-wide, as
pynvml's is. It is looked for again whenever a session starts with none open, so a driver that appears or is
upgraded later (a driver container started after the agent, a new version's library) is taken up without a
restart: a library found at another path than the loaded one is loaded and the old one unloaded. (The same path
with a new file behind it is not noticed: drivers install each version under its own file name.)

Every function here blocks (NVML is a C library); callers run them in a worker thread. NVML errors become
`NvmlError` with the failing call named; a fault on one GPU is reported for that GPU and the others carry on.
"""

from __future__ import annotations

import _ctypes
import ctypes
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pynvml

from backends.contract import BackendError
from backends.nvidia.driver_root import Attempt, DriverRoot
from backends.topology import TopologyError, normalize_bus_id

__all__ = [
    "GpuInfo",
    "GpuProblem",
    "MigInfo",
    "NvmlError",
    "NvmlUnavailable",
    "SystemInfo",
    "list_gpus",
    "list_mig_devices",
    "loaded_library",
    "nvml_session",
    "system_info",
    "use_driver_root",
]

NVML_LIBRARY = "libnvidia-ml.so.1"

_T = TypeVar("_T")
_RETRY_PAUSES = (0.05, 0.2, 0.5)
"""Seconds before asking NVML again about a GPU whose queries failed (not lost): one in the middle of a change of
driver (handed back from vfio-pci) answers Invalid Argument for a moment, and a discovery that left it out would
not look at it again until the next hot-plug event."""

_ARCHITECTURES = {2: "Kepler", 3: "Maxwell", 4: "Pascal", 5: "Volta", 6: "Turing", 7: "Ampere",
                  8: "Ada Lovelace", 9: "Hopper", 10: "Blackwell", 13: "Rubin"}
_BRANDS = {1: "Quadro", 2: "Tesla", 3: "NVS", 5: "GeForce", 6: "Titan", 12: "Quadro RTX", 13: "NVIDIA RTX",
           14: "NVIDIA"}


class NvmlError(BackendError):
    """An NVML call failed; `code` is the NVML return code."""

    def __init__(self, call: str, error: pynvml.NVMLError) -> None:
        self.call = call
        self.code: int = error.value
        super().__init__(f"{call} failed: {error}")


class NvmlUnavailable(NvmlError):
    """NVML cannot be used on this host: its library is not in the driver root or does not load, or it does not
    start (driver not loaded). `tried` names every place looked at and what was there."""

    def __init__(self, call: str, reason: str, code: int, tried: tuple[Attempt, ...] = ()) -> None:
        self.call = call
        self.code = code
        self.reason = reason
        self.tried = tried
        places = "; ".join(str(a) for a in tried)
        BackendError.__init__(self, f"{reason}{f' (tried: {places})' if places else ''}")


@dataclass(frozen=True)
class SystemInfo:
    driver_version: str
    cuda_driver_version: int  # e.g. 13000 for CUDA 13.0


@dataclass(frozen=True)
class GpuInfo:
    """A full GPU as NVML describes it."""

    index: int
    uuid: str
    product_name: str
    brand: str
    architecture: str
    compute_capability: tuple[int, int]
    memory_bytes: int
    minor: int
    bus_id: str  # sysfs form, e.g. 0000:18:00.0
    mig_capable: bool
    mig_enabled: bool
    mig_pending: bool


@dataclass(frozen=True)
class MigInfo:
    """An existing MIG device (a compute instance inside a GPU instance)."""

    parent: GpuInfo
    uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    profile: str  # e.g. "1g.10gb", or "1c.2g.20gb" for a compute instance smaller than its GPU instance
    profile_id: int
    placement_start: int
    placement_size: int
    compute_start: int
    full_instance: bool  # the compute instance spans its whole GPU instance
    memory_bytes: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int


def _call(name: str, fn: Callable[..., _T], *args: Any) -> _T:
    try:
        return fn(*args)
    except pynvml.NVMLError as e:
        raise NvmlError(name, e) from None


class _Library:
    """Where NVML is looked for, and what is loaded: guarded by `lock`, which also makes a session's start (load
    if none is open, then nvmlInit) one step for concurrent sessions."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.root: DriverRoot | None = None
        self.path: Path | None = None
        self.handle: ctypes.CDLL | None = None


_library = _Library()


def use_driver_root(root: DriverRoot) -> None:
    """Look for NVML in `root` from the next session on."""
    with _library.lock:
        _library.root = root


def loaded_library() -> Path | None:
    """The NVML library file loaded now, if any."""
    with _library.lock:
        return _library.path


def _load() -> Path:
    """Make pynvml use the NVML library of the driver root, loading it unless it is loaded already (called with no
    session open, under the library lock); the file loaded."""
    root = _library.root
    if root is None:
        raise NvmlUnavailable("loading NVML", "no driver root to look for NVML in", pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    search = root.find_library(NVML_LIBRARY)
    failed: list[Attempt] = []
    for candidate in search.candidates:
        if candidate == _library.path and pynvml.nvmlLib is _library.handle:
            return candidate
        try:
            handle = ctypes.CDLL(str(candidate))
        except OSError as e:
            failed.append(Attempt(str(candidate), f"cannot be loaded: {e}"))
            continue
        old = _library.handle if pynvml.nvmlLib is _library.handle else None
        with pynvml.libLoadLock:
            pynvml.nvmlLib = handle
            pynvml._nvmlGetFunctionPointer_cache.clear()  # function pointers into the old library
        _library.path, _library.handle = candidate, handle
        if old is not None:
            _unload(old)
        return candidate
    raise NvmlUnavailable("loading NVML", f"no loadable {NVML_LIBRARY} in the driver root {root.root}",
                          pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, (*search.tried, *failed))


def _unload(handle: ctypes.CDLL) -> None:
    """Unload a library no session uses any more (its function pointers went with pynvml's cache)."""
    with suppress(OSError):
        _ctypes.dlclose(handle._handle)


@contextmanager
def nvml_session() -> Iterator[None]:
    """Initialise NVML for the duration of the block (pynvml reference-counts nested sessions). Starting the first
    session loads NVML from the driver root (see the module's description); NvmlUnavailable when it cannot."""
    with _library.lock:
        with pynvml.libLoadLock:
            idle = pynvml._nvmlLib_refcount == 0
        path = _load() if idle else _library.path
        try:
            pynvml.nvmlInit()
        except (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded) as e:
            raise NvmlUnavailable("nvmlInit", f"NVML did not start: nvmlInit failed: {e}", e.value,
                                  (Attempt(str(path), "loaded"),)) from None
        except pynvml.NVMLError as e:
            raise NvmlError("nvmlInit", e) from None
    try:
        yield
    finally:
        with suppress(pynvml.NVMLError):  # nothing useful to do: the session is over either way
            pynvml.nvmlShutdown()


def system_info() -> SystemInfo:
    return SystemInfo(
        driver_version=_call("nvmlSystemGetDriverVersion", pynvml.nvmlSystemGetDriverVersion),
        cuda_driver_version=_call("nvmlSystemGetCudaDriverVersion", pynvml.nvmlSystemGetCudaDriverVersion),
    )


@dataclass(frozen=True)
class GpuProblem:
    """A GPU that could not be described; `mig_enabled` is None when its MIG mode is unknown too."""

    index: int
    mig_enabled: bool | None
    message: str
    lost: bool = False  # NVML says the GPU is lost (fallen off the bus): it is still there, unusable until reset
    transient: bool = False  # an NVML error that asking again may not meet


def list_gpus() -> tuple[list[GpuInfo], list[GpuProblem]]:
    """Every GPU NVML sees; a GPU whose queries fail (again after `_RETRY_PAUSES`, unless it is lost or its
    topology unreadable) is left out and described in the returned problems."""
    count = _call("nvmlDeviceGetCount", pynvml.nvmlDeviceGetCount)
    gpus: list[GpuInfo] = []
    problems: list[GpuProblem] = []
    for index in range(count):
        found = _describe(index)
        for pause in _RETRY_PAUSES:
            if not isinstance(found, GpuProblem) or not found.transient:
                break
            time.sleep(pause)
            found = _describe(index)
        if isinstance(found, GpuProblem):
            problems.append(found)
        else:
            gpus.append(found)
    return gpus, problems


def _describe(index: int) -> GpuInfo | GpuProblem:
    mig_mode: list[bool] = []  # filled as soon as the MIG mode is known, so the owner reports the fault
    try:
        return _gpu(index, mig_mode)
    except (NvmlError, TopologyError) as e:
        lost = isinstance(e, NvmlError) and e.code == pynvml.NVML_ERROR_GPU_IS_LOST
        return GpuProblem(index, mig_mode[0] if mig_mode else None, f"GPU {index}: {e}; left out", lost,
                          transient=isinstance(e, NvmlError) and not lost)


def _gpu(index: int, mig_mode: list[bool]) -> GpuInfo:
    handle = _call("nvmlDeviceGetHandleByIndex", pynvml.nvmlDeviceGetHandleByIndex, index)
    try:
        current, pending = _call("nvmlDeviceGetMigMode", pynvml.nvmlDeviceGetMigMode, handle)
        capable = True
    except NvmlError as e:
        if e.code != pynvml.NVML_ERROR_NOT_SUPPORTED:
            raise
        capable, current, pending = False, 0, 0
    mig_mode.append(current == pynvml.NVML_DEVICE_MIG_ENABLE)
    pci = _call("nvmlDeviceGetPciInfo", pynvml.nvmlDeviceGetPciInfo, handle)
    bus_id = normalize_bus_id(pci.busId.decode() if isinstance(pci.busId, bytes) else str(pci.busId))
    major, minor = _call("nvmlDeviceGetCudaComputeCapability", pynvml.nvmlDeviceGetCudaComputeCapability, handle)
    arch = _call("nvmlDeviceGetArchitecture", pynvml.nvmlDeviceGetArchitecture, handle)
    brand = _call("nvmlDeviceGetBrand", pynvml.nvmlDeviceGetBrand, handle)
    return GpuInfo(
        index=index,
        uuid=_call("nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID, handle),
        product_name=_call("nvmlDeviceGetName", pynvml.nvmlDeviceGetName, handle),
        brand=_BRANDS.get(brand, "Unknown"),
        architecture=_ARCHITECTURES.get(arch, "Unknown"),
        compute_capability=(major, minor),
        memory_bytes=_call("nvmlDeviceGetMemoryInfo", pynvml.nvmlDeviceGetMemoryInfo, handle).total,
        minor=_call("nvmlDeviceGetMinorNumber", pynvml.nvmlDeviceGetMinorNumber, handle),
        bus_id=bus_id,
        mig_capable=capable,
        mig_enabled=current == pynvml.NVML_DEVICE_MIG_ENABLE,
        mig_pending=pending != current,
    )


def _profile_names(handle: Any) -> dict[int, str]:
    """GPU-instance profile id → name (e.g. 19 → '1g.10gb') for one GPU."""
    names: dict[int, str] = {}
    for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, index)
        except pynvml.NVMLError:
            continue  # profile index not offered by this GPU
        raw = info.name.decode() if isinstance(info.name, bytes) else str(info.name)
        names[info.id] = raw.removeprefix("MIG ").strip()
    return names


def list_mig_devices(parent: GpuInfo) -> list[MigInfo]:
    """The MIG devices that exist on a MIG-enabled GPU."""
    handle = _call("nvmlDeviceGetHandleByIndex", pynvml.nvmlDeviceGetHandleByIndex, parent.index)
    names = _profile_names(handle)
    slots = _call("nvmlDeviceGetMaxMigDeviceCount", pynvml.nvmlDeviceGetMaxMigDeviceCount, handle)
    devices: list[MigInfo] = []
    for slot in range(slots):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except pynvml.NVMLError_NotFound:
            continue  # an empty slot
        except pynvml.NVMLError as e:
            raise NvmlError("nvmlDeviceGetMigDeviceHandleByIndex", e) from None
        devices.append(_mig(parent, handle, mig, names))
    return devices


def _mig(parent: GpuInfo, handle: Any, mig: Any, names: dict[int, str]) -> MigInfo:
    gi_id = _call("nvmlDeviceGetGpuInstanceId", pynvml.nvmlDeviceGetGpuInstanceId, mig)
    ci_id = _call("nvmlDeviceGetComputeInstanceId", pynvml.nvmlDeviceGetComputeInstanceId, mig)
    gi = _call("nvmlDeviceGetGpuInstanceById", pynvml.nvmlDeviceGetGpuInstanceById, handle, gi_id)
    gi_info = _call("nvmlGpuInstanceGetInfo", pynvml.nvmlGpuInstanceGetInfo, gi)
    ci = _call("nvmlGpuInstanceGetComputeInstanceById", pynvml.nvmlGpuInstanceGetComputeInstanceById, gi, ci_id)
    ci_info = _call("nvmlComputeInstanceGetInfo", pynvml.nvmlComputeInstanceGetInfo, ci)
    attrs = _call("nvmlDeviceGetAttributes", pynvml.nvmlDeviceGetAttributes, mig)
    full = attrs.computeInstanceSliceCount == attrs.gpuInstanceSliceCount
    profile = names.get(gi_info.profileId, f"profile-{gi_info.profileId}")
    if not full:
        profile = f"{attrs.computeInstanceSliceCount}c.{profile}"
    return MigInfo(
        parent=parent,
        uuid=_call("nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID, mig),
        gpu_instance_id=gi_id,
        compute_instance_id=ci_id,
        profile=profile,
        profile_id=gi_info.profileId,
        placement_start=gi_info.placement.start,
        placement_size=gi_info.placement.size,
        compute_start=ci_info.placement.start,
        full_instance=full,
        memory_bytes=_call("nvmlDeviceGetMemoryInfo", pynvml.nvmlDeviceGetMemoryInfo, mig).total,
        multiprocessors=attrs.multiprocessorCount,
        copy_engines=attrs.sharedCopyEngineCount,
        decoders=attrs.sharedDecoderCount,
        encoders=attrs.sharedEncoderCount,
        jpeg_engines=attrs.sharedJpegCount,
        ofa_engines=attrs.sharedOfaCount,
    )
