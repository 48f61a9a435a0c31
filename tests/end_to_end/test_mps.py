"""MPS control daemons across the life of `dra-agent run` processes: kill -9 at every step of prepare and
unprepare (no daemon leaked, none lost), a rolling update while a claim is prepared (the daemon keeps serving), the
reaper, and a daemon that dies while its claim is prepared (started again, its GPU unhealthy meanwhile)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Awaitable
from pathlib import Path

import pytest

from agent.kubelet.services import HealthStatus
from backends.failpoints import MPS_POINTS, POINTS
from simulator.kubelet_connection import KubeletError
from simulator.node.hardware import SimulatedNode
from simulator.node.profile import load_profile
from tests.support.agent_env import NODE, allocate, lose_claims, plugin_after_restart, two_agents, wait_until
from tests.support.mps_env import FIRST, GPU, answers, ask, daemons_of, folder, mps_config, pid_of, scratch
from tests.support.surge_env import surge
from tests.support.timing import scaled

__all__ = ["scratch"]  # the fixture: directories outside /dev/shm

DEFAULT, EXCLUSIVE_PROCESS = 0, 3
# The points after which the claim is recorded as prepared with its daemon's entry: the daemon serves after the
# restart (started again after the crash that cut its quit short). After the others the claim has no daemon: its
# prepare was rolled back, or its unprepare had stopped the daemon (the kubelet's retry finishes the rest).
SERVING = {"prepare-after-completed", "unprepare-before-backends", "mps-after-quit"}
UNPREPARING = {p for p in POINTS if p.startswith("unprepare")} | {"mps-after-quit"}


def mode_on_node(sim_root: Path, bus_id: str = FIRST[1]) -> int:
    """The GPU's compute mode as the kept simulated node holds it (saved once anything changed on its GPUs)."""
    saved = sim_root / ".sim/nvml-mig.json"
    if not saved.exists():
        return DEFAULT
    state = json.loads(saved.read_text())
    mode: int = next(g for g in state if g["bus_id"] == bus_id)["compute_mode"]
    return mode


@pytest.mark.parametrize("point", [*POINTS, *MPS_POINTS])
async def test_a_crash_at_any_step_leaks_no_daemon_and_loses_none(scratch: Path, point: str) -> None:
    async with two_agents(scratch, "dgx-h100", backends=("nvidia-gpu",), failpoint=point) as run:
        settings, kubelet, state = run.settings, run.kubelet, run.settings.state_dir
        sim = settings.sim_root
        assert sim is not None
        plugin = await kubelet.wait_for_plugin(GPU, timeout=scaled(30))
        ref = allocate(run.server, "mps", [("gpu", GPU, FIRST[0])], mps_config(defaultActiveThreadPercentage=40))
        if point in UNPREPARING:
            await plugin.prepare_or_raise([ref])
            call: Awaitable[object] = plugin.unprepare([ref])
        else:
            call = plugin.prepare([ref])
        with pytest.raises(KubeletError):
            await call
        assert await run.first.wait() == -signal.SIGKILL

        await run.second.start()
        plugin = await plugin_after_restart(kubelet, plugin)
        if point in SERVING:
            # The daemon the crash cut short in its quit may still be ending: the agent adopts it, sees it end and
            # starts the claim's daemon again.
            await wait_until(lambda: len(daemons_of(sim)) == 1 and pid_of(state, ref.uid) is not None
                             and answers(sim, state, ref.uid, "get_default_active_thread_percentage") == ["40.0"],
                             timeout=scaled(20))
        else:
            await wait_until(lambda: daemons_of(sim) == [] and not folder(state, ref.uid).exists(),
                             timeout=scaled(20))
            assert mode_on_node(sim) == DEFAULT
            if point not in UNPREPARING:
                await plugin.prepare_or_raise([ref])  # the kubelet retries
                assert len(daemons_of(sim)) == 1
                assert ask(sim, state, ref.uid, "get_default_active_thread_percentage") == ["40.0"]
        if point in SERVING or point not in UNPREPARING:
            assert mode_on_node(sim) == EXCLUSIVE_PROCESS
        assert await plugin.unprepare([ref]) == {ref.uid: ""}
        assert daemons_of(sim) == [] and not folder(state, ref.uid).exists()
        assert mode_on_node(sim) == DEFAULT


async def test_the_daemon_keeps_serving_through_a_rolling_update(scratch: Path) -> None:
    async with surge(scratch, "dgx-h100", backends=("nvidia-gpu",)) as (run, plugins):
        old, new = plugins[GPU]
        state = scratch / "state"
        ref = allocate(run.server, "mps", [("gpu", GPU, FIRST[0])], mps_config(defaultActiveThreadPercentage=60))
        await old.prepare_or_raise([ref])
        pid = pid_of(state, ref.uid)
        assert pid is not None
        await run.old.signal(signal.SIGTERM)
        assert await run.old.wait() == 0
        assert pid_of(state, ref.uid) == pid, "the old agent's end is not its daemon's"
        assert ask(run.root, state, ref.uid, "get_default_active_thread_percentage") == ["60.0"]
        assert await new.prepare_or_raise([ref])  # the new agent answers from the checkpoint
        assert pid_of(state, ref.uid) == pid and daemons_of(run.root) == [pid]
        assert await new.unprepare([ref]) == {ref.uid: ""}
        assert daemons_of(run.root) == [] and not folder(state, ref.uid).exists()


async def test_a_deleted_claims_daemon_is_stopped_by_the_reaper(scratch: Path) -> None:
    async with two_agents(scratch, "dgx-h100", backends=("nvidia-gpu",), reap_interval=scaled(0.3),
                          reap_grace=scaled(1.5)) as run:
        sim, state = run.settings.sim_root, run.settings.state_dir
        assert sim is not None
        plugin = await run.kubelet.wait_for_plugin(GPU, timeout=scaled(30))
        ref = allocate(run.server, "mps", [("gpu", GPU, FIRST[0])], mps_config())
        await plugin.prepare_or_raise([ref])
        assert len(daemons_of(sim)) == 1
        run.server.delete_object("resourceclaims", "mps")
        # The daemon stops first, then the compute mode goes back.
        await wait_until(lambda: daemons_of(sim) == [] and not folder(state, ref.uid).exists()
                         and mode_on_node(sim) == DEFAULT, timeout=scaled(30))


async def test_a_daemon_that_dies_is_started_again_and_its_gpu_is_unhealthy_meanwhile(scratch: Path) -> None:
    async with two_agents(scratch, "dgx-h100", backends=("nvidia-gpu",)) as run:
        sim, state, kubelet = run.settings.sim_root, run.settings.state_dir, run.kubelet
        assert sim is not None
        plugin = await kubelet.wait_for_plugin(GPU, timeout=scaled(30))
        ref = allocate(run.server, "mps", [("gpu", GPU, FIRST[0])], mps_config(defaultActiveThreadPercentage=20))
        await plugin.prepare_or_raise([ref])
        pid = pid_of(state, ref.uid)
        assert pid is not None
        # Held back: the daemon is not started again until the test lets it, so the unhealthy report is seen.
        program = sim / "usr/bin/nvidia-cuda-mps-control"
        program.rename(program.with_name("held-back"))
        os.kill(pid, signal.SIGKILL)
        view = await kubelet.wait_for_health(GPU, lambda v: (NODE, FIRST[0]) in v and v[(NODE, FIRST[0])].health
                                             == HealthStatus.UNHEALTHY, timeout=scaled(10))
        assert "the MPS control daemon of claim" in view[(NODE, FIRST[0])].message
        program.with_name("held-back").rename(program)
        await kubelet.wait_for_health(GPU, lambda v: v[(NODE, FIRST[0])].health == HealthStatus.HEALTHY,
                                      timeout=scaled(40))
        again = pid_of(state, ref.uid)
        assert again is not None and again != pid and daemons_of(sim) == [again]
        assert ask(sim, state, ref.uid, "get_default_active_thread_percentage") == ["20.0"], "its limits again"
        assert await plugin.unprepare([ref]) == {ref.uid: ""}
        assert daemons_of(sim) == []


async def test_at_start_the_daemon_of_a_claim_no_longer_held_is_stopped(scratch: Path) -> None:
    """The checkpoint and CDI specs are lost while a claim's daemon runs: the journal says the agent started it, no
    claim holds its GPU, so the next start stops it, removes its folder and puts the compute mode back."""
    async with two_agents(scratch, "dgx-h100", backends=("nvidia-gpu",)) as run:
        sim, state = run.settings.sim_root, run.settings.state_dir
        assert sim is not None
        plugin = await run.kubelet.wait_for_plugin(GPU, timeout=scaled(30))
        ref = allocate(run.server, "mps", [("gpu", GPU, FIRST[0])], mps_config())
        await plugin.prepare_or_raise([ref])
        await run.first.stop()  # killed
        assert len(daemons_of(sim)) == 1, "the agent's end is not its daemon's"
        lose_claims(run.settings, GPU)
        await run.second.start()
        await plugin_after_restart(run.kubelet, plugin)
        await wait_until(lambda: daemons_of(sim) == [] and not folder(state, ref.uid).exists()
                         and mode_on_node(sim) == DEFAULT, timeout=scaled(20))
        assert "stopping the MPS control daemon of a claim no longer prepared" in run.second.output()


async def test_after_a_reboot_the_claim_gets_its_compute_mode_and_daemon_again(scratch: Path) -> None:
    """The node reboots with an MPS claim prepared: the daemon is gone, the GPU's compute mode is Default again and
    the CDI specs (a tmpfs) are gone. When the kubelet prepares the claim again, the GPU is put back in
    EXCLUSIVE_PROCESS and a daemon serves with the claim's limits."""
    async with two_agents(scratch, "dgx-h100", backends=("nvidia-gpu",)) as run:
        sim, state = run.settings.sim_root, run.settings.state_dir
        assert sim is not None
        plugin = await run.kubelet.wait_for_plugin(GPU, timeout=scaled(30))
        ref = allocate(run.server, "mps", [("gpu", GPU, FIRST[0])], mps_config(defaultActiveThreadPercentage=30))
        await plugin.prepare_or_raise([ref])
        pid = pid_of(state, ref.uid)
        assert pid is not None and mode_on_node(sim) == EXCLUSIVE_PROCESS
        # The reboot: every process ends, the driver starts with Default compute modes, tmpfs folders are empty.
        await run.first.stop()
        os.kill(pid, signal.SIGKILL)
        await wait_until(lambda: daemons_of(sim) == [], timeout=scaled(10))
        SimulatedNode.existing(load_profile("dgx-h100"), sim).reboot()
        for spec in run.settings.cdi_dir.iterdir():
            spec.unlink()
        assert mode_on_node(sim) == DEFAULT
        await run.second.start()
        plugin = await plugin_after_restart(run.kubelet, plugin)
        await plugin.prepare_or_raise([ref])
        assert mode_on_node(sim) == EXCLUSIVE_PROCESS, "the compute mode the claim's daemon needs, set again"
        again = pid_of(state, ref.uid)
        assert again is not None and daemons_of(sim) == [again]
        assert ask(sim, state, ref.uid, "get_default_active_thread_percentage") == ["30.0"]
        assert await plugin.unprepare([ref]) == {ref.uid: ""}
        assert daemons_of(sim) == [] and mode_on_node(sim) == DEFAULT
