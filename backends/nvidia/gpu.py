"""The nvidia-gpu backend: one device per full GPU (GPUs in MIG mode belong to nvidia-mig); with
`sharing.byMemory`, each GPU shared by memory between claims (see `gpu_shares`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from backends.contract import (
    Allocated,
    AttributeValue,
    BackendContext,
    ClaimRef,
    Device,
    DevicesChanged,
    HealthEvent,
    Inventory,
    Prepared,
    PrepareError,
)
from backends.nvidia.common import NvidiaBackend, gpu_attributes, kept_while_lost, nvidia_gpus_in_sysfs
from backends.nvidia.config import GpuBackendConfig, GpuConfig
from backends.nvidia.gpu_shares import GpuShares, memory_policy, sharing_of
from backends.nvidia.health_rules import DeviceRef
from backends.nvidia.mig_whole import held_whole
from backends.nvidia.mps import MpsDaemons, MpsGpu, control_program
from backends.nvidia.mps_watch import MpsWatch, with_daemons
from backends.nvidia.nvml import GpuInfo, GpuProblem, NvmlError, SystemInfo, loaded_library, nvml_session
from backends.nvidia.nvml_compute import MigMode, mig_mode
from backends.nvidia.passthrough import describe, held_device
from backends.nvidia.sharing import ComputeModes, claim_mps_config, mps_of, wanted_mode
from backends.sysfs import SysfsError, read_link_name
from backends.topology import PCI_BUS_ID, device_name
from backends.vfio import PassthroughBackend, VfioConfig, wants_passthrough
from cdi.spec import ContainerEdits

__all__ = ["NvidiaGpuBackend"]


class NvidiaGpuBackend(NvidiaBackend, PassthroughBackend):
    """Full NVIDIA GPUs found through NVML, and those a claim holds on vfio-pci (gone from NVML meanwhile)."""

    name = "nvidia-gpu"
    driver = "gpu.nvidia.com"
    config_types = (GpuConfig, VfioConfig)
    records_own_changes = True  # compute modes and vfio bindings are journalled (synced) before they change

    def __init__(self) -> None:
        super().__init__()
        self._minors: dict[str, int] = {}  # device name → N of /dev/nvidiaN, from the last discovery
        self._refs: dict[str, DeviceRef] = {}  # device name → its GPU, from the last discovery
        self._devices: dict[str, Device] = {}  # device name → what was published, from the last discovery
        self._mig_gpus: set[int] = set()  # indexes of GPUs left to nvidia-mig, from the last discovery
        self._modes: ComputeModes | None = None
        self._shares: GpuShares | None = None
        self._mps: MpsDaemons | None = None
        self._mps_watch: MpsWatch | None = None
        # GPUs being given back from vfio-pci: name → (hand-back number, as published, PCI address); see
        # `_returning_devices`.
        self._returning: dict[str, tuple[int, Device, str]] = {}
        self._handbacks = 0

    def hardware(self, sysfs_root: Path) -> Sequence[str]:
        """The node's NVIDIA GPUs not on vfio-pci, from sysfs alone (`ListsHardware`): what NVML would serve."""
        try:
            return nvidia_gpus_in_sysfs(sysfs_root)
        except SysfsError:
            return []

    async def start(self, ctx: BackendContext) -> None:
        await super().start(ctx)
        self._modes = ComputeModes(ctx.state_dir, ctx.log)
        self._shares = GpuShares(ctx.state_dir, ctx.log)
        self._mps = MpsDaemons(ctx.state_dir, ctx.log)
        self._mps_watch = MpsWatch(self._mps, ctx.log)

    async def discover(self) -> Inventory:
        # GPUs on vfio-pci for a claim are gone from NVML: published as they were, not watched through NVML. The
        # journal is read before and after NVML, so a GPU passed through or given back while NVML is read is
        # in one of the two.
        passthrough = self.ctx.state_dir is not None
        entries = await self.passthrough().entries() if passthrough else []
        begun = self._handbacks
        inventory = await asyncio.to_thread(self._discover)
        watched = dict(self._refs)
        held: list[Device] = []
        for entry in [*entries, *(await self.passthrough().entries() if passthrough else [])]:
            name, notes = entry["device"], entry.get("notes")
            if name in self._devices or not notes:
                continue
            device = held_device(name, notes, self.ctx.topology)
            held.append(device)
            self._devices[name] = device
            self._refs[name] = DeviceRef("", notes["busId"])
        returning, warnings = self._returning_devices(begun)
        held.extend(returning)
        self.watch(watched)
        if not held:
            return inventory
        devices = tuple(sorted((*inventory.devices, *held), key=lambda d: d.name))
        return Inventory(devices=devices, counter_sets=inventory.counter_sets,
                         warnings=(*inventory.warnings, *warnings))

    def _returning_devices(self, begun: int) -> tuple[list[Device], list[str]]:
        """GPUs given back from vfio-pci that NVML does not list yet, published as they were meanwhile.

        The nvidia driver's link appears before its probe has finished, and NVML lists the GPU only after it; a
        discovery in between (the uevents of the hand-back set one off) must not drop the GPU, or a prepare of it
        fails until the next one. A GPU stays here until a discovery begun after its hand-back sees it in NVML,
        or until the nvidia driver no longer holds it (it is not coming back to NVML then).
        """
        kept: list[Device] = []
        warnings: list[str] = []
        for name, (handback, device, bus_id) in list(self._returning.items()):
            if name in self._devices:
                if name in self._minors and handback <= begun:
                    del self._returning[name]  # NVML lists it again
                continue
            if read_link_name(self.ctx.sysfs_root / "bus/pci/devices" / bus_id / "driver") != "nvidia":
                del self._returning[name]
                continue
            kept.append(device)
            self._devices[name] = device
            self._refs[name] = DeviceRef("", bus_id)
            minor = device.attributes.get("minor")
            if isinstance(minor, int):
                self._minors[name] = minor
            warnings.append(f"GPU {bus_id}: given back to the nvidia driver from vfio-pci and not listed by NVML "
                            "yet; published as it was until NVML lists it")
        return kept, warnings

    @property
    def modes(self) -> ComputeModes:
        assert self._modes is not None
        return self._modes

    @property
    def shares(self) -> GpuShares:
        assert self._shares is not None
        return self._shares

    @property
    def mps(self) -> MpsDaemons:
        assert self._mps is not None
        return self._mps

    @property
    def mps_watch(self) -> MpsWatch:
        assert self._mps_watch is not None
        return self._mps_watch

    async def health(self) -> AsyncIterator[HealthEvent | DevicesChanged]:
        """The NVIDIA health stream, with GPUs whose claim's MPS control daemon ended unhealthy until it serves
        again (see `mps_watch`)."""
        async for item in with_daemons(super().health(), self.mps_watch):
            yield item

    async def prepare(self, claim: ClaimRef, devices: Sequence[Allocated]) -> Sequence[Prepared]:
        """Device node per GPU; control nodes and the driver's files for the chosen capabilities for all; the
        compute mode the GpuConfig's sharing asks for. A GPU configured with VfioConfig is bound to vfio-pci
        instead and gets only its VFIO nodes. A share of a GPU gets the GPU's device node and its amount of memory
        as a hint (`DRA_AGENT_GPU_SHARE_MEMORY`), once its GPU and the other shares of it allow."""
        missing = [a.device for a in devices if a.device not in self._refs]
        if missing:
            raise PrepareError(f"{', '.join(missing)} not found on this node (any more)")
        shares = [a for a in devices if a.share_id is not None and not a.admin_access]
        if shares:
            await self._check_shares(shares)
        through = {a.device for a in devices if wants_passthrough(a)}
        plain = [a for a in devices if a.device not in through]
        minors = {a.device: self._minor(a.device) for a in plain}
        gone = [a.device for a in plain if minors[a.device] is None]
        if gone:
            raise PrepareError(await self._why_not_on_nvidia(gone))
        common = await self.common_edits(plain) if plain else None
        prepared: dict[tuple[str, str | None], Prepared] = {}
        try:
            for a in plain:
                restore: dict[str, Any] = {}
                mode = wanted_mode(a)
                share = a.share_id if a in shares else None
                # Recorded first: a crash from here on leaves an entry the rollback or the next start drops.
                if share is not None:
                    prepared[(a.device, share)] = Prepared(device=a.device, edits=ContainerEdits(), share_id=share)
                    # An allocation that names no memory (none the scheduler writes) holds all of it.
                    capacity = self._devices[a.device].capacity["memory"]
                    memory = a.consumed.get("memory", capacity)
                    await asyncio.to_thread(self.shares.admit, claim.uid, a.device, share, sharing_of(a), memory,
                                            capacity)
                if mode is not None:
                    restore["computeMode"] = await asyncio.to_thread(
                        self.modes.apply, claim.uid, a.device, self._refs[a.device].bus_id, mode, share)
                env = (f"DRA_AGENT_GPU_SHARE_MEMORY={a.consumed['memory']}",) if "memory" in a.consumed else ()
                prepared[(a.device, a.share_id)] = Prepared(
                    device=a.device,
                    edits=ContainerEdits(device_nodes=(self.device_node(f"nvidia{minors[a.device]}"),),
                                         env=env if share is not None else ()),
                    common_edits=common,
                    restore=restore,
                    share_id=a.share_id,
                    facts=self._facts(a.device),
                )
            mps = [a for a in plain if mps_of(a) is not None]
            if mps:
                edits = await self._start_mps(claim, mps)
                for a in mps:
                    item = prepared[(a.device, None)]
                    prepared[(a.device, None)] = replace(item, edits=item.edits.merge(edits),
                                                         restore={**item.restore, "mps": True})
            passthrough = [(a.device, self._refs[a.device].bus_id) for a in devices if a.device in through]
            if passthrough:
                published = {ref.bus_id for ref in self._refs.values()}
                notes = {d: describe(self._devices[d], bus_id) for d, bus_id in passthrough}
                for item in await self.passthrough().prepare(claim.uid, passthrough, published, notes):
                    prepared[(item.device, None)] = replace(item, facts={**self._facts(item.device), **item.facts})
        except BaseException:
            # One claim is all or nothing: its MPS daemon stops, compute modes this call set go back, and the
            # shares it recorded go.
            await asyncio.to_thread(self.mps.stop, claim.uid)
            await self._restore_modes(claim, list(prepared.values()))
            raise
        return [prepared[(a.device, a.share_id)] for a in devices]

    async def _start_mps(self, claim: ClaimRef, devices: Sequence[Allocated]) -> ContainerEdits:
        """The claim's MPS control daemon, serving its GPUs (already in EXCLUSIVE_PROCESS) with their limits."""
        config = claim_mps_config(devices)
        program = control_program(self.driver_root)
        gpus = [MpsGpu(a.device, self._refs[a.device].uuid or str(self._devices[a.device].attributes.get("uuid")),
                       self._devices[a.device].capacity["memory"]) for a in devices]
        library = loaded_library()
        edits = await asyncio.to_thread(self.mps.start, claim.uid, gpus, config, program,
                                        library.parent if library is not None else None)
        self.mps_watch.watch(claim.uid)
        return edits

    async def _check_shares(self, shares: Sequence[Allocated]) -> None:
        """Refuse shares the GPU cannot give: of a GPU passed through or handed to nvidia-mig (MIG mode on, or held
        whole for a claim), with a configuration that passes the GPU through, or of a backend not sharing."""
        config = self._config
        assert isinstance(config, GpuBackendConfig)
        for a in shares:
            if wants_passthrough(a):
                raise PrepareError(f"{a.device}: a share of a GPU cannot be passed through with vfio-pci: the whole "
                                   "GPU leaves the nvidia driver; ask for the whole GPU instead")
            if not config.sharing.by_memory:
                raise PrepareError(f"{a.device}: allocated as a share, but this node does not share GPUs by memory "
                                   "(backend_config.nvidia-gpu.sharing.byMemory is off)")
            wanted_mode(a)  # refuses ExclusiveProcess for a share
        held = held_whole(self.ctx.sysfs_root)
        for a in shares:
            bus_id = self._refs[a.device].bus_id
            if bus_id in held:
                raise PrepareError(f"{a.device}: GPU {bus_id} is held whole by nvidia-mig for a claim; no share of it "
                                   "can be prepared until that claim is unprepared")
            try:
                mode = await asyncio.to_thread(_mig_mode, bus_id)
            except NvmlError as e:
                raise PrepareError(f"{a.device}: cannot read the MIG mode of GPU {bus_id}: {e}") from None
            if mode.enabled or mode.pending:
                raise PrepareError(f"{a.device}: GPU {bus_id} is in MIG mode (or about to be): its memory belongs "
                                   "to MIG devices (nvidia-mig); a share of the full GPU is refused")

    def _facts(self, device: str) -> dict[str, AttributeValue]:
        """What the workload learns about a GPU it got: its UUID (when NVML told it) and PCI address."""
        ref = self._refs[device]
        facts: dict[str, AttributeValue] = {PCI_BUS_ID: ref.bus_id}
        published = self._devices.get(device)
        uuid = ref.uuid or (published.attributes.get("uuid") if published is not None else None)
        if isinstance(uuid, str) and uuid:  # a GPU held on vfio-pci is known from its description
            facts["uuid"] = uuid
        return facts

    def _minor(self, device: str) -> int | None:
        """N of the GPU's /dev/nvidiaN while the nvidia driver holds it: from the last discovery, or for a GPU given
        back from vfio-pci since (no discovery may have run yet: without udev none runs until the next start), as it
        was published, once the nvidia driver has it again."""
        if device in self._minors:
            return self._minors[device]
        returning = self._returning.get(device)
        if returning is None:
            return None
        _, published, bus_id = returning
        minor = published.attributes.get("minor")
        held = read_link_name(self.ctx.sysfs_root / "bus/pci/devices" / bus_id / "driver") == "nvidia"
        return minor if held and isinstance(minor, int) and not isinstance(minor, bool) else None

    async def _why_not_on_nvidia(self, devices: Sequence[str]) -> str:
        holders = {e["device"]: e["claim"] for e in await self.passthrough().entries()} if self.ctx.state_dir else {}
        reasons = [f"{d} is passed through with vfio-pci for claim {holders[d]}" if d in holders else
                   f"{d} is not held by the nvidia driver (NVML does not list it)" for d in devices]
        return "; ".join(reasons)

    async def unprepare(self, claim: ClaimRef, prepared: Sequence[Prepared]) -> None:
        """GPUs passed through go back to their driver; GPUs whose compute mode was set get their own back (for
        shares, when the last share of the GPU goes); shares are forgotten. The claim's MPS daemon stops first:
        its server holds the GPUs until then."""
        self.mps_watch.forget(claim.uid)  # its end is no death to revive it from
        await asyncio.to_thread(self.mps.stop, claim.uid)
        await self._restore_modes(claim, prepared)
        # Known as returning before their journal entries go: no discovery in between may miss them.
        entries = {e["device"]: e for e in await self.passthrough().entries() if e["claim"] == claim.uid}
        self._handbacks += 1
        for item in prepared:
            device, ref = self._devices.get(item.device), self._refs.get(item.device)
            if device is not None and ref is not None and (item.device in entries or "vfio" in item.restore):
                self._returning[item.device] = (self._handbacks, device, ref.bus_id)
        await self.passthrough().unprepare(claim.uid, prepared)

    async def _restore_modes(self, claim: ClaimRef, prepared: Sequence[Prepared]) -> None:
        for item in prepared:
            await asyncio.to_thread(self.modes.restore, claim.uid, item.device, item.restore.get("computeMode"),
                                    item.share_id)
            if item.share_id is not None:
                await asyncio.to_thread(self.shares.release, claim.uid, item.device, item.share_id)

    async def reconcile(self, held: Mapping[str, Sequence[str]]) -> None:
        """GPUs left on vfio-pci, or in a compute mode set, for claims no longer held go back as they were; MPS
        daemons of such claims stop (before the modes go back)."""
        await asyncio.to_thread(self.mps.reconcile, held)
        await asyncio.to_thread(self.modes.reconcile, held)
        await asyncio.to_thread(self.shares.reconcile, held)
        await self.passthrough().reconcile(held)

    async def stop(self) -> None:
        await super().stop()
        if self._modes is not None:
            self._modes.close()
        if self._shares is not None:
            self._shares.close()
        if self._mps is not None:
            self._mps.close()

    def _discover(self) -> Inventory:
        return self.read_nvml(self._inventory)

    def _inventory(self, system: SystemInfo, gpus: list[GpuInfo], problems: list[GpuProblem]) -> Inventory:
        kept, lost_warnings = kept_while_lost(self._devices, problems, "index")
        lost = {p.index for p in problems if p.lost}
        # GPUs whose MIG mode is unknown are reported here, not by nvidia-mig, so each fault shows once; but a lost
        # GPU last seen in MIG mode is nvidia-mig's to report (and to keep).
        quiet = {d.attributes.get("index") for d in kept} | lost & self._mig_gpus
        warnings = [p.message for p in problems if not p.mig_enabled and p.index not in quiet] + lost_warnings
        # A GPU nvidia-mig holds whole for a claim is out of MIG mode meanwhile, and still nvidia-mig's.
        whole = held_whole(self.ctx.sysfs_root)
        mine = [g for g in gpus if not g.mig_enabled and g.bus_id not in whole]
        self._mig_gpus = {g.index for g in gpus if g not in mine} | lost & self._mig_gpus
        devices: list[Device] = []
        for gpu in mine:
            device, device_problems = self._device(gpu, system)
            devices.append(device)
            warnings.extend(device_problems)
        self._minors = {device_name("gpu", g.bus_id): g.minor for g in mine} | {
            d.name: self._minors[d.name] for d in kept if d.name in self._minors}
        self._refs = {device_name("gpu", g.bus_id): DeviceRef(g.uuid, g.bus_id) for g in mine} | {
            d.name: self._refs[d.name] for d in kept if d.name in self._refs}
        devices.extend(kept)
        self._devices = {d.name: d for d in devices}
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
        config = self._config
        assert isinstance(config, GpuBackendConfig)
        if config.sharing.by_memory:
            policy = memory_policy(gpu.memory_bytes, config.sharing.memory_step)
            if policy is None:
                problems.append(f"has {gpu.memory_bytes} bytes of memory, less than two sharing steps of "
                                f"{config.sharing.memory_step}: published whole, not shared")
            else:
                device = replace(device, allow_multiple_allocations=True, capacity_policies={"memory": policy})
        return device, [f"GPU {gpu.bus_id}: {p}" for p in problems] + list(topology.problems)


def _mig_mode(bus_id: str) -> MigMode:
    with nvml_session():
        return mig_mode(bus_id)
