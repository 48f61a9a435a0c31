"""The compute-instance entry points of the simulated NVML: compute-instance profiles, capacity and placements
inside a GPU instance, creating, listing, looking up and destroying compute instances. The rules live in
`state`; GPU instances and MIG mode are in `mig`.
"""

from __future__ import annotations

from typing import Any

from simulator.nvml.marshal import (
    HandleKind,
    LibraryCore,
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
from simulator.nvml.state import (
    NvmlReturn,
    compute_instance_capacity,
    compute_placements,
    compute_profile,
    create_compute_instance,
)

__all__ = ["ComputeInstanceSymbols"]

_MIG, _GI, _CI = HandleKind.MIG_DEVICE, HandleKind.GPU_INSTANCE, HandleKind.COMPUTE_INSTANCE
_INVALID, _NOT_SUPPORTED = NvmlReturn.ERROR_INVALID_ARGUMENT, NvmlReturn.ERROR_NOT_SUPPORTED
_NOT_FOUND = NvmlReturn.ERROR_NOT_FOUND
_ENGINE_PROFILE_SHARED = 0  # NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED


class ComputeInstanceSymbols(LibraryCore):
    """Compute instances inside the GPU instances of MIG-enabled GPUs."""

    def _ci_profile_info(self, t: Target, index: Any, engines: Any, info: Any, versioned: bool) -> int:
        assert t.gi is not None
        if versioned:
            check_version(out(info), 2)
        if uint(engines) != _ENGINE_PROFILE_SHARED:
            return _NOT_SUPPORTED
        shape = compute_profile(t.gi, uint(index))
        p = t.gi.profile
        set_fields(
            out(info),
            id=shape.id,
            sliceCount=shape.slices,
            instanceCount=shape.instance_count,
            multiprocessorCount=shape.multiprocessors,
            sharedCopyEngineCount=p.copy_engines,
            sharedDecoderCount=p.decoders,
            sharedEncoderCount=p.encoders,
            sharedJpegCount=p.jpegs,
            sharedOfaCount=p.ofas,
            name=f"MIG {shape.name}".encode(),
        )
        return NvmlReturn.SUCCESS

    @on_handle(_GI)
    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, t: Target, index: Any, engines: Any, info: Any
    ) -> int:
        return self._ci_profile_info(t, index, engines, info, versioned=False)

    @on_handle(_GI)
    def nvmlGpuInstanceGetComputeInstanceProfileInfoV(
        self, t: Target, index: Any, engines: Any, info: Any
    ) -> int:
        return self._ci_profile_info(t, index, engines, info, versioned=True)

    @on_handle(_GI)
    def nvmlGpuInstanceGetComputeInstanceRemainingCapacity(
        self, t: Target, profile_id: Any, count: Any
    ) -> int:
        assert t.gi is not None
        out(count).value = compute_instance_capacity(t.gi, uint(profile_id))
        return NvmlReturn.SUCCESS

    @on_handle(_GI)
    def nvmlGpuInstanceGetComputeInstancePossiblePlacements(
        self, t: Target, profile_id: Any, placements: Any, count: Any
    ) -> int:
        assert t.gi is not None
        shape = compute_profile(t.gi, uint(profile_id))
        starts = compute_placements(t.gi, shape)
        out(count).value = len(starts)
        if placements is None:
            return NvmlReturn.SUCCESS
        if array_length(placements) < len(starts):
            return NvmlReturn.ERROR_INSUFFICIENT_SIZE
        array = out(placements)
        for i, start in enumerate(starts):
            array[i].start, array[i].size = start, shape.slices
        return NvmlReturn.SUCCESS

    @on_handle(_GI)
    def nvmlGpuInstanceCreateComputeInstance(self, t: Target, profile_id: Any, instance: Any) -> int:
        assert t.gi is not None
        ci = create_compute_instance(t.gi, uint(profile_id))
        store_handle(instance, token(_CI, t.index, t.gi.id, ci.id))
        self._state_changed()
        return NvmlReturn.SUCCESS

    @on_handle(_GI)
    def nvmlGpuInstanceGetComputeInstances(
        self, t: Target, profile_id: Any, instances: Any, count: Any
    ) -> int:
        assert t.gi is not None
        if instances is None:
            return _INVALID
        wanted = uint(profile_id)
        found = sorted(c.id for c in t.gi.compute_instances.values() if c.profile_id == wanted)
        out(count).value = len(found)
        if array_length(instances) < len(found):
            return NvmlReturn.ERROR_INSUFFICIENT_SIZE
        for i, ci_id in enumerate(found):
            store_handle_at(instances, i, token(_CI, t.index, t.gi.id, ci_id))
        return NvmlReturn.SUCCESS

    @on_handle(_GI)
    def nvmlGpuInstanceGetComputeInstanceById(self, t: Target, ci_id: Any, instance: Any) -> int:
        assert t.gi is not None
        if uint(ci_id) not in t.gi.compute_instances:
            return _NOT_FOUND
        store_handle(instance, token(_CI, t.index, t.gi.id, uint(ci_id)))
        return NvmlReturn.SUCCESS

    @on_handle(_CI)
    def nvmlComputeInstanceGetInfo_v2(self, t: Target, info: Any) -> int:
        assert t.gi is not None and t.ci is not None
        obj = out(info)
        store_pointer_field(obj, "device", token(_MIG, t.index, t.gi.id, t.ci.id))
        store_pointer_field(obj, "gpuInstance", token(_GI, t.index, t.gi.id))
        obj.id, obj.profileId = t.ci.id, t.ci.profile_id
        obj.placement.start, obj.placement.size = t.ci.start, t.ci.slices
        return NvmlReturn.SUCCESS

    @on_handle(_CI)
    def nvmlComputeInstanceDestroy(self, t: Target) -> int:
        assert t.gi is not None and t.ci is not None
        del t.gi.compute_instances[t.ci.id]
        self._state_changed()
        return NvmlReturn.SUCCESS
