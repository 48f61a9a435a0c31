"""FPGA backends for the conformance kit's own tests: `GoodFpga` passes every check; each other class breaks one
rule the way plugin authors do, and the kit must say what to fix."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from backends.base import BackendBase
from backends.config import BackendConfig
from backends.contract import Allocated, AttributeValue, BackendContext, ClaimRef, Device, Inventory, Prepared
from backends.sysfs import list_pci_devices, read_hex
from backends.topology import device_name
from cdi.spec import ContainerEdits, DeviceNode

VENDOR = 0x1172


class FpgaConfig(BackendConfig):
    """Settings of the test FPGA backend: there are none."""


class GoodFpga(BackendBase):
    """FPGA cards by PCI vendor id; a prepared card gets a session node under /dev, removed at unprepare."""

    name = "kit-fpga"
    driver = "fpga.kit.example"
    config_model: ClassVar[Any] = FpgaConfig

    async def discover(self) -> Inventory:
        return await asyncio.to_thread(self._discover)

    def _discover(self) -> Inventory:
        devices = []
        for bus_id in list_pci_devices(self.ctx.sysfs_root):
            if read_hex(self.ctx.topology.device_dir(bus_id) / "vendor") == VENDOR:
                devices.append(Device(name=self.device_name(bus_id), attributes=self.attributes(),
                                      topology=self.ctx.topology.lookup(bus_id)))
        return Inventory(devices=tuple(devices))

    def device_name(self, bus_id: str) -> str:
        return device_name("fpga", bus_id)

    def attributes(self) -> dict[str, AttributeValue]:
        return {"family": "agilex"}

    def session(self, device: str) -> Path:
        return self.ctx.dev_root / f"fpga-session-{device}"

    async def prepare(self, claim: ClaimRef, devices: Sequence[Allocated]) -> Sequence[Prepared]:
        return await asyncio.to_thread(self._prepare, claim, devices)

    def _prepare(self, claim: ClaimRef, devices: Sequence[Allocated]) -> list[Prepared]:
        prepared = []
        for allocated in devices:
            self.session(allocated.device).write_text(claim.uid)
            node = DeviceNode(f"/dev/{self.session(allocated.device).name}")
            prepared.append(Prepared(allocated.device, ContainerEdits(device_nodes=(node,))))
        return prepared

    async def unprepare(self, claim: ClaimRef, prepared: Sequence[Prepared]) -> None:
        await asyncio.to_thread(self._unprepare, prepared)

    def _unprepare(self, prepared: Sequence[Prepared]) -> None:
        for record in prepared:
            self.session(record.device).unlink(missing_ok=True)


class UnstableNames(GoodFpga):
    """Names cards in the order it meets them, counting on across discoveries."""

    def __init__(self) -> None:
        super().__init__()
        self._counter = itertools.count()

    def device_name(self, bus_id: str) -> str:
        return f"fpga{next(self._counter)}"


class NotIdempotent(GoodFpga):
    """Opens a new session at every prepare, even for a claim it prepared already."""

    def _prepare(self, claim: ClaimRef, devices: Sequence[Allocated]) -> list[Prepared]:
        prepared = []
        for allocated in devices:
            sessions = len(list(self.ctx.dev_root.glob(f"fpga-session-{allocated.device}*")))
            path = self.ctx.dev_root / f"fpga-session-{allocated.device}-{sessions}"
            path.write_text(claim.uid)
            prepared.append(Prepared(allocated.device, ContainerEdits(device_nodes=(DeviceNode(f"/dev/{path.name}"),)),
                                     restore={"session": sessions}))
        return prepared


class Blocking(GoodFpga):
    """Waits for the card on the event loop."""

    async def prepare(self, claim: ClaimRef, devices: Sequence[Allocated]) -> Sequence[Prepared]:
        time.sleep(0.2)  # noqa: ASYNC251 - the mistake this class shows: waiting for the card on the loop
        return await super().prepare(claim, devices)


class BadAttributes(GoodFpga):
    """Publishes attribute names and values the API server refuses."""

    def attributes(self) -> dict[str, AttributeValue]:
        return {"Vendor Name": "acme", "bitstream": "x" * 80}


class LeavesSession(GoodFpga):
    """Forgets to close the session at unprepare."""

    def _unprepare(self, prepared: Sequence[Prepared]) -> None:
        return None


class Untyped(GoodFpga):
    """Takes its settings as they come."""

    config_model = None

    async def start(self, ctx: BackendContext) -> None:
        self._ctx = ctx


class ClaimsOwnRecords(GoodFpga):
    """Declares that it records its own changes, yet keeps no record and has no reconcile: a prepare the core lost
    its record of is never undone."""

    records_own_changes = True
