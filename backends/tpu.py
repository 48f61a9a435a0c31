"""The tpu backend: Google TPU chips (PCI vendor 0x1ae0), exposed as /dev/accel<N> or through vfio-pci.

Health, from udev: a chip whose device node is missing is unhealthy (checked at start, after each discovery and
on every accel or vfio uevent); TPU functions added or removed change the device set.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from backends.base import BackendBase, DeviceEventQueue, HealthLedger, pci_events_summary
from backends.contract import (
    Allocated,
    ClaimRef,
    Device,
    DevicesChanged,
    Health,
    HealthEvent,
    Inventory,
    Prepared,
    PrepareError,
)
from backends.sysfs import SysfsError, list_dir, list_pci_devices, read_hex
from backends.topology import device_name
from cdi.spec import ContainerEdits, DeviceNode

if TYPE_CHECKING:
    import pyudev

__all__ = ["TPU_GENERATIONS", "TpuBackend"]

GOOGLE = 0x1AE0
TPU_GENERATIONS = {0x005E: "v4", 0x0056: "v4lite", 0x0063: "v5e", 0x0062: "v5p", 0x006F: "v6e"}


# Chips per process for a process that owns N chips of one host, as libtpu expects them (x,y,z).
_CHIP_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}


_HOTPLUG = ("add", "remove", "bind", "unbind")


@dataclass(frozen=True)
class _Chip:
    bus_id: str
    index: int
    kind: str  # "accel" or "vfio"
    iommu_group: int | None


class TpuBackend(BackendBase):
    """TPU chips, one device each."""

    name = "tpu"
    driver = "tpu.google.com"
    records_own_changes = True  # prepare changes nothing on the node

    def __init__(self) -> None:
        super().__init__()
        self._chips: dict[str, _Chip] = {}  # from the last discovery
        self._events: DeviceEventQueue | None = None

    async def health(self) -> AsyncIterator[HealthEvent | DevicesChanged]:
        ledger = HealthLedger()
        with DeviceEventQueue(self.ctx.udev, ("pci", "accel", "vfio"), self._stopped) as events:
            self._events = events
            try:
                async for devices in events:
                    hotplug = [d for d in devices if d.subsystem == "pci" and self._concerns_us(d)]
                    if hotplug:
                        yield DevicesChanged(reason=pci_events_summary(hotplug))
                    if not devices or any(d.subsystem != "pci" for d in devices):
                        for event in await asyncio.to_thread(self._node_health, ledger):
                            yield event
            finally:
                self._events = None

    def _concerns_us(self, device: pyudev.Device) -> bool:
        """A PCI event that may change our device set: one of our chips, or a new Google function."""
        if device.action not in _HOTPLUG:
            return False
        if any(chip.bus_id == device.sys_name for chip in self._chips.values()):
            return True
        pci_id = device.properties.get("PCI_ID")
        return device.action in ("add", "bind") and (pci_id is None or pci_id.upper().startswith(f"{GOOGLE:04X}:"))

    def _node_health(self, ledger: HealthLedger) -> list[HealthEvent]:
        """Whether each chip's device node exists now; a chip without one cannot be used."""
        events = []
        for name, chip in self._chips.items():
            node = _node(chip).path
            present = (self.ctx.dev_root / node.removeprefix("/dev/")).exists()
            reason = f"TPU {chip.bus_id}: device node {node} is {'there' if present else 'missing'}"
            event = ledger.update(name, Health.HEALTHY if present else Health.UNHEALTHY, reason,
                                  cause="device-node-missing")
            if event is not None:
                events.append(event)
        ledger.keep_only(self._chips)
        return events

    async def prepare(self, claim: ClaimRef, devices: Sequence[Allocated]) -> Sequence[Prepared]:
        """The chips' device nodes, and the libtpu environment naming exactly the allocated chips."""
        missing = [a.device for a in devices if a.device not in self._chips]
        if missing:
            raise PrepareError(f"{', '.join(missing)} not found on this node (any more)")
        chips = [self._chips[a.device] for a in devices]
        env = [f"TPU_VISIBLE_CHIPS={','.join(str(c.index) for c in sorted(chips, key=lambda c: c.index))}",
               "TPU_PROCESS_BOUNDS=1,1,1"]
        if len(chips) in _CHIP_BOUNDS:
            env.append(f"TPU_CHIPS_PER_PROCESS_BOUNDS={_CHIP_BOUNDS[len(chips)]}")
        shared = (DeviceNode("/dev/vfio/vfio"),) if any(c.kind == "vfio" for c in chips) else ()
        common = ContainerEdits(env=tuple(env), device_nodes=shared)
        # The chip's index as published (`index`), as TPU_VISIBLE_CHIPS names it.
        return [Prepared(device=a.device, edits=ContainerEdits(device_nodes=(_node(c),)), common_edits=common,
                         facts={"index": c.index})
                for a, c in zip(devices, chips, strict=True)]

    async def discover(self) -> Inventory:
        inventory = await asyncio.to_thread(self._discover)
        if self._events is not None:
            self._events.wake()  # chips may have come or gone: check their nodes again
        return inventory

    def hardware(self, sysfs_root: Path) -> Sequence[str]:
        """The node's TPU chips, from sysfs alone (`ListsHardware`)."""
        try:
            return [bus_id for bus_id, _ in _chips(sysfs_root, [])]
        except SysfsError:
            return []

    def _discover(self) -> Inventory:
        warnings: list[str] = []
        try:
            chips = _chips(self.ctx.sysfs_root, warnings)
        except SysfsError as e:
            return Inventory(warnings=(str(e),))
        devices: list[Device] = []
        chips_now: dict[str, _Chip] = {}
        for position, (bus_id, generation) in enumerate(chips):
            topology = self.ctx.topology.lookup(bus_id)
            warnings.extend(topology.problems)
            accel = [e for e in list_dir(self.ctx.topology.device_dir(bus_id) / "accel") if e.startswith("accel")]
            if accel and accel[0].removeprefix("accel").isdigit():
                kind, index = "accel", int(accel[0].removeprefix("accel"))
            elif topology.driver == "vfio-pci":
                kind, index = "vfio", position
            else:
                warnings.append(f"TPU {bus_id}: bound to {topology.driver or 'no driver'}, neither an accel "
                                "device nor vfio-pci; left out")
                continue
            if kind == "vfio" and topology.iommu_group is None:
                warnings.append(f"TPU {bus_id}: on vfio-pci but without an IOMMU group; left out")
                continue
            name = device_name("tpu", bus_id)
            chips_now[name] = _Chip(bus_id, index, kind, topology.iommu_group)
            devices.append(Device(
                name=name,
                attributes={"type": "tpu", "generation": generation, "index": index, "deviceNodeKind": kind},
                topology=topology,
            ))
        self._chips = chips_now
        return Inventory(devices=tuple(devices), warnings=tuple(warnings))


def _chips(sysfs_root: Path, warnings: list[str]) -> list[tuple[str, str]]:
    """(PCI address, generation) of every TPU chip; a function that cannot be read is a warning. Blocking."""
    chips: list[tuple[str, str]] = []
    for bus_id in list_pci_devices(sysfs_root):
        folder = f"{sysfs_root}/bus/pci/devices/{bus_id}"  # strings: see TopologyReader.device_folder
        try:
            if read_hex(f"{folder}/vendor") != GOOGLE:
                continue
            generation = TPU_GENERATIONS.get(read_hex(f"{folder}/device") or -1)
        except SysfsError as e:
            warnings.append(f"PCI device {bus_id}: {e}")
            continue
        if generation is not None:  # other Google functions (e.g. gVNIC) are not ours
            chips.append((bus_id, generation))
    return chips


def _node(chip: _Chip) -> DeviceNode:
    return DeviceNode(f"/dev/accel{chip.index}" if chip.kind == "accel" else f"/dev/vfio/{chip.iommu_group}")
