"""The device-identity entry points of the simulated NVML: index, UUID, name, brand, serial, minor number, PCI
info, memory, architecture, compute capability, NUMA node and attributes, of physical GPUs and (where NVML
answers for them too) of MIG devices. The library (`api.SimulatedNvml`) decides which GPUs are listed.
"""

from __future__ import annotations

from typing import Any

from simulator.node.catalog import MigProfile
from simulator.nvml.marshal import (
    HandleKind,
    LibraryCore,
    Target,
    check_version,
    on_handle,
    out,
    set_fields,
    set_string,
)
from simulator.nvml.state import NvmlReturn, mig_uuid, parse_bus_id

__all__ = ["IdentitySymbols"]

_MIB = 1 << 20
_NVIDIA = 0x10DE
_GPU, _MIG = HandleKind.GPU, HandleKind.MIG_DEVICE


class IdentitySymbols(LibraryCore):
    """What a GPU or MIG device says about itself."""

    def _listed(self) -> list[int]:
        """Positions of the GPUs NVML lists now (the library's rule)."""
        raise NotImplementedError

    @on_handle(_GPU)
    def nvmlDeviceGetIndex(self, t: Target, index: Any) -> int:
        listed = self._listed()
        if t.index not in listed:
            return NvmlReturn.ERROR_NOT_FOUND  # a handle from before the GPU left the nvidia driver
        out(index).value = listed.index(t.index)
        return NvmlReturn.SUCCESS

    @on_handle(_GPU, _MIG)
    def nvmlDeviceGetUUID(self, t: Target, buffer: Any, length: Any) -> int:
        text = mig_uuid(t.gpu.uuid, t.gi.id, t.ci.id) if t.gi and t.ci else t.gpu.uuid
        set_string(buffer, length, text)
        return NvmlReturn.SUCCESS

    @on_handle(_GPU, _MIG)
    def nvmlDeviceGetName(self, t: Target, buffer: Any, length: Any) -> int:
        name = t.gpu.model.product_name
        if t.gi and t.ci:
            gslices = t.gi.profile.slices
            part = t.gi.profile.name if t.ci.slices == gslices else f"{t.ci.slices}c.{t.gi.profile.name}"
            name = f"{name} MIG {part}"
        set_string(buffer, length, name)
        return NvmlReturn.SUCCESS

    @on_handle(_GPU, _MIG)
    def nvmlDeviceGetBrand(self, t: Target, brand: Any) -> int:
        out(brand).value = t.gpu.model.brand
        return NvmlReturn.SUCCESS

    @on_handle(_GPU)
    def nvmlDeviceGetSerial(self, t: Target, buffer: Any, length: Any) -> int:
        if not t.gpu.serial:
            return NvmlReturn.ERROR_NOT_SUPPORTED  # boards without a serial number
        set_string(buffer, length, t.gpu.serial)
        return NvmlReturn.SUCCESS

    @on_handle(_GPU)
    def nvmlDeviceGetMinorNumber(self, t: Target, minor: Any) -> int:
        out(minor).value = t.gpu.minor
        return NvmlReturn.SUCCESS

    @on_handle(_GPU, _MIG)
    def nvmlDeviceGetPciInfo_v3(self, t: Target, info: Any) -> int:
        domain, bus, dev, fn = parse_bus_id(t.gpu.bus_id)
        device_id = t.gpu.model.device_id << 16 | _NVIDIA
        set_fields(
            out(info),
            busIdLegacy=f"{domain:04X}:{bus:02X}:{dev:02X}.{fn:X}".encode(),
            busId=f"{domain:08X}:{bus:02X}:{dev:02X}.{fn:X}".encode(),
            domain=domain,
            bus=bus,
            device=dev,
            pciDeviceId=device_id,
            pciSubSystemId=device_id,  # reference boards: subsystem = device, NVIDIA
        )
        return NvmlReturn.SUCCESS

    def _memory_mib(self, t: Target) -> int:
        return t.gi.profile.memory_mib if t.gi else t.gpu.model.memory_mib

    @on_handle(_GPU, _MIG)
    def nvmlDeviceGetMemoryInfo(self, t: Target, memory: Any) -> int:
        total = self._memory_mib(t) * _MIB
        set_fields(out(memory), total=total, free=total, used=0)
        return NvmlReturn.SUCCESS

    @on_handle(_GPU, _MIG)
    def nvmlDeviceGetMemoryInfo_v2(self, t: Target, memory: Any) -> int:
        check_version(out(memory), 2)
        total = self._memory_mib(t) * _MIB
        set_fields(out(memory), total=total, reserved=0, free=total, used=0)
        return NvmlReturn.SUCCESS

    @on_handle(_GPU, _MIG)
    def nvmlDeviceGetArchitecture(self, t: Target, arch: Any) -> int:
        out(arch).value = t.gpu.model.architecture
        return NvmlReturn.SUCCESS

    @on_handle(_GPU, _MIG)
    def nvmlDeviceGetCudaComputeCapability(self, t: Target, major: Any, minor: Any) -> int:
        out(major).value, out(minor).value = t.gpu.model.compute_capability
        return NvmlReturn.SUCCESS

    @on_handle(_GPU)
    def nvmlDeviceGetNumaNodeId(self, t: Target, node: Any) -> int:
        if t.gpu.numa_node < 0:
            return NvmlReturn.ERROR_NOT_SUPPORTED
        out(node).value = t.gpu.numa_node
        return NvmlReturn.SUCCESS

    @on_handle(_GPU, _MIG)
    def nvmlDeviceGetAttributes_v2(self, t: Target, attributes: Any) -> int:
        model = t.gpu.model
        p: MigProfile | None
        if t.gi and t.ci:
            p = t.gi.profile
            sms = p.multiprocessors * t.ci.slices // p.slices
            gi_slices, ci_slices, mib = p.slices, t.ci.slices, p.memory_mib
        else:
            p = max(model.mig_profiles, key=lambda q: q.slices, default=None)  # whole-GPU engines
            sms, gi_slices, ci_slices, mib = model.multiprocessors, 0, 0, model.memory_mib
        set_fields(
            out(attributes),
            multiprocessorCount=sms,
            sharedCopyEngineCount=p.copy_engines if p else 0,
            sharedDecoderCount=p.decoders if p else 0,
            sharedEncoderCount=p.encoders if p else 0,
            sharedJpegCount=p.jpegs if p else 0,
            sharedOfaCount=p.ofas if p else 0,
            gpuInstanceSliceCount=gi_slices,
            computeInstanceSliceCount=ci_slices,
            memorySizeMB=mib,
        )
        return NvmlReturn.SUCCESS
