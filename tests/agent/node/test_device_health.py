"""The health board, the taint rule and the kubelet's health stream, on their own."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.kubelet.health_stream import HealthStream
from agent.kubelet.services import HealthStatus
from agent.node.health_board import HealthBoard
from agent.slices.device_rules import validate_device
from agent.slices.taints import TaintPolicy, device_taints
from backends.contract import Health, HealthEvent
from tests.support.agent_env import NODE, agent_in_process
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


def test_taints_follow_the_rule() -> None:
    board = HealthBoard(["a", "b", "c", "d"])

    async def fill() -> None:
        board.apply(HealthEvent("a", Health.UNHEALTHY, "Xid 79", "xid", "79"))
        board.apply(HealthEvent("b", Health.UNKNOWN, "no NVML"))
        board.apply(HealthEvent("c", Health.UNHEALTHY, "lost", "gpu-lost"))

    asyncio.run(fill())
    taints = device_taints("gpu.example.com", board.unhealthy(), TaintPolicy.of(["gpu-lost"]))
    assert taints == {
        "a": [{"key": "gpu.example.com/xid", "value": "79", "effect": "NoSchedule"}],
        "b": [{"key": "gpu.example.com/unmonitored", "effect": "None"}],
        "c": [{"key": "gpu.example.com/gpu-lost", "effect": "NoExecute"}],
    }


@given(health=st.sampled_from([Health.UNHEALTHY, Health.UNKNOWN]), reason=st.text(max_size=300),
       cause=st.text(max_size=80), value=st.text(max_size=80))
def test_any_reported_state_gives_a_taint_the_api_server_accepts(health: Health, reason: str, cause: str,
                                                                  value: str) -> None:
    async def state_of() -> HealthBoard:
        board = HealthBoard(["dev-0"])
        board.apply(HealthEvent("dev-0", health, reason, cause, value))
        return board

    board = asyncio.run(state_of())
    taints = device_taints("gpu.nvidia.com", board.unhealthy())
    assert len(taints["dev-0"]) == 1
    assert validate_device({"name": "dev-0", "taints": taints["dev-0"]}) == []


async def test_stream_sends_at_once_on_change_and_every_half_timeout() -> None:
    board = HealthBoard(["a", "b"])
    clients: list[int] = []
    # 2 s, and longer by the time factor: the test asserts on when the refreshes come.
    timeout = max(2, round(scaled(2)))
    stream = HealthStream(NODE, board, timeout=timeout, on_clients=clients.append)
    messages = aiter(stream.watch())
    first = await anext(messages)
    assert [(r.device, r.health, r.timeout_seconds) for r in first] == [("a", HealthStatus.HEALTHY, timeout),
                                                                       ("b", HealthStatus.HEALTHY, timeout)]
    started = time.monotonic()
    second = await anext(messages)  # nothing changed: the refresh after half the timeout
    assert 0.45 * timeout <= time.monotonic() - started < 0.95 * timeout and len(second) == 2  # well before it
    waiting = asyncio.ensure_future(anext(messages))
    await asyncio.sleep(0.05 * timeout)  # the stream waits for a change, well before its next refresh
    changed_at = time.monotonic()
    board.apply(HealthEvent("b", Health.UNHEALTHY, "link down", "link-down"))
    third = await asyncio.wait_for(waiting, scaled(1))
    assert time.monotonic() - changed_at < 0.25 * timeout, "a change goes out at once, not at the next refresh"
    assert [(r.device, r.health, r.message) for r in third] == [("a", HealthStatus.HEALTHY, ""),
                                                                ("b", HealthStatus.UNHEALTHY, "link down")]
    await messages.aclose()  # type: ignore[attr-defined]
    assert clients == [1, 0] and stream.clients == 0


async def test_concurrent_streams_get_the_same_lists() -> None:
    board = HealthBoard(["a"])
    stream = HealthStream(NODE, board, timeout=round(scaled(30)))  # no refresh comes during the test
    one, two = aiter(stream.watch()), aiter(stream.watch())
    assert await anext(one) == await anext(two)
    board.apply(HealthEvent("a", Health.UNHEALTHY, "Xid 79", "xid", "79"))
    got = await asyncio.wait_for(asyncio.gather(anext(one), anext(two)), scaled(1))
    assert got[0] == got[1] and got[0][0].health == HealthStatus.UNHEALTHY
    assert stream.clients == 2


@pytest.mark.slow
async def test_a_kubelet_connected_for_100_seconds_gets_at_least_six_lists(scratch: Path) -> None:
    from simulator.kubelet import KubeletSimulator

    async with agent_in_process(scratch, "gke-g2-l4") as env, KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await kubelet.wait_for_plugin("gpu.nvidia.com")
        lists = 0
        window = scaled(100)  # the window is the point of the test: kept, and stretched
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(window):
                async for reports in plugin.health():
                    lists += 1
                    assert reports and all(r.health == HealthStatus.HEALTHY for r in reports)
    # The default timeout is 30 s, so a list every 15 s: at 0, 15, ..., 90 s (in 100 s), and at least one more for
    # every 15 s the window is longer.
    assert lists >= window // 15
