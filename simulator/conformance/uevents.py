"""udev events for a backend under test: a `DeviceEvents` the kit owns, recording subscriptions and delivering
the events the kit makes (a PCI function removed and added back), shaped as pyudev devices are for backends."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["KitDeviceEvents", "KitUevent", "pci_uevent"]


@dataclass(frozen=True)
class KitUevent:
    """The parts of a `pyudev.Device` a backend reads from an event."""

    action: str
    subsystem: str
    sys_name: str
    sys_path: str
    properties: dict[str, str] = field(default_factory=dict)
    driver: str | None = None

    @property
    def device_path(self) -> str:
        return self.properties.get("DEVPATH", "")

    def get(self, key: str, default: Any = None) -> Any:
        return self.properties.get(key, default)


class KitDeviceEvents:
    """Implements `backends.plugin.DeviceEvents` for one backend instance."""

    def __init__(self) -> None:
        self._handlers: dict[str, list[Callable[[Any], None]]] = {}
        self.errors: list[str] = []

    def subscribe(self, subsystem: str, handler: Callable[[Any], None]) -> Callable[[], None]:
        handlers = self._handlers.setdefault(subsystem, [])
        handlers.append(handler)

        def unsubscribe() -> None:
            if handler in handlers:
                handlers.remove(handler)

        return unsubscribe

    def subscribed(self) -> list[str]:
        """Subsystems with a handler now, one entry per handler."""
        return [s for s, handlers in sorted(self._handlers.items()) for _ in handlers]

    async def emit(self, event: KitUevent) -> int:
        """Hand `event` to the subsystem's handlers on the loop, as the agent's monitor does; how many got it."""
        handlers = list(self._handlers.get(event.subsystem, ()))
        for handler in handlers:
            try:
                handler(event)
            except Exception as e:
                self.errors.append(f"the udev handler for {event.subsystem} raised {type(e).__name__}: {e} on "
                                   f"{event.action} {event.sys_name}")
        await asyncio.sleep(0)
        return len(handlers)


def pci_uevent(sysfs: Path, bus_id: str, action: str) -> KitUevent:
    """The kernel's uevent for PCI function `bus_id` (read from sysfs, so call it while the function is there)."""
    folder = Path(os.path.realpath(sysfs / "bus/pci/devices" / bus_id))

    def read(name: str) -> str:
        try:
            return (folder / name).read_text().strip()
        except OSError:
            return ""

    vendor, device, cls = read("vendor"), read("device"), read("class")
    driver_link = folder / "driver"
    driver = os.path.basename(os.readlink(driver_link)) if driver_link.is_symlink() else None
    properties = {
        "ACTION": action, "SUBSYSTEM": "pci", "DEVPATH": "/" + str(folder.relative_to(sysfs)),
        "PCI_SLOT_NAME": bus_id, "PCI_ID": f"{vendor.removeprefix('0x')}:{device.removeprefix('0x')}".upper(),
        "PCI_CLASS": cls.removeprefix("0x").upper(),
    }
    if driver:
        properties["DRIVER"] = driver
    return KitUevent(action, "pci", bus_id, str(folder), properties, driver)
