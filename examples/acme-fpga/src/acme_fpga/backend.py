"""The acme-fpga-card backend: ACME FPGA cards (PCI ids from the settings) bound to the `acme_fpga` driver.

Each card is one device, named after its PCI address, with the standard topology attributes, its model and its
memory as a capacity. A claim gets the card's device nodes (the driver's `acme_fpga` class devices) and, with an
`FpgaConfig`, the bitstream it asks for loaded on the card; unprepare loads the image the card had before.

Crash safety: before a card is reprogrammed, the image it had is written to a journal file in the backend's state
directory. The same image goes into the `Prepared.restore` record. Unprepare takes the image from the record, or
from the journal when the record is empty (the core's roll-back after a crash), and `reconcile` hands back the
cards of claims the core no longer holds (so the backend declares `records_own_changes`). The journal entry is
synced before the card is touched: some cards keep their image in flash, across a reboot.

Health, from udev: a card whose device node is gone (its `acme_fpga` class device removed while the driver holds
the card) stays published and is unhealthy (cause `device-node-missing`) until the node is back; PCI functions of
ours coming, going, or changing driver make the agent discover again.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from acme_fpga.config import AcmeFpgaSettings, FpgaConfig
from backends.plugin import (
    Allocated,
    BackendBase,
    ClaimRef,
    ContainerEdits,
    Device,
    DeviceEventQueue,
    DeviceNode,
    DevicesChanged,
    Health,
    HealthEvent,
    HealthLedger,
    Inventory,
    Prepared,
    PrepareError,
    SysfsError,
    device_name,
    list_dir,
    list_pci_devices,
    pci_events_summary,
    read_attr,
    read_hex,
)

if TYPE_CHECKING:
    import pyudev

__all__ = ["DRIVER", "AcmeFpgaBackend"]

DRIVER = "acme_fpga"
"""The kernel driver of the cards, and the class of its character devices."""

# What the cards are, by PCI id: product name and on-card memory.
_MODELS = {"acce:0f01": ("ACME F1", 16 * 2**30), "acce:0f02": ("ACME F2", 32 * 2**30)}
_HOTPLUG = ("add", "remove", "bind", "unbind")


@dataclass(frozen=True)
class _Card:
    bus_id: str
    nodes: tuple[str, ...]  # below /dev, e.g. ("acme/fpga0",)


class AcmeFpgaBackend(BackendBase):
    """ACME FPGA cards, one device each."""

    name = "acme-fpga-card"
    driver = "fpga.acme.example"
    config_model = AcmeFpgaSettings
    config_types: ClassVar[tuple[type[FpgaConfig], ...]] = (FpgaConfig,)
    # Every change (a bitstream) is journalled durably before it is made, and reconcile gives back what no claim
    # holds: the core need not wait for the disk before calling prepare.
    records_own_changes: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self._cards: dict[str, _Card] = {}  # device name → card, from the last discovery
        self._events: DeviceEventQueue | None = None

    @property
    def settings(self) -> AcmeFpgaSettings:
        assert isinstance(self._config, AcmeFpgaSettings)
        return self._config

    # Discovery ------------------------------------------------------------------------------------------------

    async def discover(self) -> Inventory:
        inventory = await asyncio.to_thread(self._discover)  # sysfs reads block: never on the event loop
        if self._events is not None:
            self._events.wake()  # cards may have come or gone: check their nodes again
        return inventory

    def _discover(self) -> Inventory:
        devices: list[Device] = []
        cards: dict[str, _Card] = {}
        warnings: list[str] = []
        try:
            bus_ids = list_pci_devices(self.ctx.sysfs_root)
        except SysfsError as e:
            return Inventory(warnings=(str(e),))
        for bus_id in bus_ids:
            folder = self.ctx.topology.device_dir(bus_id)
            pci_id = f"{read_hex(folder / 'vendor') or 0:04x}:{read_hex(folder / 'device') or 0:04x}"
            if pci_id not in self.settings.ids:
                continue
            topology = self.ctx.topology.lookup(bus_id)
            warnings.extend(topology.problems)
            if topology.driver != DRIVER:
                warnings.append(f"FPGA {bus_id}: bound to {topology.driver or 'no driver'}, not {DRIVER}; left out")
                continue
            name = device_name("fpga", bus_id)  # from the PCI address: stable across restarts and reboots
            nodes = tuple(sorted(_devname(folder / DRIVER / entry) for entry in list_dir(folder / DRIVER)))
            if name in self._cards and (not nodes or "" in nodes):
                # Its character device went while the driver still holds it: stay published, health says unusable.
                nodes = self._cards[name].nodes
            if not nodes or "" in nodes:
                warnings.append(f"FPGA {bus_id}: the {DRIVER} driver shows no device node for it; left out")
                continue
            model, memory = _MODELS.get(pci_id, ("unknown", 0))
            cards[name] = _Card(bus_id, nodes)
            devices.append(Device(
                name=name,
                attributes={"type": "fpga", "model": model, "pciId": pci_id},
                capacity={"memory": memory} if memory else {},
                topology=topology,  # pcieRoot, pciBusID, numaNode, pcieSwitch: published for us
            ))
        self._cards = cards
        return Inventory(devices=tuple(devices), warnings=tuple(warnings))

    # Health ---------------------------------------------------------------------------------------------------

    async def health(self) -> AsyncIterator[HealthEvent | DevicesChanged]:
        ledger = HealthLedger()
        with DeviceEventQueue(self.ctx.udev, ("pci", DRIVER), self._stopped) as events:
            self._events = events
            try:
                async for batch in events:
                    hotplug = [d for d in batch if d.subsystem == "pci" and self._concerns_us(d)]
                    if hotplug:
                        yield DevicesChanged(reason=pci_events_summary(hotplug))
                    for event in await asyncio.to_thread(self._node_health, ledger):
                        yield event
            finally:
                self._events = None

    def _concerns_us(self, device: pyudev.Device) -> bool:
        if device.action not in _HOTPLUG:
            return False
        if any(card.bus_id == device.sys_name for card in self._cards.values()):
            return True
        return str(device.properties.get("PCI_ID", "")).lower() in self.settings.ids

    def _node_health(self, ledger: HealthLedger) -> list[HealthEvent]:
        events = []
        for name, card in self._cards.items():
            missing = [n for n in card.nodes if not (self.ctx.dev_root / n).exists()]
            reason = (f"FPGA {card.bus_id}: device node /dev/{missing[0]} is missing" if missing
                      else f"FPGA {card.bus_id}: device nodes present")
            event = ledger.update(name, Health.UNHEALTHY if missing else Health.HEALTHY, reason,
                                  cause="device-node-missing")
            if event is not None:
                events.append(event)
        ledger.keep_only(self._cards)
        return events

    # Prepare and unprepare ------------------------------------------------------------------------------------

    async def prepare(self, claim: ClaimRef, devices: Sequence[Allocated]) -> Sequence[Prepared]:
        missing = [a.device for a in devices if a.device not in self._cards]
        if missing:
            raise PrepareError(f"{', '.join(missing)} not found on this node (any more)")
        if self.ctx.state_dir is None and any(isinstance(a.config, FpgaConfig) for a in devices):
            raise PrepareError("loading a bitstream is done only by `dra-agent run`, which keeps the records")
        return await asyncio.to_thread(self._prepare, claim, devices)

    def _prepare(self, claim: ClaimRef, devices: Sequence[Allocated]) -> list[Prepared]:
        nodes = [f"/dev/{n}" for a in devices for n in self._cards[a.device].nodes]
        common = ContainerEdits(env=(f"ACME_FPGA_DEVICES={','.join(nodes)}",))
        prepared = []
        for allocated in devices:
            card = self._cards[allocated.device]
            restore = {}
            if isinstance(allocated.config, FpgaConfig):
                restore["bitstream"] = self._load(claim.uid, allocated.device, card, allocated.config.bitstream)
            edits = ContainerEdits(device_nodes=tuple(DeviceNode(f"/dev/{n}") for n in card.nodes))
            prepared.append(Prepared(allocated.device, edits, common_edits=common, restore=restore))
        return prepared

    def _load(self, claim: str, device: str, card: _Card, bitstream: str) -> str:
        """Load `bitstream` on the card; returns the image it had before this claim (the same on a retry)."""
        journal = self._journal(claim, device)
        if journal.exists():  # prepared already (a retry): the image before is the one recorded then
            previous = str(json.loads(journal.read_text())["bitstream"])
        else:
            previous = read_attr(self.ctx.topology.device_dir(card.bus_id) / "bitstream") or "factory"
            _write_durably(journal, json.dumps({"bitstream": previous, "bus_id": card.bus_id}))
        (self.ctx.topology.device_dir(card.bus_id) / "bitstream").write_text(bitstream + "\n")
        return previous

    async def unprepare(self, claim: ClaimRef, prepared: Sequence[Prepared]) -> None:
        await asyncio.to_thread(self._unprepare, claim.uid, prepared)

    def _unprepare(self, claim: str, prepared: Sequence[Prepared]) -> None:
        for record in prepared:
            self._give_back(claim, record.device, record.restore)

    def _give_back(self, claim: str, device: str, restore: Mapping[str, object]) -> None:
        """Load the image the card had before the claim, from the record or else the journal; drop the journal."""
        journal = self._journal(claim, device)
        entry = json.loads(journal.read_text()) if journal.exists() else {}
        previous = restore.get("bitstream") or entry.get("bitstream")
        card = self._cards.get(device)
        bus_id = card.bus_id if card is not None else entry.get("bus_id")
        if previous and bus_id:
            (self.ctx.topology.device_dir(str(bus_id)) / "bitstream").write_text(f"{previous}\n")
        journal.unlink(missing_ok=True)

    async def reconcile(self, held: Mapping[str, Sequence[str]]) -> None:
        """Give back the cards the journal says were programmed for claims the core no longer holds."""
        state = self.ctx.state_dir
        if state is None:
            return
        for path in await asyncio.to_thread(lambda: sorted(state.glob("*.json"))):
            claim, _, device = path.stem.partition("_")
            if device not in held.get(claim, ()):
                self.ctx.log.warning("giving back an FPGA programmed for a claim no longer prepared",
                                     claim=claim, device=device)
                await asyncio.to_thread(self._give_back, claim, device, {})

    def _journal(self, claim: str, device: str) -> Path:
        assert self.ctx.state_dir is not None
        return self.ctx.state_dir / f"{claim}_{device}.json"


def _devname(class_device: Path) -> str:
    """The node a class device has below /dev, from its uevent's DEVNAME (as udev names it)."""
    for line in (read_attr(class_device / "uevent") or "").splitlines():
        key, _, value = line.partition("=")
        if key == "DEVNAME":
            return value
    return ""


def _write_durably(path: Path, text: str) -> None:
    """Write a journal entry so that it survives a crash: a temporary file, fsync, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    with temporary.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    temporary.replace(path)
