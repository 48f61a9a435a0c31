"""The bridge from udev callbacks to a backend's health() generator, and the ledger of reported health."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from backends.base import DeviceEventQueue, HealthLedger
from backends.contract import Health, HealthEvent
from tests.support.timing import scaled


class Events:
    """A DeviceEvents that the test drives by hand."""

    def __init__(self) -> None:
        self.handlers: dict[str, list[Callable[[Any], None]]] = {}

    def subscribe(self, subsystem: str, handler: Callable[[Any], None]) -> Callable[[], None]:
        self.handlers.setdefault(subsystem, []).append(handler)
        return lambda: self.handlers[subsystem].remove(handler)

    def emit(self, subsystem: str, device: Any) -> None:
        for handler in list(self.handlers.get(subsystem, ())):
            handler(device)


async def test_batches_in_order_until_stopped() -> None:
    udev, stopped = Events(), asyncio.Event()
    batches: list[list[str]] = []
    with DeviceEventQueue(udev, ("pci", "net"), stopped) as queue:
        assert set(udev.handlers) == {"pci", "net"}
        iterator = aiter(queue)
        assert await anext(iterator) == [], "the first batch comes at once, empty"
        udev.emit("pci", "a")
        udev.emit("net", "b")
        udev.emit("accel", "not subscribed")
        batches.append(await anext(iterator))
        queue.wake()
        batches.append(await anext(iterator))
        waiting = asyncio.create_task(anext(iterator))
        await asyncio.sleep(0)
        assert not waiting.done(), "nothing to hand over: it waits"
        udev.emit("pci", "c")
        batches.append(await waiting)
        stopped.set()
        udev.emit("pci", "after the stop")
        assert [b async for b in queue] == []
    assert batches == [["a", "b"], [], ["c"]]
    assert udev.handlers == {"pci": [], "net": []}, "unsubscribed on leaving the block"


async def test_a_waiting_consumer_ends_when_the_backend_stops() -> None:
    stopped = asyncio.Event()
    with DeviceEventQueue(None, ("pci",), stopped) as queue:
        iterator = aiter(queue)
        assert await anext(iterator) == []
        waiting = asyncio.create_task(anext(iterator))
        await asyncio.sleep(0)
        stopped.set()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(waiting, scaled(5))


def test_ledger_reports_changes_only() -> None:
    ledger = HealthLedger()
    assert ledger.update("vf-a", Health.HEALTHY, "up") is None, "never reported counts as healthy"
    down = ledger.update("vf-a", Health.UNHEALTHY, "PF down", cause="link-down")
    assert down == HealthEvent("vf-a", Health.UNHEALTHY, reason="PF down", cause="link-down")
    assert ledger.update("vf-a", Health.UNHEALTHY, "PF down", cause="link-down") is None
    assert ledger.update("vf-a", Health.HEALTHY, "up", cause="link-down") == HealthEvent("vf-a", Health.HEALTHY, "up")
    ledger.update("vf-b", Health.UNHEALTHY, "PF down")
    ledger.keep_only(["vf-a"])
    assert ledger.update("vf-b", Health.HEALTHY, "up") is None, "a device gone and back starts healthy"
