"""One NVIDIA backend's health stream: the watcher's notices judged with the backend's configuration, turned
into health events of the devices it publishes, plus udev hot-plug and recovery triggers.

Everything here runs on the event loop; the only blocking work (NVML) is the watcher thread's. Notices and udev
events meet in one `DeviceEventQueue`: a notice asks it for a batch with `wake()`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from backends.base import DeviceEventQueue, pci_events_summary
from backends.contract import DeviceEvents, DevicesChanged, Health, HealthEvent
from backends.nvidia.health_notices import Subscriber
from backends.nvidia.health_rules import (
    GPU_LOST,
    NO_INSTANCE,
    Condition,
    DeviceRef,
    GpuEvent,
    GpuLost,
    GpuRecovered,
    GpuUnmonitored,
    Ignored,
    Notice,
    Unit,
    classify,
    device_conditions,
    unit_of,
    unmonitored,
    worse,
)
from backends.nvidia.health_watcher import HealthWatcher, subscribe, unsubscribe

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from structlog.typing import FilteringBoundLogger

__all__ = ["HealthFeed"]

_NVIDIA = 0x10DE
_DISPLAY_CLASS = 0x03  # PCI base class of GPUs (VGA and 3D controllers)
_SET_CHANGES = ("add", "remove", "bind", "unbind")
_RECOVERED = "NVML answers normally for the GPU again"

Item = HealthEvent | DevicesChanged


class HealthFeed:
    """The health stream of one backend (nvidia-gpu or nvidia-mig) over the process's shared watcher."""

    def __init__(
        self,
        *,
        log: FilteringBoundLogger,
        ignored_xids: Collection[int],
        recheck_seconds: float,
        sysfs_root: Path,
        udev: DeviceEvents | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self._log = log
        self._ignored = frozenset(ignored_xids)
        self._recheck_seconds = recheck_seconds
        self._sysfs_root = sysfs_root
        self._udev = udev
        self._registry = registry
        self._devices: dict[str, DeviceRef] = {}
        self._units: dict[Unit, Condition] = {}
        self._told: dict[str, Condition] = {}  # what the stream last said about each unhealthy/unknown device
        self._notices: list[Notice] = []
        self._changes: list[str] = []  # reasons to discover again that came from the backend itself
        self._events: DeviceEventQueue | None = None
        self._streaming = False
        self._watcher: HealthWatcher | None = None
        self._subscriber: Subscriber | None = None
        self._release: asyncio.Task[None] | None = None

    # -- the backend's side -------------------------------------------------------------------------------

    def set_devices(self, devices: Mapping[str, DeviceRef]) -> None:
        """The devices the backend publishes now (after each discovery)."""
        self._devices = dict(devices)
        if self._watcher is not None:
            self._watcher.expect({ref.uuid for ref in self._devices.values()})
        if self._events is not None:
            self._events.wake()

    def devices_changed(self, reason: str) -> None:
        """Have the stream say `DevicesChanged(reason)` (call on the event loop)."""
        self._changes.append(reason)
        if self._events is not None:
            self._events.wake()

    async def stream(self, stopped: asyncio.Event) -> AsyncIterator[Item]:
        """Health changes and device-set changes until `stopped` is set; starts watching when iterated, with the
        conditions of the devices as they are then."""
        if self._streaming or stopped.is_set():
            return
        self._streaming = True
        self._subscriber = Subscriber(asyncio.get_running_loop(), self._deliver, self._recheck_seconds, self._log,
                                      self._registry)
        self._watcher = subscribe(self._subscriber)
        self._watcher.expect({ref.uuid for ref in self._devices.values()})
        try:
            with DeviceEventQueue(self._udev, ("pci",), stopped) as events:
                self._events = events
                async for devices in events:
                    for item in self._batch(devices):
                        yield item
        finally:
            self._events = None
            await self.close()
            # A stream that failed may be followed again: the new one starts by telling every device's state.
            self._streaming, self._watcher, self._subscriber, self._release = False, None, None, None
            self._told = {name: _RESTATE for name in self._devices}

    async def close(self) -> None:
        """Stop watching: waits for the watcher thread when this was its last user. The stream ends with the
        backend's stop event."""
        if self._release is None and self._watcher is not None and self._subscriber is not None:
            self._release = asyncio.ensure_future(unsubscribe(self._watcher, self._subscriber))
        if self._release is not None:
            await asyncio.shield(self._release)

    def _batch(self, devices: list[Any]) -> list[Item]:
        """What one batch of udev events and the notices received since the last batch come to."""
        items: list[Item] = []
        changed = [d for d in devices if self._on_udev(d)]
        if changed:
            items.append(DevicesChanged(pci_events_summary(changed)))
        reasons, self._changes = self._changes, []
        items.extend(DevicesChanged(reason) for reason in reasons)
        notices, self._notices = self._notices, []
        for notice in notices:
            self._on_notice(notice)
        items.extend(self._reconcile())
        return items

    # -- the watcher's notices ------------------------------------------------------------------------------

    def _owns(self, uuid: str) -> bool:
        return any(ref.uuid == uuid for ref in self._devices.values())

    def _deliver(self, notice: Notice) -> None:
        self._notices.append(notice)
        if self._events is not None:
            self._events.wake()

    def _on_notice(self, notice: Notice) -> None:
        if isinstance(notice, GpuEvent):
            verdict = classify(notice, self._ignored)
            if isinstance(verdict, Ignored):
                if self._owns(notice.uuid):
                    log = self._log.info if verdict.notable else self._log.debug
                    log("GPU event changes no health", gpu=notice.uuid, detail=verdict.message,
                        gpu_instance=notice.gpu_instance, compute_instance=notice.compute_instance)
                return
            self._mark(unit_of(notice), verdict)
            if self._watcher is not None:
                self._watcher.suspect(notice.uuid)
        elif isinstance(notice, GpuLost):
            self._mark((notice.uuid, *_WHOLE), GPU_LOST)
        elif isinstance(notice, GpuUnmonitored):
            self._mark((notice.uuid, *_WHOLE), unmonitored(notice.detail))
        elif isinstance(notice, GpuRecovered):
            for unit in [u for u, c in self._units.items() if u[0] == notice.uuid]:
                if notice.everything or self._units[unit].cause == "unmonitored":
                    del self._units[unit]

    def _mark(self, unit: Unit, condition: Condition) -> None:
        self._units[unit] = worse(self._units.get(unit), condition)

    def _reconcile(self) -> list[HealthEvent]:
        """An event for every device whose condition differs from what the stream last said about it."""
        events: list[HealthEvent] = []
        desired = device_conditions(self._units, self._devices)
        for name in sorted(self._devices):
            new, old = desired.get(name), self._told.get(name)
            if new == old:
                continue
            if new is None:
                del self._told[name]
                self._log.info("device healthy again", device=name)
                events.append(HealthEvent(name, Health.HEALTHY, _RECOVERED))
            else:
                self._told[name] = new
                self._log.warning("device not healthy", device=name, health=new.health.value, reason=new.reason)
                events.append(HealthEvent(name, new.health, new.reason, new.cause, new.value))
        for gone in set(self._told) - set(self._devices):
            del self._told[gone]  # if it comes back, the core sees it healthy until told otherwise
        return events

    # -- udev -----------------------------------------------------------------------------------------------

    def _on_udev(self, device: Any) -> bool:
        """Act on one PCI event; whether it changes the set of devices (a rediscovery is due)."""
        action = str(getattr(device, "action", "") or "")
        bus_id = str(getattr(device, "sys_name", "") or "")
        owned = any(ref.bus_id == bus_id for ref in self._devices.values())
        if owned and action != "remove" and self._watcher is not None:
            self._watcher.recheck(bus_id)  # a reset or rebind shows up here: the GPU may be well again
        if action not in _SET_CHANGES or not (owned or self._is_nvidia_gpu(device, bus_id)):
            return False
        if self._watcher is not None:
            self._watcher.refresh()
        return True

    def _is_nvidia_gpu(self, device: Any, bus_id: str) -> bool:
        """Whether the PCI function is an NVIDIA GPU, from the event's properties or else from sysfs (two small
        reads of an in-memory file system: cheap enough for the event loop)."""
        properties = getattr(device, "properties", None)
        pci_id = properties.get("PCI_ID") if properties is not None else None
        pci_class = properties.get("PCI_CLASS") if properties is not None else None
        try:
            vendor = int(str(pci_id).split(":")[0], 16) if pci_id else _read_hex(self._pci(bus_id) / "vendor")
            klass = int(str(pci_class), 16) if pci_class else _read_hex(self._pci(bus_id) / "class")
        except (OSError, ValueError):
            return False
        return vendor == _NVIDIA and klass >> 16 == _DISPLAY_CLASS

    def _pci(self, bus_id: str) -> Path:
        return self._sysfs_root / "bus/pci/devices" / bus_id


_WHOLE = (NO_INSTANCE, NO_INSTANCE)
_RESTATE = Condition(Health.UNKNOWN, "", "")  # never a real condition: the device's state is told again


def _read_hex(path: Path) -> int:
    return int(path.read_text().strip(), 16)
