"""The nvidia-mig backend: the MIG devices of GPUs in MIG mode, published with their parent's facts.

In static mode the MIG layout is whatever exists on the GPU (created by an operator or a tool); each MIG device
is one allocatable device, and the parent GPU itself is not offered.
"""

from __future__ import annotations

import asyncio
import re

from backends.contract import AttributeValue, Device, Inventory
from backends.nvidia.common import NvidiaBackend, gpu_attributes, read_nvml
from backends.nvidia.config import MigBackendConfig
from backends.nvidia.health_rules import DeviceRef
from backends.nvidia.nvml import GpuInfo, GpuProblem, MigInfo, NvmlError, SystemInfo, list_mig_devices
from backends.topology import PciTopology, device_name

__all__ = ["NvidiaMigBackend", "mig_device_name"]


def mig_device_name(parent_bus_id: str, mig: MigInfo) -> str:
    """Stable name from the parent's address, the profile and the placement: survives restarts and reboots."""
    label = re.sub(r"[^a-z0-9]", "", mig.profile.lower())
    name = f"{device_name('gpu', parent_bus_id)}-mig-{label}-{mig.profile_id}-{mig.placement_start}"
    return name if mig.full_instance else f"{name}-c{mig.compute_start}"


class NvidiaMigBackend(NvidiaBackend):
    """MIG devices found through NVML; each follows its parent GPU's health, or its own when an event names it."""

    name = "nvidia-mig"
    driver = "gpu.nvidia.com"
    config_model = MigBackendConfig

    def __init__(self) -> None:
        super().__init__()
        self._refs: dict[str, DeviceRef] = {}  # device name → its parent GPU and instance, from the last discovery

    async def discover(self) -> Inventory:
        inventory = await asyncio.to_thread(self._discover)
        self.watch(self._refs)
        return inventory

    def _discover(self) -> Inventory:
        return read_nvml(self.ctx.log, self._inventory)

    def _inventory(self, system: SystemInfo, gpus: list[GpuInfo], problems: list[GpuProblem]) -> Inventory:
        warnings = [p.message for p in problems if p.mig_enabled]
        devices: list[Device] = []
        refs: dict[str, DeviceRef] = {}
        for gpu in gpus:
            if not gpu.mig_enabled:
                continue
            topology = self.ctx.topology.lookup(gpu.bus_id)
            warnings.extend(topology.problems)
            try:
                migs = list_mig_devices(gpu)
            except NvmlError as e:
                warnings.append(f"GPU {gpu.bus_id}: MIG devices left out: {e}")
                continue
            for mig in migs:
                device = self._device(mig, system, topology, warnings)
                devices.append(device)
                refs[device.name] = DeviceRef(gpu.uuid, gpu.bus_id, mig.gpu_instance_id, mig.compute_instance_id)
        self._refs = refs
        return Inventory(devices=tuple(devices), warnings=tuple(warnings))

    def _device(self, mig: MigInfo, system: SystemInfo, topology: PciTopology, warnings: list[str]) -> Device:
        attrs, problems = gpu_attributes(mig.parent, system)
        warnings.extend(f"GPU {mig.parent.bus_id}: {p}" for p in problems)
        own: dict[str, AttributeValue] = {
            "type": "mig",
            "uuid": mig.uuid,
            "parentUUID": mig.parent.uuid,
            "parentIndex": mig.parent.index,
            "profile": mig.profile,
            "placementStart": mig.placement_start,
            "placementSize": mig.placement_size,
            "gpuInstanceId": mig.gpu_instance_id,
            "computeInstanceId": mig.compute_instance_id,
        }
        attrs.update(own)
        return Device(
            name=mig_device_name(mig.parent.bus_id, mig),
            attributes=attrs,
            capacity={
                "memory": mig.memory_bytes,
                "multiprocessors": mig.multiprocessors,
                "copyEngines": mig.copy_engines,
                "decoders": mig.decoders,
                "encoders": mig.encoders,
                "jpegEngines": mig.jpeg_engines,
                "ofaEngines": mig.ofa_engines,
            },
            topology=topology,
        )
