"""Benchmark: dynamic MIG prepare and unprepare on `dra-agent run` (simulated dgx-h100, every GPU in MIG mode,
`nvidia-mig` in dynamic mode), against the NVML calls they make.

1. the kubelet's prepare of a claim for one 1g.10gb MIG device at a given placement (the agent creates the GPU
   instance and compute instance, records them, writes the CDI spec and the checkpoint) and its unprepare
   (destroys them), `--cycles` times over the placements of all GPUs;
2. the same NVML work done directly in this process on an identical simulated node (through the node's NVML
   library, served from the node's kernel process as for the agent): list the profiles once, then create GPU
   instance + compute instance, and destroy them, `--cycles` times.

Overheads beyond NVML, call by call, beside the time the agent spent in the NVML calls of that call (create GPU
instance, create compute instance, destroy, and the lookups), timed inside the agent (bench/agent_timing.py):
at the kubelet (its latency less NVML: it includes the kubelet's gRPC client, the transport and the API server's
answer to the claim read), and the agent's (its gRPC handler's time less NVML and the claim read; see
`agent_share`). (2) shows what the same NVML work costs alone, in a quiet process. The agent runs as its own
process with its checkpoint and MIG ledger on disk, as in bench/prepare.py.

    python bench/mig.py [--cycles 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends.nvidia.driver_root import DriverRoot
from backends.nvidia.nvml import nvml_session, use_driver_root
from backends.nvidia.nvml_mig import create_compute_instance, create_gpu_instance, destroy_mig
from bench.agent_timing import AGENT_SPANS, agent_share, environment, spans_within
from bench.machine import conditions
from simulator.apiserver.server import TestApiServer
from simulator.kubelet import KubeletSimulator
from simulator.node.node import simulated_node
from simulator.node.profile import load_profile
from tests.support.agent_env import NODE, AgentProcess, allocate, memory_dir, settings_for

GPU = "gpu.nvidia.com"
NVML_CALLS = ("create_gpu_instance", "create_compute_instance", "destroy_mig", "find_gpu_instance",
              "existing_compute_instance", "mig_instance_exists")
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
    p50 = ordered[round(0.5 * (len(ordered) - 1))]
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return f"p50 {p50 * 1000:.2f} ms, p99 {p99 * 1000:.2f} ms"


def nvml_only(profile: Path, cycles: int) -> tuple[list[float], list[float]]:
    """The NVML part of making and unmaking a 1g.10gb device, timed directly: through the node's NVML library,
    served from the node's kernel process as for the agent."""
    make, unmake = [], []
    with simulated_node(str(profile), kernel_process=True) as node:
        use_driver_root(DriverRoot(node.root, node.driver_root, node.dev))  # as the NVIDIA backends do
        with nvml_session():
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


async def through_the_agent(profile: Path, cycles: int, memory: Path, disk: Path
                            ) -> list[tuple[float, float, float]]:
    """(began, prepared, unprepared) of each cycle; the agent's NVML calls are timed into memory/nvml-times."""
    spans = []
    timing = environment(memory, memory / "nvml-times",
                         [*(("nvml", f"backends.nvidia.mig_dynamic:{name}") for name in NVML_CALLS), *AGENT_SPANS])
    async with TestApiServer() as server:
        server.add_node(NODE)
        settings = settings_for(memory, server.write_kubeconfig(memory / "kubeconfig"), str(profile),
                                backends=("nvidia-mig",)).model_copy(update={"state_dir": disk / "state"})
        agent = AgentProcess(settings, {**timing,
                                        "DRA_AGENT_BACKEND_CONFIG": json.dumps({"nvidia-mig": {"mode": "dynamic"}})})
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
                    spans.append((began, prepared, time.perf_counter()))
                    assert errors == {ref.uid: ""}, errors
        finally:
            await agent.stop()
    return spans


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=300)
    args = parser.parse_args()
    print(conditions())
    disk = Path(tempfile.mkdtemp(prefix="dra-bench-mig-"))
    try:
        with memory_dir("drabm") as memory:
            profile = mig_profile(memory)
            make, unmake = nvml_only(profile, args.cycles)
            spans = await through_the_agent(profile, args.cycles, memory, disk)
            within = spans_within(memory / "nvml-times")
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    print(f"NVML only, in a quiet process, {args.cycles} cycles: make {ms(make)}; unmake {ms(unmake)}")
    for phase, start, end in (("prepare", 0, 1), ("unprepare", 1, 2)):
        total = [span[end] - span[start] for span in spans]
        nvml = [sum(within("nvml", span[start], span[end])) for span in spans]
        overhead = [t - n for t, n in zip(total, nvml, strict=True)]
        own = [agent_share(within, phase, span[start], span[end]) - n for span, n in zip(spans, nvml, strict=True)]
        print(f"through the agent, {phase}: total {ms(total)}; in NVML calls {ms(nvml)}; "
              f"overhead beyond NVML at the kubelet {ms(overhead)}; agent overhead beyond NVML {ms(own)}")
    print(conditions())


if __name__ == "__main__":
    asyncio.run(main())
