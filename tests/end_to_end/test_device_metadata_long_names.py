"""A claim whose name is valid for the API server but too long for a file name, through `dra-agent run` with
`--device-metadata`: the claim is refused before anything is written, the GPU stays free for other claims, the
kubelet's unprepare completes; a `started` record such a claim left behind (an agent before this check) is rolled
back at the next start, even with the setting off, and frees the GPU."""

from __future__ import annotations

from pathlib import Path

from agent.claims.checkpoint import Checkpoint, read_boot_id
from agent.settings import Settings
from backends.contract import ClaimRef
from simulator.kubelet_connection import Plugin
from tests.support.agent_env import AgentProcess, allocate, plugin_after_restart, two_agents

GPU = "gpu.nvidia.com"
GPU_DEVICE = "gpu-0000-18-00-0"
LONG_NAME = "a" * 120 + "." + "b" * 129  # 250 characters, a valid object name; `default_<name>` is 258 bytes


def everything_of(settings: Settings, ref: ClaimRef) -> list[str]:
    """What the agent keeps of a claim: its checkpoint record, CDI specs, metadata folder."""
    journal = Checkpoint(settings.state_dir / GPU / "checkpoint.journal", "", driver=GPU)
    journal.refresh()  # read only, as another instance would
    found = [f"{journal.claims[ref.uid].state} record"] if ref.uid in journal.claims else []
    found += [p.name for p in settings.cdi_dir.glob(f"*{ref.uid}*")]
    metadata = settings.plugins_dir / GPU / "dra-device-metadata"
    found += [p.name for p in metadata.glob(f"{ref.namespace}_*")] if metadata.is_dir() else []
    return found


async def the_gpu_is_free(plugin: Plugin, settings: Settings, name: str, ref: ClaimRef) -> None:
    """Another claim on the GPU prepares and unprepares."""
    result = (await plugin.prepare([ref]))[ref.uid]
    assert result.error == "", f"{name}: {result.error}"
    assert await plugin.unprepare([ref]) == {ref.uid: ""}
    assert everything_of(settings, ref) == []


async def test_a_name_too_long_for_a_file_name_is_refused_locks_nothing_and_a_leftover_goes_at_restart(
        scratch: Path) -> None:
    async with two_agents(scratch, "dgx-h100", backends=("nvidia-gpu",), device_metadata=True) as run:
        settings, kubelet, server = run.settings, run.kubelet, run.server
        plugin = await kubelet.wait_for_plugin(GPU)
        long = allocate(server, LONG_NAME, [("gpu", GPU, GPU_DEVICE)])
        other = allocate(server, "other", [("gpu", GPU, GPU_DEVICE)])

        error = (await plugin.prepare([long]))[long.uid].error
        assert error.startswith(f"claim default/{LONG_NAME} cannot get device metadata (setting device_metadata)")
        assert "would have 258 bytes, more than the 255 a file name may have" in error, error
        assert "Errno" not in error and "Error" not in error, error
        assert everything_of(settings, long) == []
        await the_gpu_is_free(plugin, settings, "with the setting on", other)
        assert await plugin.unprepare([long]) == {long.uid: ""}

        # What an agent without the check left: the claim's `started` record, holding the GPU.
        await run.first.stop()
        assert settings.sim_root is not None
        journal = Checkpoint(settings.state_dir / GPU / "checkpoint.journal",
                             read_boot_id(settings.sim_root / "proc"), driver=GPU)
        journal.load()
        journal.start(long.uid, long.namespace, long.name, [(GPU_DEVICE, "nvidia-gpu")])
        journal.close()

        off = AgentProcess(settings.model_copy(update={"device_metadata": False}))
        try:
            await off.start()
            plugin = await plugin_after_restart(kubelet, plugin)
            await the_gpu_is_free(plugin, settings, "after the restart with the setting off", other)
            assert everything_of(settings, long) == []
            # With the setting off the long name needs no file: the claim prepares.
            result = (await plugin.prepare([long]))[long.uid]
            assert result.error == "" and not any("/metadata=" in i for d in result.devices for i in d.cdi_device_ids)
            assert await plugin.unprepare([long]) == {long.uid: ""}
            assert everything_of(settings, long) == []
        finally:
            await off.stop()
