"""Benchmark: dynamic MIG prepare and unprepare on `dra-agent run` (simulated dgx-h100, every GPU in MIG mode,
`nvidia-mig` in dynamic mode), against the NVML calls they make.

1. the kubelet's prepare of a claim for one 1g.10gb MIG device at a given placement (the agent creates the GPU
   instance and compute instance, records them, writes the CDI spec and the checkpoint) and its unprepare
   (destroys them), `--cycles` times over the placements of all GPUs;
2. the same NVML work done directly in this process on an identical simulated node: list the profiles once,
   then create GPU instance + compute instance, and destroy them, `--cycles` times.

The agent's overhead beyond NVML is (1) - (2) at the median. The agent runs as its own process with its
checkpoint and MIG ledger on disk (fdatasync), as in bench/prepare.py.

    python bench/mig.py [--cycles 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.testing.apiserver import TestApiServer
from agent.testing.kubelet import KubeletSimulator
from backends.nvidia.nvml import nvml_session
from backends.nvidia.nvml_mig import create_compute_instance, create_gpu_instance, destroy_mig
from backends.simulation.node import simulated_node
from backends.simulation.profile import load_profile
from tests.agent_env import NODE, AgentProcess, allocate, memory_dir, settings_for

GPU = "gpu.nvidia.com"
BUS_IDS = ("0000:18:00.0", "0000:1c:00.0", "0000:3a:00.0", "0000:3e:00.0", "0000:9a:00.0", "0000:9e:00.0",
           "0000:bb:00.0", "0000:bf:00.0")


def mig_profile(folder: Path) -> Path:
    """dgx-h100 with every GPU in MIG mode and no MIG device."""
    data = load_profile("dgx-h100").model_dump(mode="json", exclude_none=True)
    data["name"] = "dgx-h100-mig"
    for complex_ in data["root_complexes"]:
        for port in complex_["ports"]:
            for slot in port.get("switch") or []:
                if slot.get("gpu"):
                    slot["gpu"]["mig"] = {"instances": []}
    path = folder / "dgx-h100-mig.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def ms(values: list[float]) -> str:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return f"p50 {statistics.median(ordered) * 1000:.2f} ms, p99 {p99 * 1000:.2f} ms"


def nvml_only(profile: Path, cycles: int) -> tuple[list[float], list[float]]:
    """The NVML part of making and unmaking a 1g.10gb device, timed directly."""
    make, unmake = [], []
    with simulated_node(str(profile)), nvml_session():
        for i in range(cycles):
            bus_id, start = BUS_IDS[i % len(BUS_IDS)], i % 7
            began = time.perf_counter()
            gi = create_gpu_instance(bus_id, 19, start, 1)
            create_compute_instance(bus_id, gi, 1)
            made = time.perf_counter()
            destroy_mig(bus_id, gi)
            make.append(made - began)
            unmake.append(time.perf_counter() - made)
    return make, unmake


async def through_the_agent(profile: Path, cycles: int, memory: Path, disk: Path) -> tuple[list[float], list[float]]:
    prepare, unprepare = [], []
    async with TestApiServer() as server:
        server.add_node(NODE)
        settings = settings_for(memory, server.write_kubeconfig(memory / "kubeconfig"), str(profile),
                                backends=("nvidia-mig",)).model_copy(update={"state_dir": disk / "state"})
        agent = AgentProcess(settings, {"DRA_AGENT_BACKEND_CONFIG": json.dumps({"nvidia-mig": {"mode": "dynamic"}})})
        await agent.start()
        try:
            async with KubeletSimulator(settings.registry_dir) as kubelet:
                plugin = await kubelet.wait_for_plugin(GPU, timeout=60)
                for i in range(cycles):
                    bus_id, start = BUS_IDS[i % len(BUS_IDS)], i % 7
                    device = f"gpu-{bus_id.replace(':', '-').replace('.', '-')}-mig-1g10gb-19-{start}"
                    ref = allocate(server, f"c{i}", [("mig", GPU, device)])
                    began = time.perf_counter()
                    await plugin.prepare_or_raise([ref])
                    prepared = time.perf_counter()
                    errors = await plugin.unprepare([ref])
                    prepare.append(prepared - began)
                    unprepare.append(time.perf_counter() - prepared)
                    assert errors == {ref.uid: ""}, errors
        finally:
            await agent.stop()
    return prepare, unprepare


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=300)
    args = parser.parse_args()
    disk = Path(tempfile.mkdtemp(prefix="dra-bench-mig-"))
    try:
        with memory_dir("drabm") as memory:
            profile = mig_profile(memory)
            make, unmake = nvml_only(profile, args.cycles)
            prepare, unprepare = await through_the_agent(profile, args.cycles, memory, disk)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    print(f"NVML only, {args.cycles} cycles: make {ms(make)}; unmake {ms(unmake)}")
    print(f"through the agent: prepare {ms(prepare)}; unprepare {ms(unprepare)}")
    print(f"agent overhead beyond NVML at the median: prepare "
          f"{(statistics.median(prepare) - statistics.median(make)) * 1000:.2f} ms, unprepare "
          f"{(statistics.median(unprepare) - statistics.median(unmake)) * 1000:.2f} ms")


if __name__ == "__main__":
    asyncio.run(main())
