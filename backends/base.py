"""Plumbing a backend may share, built-in or third-party: the context, typed configuration, the stop signal, and
udev events queued for a health() generator."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, ClassVar

from backends.config import BackendConfig, parse_config
from backends.contract import (
    Allocated,
    BackendContext,
    ClaimRef,
    DeviceEvents,
    DevicesChanged,
    Health,
    HealthEvent,
    Prepared,
    PrepareError,
)

if TYPE_CHECKING:
    import pyudev

__all__ = ["BackendBase", "DeviceEventQueue", "HealthLedger", "pci_events_summary"]


class BackendBase:
    """The plumbing of a backend: it keeps the context (`ctx`, from `start`), validates the settings against
    `config_model` (a ConfigError names the field), and owns the stop signal (`_stopped`) its `health()` ends on.
    Its `health()` stays silent until stop, and `prepare` refuses, for backends that have nothing to say or
    prepare. The built-in backends subclass it; a third-party backend may too, or implement the protocol
    directly."""

    name: ClassVar[str]
    driver: ClassVar[str]
    config_model: ClassVar[type[BackendConfig]] = BackendConfig

    def __init__(self) -> None:
        self._ctx: BackendContext | None = None
        self._config: BackendConfig | None = None
        self._stopped = asyncio.Event()

    @property
    def ctx(self) -> BackendContext:
        if self._ctx is None:
            raise RuntimeError(f"backend {self.name} used before start()")
        return self._ctx

    async def start(self, ctx: BackendContext) -> None:
        self._config = parse_config(self.config_model, ctx.config, self.name)
        self._ctx = ctx

    async def health(self) -> AsyncIterator[HealthEvent | DevicesChanged]:
        # No health source of its own: the stream stays open, silent, until the backend stops.
        await self._stopped.wait()
        return
        yield  # makes this an async generator

    async def prepare(self, claim: ClaimRef, devices: Sequence[Allocated]) -> Sequence[Prepared]:
        raise PrepareError(f"backend {self.name} does not support preparing devices")

    async def unprepare(self, claim: ClaimRef, prepared: Sequence[Prepared]) -> None:
        return None

    async def stop(self) -> None:
        self._stopped.set()


class DeviceEventQueue:
    """udev events of some subsystems, taken from the monitor's callbacks and handed to a backend's health()
    generator in batches, until the backend stops:

        async def health(self):
            with DeviceEventQueue(self.ctx.udev, ("pci", "net"), self._stopped) as events:
                async for devices in events:  # pyudev devices, with .action; the first batch is empty
                    ...                       # read sysfs (off the loop), yield HealthEvent / DevicesChanged

    The first batch comes at once and is empty, so the backend reports the state it starts in. `wake()` asks for
    another batch even without events (e.g. after a rediscovery). With `udev` None only those batches come.
    Events that arrive together come in one batch, so a burst (a PF and its VFs removed) is handled once.
    """

    def __init__(self, udev: DeviceEvents | None, subsystems: Iterable[str], stopped: asyncio.Event) -> None:
        self._udev = udev
        self._subsystems = tuple(subsystems)
        self._stopped = stopped
        self._pending: list[pyudev.Device] = []
        self._ready = asyncio.Event()
        self._ready.set()
        self._unsubscribe: list[Callable[[], None]] = []

    def __enter__(self) -> DeviceEventQueue:
        if self._udev is not None:
            self._unsubscribe = [self._udev.subscribe(s, self._on_event) for s in self._subsystems]
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe = []

    def wake(self) -> None:
        """Hand over a batch now, even an empty one."""
        self._ready.set()

    def _on_event(self, device: pyudev.Device) -> None:
        self._pending.append(device)
        self._ready.set()

    def __aiter__(self) -> DeviceEventQueue:
        return self

    async def __anext__(self) -> list[pyudev.Device]:
        if not self._ready.is_set() and not self._stopped.is_set():
            waiters = [asyncio.ensure_future(self._ready.wait()), asyncio.ensure_future(self._stopped.wait())]
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()
                await asyncio.gather(*waiters, return_exceptions=True)
        if self._stopped.is_set():
            raise StopAsyncIteration
        batch, self._pending = self._pending, []
        self._ready.clear()
        return batch


class HealthLedger:
    """The health last reported for each device, so that a backend yields changes only. A device never reported
    counts as healthy, which is how the core publishes it."""

    def __init__(self) -> None:
        self._reported: dict[str, Health] = {}

    def update(self, device: str, health: Health, reason: str, cause: str = "") -> HealthEvent | None:
        """The event to yield when `device` now has `health`, or None when that was already reported."""
        if self._reported.get(device, Health.HEALTHY) == health:
            return None
        self._reported[device] = health
        return HealthEvent(device, health, reason=reason, cause=cause if health is not Health.HEALTHY else "")

    def keep_only(self, devices: Iterable[str]) -> None:
        """Forget devices that are gone, so that one coming back starts healthy again."""
        keep = set(devices)
        self._reported = {d: h for d, h in self._reported.items() if d in keep}


def pci_events_summary(devices: Sequence[pyudev.Device]) -> str:
    """One line for a batch of PCI uevents (a DevicesChanged reason), e.g. 'PCI remove 0000:04:00.1, 0000:04:00.0'."""
    by_action: dict[str, list[str]] = {}
    for device in devices:
        by_action.setdefault(device.action or "change", []).append(device.sys_name)
    parts = []
    for action, names in by_action.items():
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        parts.append(f"PCI {action} {shown}")
    return "; ".join(parts)
