"""The nvidia-gpu backend: one device per full GPU (GPUs in MIG mode belong to nvidia-mig)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from backends.contract import Allocated, ClaimRef, Device, Inventory, Prepared, PrepareError
from backends.nvidia.common import NvidiaBackend, gpu_attributes, read_nvml
from backends.nvidia.config import GpuConfig
from backends.nvidia.health_rules import DeviceRef
from backends.nvidia.nvml import GpuInfo, GpuProblem, SystemInfo
from backends.topology import device_name
from backends.vfio import PassthroughBackend, VfioConfig
from cdi.spec import ContainerEdits, DeviceNode

__all__ = ["NvidiaGpuBackend"]


class NvidiaGpuBackend(NvidiaBackend, PassthroughBackend):
    """Full NVIDIA GPUs found through NVML."""

    name = "nvidia-gpu"
    driver = "gpu.nvidia.com"
    config_types = (GpuConfig, VfioConfig)

    def __init__(self) -> None:
        super().__init__()
        self._minors: dict[str, int] = {}  # device name → N of /dev/nvidiaN, from the last discovery
        self._refs: dict[str, DeviceRef] = {}  # device name → its GPU, from the last discovery

    async def discover(self) -> Inventory:
        inventory = await asyncio.to_thread(self._discover)
        self.watch(self._refs)
        return inventory

    async def prepare(self, claim: ClaimRef, devices: Sequence[Allocated]) -> Sequence[Prepared]:
        """Device node per GPU; control nodes and the driver's files for the chosen capabilities for all. A GPU
        configured with VfioConfig is bound to vfio-pci instead and gets only its VFIO nodes."""
        missing = [a.device for a in devices if a.device not in self._minors]
        if missing:
            raise PrepareError(f"{', '.join(missing)} not found on this node (any more)")
        plain = [a for a in devices if not isinstance(a.config, VfioConfig)]
        common = await self.common_edits(plain) if plain else None
        prepared = {
            a.device: Prepared(
                device=a.device,
                edits=ContainerEdits(device_nodes=(DeviceNode(f"/dev/nvidia{self._minors[a.device]}"),)),
                common_edits=common,
            )
            for a in plain
        }
        passthrough = [(a.device, self._refs[a.device].bus_id) for a in devices if isinstance(a.config, VfioConfig)]
        if passthrough:
            published = {ref.bus_id for ref in self._refs.values()}
            for item in await self.passthrough().prepare(claim.uid, passthrough, published):
                prepared[item.device] = item
        return [prepared[a.device] for a in devices]

    async def unprepare(self, claim: ClaimRef, prepared: Sequence[Prepared]) -> None:
        """GPUs passed through go back to their driver; the others need nothing."""
        await self.passthrough().unprepare(claim.uid, prepared)

    async def reconcile(self, held: Mapping[str, Sequence[str]]) -> None:
        """GPUs left on vfio-pci for claims no longer held go back to their driver."""
        await self.passthrough().reconcile(held)

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
        self._minors = {device_name("gpu", g.bus_id): g.minor for g in gpus if not g.mig_enabled}
        self._refs = {device_name("gpu", g.bus_id): DeviceRef(g.uuid, g.bus_id) for g in gpus if not g.mig_enabled}
        self.driver_version_seen(system.driver_version)
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
            migPending=gpu.mig_pending,
        )
        device = Device(
            name=device_name("gpu", gpu.bus_id),
            attributes=attrs,
            capacity={"memory": gpu.memory_bytes},
            topology=topology,
        )
        return device, [f"GPU {gpu.bus_id}: {p}" for p in problems] + list(topology.problems)
