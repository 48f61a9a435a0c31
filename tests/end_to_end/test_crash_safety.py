"""kill -9 at every step of prepare and unprepare, then restart: the checkpoint, the CDI directory and the
hardware agree, the kubelet's retry succeeds, and nothing is left after unprepare."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path

import grpc
import pytest

from agent.claims.checkpoint import Checkpoint
from backends.failpoints import POINTS
from simulator.apiserver.server import TestApiServer
from simulator.kubelet import KubeletSimulator
from simulator.kubelet_connection import KubeletError
from tests.support.agent_env import NODE, AgentProcess, allocate, plugin_after_restart, settings_for, wait_until
from tests.support.timing import scaled

GPU = "gpu.nvidia.com"

# What a crash at each point leaves on disk: the claim's checkpoint state (None: no record) and its CDI spec.
AFTER_CRASH = {
    "prepare-before-started": (None, False),
    "prepare-after-started": ("started", False),
    "prepare-after-backends": ("started", False),
    "prepare-after-cdi": ("started", True),
    "prepare-after-completed": ("completed", True),
    "unprepare-before-backends": ("completed", True),
    "unprepare-after-backends": ("completed", True),
    "unprepare-after-cdi": ("completed", False),
    "unprepare-after-removed": (None, False),
}


@pytest.fixture
async def server() -> AsyncIterator[TestApiServer]:
    async with TestApiServer() as api:
        api.add_node(NODE)
        yield api


def test_every_crash_point_is_covered() -> None:
    assert set(AFTER_CRASH) == set(POINTS) and len(POINTS) >= 8


def claim_state(state_dir: Path, uid: str) -> str | None:
    journal = Checkpoint(state_dir / GPU / "checkpoint.journal", "unused")
    journal.load()
    record = journal.claims.get(uid)
    return record.state if record else None


def hardware(node_root: Path) -> dict[str, str]:
    """What prepare may change on the node: the driver every PCI function is bound to."""
    devices = node_root / "sys/bus/pci/devices"
    return {d.name: os.readlink(d / "driver") if (d / "driver").exists() else "" for d in devices.iterdir()}


@pytest.mark.parametrize("point", POINTS)
async def test_crash_and_restart(server: TestApiServer, scratch: Path, point: str) -> None:
    settings = settings_for(scratch, server.write_kubeconfig(scratch / "kubeconfig"), "gke-n1-t4x2",
                            backends=("nvidia-gpu",))
    crashing = AgentProcess(settings, {"DRA_AGENT_FAILPOINTS": point})
    restarted = AgentProcess(settings)
    spec = settings.cdi_dir / "placeholder"
    try:
        await crashing.start()
        async with KubeletSimulator(settings.registry_dir) as kubelet:
            plugin = await kubelet.wait_for_plugin(GPU, timeout=scaled(20))
            await wait_until(lambda: server.objects("resourceslices"))
            before = hardware(settings.sim_root)  # type: ignore[arg-type]
            gpu = server.objects("resourceslices")[0]["spec"]["devices"][0]["name"]
            ref = allocate(server, "train", [("gpu", GPU, gpu)])
            spec = settings.cdi_dir / f"k8s.gpu.nvidia.com-claim_{ref.uid}.json"
            if point.startswith("unprepare"):
                await plugin.prepare_or_raise([ref])
                call: Awaitable[object] = plugin.unprepare([ref])
            else:
                call = plugin.prepare([ref])
            with pytest.raises(KubeletError) as caught:
                await call
            assert caught.value.code == grpc.StatusCode.UNAVAILABLE
            assert await crashing.wait() == -signal.SIGKILL

            state, spec_exists = AFTER_CRASH[point]
            assert claim_state(settings.state_dir, ref.uid) == state
            assert spec.exists() == spec_exists

            await restarted.start()
            plugin = await plugin_after_restart(kubelet, plugin)  # the dead instance's socket was replaced
            # Recovery: a cut-short prepare is rolled back, a completed one keeps (or gets back) its spec.
            recovered = "completed" if state == "completed" else None
            assert claim_state(settings.state_dir, ref.uid) == recovered
            assert spec.exists() == (recovered == "completed")
            assert hardware(settings.sim_root) == before  # type: ignore[arg-type]

            if point.startswith("prepare"):
                result = await plugin.prepare_or_raise([ref])  # the kubelet retries
                assert result[ref.uid].devices[0].device == gpu
                assert spec.exists()
            assert await plugin.unprepare([ref]) == {ref.uid: ""}
            assert claim_state(settings.state_dir, ref.uid) is None
            assert not spec.exists()
            assert list(settings.cdi_dir.iterdir()) == []
            assert hardware(settings.sim_root) == before  # type: ignore[arg-type]
    finally:
        await crashing.stop()
        await restarted.stop()
