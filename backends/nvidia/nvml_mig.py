"""NVML calls for dynamic MIG: a GPU's GPU-instance profiles and placements, creating a MIG device at an exact
placement, and destroying it. Blocking, like everything that calls NVML: run in a worker thread.

The create flow follows NVML's own: the GPU instance at the placement, then one compute instance as large as it
(engine profile SHARED), which is the MIG device; destroy goes compute instance first, then GPU instance.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import pynvml

from backends.nvidia.mig_layout import GiProfile
from backends.nvidia.nvml import NvmlError, _call

__all__ = [
    "INSUFFICIENT_RESOURCES",
    "CreatedMig",
    "create_compute_instance",
    "create_gpu_instance",
    "destroy_mig",
    "existing_compute_instance",
    "find_gpu_instance",
    "gpu_instance_profiles",
    "mig_instance_exists",
]

INSUFFICIENT_RESOURCES = pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
"""What creating a GPU instance says when its placement overlaps one that exists."""

# A compute instance as large as its GPU instance, by the GPU instance's compute slices.
_FULL_CI_PROFILE = {1: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, 2: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE,
                    3: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, 4: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE,
                    6: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE, 7: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE,
                    8: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE}


@dataclass(frozen=True)
class CreatedMig:
    """A MIG device made for a claim: its GPU and compute instance ids and its UUID."""

    gpu_instance_id: int
    compute_instance_id: int
    uuid: str


def _handle(bus_id: str) -> Any:
    return _call("nvmlDeviceGetHandleByPciBusId", pynvml.nvmlDeviceGetHandleByPciBusId, bus_id)


def gpu_instance_profiles(bus_id: str) -> list[GiProfile]:
    """Every GPU-instance profile the GPU offers, with its possible placements (also while instances exist)."""
    handle = _handle(bus_id)
    profiles: list[GiProfile] = []
    for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, index)
        except pynvml.NVMLError:
            continue  # profile index not offered by this GPU
        name = info.name.decode() if isinstance(info.name, bytes) else str(info.name)
        starts = _placements(handle, info.id)
        if not starts:
            continue
        profiles.append(GiProfile(
            id=info.id, name=name.removeprefix("MIG ").strip(), slices=info.sliceCount, size=starts[0][1],
            instances=info.instanceCount, multiprocessors=info.multiprocessorCount, copy_engines=info.copyEngineCount,
            decoders=info.decoderCount, encoders=info.encoderCount, jpeg_engines=info.jpegCount,
            ofa_engines=info.ofaCount, memory_bytes=info.memorySizeMB << 20, starts=tuple(s for s, _ in starts),
        ))
    return profiles


def _placements(handle: Any, profile_id: int) -> list[tuple[int, int]]:
    count = ctypes.c_uint(0)
    _call("nvmlDeviceGetGpuInstancePossiblePlacements", pynvml.nvmlDeviceGetGpuInstancePossiblePlacements, handle,
          profile_id, None, ctypes.byref(count))
    array = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
    _call("nvmlDeviceGetGpuInstancePossiblePlacements", pynvml.nvmlDeviceGetGpuInstancePossiblePlacements, handle,
          profile_id, array, ctypes.byref(count))
    return [(p.start, p.size) for p in array[: count.value]]


def create_gpu_instance(bus_id: str, profile_id: int, start: int, size: int) -> int:
    """Create the GPU instance at exactly this placement; its id. NVML says INSUFFICIENT_RESOURCES when the
    placement overlaps an instance that exists."""
    placement = pynvml.c_nvmlGpuInstancePlacement_t(start, size)
    gi = _call("nvmlDeviceCreateGpuInstanceWithPlacement", pynvml.nvmlDeviceCreateGpuInstanceWithPlacement,
               _handle(bus_id), profile_id, ctypes.byref(placement))
    info = _call("nvmlGpuInstanceGetInfo", pynvml.nvmlGpuInstanceGetInfo, gi)
    gi_id: int = info.id
    return gi_id


def create_compute_instance(bus_id: str, gpu_instance_id: int, slices: int) -> CreatedMig:
    """The compute instance as large as the GPU instance, and the MIG device it makes."""
    handle = _handle(bus_id)
    gi = _call("nvmlDeviceGetGpuInstanceById", pynvml.nvmlDeviceGetGpuInstanceById, handle, gpu_instance_id)
    profile = _call("nvmlGpuInstanceGetComputeInstanceProfileInfo", pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo,
                    gi, _FULL_CI_PROFILE[slices], pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
    ci = _call("nvmlGpuInstanceCreateComputeInstance", pynvml.nvmlGpuInstanceCreateComputeInstance, gi, profile.id)
    info = _call("nvmlComputeInstanceGetInfo", pynvml.nvmlComputeInstanceGetInfo, ci)
    uuid = _call("nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID, info.device)
    return CreatedMig(gpu_instance_id, info.id, uuid)


def destroy_mig(bus_id: str, gpu_instance_id: int) -> bool:
    """Destroy the GPU instance and every compute instance in it; False when it does not exist (any more)."""
    handle = _handle(bus_id)
    try:
        gi = pynvml.nvmlDeviceGetGpuInstanceById(handle, gpu_instance_id)
    except (pynvml.NVMLError_NotFound, pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
        return False  # gone, or MIG is off: nothing to destroy
    except pynvml.NVMLError as e:
        raise NvmlError("nvmlDeviceGetGpuInstanceById", e) from None
    for profile in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        for ci in _compute_instances(gi, profile):
            _call("nvmlComputeInstanceDestroy", pynvml.nvmlComputeInstanceDestroy, ci)
    _call("nvmlGpuInstanceDestroy", pynvml.nvmlGpuInstanceDestroy, gi)
    return True


def _compute_instances(gi: Any, profile_id: int) -> list[Any]:
    array = (pynvml.c_nvmlComputeInstance_t * 8)()
    count = ctypes.c_uint(0)
    try:
        pynvml.nvmlGpuInstanceGetComputeInstances(gi, profile_id, array, ctypes.byref(count))
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument, pynvml.NVMLError_NotFound):
        return []  # a compute profile this GPU instance does not offer
    except pynvml.NVMLError as e:
        raise NvmlError("nvmlGpuInstanceGetComputeInstances", e) from None
    return list(array[: count.value])


def find_gpu_instance(bus_id: str, profile_id: int, start: int) -> int | None:
    """The id of the GPU instance of this profile at this start, if there is one."""
    handle = _handle(bus_id)
    array = (pynvml.c_nvmlGpuInstance_t * 8)()
    count = ctypes.c_uint(0)
    try:
        pynvml.nvmlDeviceGetGpuInstances(handle, profile_id, array, ctypes.byref(count))
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
        return None  # MIG is off, or the GPU lacks the profile: no such instance
    except pynvml.NVMLError as e:
        raise NvmlError("nvmlDeviceGetGpuInstances", e) from None
    for gi in array[: count.value]:
        info = _call("nvmlGpuInstanceGetInfo", pynvml.nvmlGpuInstanceGetInfo, gi)
        if info.placement.start == start:
            found: int = info.id
            return found
    return None


def existing_compute_instance(bus_id: str, gpu_instance_id: int) -> CreatedMig | None:
    """The compute instance a GPU instance holds already (the one made for it), if any."""
    gi = _call("nvmlDeviceGetGpuInstanceById", pynvml.nvmlDeviceGetGpuInstanceById, _handle(bus_id), gpu_instance_id)
    for profile in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        for ci in _compute_instances(gi, profile):
            info = _call("nvmlComputeInstanceGetInfo", pynvml.nvmlComputeInstanceGetInfo, ci)
            uuid = _call("nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID, info.device)
            return CreatedMig(gpu_instance_id, info.id, uuid)
    return None


def mig_instance_exists(bus_id: str, gpu_instance_id: int, profile_id: int, start: int) -> bool:
    """Whether the GPU instance with this id exists and is the one recorded (same profile and start)."""
    try:
        gi = pynvml.nvmlDeviceGetGpuInstanceById(_handle(bus_id), gpu_instance_id)
        info = pynvml.nvmlGpuInstanceGetInfo(gi)
    except pynvml.NVMLError:
        return False
    return bool(info.profileId == profile_id and info.placement.start == start)
