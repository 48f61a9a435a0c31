"""State and rules of the simulated NVIDIA GPUs: return codes, MIG mode, GPU and compute instances.

Pure Python (no ctypes): the NVML entry points in `api`, `identity`, `mig`, `compute_instances` and `compute`
translate calls into these operations, which raise `SimulatedNvmlError` carrying the NVML return code a real
driver would give.
MIG rules follow reference/mechanics.md §2.2/§3: placements on the 8-wide memory-slice axis, overlap or an
exhausted instance count → INSUFFICIENT_RESOURCES, a start the profile does not allow → INVALID_ARGUMENT.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple

from simulator.node.catalog import GpuModel, MigProfile

__all__ = [
    "ComputeInstance",
    "ComputeProfile",
    "GpuInstance",
    "MigInstanceView",
    "NvmlReturn",
    "SimGpu",
    "SimulatedNvmlError",
    "compute_instance_capacity",
    "compute_placements",
    "compute_profile",
    "create_compute_instance",
    "create_gpu_instance",
    "destroy_gpu_instance",
    "gpu_instance_capacity",
    "mig_uuid",
    "parse_bus_id",
    "set_mig_mode",
]

_ARCH_HOPPER = 9  # NVML_DEVICE_ARCH_HOPPER: first architecture that toggles MIG without a GPU reset
_MIG_NAMESPACE = uuid.UUID("0b7f3f64-6c55-4d0c-8a55-2f0c1c7e9a31")


class NvmlReturn(IntEnum):
    """The nvmlReturn_t codes the simulation produces (values as in nvml.h)."""

    SUCCESS = 0
    ERROR_UNINITIALIZED = 1
    ERROR_INVALID_ARGUMENT = 2
    ERROR_NOT_SUPPORTED = 3
    ERROR_NO_PERMISSION = 4
    ERROR_ALREADY_INITIALIZED = 5
    ERROR_NOT_FOUND = 6
    ERROR_INSUFFICIENT_SIZE = 7
    ERROR_DRIVER_NOT_LOADED = 9
    ERROR_TIMEOUT = 10
    ERROR_GPU_IS_LOST = 15
    ERROR_RESET_REQUIRED = 16
    ERROR_LIB_RM_VERSION_MISMATCH = 18
    ERROR_IN_USE = 19
    ERROR_INSUFFICIENT_RESOURCES = 23
    ERROR_ARGUMENT_VERSION_MISMATCH = 25
    ERROR_UNKNOWN = 999


class SimulatedNvmlError(RuntimeError):
    """An operation on the simulated GPUs failed with NVML return code `code`."""

    def __init__(self, code: int, detail: str = "") -> None:
        self.code = int(code)
        try:
            name = NvmlReturn(code).name
        except ValueError:
            name = f"NVML error {code}"
        super().__init__(f"{name}: {detail}" if detail else name)


def _fail(code: NvmlReturn, detail: str = "") -> SimulatedNvmlError:
    return SimulatedNvmlError(code, detail)


def parse_bus_id(text: str) -> tuple[int, int, int, int]:
    """(domain, bus, device, function) from 'dddd:bb:dd.f', 'dddddddd:bb:dd.f' or 'bb:dd.f' (any case)."""
    parts = text.strip().split(":")
    if len(parts) == 2:
        parts.insert(0, "0")
    if len(parts) != 3 or "." not in parts[2]:
        raise ValueError(f"not a PCI bus id: {text!r}")
    dev, fn = parts[2].split(".", 1)
    return int(parts[0], 16), int(parts[1], 16), int(dev, 16), int(fn, 16)


def mig_uuid(parent_uuid: str, gi: int, ci: int) -> str:
    """The MIG device UUID of compute instance `ci` in GPU instance `gi`: stable for the same triple."""
    return f"MIG-{uuid.uuid5(_MIG_NAMESPACE, f'{parent_uuid}/{gi}/{ci}')}"


@dataclass(eq=False)
class ComputeInstance:
    """A compute instance: its id inside the GPU instance, CI profile id and compute-slice placement."""

    id: int
    profile_id: int  # NVML_COMPUTE_INSTANCE_PROFILE_* (the CI profile id equals its index)
    slices: int
    start: int  # first compute slice inside the GPU instance


@dataclass(eq=False)
class GpuInstance:
    """A GPU instance: its id, GI profile, placement on the memory-slice axis and compute instances."""

    id: int
    profile: MigProfile
    start: int
    compute_instances: dict[int, ComputeInstance] = field(default_factory=dict)

    @property
    def memory_slices(self) -> range:
        return range(self.start, self.start + self.profile.size)


@dataclass(eq=False)
class SimGpu:
    """One simulated physical GPU and its mutable state.

    `bus_id` is the sysfs form ('0000:18:00.0'); `uuid` the 'GPU-…' string. `faults` maps an NVML C symbol
    (e.g. "nvmlDeviceGetMemoryInfo") to the return code every call of that symbol gets for this GPU or any
    of its MIG devices. `mig_enabled` is the current MIG mode; `mig_pending` the mode after the next reset.
    `busy` (processes running) makes a MIG mode change fail with IN_USE; `lost` (fell off the bus) makes
    every call on the GPU return GPU_IS_LOST. `compute_mode` is the NVML compute mode (NVML_COMPUTEMODE_*).
    """

    model: GpuModel
    bus_id: str
    uuid: str
    minor: int
    numa_node: int = -1
    serial: str = ""
    mig_enabled: bool = False
    faults: dict[str, int] = field(default_factory=dict)
    mig_pending: bool = field(init=False)
    busy: bool = field(default=False, init=False)
    lost: bool = field(default=False, init=False)
    compute_mode: int = field(default=0, init=False)
    gpu_instances: dict[int, GpuInstance] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        parse_bus_id(self.bus_id)  # reject malformed ids early
        if self.mig_enabled and not self.mig_capable:
            raise ValueError(f"{self.model.key} does not support MIG")
        self.mig_pending = self.mig_enabled

    @property
    def mig_capable(self) -> bool:
        return bool(self.model.mig_profiles)

    @property
    def compute_slices(self) -> int:
        """Compute slices of the whole GPU (the largest profile's 'g')."""
        return max((p.slices for p in self.model.mig_profiles), default=0)

    def profile_by_id(self, profile_id: int) -> MigProfile | None:
        return next((p for p in self.model.mig_profiles if p.id == profile_id), None)

    def profile_by_index(self, index: int) -> MigProfile | None:
        return next((p for p in self.model.mig_profiles if p.index == index), None)

    def mig_slots(self) -> list[tuple[GpuInstance, ComputeInstance]]:
        """Existing compute instances in (GI id, CI id) order: the MIG device slots."""
        return [
            (gi, gi.compute_instances[ci])
            for gi in sorted(self.gpu_instances.values(), key=lambda g: g.id)
            for ci in sorted(gi.compute_instances)
        ]


class MigInstanceView(NamedTuple):
    """A read-only view of one GPU instance for assertions."""

    profile: str
    start: int
    gi: int
    cis: tuple[int, ...]


class ComputeProfile(NamedTuple):
    """A compute-instance profile as offered inside one GPU instance."""

    id: int
    slices: int
    instance_count: int
    multiprocessors: int
    name: str


# CI profile index → compute slices, and which CI sizes each GI size offers (mechanics.md §3:
# 7g {1,2,3,4,7}, 4g {1,2,4}, 3g {1,2,3}, 2g {1,2}, 1g {1}).
_CI_SLICES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7}
_CI_SIZES_BY_GI = {1: (1,), 2: (1, 2), 3: (1, 2, 3), 4: (1, 2, 4), 7: (1, 2, 3, 4, 7)}


def compute_profile(gi: GpuInstance, index: int) -> ComputeProfile:
    """CI profile `index` inside `gi`; NOT_SUPPORTED when the GI does not offer that size."""
    slices = _CI_SLICES.get(index)
    if slices is None or slices not in _CI_SIZES_BY_GI.get(gi.profile.slices, ()):
        raise _fail(NvmlReturn.ERROR_NOT_SUPPORTED, f"CI profile {index} in a {gi.profile.name} instance")
    gslices = gi.profile.slices
    name = gi.profile.name if slices == gslices else f"{slices}c.{gi.profile.name}"
    sms = gi.profile.multiprocessors * slices // gslices
    return ComputeProfile(index, slices, gslices // slices, sms, name)


def _aligned_starts(size: int, width: int) -> list[int]:
    # CI placements are aligned to the next power of two of their size (so a 3c fits at 0 or 4 of a 7g).
    step = 1 << (size - 1).bit_length()
    return [s for s in range(0, width - size + 1, step)]


def compute_placements(gi: GpuInstance, profile: ComputeProfile) -> list[int]:
    """Every compute-slice start a CI of `profile` may take inside `gi`, occupied or not."""
    return _aligned_starts(profile.slices, gi.profile.slices)


def _free_gi_starts(profile: MigProfile, occupied: set[int]) -> list[int]:
    return [s for s in profile.starts if occupied.isdisjoint(range(s, s + profile.size))]


def _check_gi_room(gpu: SimGpu, profile: MigProfile) -> set[int]:
    """Occupied memory slices, after checking the profile's instance count and the compute-slice budget."""
    existing = list(gpu.gpu_instances.values())
    if sum(1 for g in existing if g.profile.id == profile.id) >= profile.instances:
        raise _fail(NvmlReturn.ERROR_INSUFFICIENT_RESOURCES, f"all {profile.name} instances in use")
    if sum(g.profile.slices for g in existing) + profile.slices > gpu.compute_slices:
        raise _fail(NvmlReturn.ERROR_INSUFFICIENT_RESOURCES, "no free compute slices")
    return {s for g in existing for s in g.memory_slices}


def _require_mig_on(gpu: SimGpu) -> None:
    # NVIDIA's own driver code reads NOT_SUPPORTED from GPU-instance calls as "MIG is disabled".
    if not gpu.mig_capable or not gpu.mig_enabled:
        raise _fail(NvmlReturn.ERROR_NOT_SUPPORTED, "MIG is not enabled")


def create_gpu_instance(gpu: SimGpu, profile: MigProfile, start: int | None) -> GpuInstance:
    """Create a GPU instance at `start` (or the first free allowed placement when None)."""
    _require_mig_on(gpu)
    if start is not None and start not in profile.starts:
        raise _fail(NvmlReturn.ERROR_INVALID_ARGUMENT, f"{profile.name} cannot start at {start}")
    occupied = _check_gi_room(gpu, profile)
    free = _free_gi_starts(profile, occupied)
    if start is not None:
        free = [start] if start in free else []
    if not free:
        raise _fail(NvmlReturn.ERROR_INSUFFICIENT_RESOURCES, f"no free placement for {profile.name}")
    gi_id = next(i for i in range(1, 1 << 16) if i not in gpu.gpu_instances)
    gi = GpuInstance(gi_id, profile, free[0])
    gpu.gpu_instances[gi_id] = gi
    return gi


def gpu_instance_capacity(gpu: SimGpu, profile: MigProfile) -> int:
    """How many more instances of `profile` fit next to the existing ones."""
    _require_mig_on(gpu)
    existing = list(gpu.gpu_instances.values())
    left = profile.instances - sum(1 for g in existing if g.profile.id == profile.id)
    slices_left = gpu.compute_slices - sum(g.profile.slices for g in existing)
    occupied = {s for g in existing for s in g.memory_slices}
    count = 0
    # Leftmost-first packing is optimal for same-size placements on a line.
    for s in profile.starts:
        span = range(s, s + profile.size)
        if count < left and (count + 1) * profile.slices <= slices_left and occupied.isdisjoint(span):
            occupied.update(span)
            count += 1
    return count


def destroy_gpu_instance(gpu: SimGpu, gi: GpuInstance) -> None:
    """Destroy `gi`; IN_USE while it still holds compute instances."""
    if gi.compute_instances:
        raise _fail(NvmlReturn.ERROR_IN_USE, f"GPU instance {gi.id} still has compute instances")
    del gpu.gpu_instances[gi.id]


def _ci_room(gi: GpuInstance, profile: ComputeProfile) -> tuple[int, set[int]]:
    used = {s for c in gi.compute_instances.values() for s in range(c.start, c.start + c.slices)}
    same = sum(1 for c in gi.compute_instances.values() if c.profile_id == profile.id)
    left = profile.instance_count - same
    return left, used


def create_compute_instance(gi: GpuInstance, index: int) -> ComputeInstance:
    """Create a compute instance of CI profile `index` inside `gi` at the first free compute slices."""
    profile = compute_profile(gi, index)
    left, used = _ci_room(gi, profile)
    free = [s for s in compute_placements(gi, profile) if used.isdisjoint(range(s, s + profile.slices))]
    if left <= 0 or not free:
        raise _fail(NvmlReturn.ERROR_INSUFFICIENT_RESOURCES, f"no room for CI profile {index} in GI {gi.id}")
    ci_id = next(i for i in range(1 << 16) if i not in gi.compute_instances)
    ci = ComputeInstance(ci_id, profile.id, profile.slices, free[0])
    gi.compute_instances[ci_id] = ci
    return ci


def compute_instance_capacity(gi: GpuInstance, index: int) -> int:
    """How many more compute instances of CI profile `index` fit in `gi`."""
    profile = compute_profile(gi, index)
    left, used = _ci_room(gi, profile)
    count = 0
    for s in compute_placements(gi, profile):
        span = range(s, s + profile.slices)
        if count < left and used.isdisjoint(span):
            used.update(span)
            count += 1
    return count


def set_mig_mode(gpu: SimGpu, enable: bool) -> NvmlReturn:
    """Request MIG mode `enable`; returns the activation status.

    Hopper and newer apply the change at once (status SUCCESS). Older architectures only record the pending
    mode and report RESET_REQUIRED until the GPU is reset. A busy GPU, or disabling while GPU instances
    exist, fails with IN_USE.
    """
    if not gpu.mig_capable:
        raise _fail(NvmlReturn.ERROR_NOT_SUPPORTED, f"{gpu.model.key} does not support MIG")
    if gpu.mig_enabled == enable and gpu.mig_pending == enable:
        return NvmlReturn.SUCCESS
    if gpu.busy:
        raise _fail(NvmlReturn.ERROR_IN_USE, "processes are running on the GPU")
    if not enable and gpu.gpu_instances:
        raise _fail(NvmlReturn.ERROR_IN_USE, "GPU instances still exist")
    gpu.mig_pending = enable
    if gpu.model.architecture >= _ARCH_HOPPER:
        gpu.mig_enabled = enable
    return NvmlReturn.SUCCESS if gpu.mig_enabled == enable else NvmlReturn.ERROR_RESET_REQUIRED
