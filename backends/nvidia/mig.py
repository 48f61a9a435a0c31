"""The nvidia-mig backend: the MIG devices of GPUs in MIG mode, published with their parent's facts.

In static mode the MIG layout is whatever exists on the GPU (created by an operator or a tool); each MIG device
is one allocatable device, and the parent GPU itself is not offered. In dynamic mode (per GPU model) the GPU is
offered whole and as every MIG profile at every placement, drawing from the GPU's counters; the MIG device a
claim was allocated is created at prepare and destroyed at unprepare (see `mig_dynamic`).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from backends.contract import (
    Allocated,
    AttributeValue,
    BackendContext,
    ClaimRef,
    CounterSet,
    Device,
    Inventory,
    Prepared,
    PrepareError,
)
from backends.nvidia.common import NvidiaBackend, gpu_attributes, kept_while_lost
from backends.nvidia.config import GpuConfig, MigBackendConfig
from backends.nvidia.health_rules import DeviceRef
from backends.nvidia.mig_dynamic import MigMaker, Offer, dynamic_devices
from backends.nvidia.mig_edits import MigEdits
from backends.nvidia.mig_ledger import MigLedger
from backends.nvidia.mig_whole import WholeGpus
from backends.nvidia.nvml import GpuInfo, GpuProblem, MigInfo, NvmlError, SystemInfo, list_mig_devices
from backends.nvidia.sharing import ComputeModes, wanted_mode
from backends.topology import PCI_BUS_ID, PciTopology, device_name
from cdi.spec import ContainerEdits

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
    config_types = (GpuConfig,)
    records_own_changes = True  # MIG devices, MIG mode and compute modes are journalled (synced) first

    def __init__(self) -> None:
        super().__init__()
        self._refs: dict[str, DeviceRef] = {}  # device name → its parent GPU and instance, from the last discovery
        self._offers: dict[str, Offer] = {}  # dynamic device name → what it is, from the last discovery
        self._existing: dict[str, tuple[int, int, int]] = {}  # static device → GPU minor, GPU and compute instance
        self._devices: dict[str, Device] = {}  # device name → what was published, from the last discovery
        self._counter_sets: dict[str, CounterSet] = {}  # name → counter set published, from the last discovery
        self._maker: MigMaker | None = None
        self._whole: WholeGpus | None = None
        self._modes: ComputeModes | None = None
        self._mig_edits: MigEdits | None = None

    async def start(self, ctx: BackendContext) -> None:
        await super().start(ctx)
        self._mig_edits = MigEdits(ctx.host_root, self.device_node)
        self._modes = ComputeModes(ctx.state_dir, ctx.log)
        if ctx.state_dir is not None:
            ledger = MigLedger(ctx.state_dir / "mig-ledger.json")
            await asyncio.to_thread(ledger.load)
            for problem in ledger.problems:
                ctx.log.error(problem)
            self._maker = MigMaker(ledger, self._mig_edits, ctx.log)
            self._whole = WholeGpus(ctx.state_dir, ctx.sysfs_root, ctx.log)
            await asyncio.to_thread(self._whole.load)

    @property
    def settings(self) -> MigBackendConfig:
        assert isinstance(self._config, MigBackendConfig)
        return self._config

    async def prepare(self, claim: ClaimRef, devices: Sequence[Allocated]) -> Sequence[Prepared]:
        """A static MIG device exists: the container gets its nodes. A dynamic one is made now; a whole GPU leaves
        MIG mode for the claim (see `mig_whole`)."""
        unknown = [a.device for a in devices if a.device not in self._offers and a.device not in self._existing]
        if unknown:
            raise PrepareError(f"{', '.join(unknown)} not found on this node (any more)")
        whole = {a.device for a in devices if a.device in self._offers and self._offers[a.device].placement is None}
        modes = {a.device: wanted_mode(a, mig_device=a.device not in whole) for a in devices}
        common = await self.common_edits(devices)
        prepared: list[Prepared] = []
        attempted: list[Prepared] = []
        try:
            for allocated in devices:
                attempted.append(Prepared(allocated.device, ContainerEdits()))
                if allocated.device in self._existing:
                    assert self._mig_edits is not None
                    edits = await asyncio.to_thread(self._mig_edits.edits, *self._existing[allocated.device])
                    prepared.append(Prepared(allocated.device, edits, common))
                    continue
                if self._maker is None or self._whole is None:
                    raise PrepareError("dynamic MIG devices are made only by `dra-agent run`, which records them")
                offer = self._offers[allocated.device]
                if allocated.admin_access:
                    # Watching a GPU other claims may use: nothing is made, its MIG mode stays as it is. The MIG
                    # device's nodes while a workload has it made, else the GPU's own node (NVML on it sees every
                    # MIG device of the GPU).
                    made = await asyncio.to_thread(self._maker.made_edits, allocated.device, offer)
                    edits = made or ContainerEdits(device_nodes=(self.device_node(f"nvidia{offer.gpu_minor}"),))
                    prepared.append(Prepared(allocated.device, edits, common))
                    continue
                if allocated.device in whole:
                    prepared.append(await self._take_whole(claim, allocated.device, offer, modes, common))
                    continue
                edits, restore = await asyncio.to_thread(self._maker.make, claim.uid, allocated.device, offer)
                prepared.append(Prepared(allocated.device, edits, common, restore))
        except BaseException:
            # One claim is all or nothing: what this call made or changed for it goes again.
            await self.unprepare(claim, attempted)
            raise
        return [replace(p, facts=self._facts(p)) for p in prepared]

    def _facts(self, prepared: Prepared) -> dict[str, AttributeValue]:
        """What the workload learns about the device it got: the MIG device's UUID (a whole GPU's, and its PCI
        address, for a whole GPU taken out of MIG mode)."""
        offer = self._offers.get(prepared.device)
        if offer is not None and offer.placement is None:
            return {"uuid": offer.gpu_uuid, PCI_BUS_ID: offer.bus_id}
        uuid = prepared.restore.get("uuid")  # a MIG device made for the claim
        if not isinstance(uuid, str):
            published = self._devices.get(prepared.device)
            uuid = published.attributes.get("uuid") if published is not None else None
        return {"uuid": uuid} if isinstance(uuid, str) and uuid else {}

    async def _take_whole(self, claim: ClaimRef, device: str, offer: Offer, modes: Mapping[str, int | None],
                          common: ContainerEdits) -> Prepared:
        """The whole GPU, out of MIG mode for the claim: its device node, and the compute mode asked for."""
        assert self._whole is not None
        minor = await asyncio.to_thread(self._whole.take, claim.uid, device, offer.bus_id)
        restore: dict[str, Any] = {"wholeGpu": {"busId": offer.bus_id}}
        mode = modes[device]
        if mode is not None:
            restore["computeMode"] = await asyncio.to_thread(self.modes.apply, claim.uid, device, offer.bus_id, mode)
        return Prepared(device, ContainerEdits(device_nodes=(self.device_node(f"nvidia{minor}"),)), common, restore)

    @property
    def modes(self) -> ComputeModes:
        assert self._modes is not None
        return self._modes

    async def stop(self) -> None:
        await super().stop()
        if self._maker is not None:
            self._maker.ledger.close()
        if self._whole is not None:
            self._whole.close()
        if self._modes is not None:
            self._modes.close()

    async def reconcile(self, held: Mapping[str, Sequence[str]]) -> None:
        """Destroy the MIG devices this agent made for claims the core no longer holds (its records were lost);
        GPUs held whole for such claims get their compute mode and MIG mode back."""
        await asyncio.to_thread(self.modes.reconcile, held)
        if self._whole is not None:
            await asyncio.to_thread(self._whole.reconcile, held)
        if self._maker is None:
            return
        for entry in self._maker.ledger:
            if entry.device not in held.get(entry.claim, ()):
                self.ctx.log.warning("destroying a MIG device made for a claim no longer prepared",
                                     device=entry.device, claim=entry.claim, gpu=entry.bus_id)
                await asyncio.to_thread(self._maker.unmake, entry.claim, entry.device)

    async def unprepare(self, claim: ClaimRef, prepared: Sequence[Prepared]) -> None:
        """Destroy the dynamic MIG devices made for the claim; static ones stay as they were. A GPU held whole
        gets its compute mode back, then MIG mode."""
        if self._maker is None or self._whole is None:
            return
        await asyncio.to_thread(self._release, claim.uid, prepared)

    def _release(self, claim: str, prepared: Sequence[Prepared]) -> None:
        """The blocking part of unprepare, in one worker-thread call."""
        assert self._maker is not None and self._whole is not None
        for item in prepared:
            self.modes.restore(claim, item.device, item.restore.get("computeMode"))
            self._whole.give_back(claim, item.device)
            self._maker.unmake(claim, item.device)

    async def discover(self) -> Inventory:
        inventory = await asyncio.to_thread(self._discover)
        self.watch(self._refs)
        return inventory

    def _discover(self) -> Inventory:
        return self.read_nvml(self._inventory)

    def _inventory(self, system: SystemInfo, gpus: list[GpuInfo], problems: list[GpuProblem]) -> Inventory:
        warnings = [p.message for p in problems if p.mig_enabled]
        # A GPU held whole for a claim is out of MIG mode until its unprepare: published as before meanwhile.
        whole = self._whole.held() if self._whole is not None else frozenset()
        devices: list[Device] = []
        counter_sets: list[CounterSet] = []
        refs: dict[str, DeviceRef] = {}
        offers: dict[str, Offer] = {}
        existing: dict[str, tuple[int, int, int]] = {}
        self.driver_version_seen(system.driver_version)
        for gpu in gpus:
            if not gpu.mig_enabled and gpu.bus_id not in whole:
                continue
            topology = self.ctx.topology.lookup(gpu.bus_id)
            warnings.extend(topology.problems)
            dynamic = self.settings.mode_for(gpu.product_name) == "dynamic"
            if dynamic and gpu.mig_pending:
                # It leaves MIG mode at its next reset: offer what exists, make nothing new.
                warnings.append(f"GPU {gpu.bus_id}: MIG mode change pending a GPU reset; its existing MIG "
                                "devices are offered as they are, no new ones are made")
                dynamic = False
            if dynamic:
                attrs, attr_problems = gpu_attributes(gpu, system)
                warnings.extend(f"GPU {gpu.bus_id}: {p}" for p in attr_problems)
                try:
                    found, counter_set, gpu_offers = dynamic_devices(gpu, attrs, topology)
                except NvmlError as e:
                    warnings.append(f"GPU {gpu.bus_id}: MIG profiles unreadable, GPU left out: {e}")
                    continue
                devices.extend(found)
                counter_sets.append(counter_set)
                offers.update(gpu_offers)
                refs.update({d.name: DeviceRef(gpu.uuid, gpu.bus_id) for d in found})
                continue
            try:
                migs = list_mig_devices(gpu)
            except NvmlError as e:
                warnings.append(f"GPU {gpu.bus_id}: MIG devices left out: {e}")
                continue
            for mig in migs:
                device = self._device(mig, system, topology, warnings)
                devices.append(device)
                refs[device.name] = DeviceRef(gpu.uuid, gpu.bus_id, mig.gpu_instance_id, mig.compute_instance_id)
                existing[device.name] = (gpu.minor, mig.gpu_instance_id, mig.compute_instance_id)
        kept, lost_warnings = kept_while_lost(self._devices, problems, "parentIndex")
        warnings.extend(lost_warnings)
        for device in kept:
            devices.append(device)
            if device.name in self._refs:
                refs[device.name] = self._refs[device.name]
            if device.name in self._offers:
                offers[device.name] = self._offers[device.name]
            if device.name in self._existing:
                existing[device.name] = self._existing[device.name]
        used = {c.counter_set for d in kept for c in d.consumes_counters}
        counter_sets.extend(self._counter_sets[name] for name in sorted(used) if name in self._counter_sets)
        self._refs = refs
        self._offers = offers
        self._existing = existing
        self._devices = {d.name: d for d in devices}
        self._counter_sets = {c.name: c for c in counter_sets}
        return Inventory(devices=tuple(devices), counter_sets=tuple(counter_sets), warnings=tuple(warnings))

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
