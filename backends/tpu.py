"""The tpu backend: Google TPU chips (PCI vendor 0x1ae0), exposed as /dev/accel<N> or through vfio-pci."""

from __future__ import annotations

import asyncio

from backends.base import BuiltinBackend
from backends.contract import Device, Inventory
from backends.sysfs import SysfsError, list_dir, list_pci_devices, read_hex
from backends.topology import device_name

__all__ = ["TPU_GENERATIONS", "TpuBackend"]

GOOGLE = 0x1AE0
TPU_GENERATIONS = {0x005E: "v4", 0x0056: "v4lite", 0x0063: "v5e", 0x0062: "v5p", 0x006F: "v6e"}


class TpuBackend(BuiltinBackend):
    """TPU chips, one device each."""

    name = "tpu"
    driver = "tpu.google.com"

    async def discover(self) -> Inventory:
        return await asyncio.to_thread(self._discover)

    def _discover(self) -> Inventory:
        warnings: list[str] = []
        chips: list[tuple[str, str]] = []
        try:
            for bus_id in list_pci_devices(self.ctx.sysfs_root):
                folder = self.ctx.topology.device_dir(bus_id)
                try:
                    if read_hex(folder / "vendor") != GOOGLE:
                        continue
                    generation = TPU_GENERATIONS.get(read_hex(folder / "device") or -1)
                except SysfsError as e:
                    warnings.append(f"PCI device {bus_id}: {e}")
                    continue
                if generation is not None:  # other Google functions (e.g. gVNIC) are not ours
                    chips.append((bus_id, generation))
        except SysfsError as e:
            return Inventory(warnings=(str(e),))
        devices: list[Device] = []
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
            devices.append(Device(
                name=device_name("tpu", bus_id),
                attributes={"type": "tpu", "generation": generation, "index": index, "deviceNodeKind": kind},
                topology=topology,
            ))
        return Inventory(devices=tuple(devices), warnings=tuple(warnings))
