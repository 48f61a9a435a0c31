"""GPU sharing (`GpuConfig.sharing`): the compute mode a claim asks for set through NVML at prepare and put back
at unprepare, after a crash and at start; refusals for MPS, invalid configuration and MIG devices; the simulated
NVML's compute mode as real NVML has it."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
import pytest
import yaml

from backends.nvidia.nvml import nvml_session
from simulator.kubelet import KubeletSimulator
from simulator.kubelet_connection import KubeletError
from simulator.node.node import SimulatedNode
from tests.support.agent_env import (
    agent_in_process,
    allocate,
    journal_entries,
    lose_claims,
    plugin_after_restart,
    simulated_nvml,
    two_agents,
)
from tests.support.timing import scaled

GPU = "gpu.nvidia.com"
DEVICE, BUS_ID = "gpu-0000-18-00-0", "0000:18:00.0"
DEFAULT, EXCLUSIVE_PROCESS = pynvml.NVML_COMPUTEMODE_DEFAULT, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
TIME_SLICING = {"strategy": "TimeSlicing"}
EXCLUSIVE = {"strategy": "ExclusiveProcess"}


def gpu_config(sharing: Any) -> list[dict[str, Any]]:
    parameters = {"apiVersion": "dra-agent.io/v1alpha1", "kind": "GpuConfig", "sharing": sharing}
    return [{"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": GPU, "parameters": parameters}}]



def journal(state_dir: Path, backend: str = "nvidia-gpu") -> dict[str, Any]:
    """The backend's compute-mode journal replayed: entry key → entry."""
    path = state_dir / "backends" / backend / "compute-modes.json"
    return journal_entries(path)


def mode_on_node(sim_root: Path, bus_id: str = BUS_ID) -> int:
    """The compute mode a kept simulated node's GPU holds, as the hardware keeps it across agent restarts."""
    state = json.loads((sim_root / ".sim/nvml-mig.json").read_text())
    mode: int = next(g for g in state if g["bus_id"] == bus_id)["compute_mode"]
    return mode


@pytest.mark.parametrize(("before", "sharing", "during"), [
    (EXCLUSIVE_PROCESS, TIME_SLICING, DEFAULT),
    (DEFAULT, EXCLUSIVE, EXCLUSIVE_PROCESS),
    (pynvml.NVML_COMPUTEMODE_PROHIBITED, EXCLUSIVE, EXCLUSIVE_PROCESS),
])
async def test_sharing_sets_the_compute_mode_and_unprepare_puts_the_old_one_back(
        scratch: Path, before: int, sharing: dict[str, str], during: int) -> None:
    async with agent_in_process(scratch, "dgx-h100") as env, KubeletSimulator(env.settings.registry_dir) as kubelet:
        nvml = simulated_nvml(env)
        nvml.set_compute_mode(0, before)  # as an operator's `nvidia-smi -c` left it
        plugin = await kubelet.wait_for_plugin(GPU)
        claim = allocate(env.server, "shared", [("gpu", GPU, DEVICE)], gpu_config(sharing))
        result = (await plugin.prepare([claim]))[claim.uid]
        assert result.error == ""
        assert nvml.compute_mode(0) == during
        assert [nvml.compute_mode(i) for i in range(1, 8)] == [DEFAULT] * 7, "the claim's GPU only"
        (entry,) = journal(env.settings.state_dir).values()
        assert entry == {"claim": claim.uid, "device": DEVICE, "busId": BUS_ID, "original": before}
        spec = yaml.safe_load(next(env.settings.cdi_dir.glob(f"*{claim.uid}*")).read_text())
        assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia0"}]
        assert (await plugin.prepare([claim]))[claim.uid] == result, "prepare is idempotent"

        assert (await plugin.unprepare([claim]))[claim.uid] == ""
        assert nvml.compute_mode(0) == before
        assert journal(env.settings.state_dir) == {}


async def test_without_sharing_the_compute_mode_is_left_as_it_is(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100") as env, KubeletSimulator(env.settings.registry_dir) as kubelet:
        nvml = simulated_nvml(env)
        nvml.set_compute_mode(0, EXCLUSIVE_PROCESS)
        plugin = await kubelet.wait_for_plugin(GPU)
        claim = allocate(env.server, "plain", [("gpu", GPU, DEVICE)])
        assert (await plugin.prepare([claim]))[claim.uid].error == ""
        assert nvml.compute_mode(0) == EXCLUSIVE_PROCESS
        assert (await plugin.unprepare([claim]))[claim.uid] == ""
        assert nvml.compute_mode(0) == EXCLUSIVE_PROCESS and journal(env.settings.state_dir) == {}


@pytest.mark.parametrize(("sharing", "message"), [
    ({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0}},
     "GpuConfig.sharing.mpsConfig.defaultActiveThreadPercentage: Input should be greater than or equal to 1"),
    ({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 101}},
     "GpuConfig.sharing.mpsConfig.defaultActiveThreadPercentage: Input should be less than or equal to 100"),
    ({"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "1.5Gi"}},
     "GpuConfig.sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: Value error, must be a whole amount of bytes with "
     "an optional suffix k, M, G, T, Ki, Mi, Gi or Ti (e.g. 4Gi)"),
    ({"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {DEVICE: "4GB"}}},
     f"GpuConfig.sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit.{DEVICE}: Value error, must be a whole amount"),
    ({"strategy": "MPS", "mpsConfig": {"multiUser": True}},
     "GpuConfig.sharing.mpsConfig.multiUser: Extra inputs are not permitted"),
    ({"strategy": "TimeSlicing", "mpsConfig": {}}, "GpuConfig.sharing.mpsConfig: Extra inputs are not permitted"),
    ({"strategy": "RoundRobin"}, "GpuConfig.sharing.strategy: Input tag 'RoundRobin' found using 'strategy' does not "
                                 "match any of the expected tags: 'TimeSlicing', 'ExclusiveProcess', 'MPS'"),
    ({"strategy": "TimeSlicing", "interval": "Long"}, "GpuConfig.sharing.interval: Extra inputs are not permitted"),
    ({}, "GpuConfig.sharing.strategy: Unable to extract tag using discriminator 'strategy'"),
    ("TimeSlicing", "GpuConfig.sharing: Input should be a valid dictionary"),
])
async def test_invalid_sharing_fails_the_claim_naming_the_field(scratch: Path, sharing: Any, message: str) -> None:
    async with agent_in_process(scratch, "dgx-h100") as env, KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await kubelet.wait_for_plugin(GPU)
        claim = allocate(env.server, "bad", [("gpu", GPU, DEVICE)], gpu_config(sharing))
        error = (await plugin.prepare([claim]))[claim.uid].error
        assert message in error
        assert simulated_nvml(env).compute_mode(0) == DEFAULT
        assert journal(env.settings.state_dir) == {}


async def test_an_admin_access_claim_never_changes_the_compute_mode(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100") as env, KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await kubelet.wait_for_plugin(GPU)
        claim = allocate(env.server, "watcher", [("gpu", GPU, DEVICE)], gpu_config(EXCLUSIVE))
        stored = env.server.objects("resourceclaims")[0]
        stored["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
        env.server.put_claim(stored)
        assert (await plugin.prepare([claim]))[claim.uid].error == ""
        assert simulated_nvml(env).compute_mode(0) == DEFAULT
        assert journal(env.settings.state_dir) == {}


async def test_a_compute_mode_nvml_refuses_fails_the_claim_and_leaves_no_record(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100") as env, KubeletSimulator(env.settings.registry_dir) as kubelet:
        nvml = simulated_nvml(env)
        nvml.gpus[0].faults["nvmlDeviceSetComputeMode"] = pynvml.NVML_ERROR_NO_PERMISSION
        plugin = await kubelet.wait_for_plugin(GPU)
        claim = allocate(env.server, "shared", [("gpu", GPU, DEVICE)], gpu_config(EXCLUSIVE))
        error = (await plugin.prepare([claim]))[claim.uid].error
        assert (f"{DEVICE}: cannot set compute mode ExclusiveProcess on GPU {BUS_ID}: nvmlDeviceSetComputeMode "
                "failed") in error
        assert "(setting a compute mode needs root)" in error
        assert nvml.compute_mode(0) == DEFAULT and journal(env.settings.state_dir) == {}


async def test_sharing_on_a_mig_device_time_slices_as_it_is_and_refuses_exclusive_and_mps(scratch: Path) -> None:
    async with agent_in_process(scratch, "mixed") as env, KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await kubelet.wait_for_plugin(GPU)
        mig = "gpu-0000-07-00-0-mig-2g20gb-14-4"
        for sharing in (EXCLUSIVE, {"strategy": "MPS"}):
            refused = allocate(env.server, "exclusive", [("gpu", GPU, mig)], gpu_config(sharing))
            error = (await plugin.prepare([refused]))[refused.uid].error
            assert (f"{mig}: sharing strategy {sharing['strategy']} needs a full GPU; a MIG device has no compute "
                    "mode") in error
        shared = allocate(env.server, "sliced", [("gpu", GPU, mig)], gpu_config(TIME_SLICING))
        assert (await plugin.prepare([shared]))[shared.uid].error == ""
        nvml = simulated_nvml(env)
        assert [nvml.compute_mode(i) for i in range(len(nvml.gpus))] == [DEFAULT] * len(nvml.gpus)
        assert journal(env.settings.state_dir, "nvidia-mig") == {}


@pytest.mark.parametrize("point", ["prepare-after-backends", "prepare-after-cdi"])
async def test_a_crash_after_the_mode_changed_is_undone_at_restart(scratch: Path, point: str) -> None:
    async with two_agents(scratch, "dgx-h100", backends=("nvidia-gpu",), failpoint=point) as run:
        server, settings, kubelet = run.server, run.settings, run.kubelet
        crashing, restarted = run.first, run.second
        sim = settings.sim_root
        assert sim is not None
        plugin = await kubelet.wait_for_plugin(GPU, timeout=scaled(30))
        ref = allocate(server, "shared", [("gpu", GPU, DEVICE)], gpu_config(EXCLUSIVE))
        with pytest.raises(KubeletError):
            await plugin.prepare([ref])
        assert await crashing.wait() == -signal.SIGKILL
        assert mode_on_node(sim) == EXCLUSIVE_PROCESS
        # The checkpoint holds no restore record yet: the journal alone knows the mode to put back.
        await restarted.start()
        plugin = await plugin_after_restart(kubelet, plugin)
        assert mode_on_node(sim) == DEFAULT
        assert journal(settings.state_dir) == {}
        await plugin.prepare_or_raise([ref])  # the kubelet retries
        assert mode_on_node(sim) == EXCLUSIVE_PROCESS
        assert await plugin.unprepare([ref]) == {ref.uid: ""}
        assert mode_on_node(sim) == DEFAULT


async def test_at_start_a_mode_set_for_a_claim_no_longer_held_is_put_back(scratch: Path) -> None:
    """The checkpoint is lost while a claim's compute mode is set: the journal says the agent set it, no claim
    holds the GPU, so the next start puts the old mode back."""
    async with two_agents(scratch, "dgx-h100", backends=("nvidia-gpu",)) as run:
        server, settings, kubelet = run.server, run.settings, run.kubelet
        first, second = run.first, run.second
        sim = settings.sim_root
        assert sim is not None
        plugin = await kubelet.wait_for_plugin(GPU, timeout=scaled(30))
        ref = allocate(server, "shared", [("gpu", GPU, DEVICE)], gpu_config(EXCLUSIVE))
        await plugin.prepare_or_raise([ref])
        await first.stop()  # killed
        assert mode_on_node(sim) == EXCLUSIVE_PROCESS
        lose_claims(settings, GPU)
        await second.start()
        await plugin_after_restart(kubelet, plugin)
        assert mode_on_node(sim) == DEFAULT
        assert "restoring a GPU compute mode set for a claim no longer prepared" in second.output()
        assert journal(settings.state_dir) == {}


def test_the_simulated_compute_mode_is_per_gpu_not_per_mig_device_and_outlives_the_process(
        sim_node: Callable[[str], SimulatedNode]) -> None:
    node = sim_node("mixed")
    with nvml_session():
        gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetComputeMode(gpu) == DEFAULT
        pynvml.nvmlDeviceSetComputeMode(gpu, EXCLUSIVE_PROCESS)
        assert pynvml.nvmlDeviceGetComputeMode(gpu) == EXCLUSIVE_PROCESS
        with pytest.raises(pynvml.NVMLError_NotSupported):  # support removed from the driver
            pynvml.nvmlDeviceSetComputeMode(gpu, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceSetComputeMode(gpu, 7)
        parent = pynvml.nvmlDeviceGetHandleByIndex(1)  # the A100 in MIG mode
        mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 0)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetComputeMode(mig)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceSetComputeMode(mig, DEFAULT)
    again = SimulatedNode.open(node.profile, node.root)  # a restarted agent's view of the same node
    assert [g.compute_mode for g in again.nvml.gpus][:2] == [EXCLUSIVE_PROCESS, DEFAULT]


async def test_mps_with_vfio_for_the_same_gpu_fails_the_claim(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100") as env, KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await kubelet.wait_for_plugin(GPU)
        vfio = {"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": GPU, "parameters": {
            "apiVersion": "dra-agent.io/v1alpha1", "kind": "VfioConfig"}}}
        claim = allocate(env.server, "both", [("gpu", GPU, DEVICE)], [*gpu_config({"strategy": "MPS"}), vfio])
        error = (await plugin.prepare([claim]))[claim.uid].error
        assert ("GpuConfig.sharing MPS runs an MPS control daemon on the GPU through the nvidia driver, and VfioConfig "
                "binds the GPU to vfio-pci") in error
        assert simulated_nvml(env).compute_mode(0) == DEFAULT and journal(env.settings.state_dir) == {}
