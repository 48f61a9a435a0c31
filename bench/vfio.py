"""Benchmark: vfio-pci passthrough prepare and unprepare on `dra-agent run` (simulated dgx-h100), against the
sysfs writes they make and the simulated kernel's reaction to them.

The agent runs as its own process (`nvidia-gpu` and `sriov-nic`, checkpoint and vfio journals on disk, the
simulated node in RAM as sysfs is, its kernel reacting to sysfs writes from a process of its own, as in
bench/prepare.py); the test API server and the kubelet simulator run in this process. Per cycle, a claim with
the opaque `VfioConfig` for one device is prepared (the agent records the original driver, binds the device's
IOMMU group to vfio-pci, writes the CDI spec and the checkpoint), then unprepared (the original driver back),
rotating over the 8 GPUs and over 8 VFs (one per PF). For comparison, a plain prepare of the same GPUs (no
`VfioConfig`) in the same process.

Inside the agent (bench/agent_timing.py), each sysfs write's system calls (open to close, in the writer thread)
and each wait for the driver link to change (the kernel's reaction, seen by polling every 2 ms at most) are
timed, and so are the agent's gRPC handler and its read of the claim. Per call, two overheads beyond that sysfs
time: at the kubelet (its latency less the sysfs time: it includes the kubelet's gRPC client, the transport and
the API server's answer to the claim read), and the agent's (its handler's time less the sysfs time and the claim
read; see `agent_share`). Before each cycle the benchmark waits for the agent to be idle (see `quiet`).

    python bench/vfio.py [--cycles 200]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.agent_timing import AGENT_SPANS, agent_share, environment, spans_within
from bench.machine import conditions
from simulator.apiserver.server import TestApiServer
from simulator.kubelet import KubeletSimulator
from simulator.kubelet_connection import Plugin
from tests.support.agent_env import NODE, AgentProcess, allocate, memory_dir, settings_for, wait_until

GPU, SRIOV = "gpu.nvidia.com", "sriov.dra-agent.io"
VFIO_CONFIG = {"apiVersion": "dra-agent.io/v1alpha1", "kind": "VfioConfig"}
TIMED = [("write", "backends.vfio_sysfs:os"), ("wait", "backends.vfio_sysfs:Rebinder.wait_for"),
         *AGENT_SPANS]
WARM_UP = 5  # cycles of each kind not counted: the first prepare of a backend loads its journal


@dataclass
class Calls:
    """The kubelet's prepare and unprepare calls of one kind: (began, prepared, unprepared) each."""

    name: str
    spans: list[tuple[float, float, float]] = field(default_factory=list)


def config_for(driver: str) -> list[dict[str, Any]]:
    return [{"source": "FromClaim", "requests": ["dev"], "opaque": {"driver": driver, "parameters": VFIO_CONFIG}}]


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


async def quiet(pid: int, settle: float) -> None:
    """Wait for the agent to finish what the last cycle set off after its answers: the driver changes' uevents
    make it discover its devices again (once they have stopped for 0.2 s: `settle`), and a device is out of its
    inventory while it is away from its own driver. Quiet: no CPU time used for 0.15 s."""
    await asyncio.sleep(settle)
    last, still = cpu_ticks(pid), 0
    for _ in range(100):
        await asyncio.sleep(0.05)
        now = cpu_ticks(pid)
        still = still + 1 if now == last else 0
        last = now
        if still == 3:
            return


async def run_cycles(server: TestApiServer, plugin: Plugin, calls: Calls, devices: Sequence[str], cycles: int,
                     vfio: bool, pid: int) -> None:
    for i in range(WARM_UP + cycles):
        await quiet(pid, 0.25 if vfio else 0)
        name = f"{calls.name.lower().replace(' ', '-')}-{i}"
        ref = allocate(server, name, [("dev", plugin.driver, devices[i % len(devices)])],
                       config_for(plugin.driver) if vfio else None)
        began = time.perf_counter()
        await plugin.prepare_or_raise([ref])
        prepared = time.perf_counter()
        await plugin.unprepare_or_raise([ref])
        if i >= WARM_UP:
            calls.spans.append((began, prepared, time.perf_counter()))


def published(server: TestApiServer, driver: str) -> list[str]:
    """The driver's devices in its slices, one per PCI switch: the 8 GPUs; the first VF of each of the 8 PFs."""
    names = sorted(d["name"] for s in server.objects("resourceslices") if s["spec"]["driver"] == driver
                   for d in s["spec"].get("devices", []))
    return names if driver == GPU else names[::len(names) // 8]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1000


def line(label: str, values: list[float]) -> str:
    return f"{label} p50 {pct(values, 0.5):.2f} ms, p99 {pct(values, 0.99):.2f} ms"


def report(calls: Calls, within: Callable[[str, float, float], list[float]]) -> None:
    for phase, (start, end) in (("prepare", (0, 1)), ("unprepare", (1, 2))):
        total, sysfs, overhead, own, writes, waits = [], [], [], [], [], []
        for span in calls.spans:
            began, ended = span[start], span[end]
            write, wait = within("write", began, ended), within("wait", began, ended)
            used = sum(write) + sum(wait)
            total.append(ended - began)
            sysfs.append(used)
            overhead.append(ended - began - used)
            own.append(agent_share(within, phase, began, ended) - used)
            writes.append(len(write))
            waits.append(len(wait))
        print(f"{calls.name} {phase} ({len(total)} calls, {statistics.median(writes):.0f} writes and "
              f"{statistics.median(waits):.0f} driver waits each): {line('total', total)}; "
              f"{line('sysfs writes + kernel reaction', sysfs)}; {line('overhead at the kubelet', overhead)}; "
              f"{line('agent overhead', own)}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=200)
    args = parser.parse_args()
    print(conditions())
    disk = Path(tempfile.mkdtemp(prefix="dra-bench-vfio-", dir="/var/tmp"))
    try:
        with memory_dir("drabv") as memory:
            times = memory / "sysfs-times"
            env = environment(memory, times, TIMED)
            async with TestApiServer() as server:
                server.add_node(NODE)
                settings = settings_for(memory, server.write_kubeconfig(memory / "kubeconfig"), "dgx-h100",
                                        backends=("nvidia-gpu", "sriov-nic")).model_copy(
                    # The node in RAM, as sysfs is; the journals on disk.
                    update={"state_dir": disk / "state", "sim_root": memory / "node"})
                agent = AgentProcess(settings, env)
                await agent.start()
                try:
                    async with KubeletSimulator(settings.registry_dir) as kubelet:
                        gpu = await kubelet.wait_for_plugin(GPU, timeout=60)
                        nic = await kubelet.wait_for_plugin(SRIOV, timeout=60)
                        await wait_until(lambda: {s["spec"]["driver"] for s in server.objects("resourceslices")}
                                         == {GPU, SRIOV}, 30)
                        assert agent.process is not None
                        pid = agent.process.pid
                        gpus, vfs = published(server, GPU), published(server, SRIOV)
                        plain, gpu_vfio, vf_vfio = Calls("plain GPU"), Calls("GPU vfio"), Calls("VF vfio")
                        await run_cycles(server, gpu, plain, gpus, args.cycles, vfio=False, pid=pid)
                        await run_cycles(server, gpu, gpu_vfio, gpus, args.cycles, vfio=True, pid=pid)
                        await run_cycles(server, nic, vf_vfio, vfs, args.cycles, vfio=True, pid=pid)
                finally:
                    await agent.stop()
            within = spans_within(times)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    print(line(f"plain GPU prepare ({len(plain.spans)} calls, no VfioConfig):",
               [p - b for b, p, _ in plain.spans]))
    report(gpu_vfio, within)
    report(vf_vfio, within)
    print(conditions())


if __name__ == "__main__":
    asyncio.run(main())
