"""The nvidia-gpu backend: one device per full GPU (GPUs in MIG mode belong to nvidia-mig)."""

from __future__ import annotations

import asyncio

from backends.base import BuiltinBackend
from backends.contract import Device, Inventory
from backends.nvidia.common import gpu_attributes, read_nvml
from backends.nvidia.nvml import GpuInfo, GpuProblem, SystemInfo
from backends.topology import device_name

__all__ = ["NvidiaGpuBackend"]


class NvidiaGpuBackend(BuiltinBackend):
    """Full NVIDIA GPUs found through NVML."""

    name = "nvidia-gpu"
    driver = "gpu.nvidia.com"

    async def discover(self) -> Inventory:
        return await asyncio.to_thread(self._discover)

    def _discover(self) -> Inventory:
        return read_nvml(self.ctx.log, self._inventory)

    def _inventory(self, system: SystemInfo, gpus: list[GpuInfo], problems: list[GpuProblem]) -> Inventory:
        # GPUs whose MIG mode is unknown are reported here, not by nvidia-mig, so each fault shows once.
        warnings = [p.message for p in problems if not p.mig_enabled]
        devices: list[Device] = []
        for gpu in gpus:
            if gpu.mig_enabled:
                continue  # its MIG devices are published by nvidia-mig
            device, device_problems = self._device(gpu, system)
            devices.append(device)
            warnings.extend(device_problems)
        return Inventory(devices=tuple(devices), warnings=tuple(warnings))

    def _device(self, gpu: GpuInfo, system: SystemInfo) -> tuple[Device, list[str]]:
        attrs, problems = gpu_attributes(gpu, system)
        topology = self.ctx.topology.lookup(gpu.bus_id)
        attrs.update(
            type="gpu",
            uuid=gpu.uuid,
            index=gpu.index,
            minor=gpu.minor,
            migCapable=gpu.mig_capable,
            migEnabled=gpu.mig_enabled,
        )
        device = Device(
            name=device_name("gpu", gpu.bus_id),
            attributes=attrs,
            capacity={"memory": gpu.memory_bytes},
            topology=topology,
        )
        return device, [f"GPU {gpu.bus_id}: {p}" for p in problems] + list(topology.problems)
