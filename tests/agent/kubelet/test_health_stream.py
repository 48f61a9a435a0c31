"""The kubelet's health stream (agent/kubelet/health_stream.py): a list at once, on every change and every half
timeout, the same lists to every stream, and the lists a kubelet gets over a long connection."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from agent.kubelet.health_stream import HealthStream
from agent.kubelet.services import HealthStatus
from agent.node.health_board import HealthBoard
from backends.contract import Health, HealthEvent
from tests.support.agent_env import NODE, agent_in_process
from tests.support.timing import scaled


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
