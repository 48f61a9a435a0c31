"""GPU sharing with CUDA MPS (`GpuConfig.sharing.strategy: MPS`) through the whole agent: a control daemon per
claim with its limits, the CDI edits that reach it, compute mode EXCLUSIVE_PROCESS while it runs, and what fails
the claim."""

from __future__ import annotations

import json
from pathlib import Path

import pynvml
import pytest

from backends.nvidia.mps_launch import SHM_KEPT
from simulator.kubelet import KubeletSimulator
from tests.support.agent_env import agent_in_process, allocate, journal_entries, memory_dir, simulated_nvml
from tests.support.mps_env import (
    FIRST,
    GPU,
    SECOND,
    ask,
    control_log,
    daemons_of,
    folder,
    mps_config,
    pid_of,
    same_file,
    scratch,
)

__all__ = ["scratch"]  # the fixture: directories outside /dev/shm

DEFAULT, EXCLUSIVE_PROCESS = pynvml.NVML_COMPUTEMODE_DEFAULT, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS


def spec_of(cdi_dir: Path, claim: str) -> dict[str, object]:
    (path,) = cdi_dir.glob(f"*{claim}*")
    loaded: dict[str, object] = json.loads(path.read_text())
    return loaded


async def test_a_claim_gets_its_own_daemon_with_its_limits_and_unprepare_stops_it(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100", backends=("nvidia-gpu",)) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        nvml, state, sim = simulated_nvml(env), env.settings.state_dir, env.agent.host.host_root
        uuid = nvml.gpus[0].uuid
        plugin = await kubelet.wait_for_plugin(GPU)
        claim = allocate(env.server, "mps", [("gpu", GPU, FIRST[0])], mps_config(
            defaultActiveThreadPercentage=30, defaultPinnedDeviceMemoryLimit="10Gi"))
        result = (await plugin.prepare([claim]))[claim.uid]
        assert result.error == ""
        pid = pid_of(state, claim.uid)
        assert pid is not None and daemons_of(sim) == [pid]
        assert ask(sim, state, claim.uid, "get_default_active_thread_percentage",
                   f"get_default_device_pinned_mem_limit {uuid}") == ["30.0", "10240M"]
        assert f"Devices: CUDA_VISIBLE_DEVICES={uuid}" in control_log(state, claim.uid)
        assert same_file(f"/proc/{pid}/root/dev/shm", folder(state, claim.uid) / "shm"), \
            "the daemon's /dev/shm is the claim's shm folder"
        assert nvml.compute_mode(0) == EXCLUSIVE_PROCESS
        edits = spec_of(env.settings.cdi_dir, claim.uid)["devices"][0]["containerEdits"]  # type: ignore[index]
        assert {"CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps", "CUDA_MPS_LOG_DIRECTORY=/var/log/nvidia-mps"} <= set(
            edits["env"])
        mounts = {m["containerPath"]: m for m in edits["mounts"]}
        base = folder(state, claim.uid)
        assert mounts["/tmp/nvidia-mps"]["hostPath"] == str(base / "pipe")
        assert mounts["/var/log/nvidia-mps"]["hostPath"] == str(base / "log")
        assert mounts["/dev/shm"]["hostPath"] == str(base / "shm")
        assert "rw" in mounts["/tmp/nvidia-mps"]["options"] and "rw" in mounts["/dev/shm"]["options"]
        assert (await plugin.prepare([claim]))[claim.uid] == result, "prepare is idempotent"
        assert pid_of(state, claim.uid) == pid, "the same daemon serves"

        assert (await plugin.unprepare([claim]))[claim.uid] == ""
        assert daemons_of(sim) == [] and not base.exists()
        assert nvml.compute_mode(0) == DEFAULT
        assert journal_entries(state / "backends/nvidia-gpu/mps-daemons.json") == {}


async def test_two_claims_on_two_gpus_have_two_daemons(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100", backends=("nvidia-gpu",)) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        nvml, state, sim = simulated_nvml(env), env.settings.state_dir, env.agent.host.host_root
        plugin = await kubelet.wait_for_plugin(GPU)
        one = allocate(env.server, "one", [("gpu", GPU, FIRST[0])], mps_config(defaultActiveThreadPercentage=25))
        two = allocate(env.server, "two", [("gpu", GPU, SECOND[0])], mps_config(
            defaultPerDevicePinnedMemoryLimit={SECOND[0]: "2Gi"}))
        results = await plugin.prepare([one, two])
        assert [r.error for r in results.values()] == ["", ""]
        pids = {pid_of(state, one.uid), pid_of(state, two.uid)}
        assert None not in pids and sorted(daemons_of(sim)) == sorted(pids)  # type: ignore[type-var]
        assert ask(sim, state, one.uid, "get_default_active_thread_percentage") == ["25.0"]
        assert ask(sim, state, two.uid, "get_default_active_thread_percentage",
                   f"get_default_device_pinned_mem_limit {nvml.gpus[1].uuid}") == ["100.0", "2048M"]
        assert [nvml.compute_mode(i) for i in range(3)] == [EXCLUSIVE_PROCESS, EXCLUSIVE_PROCESS, DEFAULT]
        assert (await plugin.unprepare([one]))[one.uid] == ""
        assert daemons_of(sim) == [pid_of(state, two.uid)], "the other claim's daemon keeps serving"
        assert (await plugin.unprepare([two]))[two.uid] == ""
        assert daemons_of(sim) == []


@pytest.mark.parametrize(("limits", "message"), [
    ({"defaultPinnedDeviceMemoryLimit": "100Gi"},
     f"{FIRST[0]}: GpuConfig.sharing.mpsConfig: a pinned device memory limit of 107374182400 bytes is more than the "
     "GPU's memory"),
    ({"defaultPerDevicePinnedMemoryLimit": {SECOND[0]: "1Gi"}},
     f"GpuConfig.sharing.mpsConfig: defaultPerDevicePinnedMemoryLimit names '{SECOND[0]}', which is not a device of "
     f"this claim (its devices: {FIRST[0]}, or their GPU UUIDs)"),
    ({"defaultPinnedDeviceMemoryLimit": "1000k"},
     f"{FIRST[0]}: GpuConfig.sharing.mpsConfig: a pinned device memory limit of 1000000 bytes is less than 1Mi"),
])
async def test_limits_the_claims_gpus_cannot_have_fail_the_claim_and_leave_nothing(
        scratch: Path, limits: dict[str, object], message: str) -> None:
    async with agent_in_process(scratch, "dgx-h100", backends=("nvidia-gpu",)) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        state, sim = env.settings.state_dir, env.agent.host.host_root
        plugin = await kubelet.wait_for_plugin(GPU)
        claim = allocate(env.server, "bad", [("gpu", GPU, FIRST[0])], mps_config(**limits))
        error = (await plugin.prepare([claim]))[claim.uid].error
        assert message in error
        assert daemons_of(sim) == [] and not folder(state, claim.uid).exists()
        assert simulated_nvml(env).compute_mode(0) == DEFAULT


async def test_a_driver_root_without_the_mps_program_fails_the_claim(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100", backends=("nvidia-gpu",)) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        (env.agent.host.host_root / "usr/bin/nvidia-cuda-mps-control").unlink()
        plugin = await kubelet.wait_for_plugin(GPU)
        claim = allocate(env.server, "nompsd", [("gpu", GPU, FIRST[0])], mps_config())
        error = (await plugin.prepare([claim]))[claim.uid].error
        assert "sharing strategy MPS needs nvidia-cuda-mps-control from the NVIDIA driver, and the driver root" in error
        assert simulated_nvml(env).compute_mode(0) == DEFAULT


async def test_a_node_kept_below_dev_shm_leaves_the_daemon_the_hosts_shm() -> None:
    """Test and demo nodes live in RAM below /dev/shm: the claim's folder bound there would hide the daemon's own
    files, so the daemon keeps the host's /dev/shm and says so in its output."""
    with memory_dir("dra-t-") as root:
        async with agent_in_process(root, "dgx-h100", backends=("nvidia-gpu",)) as env, \
                KubeletSimulator(env.settings.registry_dir) as kubelet:
            state = env.settings.state_dir
            plugin = await kubelet.wait_for_plugin(GPU)
            claim = allocate(env.server, "inram", [("gpu", GPU, FIRST[0])], mps_config())
            assert (await plugin.prepare([claim]))[claim.uid].error == ""
            pid = pid_of(state, claim.uid)
            assert pid is not None and same_file(f"/proc/{pid}/root/dev/shm", "/dev/shm")
            output = (folder(state, claim.uid) / "log" / "daemon-output.log").read_text()
            assert f"{SHM_KEPT}: " in output
            assert (await plugin.unprepare([claim]))[claim.uid] == ""


async def test_requests_of_one_claim_with_different_mps_limits_fail_the_claim(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100", backends=("nvidia-gpu",)) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await kubelet.wait_for_plugin(GPU)
        configs = [{**mps_config(defaultActiveThreadPercentage=p)[0], "requests": [r]}
                   for r, p in (("a", 20), ("b", 80))]
        claim = allocate(env.server, "two", [("a", GPU, FIRST[0]), ("b", GPU, SECOND[0])], configs)
        error = (await plugin.prepare([claim]))[claim.uid].error
        assert ("the GPUs of a claim that use MPS share one MPS control daemon: the requests' "
                "GpuConfig.sharing.mpsConfig must be the same for all of them") in error
        assert daemons_of(env.agent.host.host_root) == [] and not folder(env.settings.state_dir, claim.uid).exists()
        nvml = simulated_nvml(env)
        assert [nvml.compute_mode(i) for i in range(2)] == [DEFAULT, DEFAULT]
