"""The taint rule (agent/slices/taints.py): which taint each unhealthy or unmonitored device gets, and that every
one of them is a taint the API server accepts."""

from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from agent.node.health_board import HealthBoard
from agent.slices.device_rules import validate_device
from agent.slices.taints import TaintPolicy, device_taints
from backends.contract import Health, HealthEvent


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
