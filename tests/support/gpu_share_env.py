"""Shares of full GPUs (`backend_config.nvidia-gpu.sharing.byMemory`) for tests of the running agent: claims for
shares of GPU 0 allocated by the simulated scheduler, and what the agent made of them (checkpoint records, CDI specs,
its backend journals)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from backends.contract import ClaimRef
from simulator.apiserver.server import TestApiServer
from simulator.kubelet import KubeletSimulator
from simulator.kubelet_connection import Plugin
from simulator.scheduler.allocation import allocate
from tests.support.agent_env import NODE, InProcess, journal_entries, wait_until
from tests.support.allocation_env import claim, device_classes, exactly
from tests.support.timing import scaled

GPU = "gpu.nvidia.com"
DEVICE, BUS_ID = "gpu-0000-18-00-0", "0000:18:00.0"  # index 0
SHARING = {"nvidia-gpu": {"sharing": {"byMemory": True}}}
ON_GPU_0 = 'device.attributes["gpu.nvidia.com"].index == 0'


def gpu_config(sharing: dict[str, str] | None) -> list[dict[str, Any]]:
    parameters: dict[str, Any] = {"apiVersion": "dra-agent.io/v1alpha1", "kind": "GpuConfig"}
    if sharing is not None:
        parameters["sharing"] = sharing
    return [{"requests": ["gpu"], "opaque": {"driver": GPU, "parameters": parameters}}]


def slices(server: TestApiServer) -> list[dict[str, Any]]:
    return [dict(s) for s in server.objects("resourceslices")]


def published_gpu(server: TestApiServer, name: str = DEVICE) -> dict[str, Any]:
    """The GPU as published; empty before it is."""
    return next((d for s in slices(server) for d in s["spec"].get("devices") or () if d["name"] == name), {})


def share(server: TestApiServer, name: str, *memories: str | None, sharing: dict[str, str] | None = None) -> ClaimRef:
    """A claim for shares of GPU 0, one request per amount (None: names no amount), allocated by the scheduler
    and stored as it would leave it."""
    requests = []
    for index, memory in enumerate(memories):
        capacity: dict[str, Any] = {"capacity": {"requests": {"memory": memory}}} if memory is not None else {}
        requests.append(exactly("gpu" if index == 0 else f"gpu{index}", GPU, ON_GPU_0, **capacity))
    wanted = claim(name, *requests, config=gpu_config(sharing) if sharing is not None else None)
    held = [c for c in server.objects("resourceclaims")]
    allocation = allocate(wanted, classes=device_classes(), slices=slices(server), allocated=held, node=NODE)
    wanted["metadata"]["uid"] = uid = f"00000000-0000-4000-8000-{len(held) + 1:012d}"
    server.put_claim({**wanted, "status": {"allocation": allocation.status}})
    return ClaimRef(uid, "default", name)


async def sharing_agent(env: InProcess, kubelet: KubeletSimulator) -> Plugin:
    await wait_until(lambda: published_gpu(env.server).get("allowMultipleAllocations") is True, scaled(10))
    return await kubelet.wait_for_plugin(GPU)


def records(env: InProcess) -> dict[str, list[tuple[str, str | None]]]:
    preparer = env.agent.drivers[GPU].preparer
    assert preparer is not None
    return {uid: [(d.device, d.share_id) for d in c.devices] for uid, c in preparer.checkpoint.claims.items()}


def spec_of(env: InProcess, uid: str) -> dict[str, Any] | None:
    found = list(env.settings.cdi_dir.glob(f"*{uid}*"))
    return yaml.safe_load(found[0].read_text()) if found else None


def backend_journal(state_dir: Path, name: str) -> dict[str, Any]:
    return journal_entries(state_dir / "backends" / "nvidia-gpu" / name)
