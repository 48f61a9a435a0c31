"""A backend that does not run (it failed to start or to discover) is no silent gap: /readyz names it, its hardware
is counted in dra_agent_unserved_devices, and every driver has a dra_agent_published_devices series, 0 when it
publishes nothing, so "a node publishing no device" can be asked of Prometheus."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agent.daemon import Agent
from backends.contract import BackendError
from backends.sriov.backend import SriovNicBackend
from tests.support.agent_env import agent_in_process
from tests.support.timing import scaled


def sample(agent: Agent, name: str, **labels: str) -> float | None:
    value: float | None = agent.metrics.registry.get_sample_value(name, labels)
    return value


async def test_a_backend_that_fails_to_start_is_named_and_its_gpus_counted(scratch: Path) -> None:
    """Settings made in code are not checked before the start (the command line checks them): the backend's own
    check at start fails it, as any failure of its start would."""
    async with agent_in_process(scratch, "dgx-h100", backends=("nvidia-gpu", "nvidia-mig", "sriov-nic"),
                                backend_config={"nvidia-gpu": {"ignoredXid": [13]}}) as env:
        agent = env.agent
        reasons = agent.not_ready()
        assert [r for r in reasons if "nvidia-gpu" in r] == [
            "backend nvidia-gpu (gpu.nvidia.com) is not running, 8 device(s) of it not served: failed to start: "
            "invalid configuration for backend nvidia-gpu: ignoredXid: Extra inputs are not permitted"]
        assert sample(agent, "dra_agent_unserved_devices", driver="gpu.nvidia.com", backend="nvidia-gpu") == 8
        # nvidia-mig finds no MIG device on this node: its driver publishes nothing, and says so.
        assert sample(agent, "dra_agent_published_devices", driver="gpu.nvidia.com") == 0
        assert sample(agent, "dra_agent_published_slices", driver="gpu.nvidia.com") == 0
        async with asyncio.timeout(scaled(10)):
            await agent.drivers["sriov.dra-agent.io"].published.wait()
        assert sample(agent, "dra_agent_published_devices", driver="sriov.dra-agent.io") == 64
        assert not agent.ready or reasons  # systemd's READY=1 means start-up is done; /readyz says the rest


async def test_a_backend_whose_discovery_fails_is_named_and_its_vfs_counted(scratch: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    async def fails(self: SriovNicBackend) -> None:
        raise BackendError("the PF's driver does not answer")

    monkeypatch.setattr(SriovNicBackend, "discover", fails)
    async with agent_in_process(scratch, "dgx-h100", backends=("nvidia-gpu", "sriov-nic")) as env:
        agent = env.agent
        assert [r for r in agent.not_ready() if "sriov" in r] == [
            "backend sriov-nic (sriov.dra-agent.io) is not running, 64 device(s) of it not served: discovery "
            "failed: the PF's driver does not answer"]
        assert sample(agent, "dra_agent_unserved_devices", driver="sriov.dra-agent.io", backend="sriov-nic") == 64
        assert sample(agent, "dra_agent_published_devices", driver="sriov.dra-agent.io") == 0
        assert sample(agent, "dra_agent_unserved_devices", driver="gpu.nvidia.com", backend="nvidia-gpu") == 0


async def test_a_node_without_hardware_has_every_driver_at_zero(scratch: Path) -> None:
    async with agent_in_process(scratch, "gke-g2-l4", backends=("tpu", "sriov-nic")) as env:
        agent = env.agent
        assert agent.not_ready() == []
        assert sample(agent, "dra_agent_published_devices", driver="tpu.google.com") == 0
        assert sample(agent, "dra_agent_published_devices", driver="sriov.dra-agent.io") == 0
