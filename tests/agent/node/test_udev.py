"""The agent's udev monitor: dispatch on the event loop, failing handlers, lost events, and hosts where udev
cannot be watched. (Events from a simulated node, through real libudev: tests/end_to_end/test_udev_health.py.)"""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from agent.node.host import Host
from agent.node.udev import UdevMonitor, open_udev_monitor
from tests.support.timing import scaled


class FakeMonitor:
    """pyudev.Monitor's surface as UdevMonitor uses it: a readable fd and poll(timeout=0)."""

    def __init__(self) -> None:
        self.read_end, self.write_end = os.pipe()
        self.queued: list[Any] = []
        self.filters: list[str] = []

    def fileno(self) -> int:
        return self.read_end

    def filter_by(self, subsystem: str) -> None:
        self.filters.append(subsystem)

    def poll(self, timeout: float) -> Any:
        assert timeout == 0, "the loop must never block"
        if not self.queued:
            os.read(self.read_end, 4096)
            return None
        item = self.queued.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def deliver(self, *items: Any) -> None:
        self.queued.extend(items)
        os.write(self.write_end, b"x")

    def close(self) -> None:
        os.close(self.read_end)
        os.close(self.write_end)


def device(subsystem: str, name: str, action: str = "add") -> SimpleNamespace:
    return SimpleNamespace(subsystem=subsystem, sys_name=name, action=action)


async def test_dispatch_by_subsystem_survives_failing_handlers_and_lost_events() -> None:
    fake = FakeMonitor()
    udev = UdevMonitor(fake)
    seen: list[tuple[str, str]] = []
    done = asyncio.Event()

    def failing(d: SimpleNamespace) -> None:
        raise RuntimeError(f"cannot handle {d.sys_name}")

    def record(d: SimpleNamespace) -> None:
        seen.append((d.action, d.sys_name))
        if d.sys_name == "last":
            done.set()

    udev.subscribe("pci", failing)
    udev.subscribe("pci", record)
    unsubscribe = udev.subscribe("net", record)
    unsubscribe()
    assert fake.filters == ["pci", "net"], "the kernel drops other subsystems"
    try:
        with capture_logs() as logs:
            udev.start()
            fake.deliver(device("pci", "first"), OSError(errno.ENOBUFS, "No buffer space"),
                         device("net", "eth0", "change"), device("pci", "last", "remove"))
            await asyncio.wait_for(done.wait(), scaled(10))
        assert seen == [("add", "first"), ("remove", "last")]
        events = [log["event"] for log in logs]
        assert events.count("udev event handler failed") == 2
        assert "udev events were lost: the receive buffer overflowed" in events
        udev.close()
        assert not asyncio.get_running_loop().remove_reader(fake.read_end), "close() stops reading"
        with pytest.raises(RuntimeError, match="after close"):
            udev.start()
    finally:
        fake.close()


def test_the_real_host_gets_a_monitor_or_a_reason() -> None:
    with capture_logs() as logs:
        udev = open_udev_monitor(Host(Path("/sys"), Path("/dev"), driver_root=Path("/")))
    if udev is None:  # a sandbox without netlink sockets: the reason is logged
        assert any(log["event"].startswith("no udev events") for log in logs)
        return
    assert udev.source == "kernel"
    unsubscribe = udev.subscribe("pci", lambda device: None)
    unsubscribe()
    udev.close()
    udev.close()


def test_a_monitor_that_cannot_be_opened_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    import pyudev

    def refuse(context: object, source: str) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(pyudev.Monitor, "from_netlink", refuse)
    with capture_logs() as logs:
        assert open_udev_monitor(Host(Path("/sys"), Path("/dev"), driver_root=Path("/")), "udev") is None
    (warning,) = logs
    assert warning["event"].startswith("no udev events: cannot watch udev")
    assert warning["source"] == "udev" and "Operation not permitted" in warning["error"]
