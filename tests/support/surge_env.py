"""Two `dra-agent run` processes on one node, as during a DaemonSet rolling update (surge): the old pod's agent,
then the new pod's beside it on the same state, files and simulated hardware, with the kubelet simulator
watching both. Also what the simulated node's hardware holds, as tests look at it from outside."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from simulator.apiserver.server import TestApiServer
from simulator.kubelet import KubeletSimulator
from simulator.kubelet_connection import Plugin
from tests.support.agent_env import NODE, AgentProcess, settings_for
from tests.support.timing import scaled

GPU = "gpu.nvidia.com"
OLD_POD, NEW_POD = "00000000-0000-4000-8000-00000000000a", "00000000-0000-4000-8000-00000000000b"


def kernels(root: Path) -> list[int]:
    """The pids of simulated kernel processes serving the node at `root`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"simulator.kernel.process" in argv and str(root).encode() in argv:
            found.append(int(entry))
    return found


def made_on_node(sim_root: Path, bus_id: str) -> list[tuple[str, int, int]]:
    """The GPU instances on one GPU of a kept simulated node, as the hardware holds them across agent restarts:
    (profile, start, compute instances)."""
    state = json.loads((sim_root / ".sim/nvml-mig.json").read_text())
    gpu = next(g for g in state if g["bus_id"] == bus_id)
    return sorted((gi["profile"], gi["start"], len(gi["compute_instances"])) for gi in gpu["gpu_instances"])


@dataclass
class Surge:
    server: TestApiServer
    root: Path
    old: AgentProcess
    new: AgentProcess
    kubelet: KubeletSimulator


async def both_registered(kubelet: KubeletSimulator, drivers: Sequence[str]) -> dict[str, list[Plugin]]:
    """Each driver's two instances (old first), once both are connected."""
    async with asyncio.timeout(scaled(60)):
        while True:
            plugins = {d: [p for p in kubelet.plugins(d) if p.connected] for d in drivers}
            if all(len(p) == 2 for p in plugins.values()):
                return plugins
            await asyncio.sleep(0.05)  # the simulator scans the registry: nothing to wait on


@asynccontextmanager
async def surge_env(scratch: Path, profile: str, env: dict[str, str] | None = None,
                    **extra: Any) -> AsyncIterator[Surge]:
    """The old pod's agent and the kubelet simulator, and the new pod's agent ready to start (`surge.new.start()`);
    both are stopped at the end."""
    async with TestApiServer() as server:
        server.add_node(NODE)
        base = settings_for(scratch, server.write_kubeconfig(scratch / "kubeconfig"), profile, **extra)
        old = AgentProcess(base.model_copy(update={"pod_uid": OLD_POD}), env)
        new = AgentProcess(base.model_copy(update={"pod_uid": NEW_POD}), env)
        old.log, new.log = scratch / "old.log", scratch / "new.log"
        assert base.sim_root is not None
        try:
            async with KubeletSimulator(base.registry_dir) as kubelet:
                yield Surge(server, base.sim_root, old, new, kubelet)
        finally:
            await old.stop()
            await new.stop()


@asynccontextmanager
async def surge(scratch: Path, profile: str, env: dict[str, str] | None = None,
                drivers: Sequence[str] = (GPU,), **extra: Any) -> AsyncIterator[tuple[Surge, dict[str, list[Plugin]]]]:
    """The old pod's agent started first, then the new pod's beside it, both registered with the kubelet for every
    one of `drivers`: with each driver's two plugins, old first."""
    async with surge_env(scratch, profile, env, **extra) as run:
        try:
            await run.old.start()
            firsts = {d: await run.kubelet.wait_for_plugin(d, timeout=scaled(60)) for d in drivers}
            await run.new.start()
            plugins = await both_registered(run.kubelet, drivers)
        except TimeoutError:
            raise AssertionError(f"old agent:\n{run.old.output()}\nnew agent:\n{run.new.output()}") from None
        assert all(plugins[d][0] is firsts[d] for d in drivers)
        yield run, plugins
