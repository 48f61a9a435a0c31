"""The sriov-nic backend: the virtual functions of every SR-IOV capable network adapter.

A physical function is any network-class PCI function with `sriov_totalvfs` > 0; its VFs are found through its
`virtfn<N>` links. Each VF is one allocatable device carrying its PF, kernel driver, netdev, RDMA capability
and the standard topology attributes, so a claim can pair it with a GPU on the same PCIe root or switch.

Health, from udev and rtnetlink: a PF whose link is down makes all its VFs unhealthy (read from sysfs at start,
after each discovery, when the PF's netdev has a uevent and when rtnetlink says its link went down or up);
network functions added or removed change the device set.

A claim's `VfConfig.netDevice` hands the VF's network interface to the pod (`backends.sriov.vf_netdev`); every prepared
VF tells the workload its PCI address, PF, interface and MAC (`Prepared.facts`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ConfigDict, Field

from backends.base import DeviceEventQueue, HealthLedger, pci_events_summary
from backends.config import BackendConfig
from backends.contract import (
    Allocated,
    AttributeValue,
    BackendContext,
    ClaimRef,
    Device,
    DevicesChanged,
    Health,
    HealthEvent,
    Inventory,
    Prepared,
    PrepareError,
)
from backends.host_net import read_host_network
from backends.sriov.numvfs import VfCountError, VfCountRule, apply_vf_count, physical_functions, wanted_counts
from backends.sriov.vf_config import NetDeviceRequest, VfConfig
from backends.sriov.vf_netdev import VfInterface, hand_over, net_device_requests, read_vf_interface
from backends.sysfs import SysfsError, list_dir, list_pci_devices, read_attr, read_hex, read_int, read_link_name
from backends.topology import device_name
from backends.vfio import PassthroughBackend, VfioConfig, wants_passthrough
from cdi.spec import ContainerEdits, DeviceNode

if TYPE_CHECKING:
    import pyudev

__all__ = ["SriovBackendConfig", "SriovNicBackend"]

_NETWORK_CLASS = 0x02
_HOTPLUG = ("add", "remove", "bind", "unbind")


class SriovBackendConfig(BackendConfig):
    """`backend_config.sriov-nic`: `numVfs`, the VF count of PFs by interface name, PCI address or vendor:device
    (see `sriov_numvfs`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    num_vfs: tuple[VfCountRule, ...] = Field(default=(), alias="numVfs", max_length=256)


class SriovNicBackend(PassthroughBackend):
    """SR-IOV virtual functions of network adapters."""

    name = "sriov-nic"
    driver = "sriov.dra-agent.io"
    config_types = (VfioConfig, VfConfig)
    config_model = SriovBackendConfig
    records_own_changes = True  # vfio bindings are journalled (synced) before they change

    def __init__(self) -> None:
        super().__init__()
        self._vfs: dict[str, str] = {}  # device name → VF bus id, from the last discovery
        self._pfs: dict[str, tuple[str, ...]] = {}  # PF bus id → its VFs' device names, from the last discovery
        self._netdevs: set[str] = set()  # the PFs' interface names when their links were last read
        self._events: DeviceEventQueue | None = None
        self._count_problems: list[str] = []  # VF counts not applied, reported with the next discovery
        self._deferred: dict[str, int] = {}  # PF → VF count to apply once the claims holding VFs are known
        self._recount = False  # VF counts changed after start: the device set must be read again

    async def start(self, ctx: BackendContext) -> None:
        await super().start(ctx)
        if ctx.state_dir is None:
            return  # a one-off command (discover): the hardware is shown as it is
        # PFs without VFs get theirs now, before the first discovery: no VF of theirs can be in use. Changing a
        # PF that has VFs waits for `reconcile`, which knows which VFs claims hold.
        await asyncio.to_thread(self._apply_counts, set(), True)

    def hardware(self, sysfs_root: Path) -> Sequence[str]:
        """The VFs of the node's SR-IOV network adapters, from sysfs alone (`ListsHardware`)."""
        try:
            return [vf for pf in physical_functions(sysfs_root) for vf in pf.vfs]
        except SysfsError:
            return []

    async def reconcile(self, held: Mapping[str, Sequence[str]]) -> None:
        # VFs left on vfio-pci for claims no longer held go back first: they are free again.
        await self.passthrough().reconcile(held)
        if not self._deferred:
            return
        in_use = {self._vfs[d] for devices in held.values() for d in devices if d in self._vfs}
        if await asyncio.to_thread(self._apply_counts, in_use, False):
            self._recount = True
            if self._events is not None:
                self._events.wake()

    def _apply_counts(self, in_use: set[str], empty_only: bool) -> bool:
        """Apply the configured VF counts (only to PFs without VFs with `empty_only`); whether any changed."""
        config = self._config
        assert isinstance(config, SriovBackendConfig)
        if not config.num_vfs:
            return False
        pfs = {pf.bus_id: pf for pf in physical_functions(self.ctx.sysfs_root)}
        wanted = wanted_counts(config.num_vfs, list(pfs.values())) if empty_only else self._deferred
        host = read_host_network(self.ctx.host_root)
        changed = False
        for bus_id, count in sorted(wanted.items()):
            pf = pfs.get(bus_id)
            if pf is None:
                continue
            if empty_only and pf.current and count != pf.current:
                self._deferred[bus_id] = count
                continue
            self._deferred.pop(bus_id, None)
            try:
                if apply_vf_count(self.ctx.sysfs_root, pf, count, host, in_use):
                    changed = True
                    self.ctx.log.info("VF count set", pf=bus_id, vfs=count, before=pf.current)
            except VfCountError as e:
                self.ctx.log.warning("VF count not applied", pf=bus_id, error=str(e))
                self._count_problems.append(str(e))
        return changed

    async def health(self) -> AsyncIterator[HealthEvent | DevicesChanged]:
        ledger = HealthLedger()
        with DeviceEventQueue(self.ctx.udev, ("pci", "net"), self._stopped) as events:
            self._events = events
            # A link going down or up comes over rtnetlink only: an empty batch makes the links be read again.
            stop_links = self.ctx.links.subscribe(self._on_link) if self.ctx.links is not None else None
            try:
                async for devices in events:
                    hotplug = [d for d in devices if d.subsystem == "pci" and self._concerns_us(d)]
                    if hotplug or self._recount:
                        self._recount = False
                        yield DevicesChanged(reason=pci_events_summary(hotplug) if hotplug
                                             else "VF counts changed as configured")
                    if not devices or any(self._is_pf_netdev_event(d) for d in devices):
                        for event in await asyncio.to_thread(self._link_health, ledger):
                            yield event
            finally:
                if stop_links is not None:
                    stop_links()
                self._events = None

    def _on_link(self, name: str) -> None:
        if name in self._netdevs and self._events is not None:
            self._events.wake()

    def _concerns_us(self, device: pyudev.Device) -> bool:
        """A PCI event that may change our device set: one of our functions, or a new network function."""
        if device.action not in _HOTPLUG:
            return False
        if device.sys_name in self._vfs.values() or device.sys_name in self._pfs:
            return True
        try:
            network = int(device.properties.get("PCI_CLASS", ""), 16) >> 16 == _NETWORK_CLASS
        except ValueError:
            network = True  # no class in the event: rediscovering costs less than missing a NIC
        return device.action in ("add", "bind") and network

    def _is_pf_netdev_event(self, device: pyudev.Device) -> bool:
        # A new or renamed interface may be a PF's; other interfaces (veth pairs of pods, ...) are not ours.
        return device.subsystem == "net" and (device.sys_name in self._netdevs or device.action in ("add", "move"))

    def _link_health(self, ledger: HealthLedger) -> list[HealthEvent]:
        """Each PF's link state, read now; every VF of a PF whose link is down is unhealthy."""
        events: list[HealthEvent] = []
        netdevs: set[str] = set()
        for pf, vfs in self._pfs.items():
            try:
                link = _link(self.ctx.topology.device_folder(pf))
            except SysfsError as e:
                self.ctx.log.warning("cannot read the link state of a PF", pf=pf, error=str(e))
                continue
            if link is None:
                continue  # no netdev (driver unbound, being renamed): nothing to tell
            netdev, up = link
            netdevs.add(netdev)
            reason = f"PF {netdev} ({pf}) link is {'up' if up else 'down'}"
            for vf in vfs:
                event = ledger.update(vf, Health.HEALTHY if up else Health.UNHEALTHY, reason, cause="link-down")
                if event is not None:
                    events.append(event)
        ledger.keep_only(vf for vfs in self._pfs.values() for vf in vfs)
        self._netdevs = netdevs
        return events

    async def prepare(self, claim: ClaimRef, devices: Sequence[Allocated]) -> Sequence[Prepared]:
        """A VF keeps its kernel driver: the container gets its RDMA verbs device, when it has one, and with
        `VfConfig.netDevice` its network interface. A VF configured with VfioConfig is bound to vfio-pci instead and
        gets its VFIO nodes."""
        missing = [a.device for a in devices if a.device not in self._vfs]
        if missing:
            raise PrepareError(f"{', '.join(missing)} not found on this node (any more)")
        moves = net_device_requests(devices)
        through = {a.device for a in devices if wants_passthrough(a)}
        # Read before any VF is bound to vfio-pci, which takes its interface away.
        seen = await asyncio.to_thread(self._interfaces, devices)
        plain = [a for a in devices if a.device not in through]
        prepared = {p.device: p for p in await asyncio.to_thread(self._prepare, plain, moves, seen)} if plain else {}
        passthrough = [(a.device, self._vfs[a.device]) for a in devices if a.device in through]
        if passthrough:
            for item in await self.passthrough().prepare(claim.uid, passthrough, set(self._vfs.values())):
                prepared[item.device] = item
        return [dataclasses.replace(prepared[a.device], facts=seen[a.device].facts(a.device not in through))
                for a in devices]

    async def unprepare(self, claim: ClaimRef, prepared: Sequence[Prepared]) -> None:
        """VFs passed through go back to their driver; the others need nothing (an interface moved into the pod
        comes back to the host by itself when the pod's network namespace goes)."""
        await self.passthrough().unprepare(claim.uid, prepared)

    def _interfaces(self, devices: Sequence[Allocated]) -> dict[str, VfInterface]:
        seen: dict[str, VfInterface] = {}
        for allocated in devices:
            bus_id = self._vfs[allocated.device]
            try:
                seen[allocated.device] = read_vf_interface(self.ctx.topology.device_dir(bus_id), bus_id)
            except SysfsError as e:
                raise PrepareError(f"{allocated.device}: {e}") from None
        return seen

    def _prepare(self, devices: Sequence[Allocated], moves: Mapping[str, NetDeviceRequest],
                 seen: Mapping[str, VfInterface]) -> list[Prepared]:
        prepared: list[Prepared] = []
        has_cm = (self.ctx.dev_root / "infiniband/rdma_cm").exists()
        rdma_cm = (DeviceNode("/dev/infiniband/rdma_cm"),) if has_cm else ()
        for allocated in devices:
            folder = self.ctx.topology.device_dir(self._vfs[allocated.device])
            try:
                verbs = [v for v in list_dir(folder / "infiniband_verbs") if v.startswith("uverbs")]
            except SysfsError as e:
                raise PrepareError(f"{allocated.device}: {e}") from None
            nodes = tuple(DeviceNode(f"/dev/infiniband/{v}") for v in verbs)
            request = moves.get(allocated.device)
            net, network = (hand_over(allocated.device, seen[allocated.device], request, self.ctx.host_root)
                            if request is not None else (None, None))
            prepared.append(Prepared(
                device=allocated.device,
                edits=ContainerEdits(device_nodes=nodes, net_devices=(net,) if net is not None else ()),
                common_edits=ContainerEdits(device_nodes=rdma_cm) if nodes else None,
                network=network,
            ))
        return prepared

    async def discover(self) -> Inventory:
        inventory = await asyncio.to_thread(self._discover)
        if self._events is not None:
            self._events.wake()  # PFs may have come or gone: read their links again
        return inventory

    def _discover(self) -> Inventory:
        devices: list[Device] = []
        warnings: list[str] = []
        pfs: dict[str, tuple[str, ...]] = {}
        try:
            bus_ids = list_pci_devices(self.ctx.sysfs_root)
        except SysfsError as e:
            return Inventory(warnings=(str(e),))
        for bus_id in bus_ids:
            folder = self.ctx.topology.device_folder(bus_id)
            try:
                if not _is_physical_function(folder):
                    continue
                vfs = self._virtual_functions(bus_id, folder, warnings)
            except SysfsError as e:
                warnings.append(f"NIC {bus_id}: {e}; its VFs are left out")
                continue
            devices.extend(vfs)
            pfs[bus_id] = tuple(vf.name for vf in vfs)
        self._vfs = {d.name: d.topology.bus_id for d in devices if d.topology is not None}
        self._pfs = pfs
        warnings.extend(self._count_problems)
        self._count_problems = []
        return Inventory(devices=tuple(devices), warnings=tuple(warnings))

    def _virtual_functions(self, pf_bus_id: str, pf: str, warnings: list[str]) -> list[Device]:
        pf_netdevs = list_dir(f"{pf}/net")
        pf_name = pf_netdevs[0] if pf_netdevs else None
        speed = read_int(f"{pf}/net/{pf_name}/speed") if pf_name else None
        links = sorted(
            (int(entry.removeprefix("virtfn")), entry)
            for entry in list_dir(pf)
            if entry.startswith("virtfn") and entry.removeprefix("virtfn").isdigit()
        )
        devices: list[Device] = []
        for index, link in links:
            vf_bus_id = read_link_name(f"{pf}/{link}")
            if vf_bus_id is None:
                continue
            topology = self.ctx.topology.lookup(vf_bus_id)
            warnings.extend(topology.problems)
            vf = os.path.dirname(pf) + "/" + vf_bus_id
            attrs: dict[str, AttributeValue] = {
                "type": "vf",
                "pfPciBusID": pf_bus_id,
                "vfIndex": index,
                "rdma": bool(list_dir(f"{vf}/infiniband")),
            }
            if pf_name:
                attrs["pfName"] = pf_name
            if topology.vendor_id is not None and topology.device_id is not None:
                attrs["vendorID"] = f"{topology.vendor_id:04x}"
                attrs["deviceID"] = f"{topology.device_id:04x}"
            if topology.driver:
                attrs["driver"] = topology.driver
            netdevs = list_dir(f"{vf}/net")
            if netdevs:
                attrs["netdev"] = netdevs[0]
            if speed is not None and speed > 0:
                attrs["linkSpeedMbps"] = speed
            devices.append(Device(name=device_name("vf", vf_bus_id), attributes=attrs, topology=topology))
        return devices


def _is_physical_function(folder: str) -> bool:
    total = read_int(f"{folder}/sriov_totalvfs")
    if not total:
        return False
    cls = read_hex(f"{folder}/class")
    return cls is not None and cls >> 16 == _NETWORK_CLASS


def _link(pf: str) -> tuple[str, bool] | None:
    """The PF's network interface and whether its link is up; None when it has no interface."""
    netdevs = list_dir(f"{pf}/net")
    if not netdevs:
        return None
    folder = f"{pf}/net/{netdevs[0]}"
    operstate = read_attr(f"{folder}/operstate")
    try:
        carrier = read_attr(f"{folder}/carrier")
    except SysfsError:
        carrier = None  # the kernel refuses to read carrier while the interface is administratively down
    # Drivers that do not track operstate report "unknown"; the carrier tells then.
    up = operstate == "up" or (operstate in (None, "unknown") and carrier == "1")
    return netdevs[0], up
