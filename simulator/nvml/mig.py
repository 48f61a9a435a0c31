"""The MIG entry points of the simulated NVML: MIG mode, GPU instances and MIG device handles (compute instances
are in `compute_instances`).

Each method is named after the C symbol pynvml looks up and returns an NVML return code; the rules live in
`state`. Profile info, possible placements and the MIG device queries work whatever the MIG mode;
creating, listing or looking up GPU instances needs MIG enabled (NOT_SUPPORTED otherwise, which NVIDIA's
own code reads as "MIG disabled").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from simulator.node.catalog import MigProfile
from simulator.nvml.compute_instances import ComputeInstanceSymbols
from simulator.nvml.marshal import (
    HandleKind,
    Target,
    array_length,
    check_version,
    on_handle,
    out,
    set_fields,
    store_handle,
    store_handle_at,
    store_pointer_field,
    token,
    uint,
)
from simulator.nvml.persist import save_mig_state
from simulator.nvml.state import (
    GpuInstance,
    NvmlReturn,
    SimGpu,
    SimulatedNvmlError,
    create_gpu_instance,
    destroy_gpu_instance,
    gpu_instance_capacity,
    set_mig_mode,
)

__all__ = ["MAX_MIG_DEVICES", "MigSymbols"]

MAX_MIG_DEVICES = 7  # one MIG device per compute slice at most
_GPU, _MIG = HandleKind.GPU, HandleKind.MIG_DEVICE
_GI, _CI = HandleKind.GPU_INSTANCE, HandleKind.COMPUTE_INSTANCE
_INVALID, _NOT_SUPPORTED = NvmlReturn.ERROR_INVALID_ARGUMENT, NvmlReturn.ERROR_NOT_SUPPORTED
_NOT_FOUND = NvmlReturn.ERROR_NOT_FOUND
_ENGINE_PROFILE_SHARED = 0  # NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED


def _profile(gpu: SimGpu, profile_id: Any) -> MigProfile:
    """The GI profile a create/placement call names by id; INVALID_ARGUMENT for an id the GPU lacks."""
    if not gpu.mig_capable:
        raise SimulatedNvmlError(_NOT_SUPPORTED, f"{gpu.model.key} does not support MIG")
    profile = gpu.profile_by_id(uint(profile_id))
    if profile is None:
        raise SimulatedNvmlError(_INVALID, f"no GPU instance profile id {uint(profile_id)}")
    return profile


def _placement_start(placement: Any) -> int:
    """`start` of a placement passed by pointer, byref or as the struct itself."""
    start = getattr(out(placement), "start", None)
    if not isinstance(start, int):
        raise SimulatedNvmlError(_INVALID, f"not a placement: {placement!r}")
    return start


def _fill_gi_profile(info: Any, profile: MigProfile) -> None:
    set_fields(
        info,
        id=profile.id,
        isP2pSupported=0,
        sliceCount=profile.slices,
        instanceCount=profile.instances,
        multiprocessorCount=profile.multiprocessors,
        copyEngineCount=profile.copy_engines,
        decoderCount=profile.decoders,
        encoderCount=profile.encoders,
        jpegCount=profile.jpegs,
        ofaCount=profile.ofas,
        memorySizeMB=profile.memory_mib,
        name=f"MIG {profile.name}".encode(),
    )


class MigSymbols(ComputeInstanceSymbols):
    """MIG mode, GPU instances and MIG device handles (compute instances: `compute_instances`).

    With `state_file` set (a kept node), every change of MIG mode, instances or compute mode is saved there.
    """

    state_file: Path | None = None

    def _state_changed(self) -> None:
        if self.state_file is not None:
            save_mig_state(self._gpus, self.state_file)

    # -- handles -------------------------------------------------------------------------------------

    @staticmethod
    def _gi_token(t: Target, gi: GpuInstance) -> int:
        return token(_GI, t.index, gi.id)

    def _gpu_instance_of(self, t: Target, gi_id: int) -> GpuInstance:
        if not t.gpu.mig_capable or not t.gpu.mig_enabled:
            raise SimulatedNvmlError(_NOT_SUPPORTED, "MIG is not enabled")
        gi = t.gpu.gpu_instances.get(gi_id)
        if gi is None:
            raise SimulatedNvmlError(_NOT_FOUND, f"no GPU instance {gi_id}")
        return gi

    # -- MIG mode ------------------------------------------------------------------------------------

    @on_handle(_GPU)
    def nvmlDeviceGetMigMode(self, t: Target, current: Any, pending: Any) -> int:
        if not t.gpu.mig_capable:
            return _NOT_SUPPORTED
        out(current).value = int(t.gpu.mig_enabled)
        out(pending).value = int(t.gpu.mig_pending)
        return NvmlReturn.SUCCESS

    @on_handle(_GPU)
    def nvmlDeviceSetMigMode(self, t: Target, mode: Any, activation_status: Any) -> int:
        requested = uint(mode)
        if requested not in (0, 1):
            return _INVALID
        try:
            status = set_mig_mode(t.gpu, bool(requested))
        except SimulatedNvmlError as exc:
            if activation_status is not None:
                out(activation_status).value = exc.code
            raise
        out(activation_status).value = int(status)
        self._state_changed()
        return NvmlReturn.SUCCESS

    # -- GPU instance profiles and placements -------------------------------------------------------

    def _gi_profile_info(self, t: Target, index: Any, info: Any, versioned: bool) -> int:
        if versioned:
            check_version(out(info), 2)
        profile = t.gpu.profile_by_index(uint(index))
        if profile is None:
            return _NOT_SUPPORTED
        _fill_gi_profile(out(info), profile)
        return NvmlReturn.SUCCESS

    @on_handle(_GPU)
    def nvmlDeviceGetGpuInstanceProfileInfo(self, t: Target, index: Any, info: Any) -> int:
        return self._gi_profile_info(t, index, info, versioned=False)

    @on_handle(_GPU)
    def nvmlDeviceGetGpuInstanceProfileInfoV(self, t: Target, index: Any, info: Any) -> int:
        return self._gi_profile_info(t, index, info, versioned=True)

    @on_handle(_GPU)
    def nvmlDeviceGetGpuInstanceProfileInfoByIdV(self, t: Target, profile_id: Any, info: Any) -> int:
        check_version(out(info), 2)
        profile = t.gpu.profile_by_id(uint(profile_id))
        if profile is None:
            return _NOT_SUPPORTED
        _fill_gi_profile(out(info), profile)
        return NvmlReturn.SUCCESS

    @on_handle(_GPU)
    def nvmlDeviceGetGpuInstancePossiblePlacements_v2(
        self, t: Target, profile_id: Any, placements: Any, count: Any
    ) -> int:
        profile = _profile(t.gpu, profile_id)
        n = len(profile.starts)
        if placements is None:  # first call of the two-call pattern: the count only
            out(count).value = n
            return NvmlReturn.SUCCESS
        if array_length(placements) < n:
            out(count).value = n
            return NvmlReturn.ERROR_INSUFFICIENT_SIZE
        array = out(placements)
        for i, start in enumerate(profile.starts):
            array[i].start, array[i].size = start, profile.size
        out(count).value = n
        return NvmlReturn.SUCCESS

    @on_handle(_GPU)
    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, t: Target, profile_id: Any, count: Any) -> int:
        out(count).value = gpu_instance_capacity(t.gpu, _profile(t.gpu, profile_id))
        return NvmlReturn.SUCCESS

    # -- GPU instances -------------------------------------------------------------------------------

    @on_handle(_GPU)
    def nvmlDeviceCreateGpuInstance(self, t: Target, profile_id: Any, instance: Any) -> int:
        gi = create_gpu_instance(t.gpu, _profile(t.gpu, profile_id), None)
        store_handle(instance, self._gi_token(t, gi))
        self._state_changed()
        return NvmlReturn.SUCCESS

    @on_handle(_GPU)
    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self, t: Target, profile_id: Any, placement: Any, instance: Any
    ) -> int:
        profile = _profile(t.gpu, profile_id)
        gi = create_gpu_instance(t.gpu, profile, _placement_start(placement))
        store_handle(instance, self._gi_token(t, gi))
        self._state_changed()
        return NvmlReturn.SUCCESS

    @on_handle(_GPU)
    def nvmlDeviceGetGpuInstances(self, t: Target, profile_id: Any, instances: Any, count: Any) -> int:
        profile = _profile(t.gpu, profile_id)
        if not t.gpu.mig_enabled:
            return _NOT_SUPPORTED
        if instances is None:
            return _INVALID
        found = sorted(
            (g for g in t.gpu.gpu_instances.values() if g.profile.id == profile.id), key=lambda g: g.id
        )
        out(count).value = len(found)
        if array_length(instances) < len(found):
            return NvmlReturn.ERROR_INSUFFICIENT_SIZE
        for i, gi in enumerate(found):
            store_handle_at(instances, i, self._gi_token(t, gi))
        return NvmlReturn.SUCCESS

    @on_handle(_GPU)
    def nvmlDeviceGetGpuInstanceById(self, t: Target, gi_id: Any, instance: Any) -> int:
        gi = self._gpu_instance_of(t, uint(gi_id))
        store_handle(instance, self._gi_token(t, gi))
        return NvmlReturn.SUCCESS

    @on_handle(_GI)
    def nvmlGpuInstanceGetInfo(self, t: Target, info: Any) -> int:
        assert t.gi is not None
        obj = out(info)
        store_pointer_field(obj, "device", token(_GPU, t.index))
        obj.id, obj.profileId = t.gi.id, t.gi.profile.id
        obj.placement.start, obj.placement.size = t.gi.start, t.gi.profile.size
        return NvmlReturn.SUCCESS

    @on_handle(_GI)
    def nvmlGpuInstanceDestroy(self, t: Target) -> int:
        assert t.gi is not None
        destroy_gpu_instance(t.gpu, t.gi)
        self._state_changed()
        return NvmlReturn.SUCCESS

    # -- MIG device handles --------------------------------------------------------------------------

    @on_handle(_GPU, _MIG)
    def nvmlDeviceIsMigDeviceHandle(self, t: Target, is_mig: Any) -> int:
        out(is_mig).value = int(t.mig)
        return NvmlReturn.SUCCESS

    @on_handle(_GPU, _MIG)
    def nvmlDeviceGetGpuInstanceId(self, t: Target, gi_id: Any) -> int:
        if t.gi is None:
            return _NOT_SUPPORTED
        out(gi_id).value = t.gi.id
        return NvmlReturn.SUCCESS

    @on_handle(_GPU, _MIG)
    def nvmlDeviceGetComputeInstanceId(self, t: Target, ci_id: Any) -> int:
        if t.ci is None:
            return _NOT_SUPPORTED
        out(ci_id).value = t.ci.id
        return NvmlReturn.SUCCESS

    @on_handle(_GPU)
    def nvmlDeviceGetMaxMigDeviceCount(self, t: Target, count: Any) -> int:
        # nvml.h: zero when MIG is not supported or not enabled.
        out(count).value = MAX_MIG_DEVICES if t.gpu.mig_capable and t.gpu.mig_enabled else 0
        return NvmlReturn.SUCCESS

    @on_handle(_GPU)
    def nvmlDeviceGetMigDeviceHandleByIndex(self, t: Target, index: Any, device: Any) -> int:
        i = uint(index)
        if not t.gpu.mig_capable or i >= MAX_MIG_DEVICES:
            return _INVALID
        slots = t.gpu.mig_slots()
        if i >= len(slots):
            return _NOT_FOUND  # an empty slot
        gi, ci = slots[i]
        store_handle(device, token(_MIG, t.index, gi.id, ci.id))
        return NvmlReturn.SUCCESS

    @on_handle(_GPU, _MIG)
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, t: Target, device: Any) -> int:
        if not t.mig:
            return _INVALID
        store_handle(device, token(_GPU, t.index))
        return NvmlReturn.SUCCESS
