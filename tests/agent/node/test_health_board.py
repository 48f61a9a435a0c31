"""The health board (agent/node/health_board.py): the latest health of each device a backend reports, what
changes it, devices that leave, and the waiters woken by a change."""

from __future__ import annotations

import asyncio
import time

from agent.node.health_board import HealthBoard
from backends.contract import Health, HealthEvent
from tests.support.timing import scaled


async def test_board_records_changes_only() -> None:
    board = HealthBoard(["a", "b"])
    assert board.apply(HealthEvent("a", Health.HEALTHY)) is None, "healthy to healthy is no change"
    state = board.apply(HealthEvent("a", Health.UNHEALTHY, "Xid 79", "xid", "79"))
    assert state is not None and state.health is Health.UNHEALTHY and board.version == 1
    assert board.apply(HealthEvent("a", Health.UNHEALTHY, "Xid 79", "xid", "79")) is None, "a repeated report"
    assert board.apply(HealthEvent("a", Health.UNHEALTHY, "Xid 48", "xid", "48")) is not None, "another Xid"
    assert list(board.unhealthy()) == ["a"]
    assert board.apply(HealthEvent("a", Health.HEALTHY, "reset")) is not None
    assert board.unhealthy() == {} and board.version == 3


async def test_devices_that_leave_are_forgotten_unless_in_use() -> None:
    board = HealthBoard(["a", "b", "c"])
    board.apply(HealthEvent("b", Health.UNHEALTHY, "link down", "link-down"))
    in_use = {"c"}
    board.in_use = lambda: in_use
    board.set_devices(["a"])
    states = board.states()
    assert list(states) == ["a", "c"], "b left and nobody uses it; c left while a claim uses it"
    assert states["c"].health is Health.UNHEALTHY and states["c"].cause == "removed"
    board.set_devices(["a", "b"])
    assert board.state("b").health is Health.HEALTHY, "a device that comes back starts healthy"
    in_use.clear()
    assert list(board.states()) == ["a", "b"]


async def test_waiters_wake_on_change_and_on_timeout() -> None:
    board = HealthBoard(["a"])
    waiter = asyncio.create_task(board.wait_changed(board.version, scaled(5)))
    await asyncio.sleep(0)
    board.apply(HealthEvent("a", Health.UNKNOWN, "NVML does not answer", "unmonitored"))
    assert await asyncio.wait_for(waiter, scaled(1)) == 1
    started = time.monotonic()
    assert await board.wait_changed(1, 0.05) == 1
    assert time.monotonic() - started >= 0.04
