"""A whole GPU in MIG mode allocated whole (dynamic MIG): MIG mode off for the claim on Hopper, on again at
unprepare, after a crash and at start; refused on Ampere, with a pending mode change, with MIG devices, while in
use; published as before while held."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pynvml
import pytest
import yaml

from agent.node.inventory import BackendReport, merge_pools
from backends.failpoints import MIG_WHOLE_POINTS
from simulator.kubelet import KubeletSimulator
from simulator.kubelet_connection import KubeletError, Plugin
from tests.support.agent_env import (
    InProcess,
    agent_in_process,
    allocate,
    journal_entries,
    lose_claims,
    plugin_after_restart,
    simulated_nvml,
    two_agents,
)
from tests.support.mig_env import DYNAMIC, dgx_h100_in_mig_mode
from tests.support.timing import scaled

GPU = "gpu.nvidia.com"
WHOLE, BUS_ID = "gpu-0000-18-00-0", "0000:18:00.0"



def whole_journal(state_dir: Path) -> dict[str, Any]:
    path = state_dir / "backends/nvidia-mig/mig-whole.json"
    return journal_entries(path)


async def rediscover(env: InProcess) -> tuple[dict[str, list[str]], list[str]]:
    """Discovery run again on the running agent's NVIDIA backends: device names by backend, and what merging them
    into one pool found wrong (a device both publish)."""
    plugins = [p for p in env.agent._plugins if p.backend.driver == GPU]  # the backends the agent runs
    reports = [BackendReport(p, GPU, await p.backend.discover()) for p in plugins]
    found = {r.name: sorted(d.name for d in r.inventory.devices) for r in reports if r.inventory is not None}
    (pool,) = merge_pools(reports)
    return found, list(pool.problems)


async def prepare(plugin: Plugin, env: InProcess, name: str, device: str,
                  configs: list[dict[str, Any]] | None = None) -> tuple[Any, str]:
    claim = allocate(env.server, name, [("gpu", GPU, device)], configs)
    return claim, (await plugin.prepare([claim]))[claim.uid].error


async def test_the_whole_gpu_leaves_mig_mode_for_its_claim_and_comes_back(scratch: Path) -> None:
    profile = dgx_h100_in_mig_mode(scratch)
    async with agent_in_process(scratch, str(profile), backend_config=DYNAMIC) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        nvml = simulated_nvml(env)
        plugin = await kubelet.wait_for_plugin(GPU)
        before, problems = await rediscover(env)
        assert WHOLE in before["nvidia-mig"] and len(before["nvidia-mig"]) == 8 * 26 and problems == []
        sharing = {"apiVersion": "dra-agent.io/v1alpha1", "kind": "GpuConfig",
                   "sharing": {"strategy": "ExclusiveProcess"}}
        claim, error = await prepare(plugin, env, "whole", WHOLE,
                                     [{"source": "FromClaim", "requests": ["gpu"],
                                       "opaque": {"driver": GPU, "parameters": sharing}}])
        assert error == ""
        assert nvml.mig_mode(0) == (False, False), "off at once: an H100 needs no reset"
        assert nvml.mig_mode(1) == (True, True), "the claim's GPU only"
        assert nvml.compute_mode(0) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
        spec = yaml.safe_load(next(env.settings.cdi_dir.glob(f"*{claim.uid}*")).read_text())
        assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia0"}]
        assert "/dev/nvidiactl" in {n["path"] for n in spec["containerEdits"]["deviceNodes"]}
        (entry,) = whole_journal(env.settings.state_dir).values()
        assert entry == {"claim": claim.uid, "device": WHOLE, "busId": BUS_ID}
        # Out of MIG mode, the GPU stays nvidia-mig's and is published as it was.
        assert await rediscover(env) == (before, [])

        _, error = await prepare(plugin, env, "small", f"{WHOLE}-mig-1g10gb-19-0")
        assert "creating MIG 1g.10gb at 0 failed" in error, "a scheduler would not allocate it: counters say so"

        assert (await plugin.unprepare([claim]))[claim.uid] == ""
        assert nvml.mig_mode(0) == (True, True)
        assert nvml.compute_mode(0) == pynvml.NVML_COMPUTEMODE_DEFAULT
        assert whole_journal(env.settings.state_dir) == {}
        assert await rediscover(env) == (before, [])
        small, error = await prepare(plugin, env, "again", f"{WHOLE}-mig-1g10gb-19-0")
        assert error == "" and len(nvml.instances(0)) == 1
        assert (await plugin.unprepare([small]))[small.uid] == ""


async def test_an_ampere_gpu_would_need_a_reset_and_is_refused(scratch: Path) -> None:
    async with agent_in_process(scratch, "mixed", backend_config=DYNAMIC) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await kubelet.wait_for_plugin(GPU)
        nvml = simulated_nvml(env)
        index = nvml.gpu_index("0000:07:00.0")  # the A100
        for instance in nvml.instances(index):  # even without MIG devices
            nvml.destroy_instance(index, instance.gi)
        _, error = await prepare(plugin, env, "whole", "gpu-0000-07-00-0")
        assert ("GPU 0000:07:00.0 cannot leave MIG mode without a GPU reset (before Hopper), and dra-agent never "
                "resets GPUs; allocate one of its MIG devices instead") in error
        assert nvml.mig_mode(index) == (True, True)
        assert whole_journal(env.settings.state_dir) == {}


async def test_a_pending_mode_change_mig_devices_or_processes_refuse_the_whole_gpu(scratch: Path) -> None:
    profile = dgx_h100_in_mig_mode(scratch, {0: [{"profile": "3g.40gb", "start": 0}]})
    async with agent_in_process(scratch, str(profile), backend_config=DYNAMIC) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await kubelet.wait_for_plugin(GPU)
        nvml = simulated_nvml(env)
        # The profile's first switch entry stands for GPUs 0000:18:00.0 and 0000:1c:00.0: both hold an operator's
        # MIG device.
        _, error = await prepare(plugin, env, "with-mig", "gpu-0000-1c-00-0")
        assert "GPU 0000:1c:00.0 has MIG devices; it can be used whole only when it has none" in error
        assert nvml.mig_mode(1) == (True, True)

        other, index = "gpu-0000-3a-00-0", 2
        nvml.set_busy(index)
        _, error = await prepare(plugin, env, "busy", other)
        assert "GPU 0000:3a:00.0 is in use (processes run on it): MIG mode cannot be turned off" in error
        assert nvml.mig_mode(index) == (True, True)
        nvml.set_busy(index, False)

        nvml.gpus[index].mig_pending = False  # a mode change NVML holds back until a reset
        _, error = await prepare(plugin, env, "pending", other)
        assert "GPU 0000:3a:00.0 has a MIG mode change pending a GPU reset" in error
        assert "dra-agent never resets GPUs" in error

        nvml.gpus[3].mig_enabled = nvml.gpus[3].mig_pending = False  # an operator took it out of MIG mode
        _, error = await prepare(plugin, env, "left", "gpu-0000-3e-00-0")
        assert "GPU 0000:3e:00.0 left MIG mode outside dra-agent" in error
        assert nvml.mig_mode(3) == (False, False), "not turned on by a claim that never turned it off"
        assert whole_journal(env.settings.state_dir) == {}


def mig_enabled_on_node(sim_root: Path, bus_id: str = BUS_ID) -> bool:
    """The MIG mode a kept simulated node's GPU holds across agent restarts (saved at its first change; the profile
    puts every GPU in MIG mode)."""
    path = sim_root / ".sim/nvml-mig.json"
    if not path.exists():
        return True
    state = json.loads(path.read_text())
    enabled: bool = next(g for g in state if g["bus_id"] == bus_id)["mig_enabled"]
    return enabled


@pytest.mark.parametrize("point", [*MIG_WHOLE_POINTS, "prepare-after-backends"])
async def test_a_crash_while_taking_the_whole_gpu_is_undone_at_restart(scratch: Path, point: str) -> None:
    env = {"DRA_AGENT_BACKEND_CONFIG": json.dumps(DYNAMIC)}
    async with two_agents(scratch, str(dgx_h100_in_mig_mode(scratch)),
                          backends=("nvidia-gpu", "nvidia-mig"), env=env, failpoint=point) as run:
        server, settings, kubelet = run.server, run.settings, run.kubelet
        crashing, restarted = run.first, run.second
        sim = settings.sim_root
        assert sim is not None
        plugin = await kubelet.wait_for_plugin(GPU, timeout=scaled(30))
        ref = allocate(server, "whole", [("gpu", GPU, WHOLE)])
        with pytest.raises(KubeletError):
            await plugin.prepare([ref])
        assert await crashing.wait() == -signal.SIGKILL
        # The intent is recorded before MIG mode changes.
        assert mig_enabled_on_node(sim) == (point == "mig-whole-after-intent")

        await restarted.start()
        plugin = await plugin_after_restart(kubelet, plugin)
        assert mig_enabled_on_node(sim), "the rollback turned MIG mode on again"
        assert whole_journal(settings.state_dir) == {}
        result = await plugin.prepare_or_raise([ref])  # the kubelet retries
        assert result[ref.uid].devices[0].device == WHOLE
        assert not mig_enabled_on_node(sim)
        assert await plugin.unprepare([ref]) == {ref.uid: ""}
        assert mig_enabled_on_node(sim)


async def test_at_start_a_gpu_held_whole_for_a_claim_no_longer_held_goes_back_to_mig_mode(scratch: Path) -> None:
    env = {"DRA_AGENT_BACKEND_CONFIG": json.dumps(DYNAMIC)}
    async with two_agents(scratch, str(dgx_h100_in_mig_mode(scratch)),
                          backends=("nvidia-gpu", "nvidia-mig"), env=env) as run:
        server, settings, kubelet = run.server, run.settings, run.kubelet
        first, second = run.first, run.second
        sim = settings.sim_root
        assert sim is not None
        plugin = await kubelet.wait_for_plugin(GPU, timeout=scaled(30))
        ref = allocate(server, "whole", [("gpu", GPU, WHOLE)])
        await plugin.prepare_or_raise([ref])
        await first.stop()  # killed
        assert not mig_enabled_on_node(sim)
        lose_claims(settings, GPU)
        await second.start()
        await plugin_after_restart(kubelet, plugin)
        assert mig_enabled_on_node(sim)
        assert "turning MIG mode on again on a GPU held whole" in second.output()
        assert whole_journal(settings.state_dir) == {}


async def test_an_admin_access_claim_of_the_whole_gpu_leaves_its_mig_mode_alone(scratch: Path) -> None:
    profile = dgx_h100_in_mig_mode(scratch)
    async with agent_in_process(scratch, str(profile), backend_config=DYNAMIC) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await kubelet.wait_for_plugin(GPU)
        claim = allocate(env.server, "watcher", [("gpu", GPU, WHOLE)])
        stored = env.server.objects("resourceclaims")[0]
        stored["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
        env.server.put_claim(stored)
        assert (await plugin.prepare([claim]))[claim.uid].error == ""
        spec = yaml.safe_load(next(env.settings.cdi_dir.glob(f"*{claim.uid}*")).read_text())
        assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia0"}]
        assert simulated_nvml(env).mig_mode(0) == (True, True)
        assert whole_journal(env.settings.state_dir) == {}
        assert (await plugin.unprepare([claim]))[claim.uid] == ""
        assert simulated_nvml(env).mig_mode(0) == (True, True)
