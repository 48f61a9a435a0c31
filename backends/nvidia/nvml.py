"""The NVIDIA backends' window onto NVML: the only module that imports pynvml.

Every function here blocks (NVML is a C library); callers run them in a worker thread. NVML errors become
`NvmlError` with the failing call named; a fault on one GPU is reported for that GPU and the others carry on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, TypeVar

import pynvml

from backends.contract import BackendError
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
    "nvml_session",
    "system_info",
]

_T = TypeVar("_T")

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
    """There is no usable NVIDIA driver on this host (library missing, driver not loaded)."""


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


@contextmanager
def nvml_session() -> Iterator[None]:
    """Initialise NVML for the duration of the block (pynvml reference-counts nested sessions)."""
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded) as e:
        raise NvmlUnavailable("nvmlInit", e) from None
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


def list_gpus() -> tuple[list[GpuInfo], list[GpuProblem]]:
    """Every GPU NVML sees; a GPU whose queries fail is left out and described in the returned problems."""
    count = _call("nvmlDeviceGetCount", pynvml.nvmlDeviceGetCount)
    gpus: list[GpuInfo] = []
    problems: list[GpuProblem] = []
    for index in range(count):
        mig_mode: list[bool] = []  # filled as soon as the MIG mode is known, so the owner reports the fault
        try:
            gpus.append(_gpu(index, mig_mode))
        except (NvmlError, TopologyError) as e:
            lost = isinstance(e, NvmlError) and e.code == pynvml.NVML_ERROR_GPU_IS_LOST
            problems.append(GpuProblem(index, mig_mode[0] if mig_mode else None, f"GPU {index}: {e}; left out", lost))
    return gpus, problems


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
