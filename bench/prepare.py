"""Benchmark: the kubelet's view of `dra-agent run` on a simulated dgx-h100 with 64 VFs per PF.

The agent runs as its own process (`dra-agent run`, logging at info to a file), with its checkpoint on disk
(durable appends, fdatasync) and its CDI directory in RAM (as /var/run/cdi is); the test API server and the
kubelet simulator run in this process and talk to it over loopback HTTP and real unix sockets. Measures:

1. start-up: process start → every driver registered with the kubelet and all its slices in the API server (on a
   simulated node kept between starts, as a real host's sysfs exists before the agent);
2. prepare latency of a 1-GPU claim (each followed by its unprepare), and the round trip of an empty request
   on the same socket for comparison;
3. 100 claims on distinct devices prepared concurrently (100 pods starting at once);
4. the agent's RSS after start-up and after 1,000 and 2,000 prepare/unprepare cycles.

The claims' status.devices are written as the agent does by default; `--no-claim-status` runs without.
`--claim-status-ab` measures only the 1-GPU prepare latency and the agent's CPU time per prepare/unprepare cycle,
with status writes off and on, `--cycles` calls each, in blocks of agents started on the same simulated node in the
order off on on off off on on off (drift of the machine's speed cancels out), and prints both and the difference.
With --device-metadata the agent writes device metadata files, into a plugins folder on disk (as
/var/lib/kubelet/plugins is on a node), so each prepare also writes and syncs a file there.

The packages' bytecode is compiled first, as an installed package has it (unless --no-compile).

    python bench/prepare.py [--cycles 1000] [--starts 5] [--no-compile] [--no-claim-status | --claim-status-ab]
                            [--device-metadata]
"""

from __future__ import annotations

import argparse
import asyncio
import compileall
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.agent_timing import environment, spans_within
from bench.discover import profile_with_vfs
from bench.machine import conditions
from simulator.apiserver.server import TestApiServer
from simulator.kubelet import KubeletSimulator
from simulator.kubelet_connection import Plugin
from tests.support.agent_env import NODE, AgentProcess, allocate, settings_for, wait_until

GPU, NIC = "gpu.nvidia.com", "sriov.dra-agent.io"
STATUS = "/apis/resource.k8s.io/v1/namespaces/*/resourceclaims/*/status"
KERNEL_START = "simulator.kernel.process:KernelProcess.start"


def compile_packages() -> None:
    """Compile the packages' bytecode, as installing them does (pip, the container image): a source tree run with
    PYTHONDONTWRITEBYTECODE set (as on the machine of docs/performance.md) would otherwise compile every module
    at every start."""
    root = Path(__file__).resolve().parent.parent
    for package in ("agent", "backends", "cdi", "simulator"):
        compileall.compile_dir(root / package, quiet=1)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def start_agent(server: TestApiServer, memory: Path, disk: Path, profile: Path, kubeconfig: Path,
                      run: int, agents: list[AgentProcess], *, claim_status: bool = True, metadata: bool = False,
                      ) -> tuple[AgentProcess, KubeletSimulator, dict[str, Plugin], float, float]:
    """Start an agent (added to `agents`, to be stopped whatever happens) and time its start-up."""
    root = memory / f"run{run}"
    # The simulated node is kept across starts, as a real host's sysfs is there before the agent starts.
    extra = {"device_metadata": True, "plugins_dir": disk / f"plugins{run}"} if metadata else {}
    settings = settings_for(root, kubeconfig, str(profile)).model_copy(
        update={"state_dir": disk / f"state{run}", "log_level": "info", "sim_root": memory / "node",
                "claim_status": claim_status, **extra})
    # The simulated kernel's process start is timed inside the agent, to be told apart: a real node's kernel runs
    # before the agent starts.
    agent = AgentProcess(settings, environment(memory, memory / "kernel-start", [("kernel", KERNEL_START)]))
    agents.append(agent)
    kubelet = KubeletSimulator(settings.registry_dir)
    started = time.perf_counter()
    await agent.start()
    plugins = {d: await kubelet.wait_for_plugin(d, timeout=30) for d in (GPU, NIC)}
    await wait_until(lambda: pools_complete(server) == {GPU, NIC}, 30, interval=0.005)
    return agent, kubelet, plugins, started, time.perf_counter() - started


def pools_complete(server: TestApiServer) -> set[str]:
    """The drivers whose pool is in the API server whole: as many slices of its generation as each says it has
    (a pool of 512 VFs is several slices, written at once but arriving one by one)."""
    slices: dict[tuple[str, int], list[int]] = {}
    for obj in server.objects("resourceslices"):
        pool = obj["spec"]["pool"]
        slices.setdefault((obj["spec"]["driver"], pool["generation"]), []).append(pool["resourceSliceCount"])
    return {driver for (driver, _), counts in slices.items() if len(counts) == counts[0]}


async def prepare_latency(server: TestApiServer, plugin: Plugin, gpus: list[str], cycles: int, tag: str
                          ) -> list[float]:
    """Seconds of each of `cycles` 1-GPU prepares (each followed by its unprepare), over 8 claims in turn."""
    claims = [allocate(server, f"{tag}-{i}", [("gpu", GPU, gpus[i % len(gpus)])]) for i in range(8)]
    latency = []
    for cycle in range(cycles):
        ref = claims[cycle % len(claims)]
        t = time.perf_counter()
        await plugin.prepare_or_raise([ref])
        latency.append(time.perf_counter() - t)
        await plugin.unprepare_or_raise([ref])
    return latency


async def claim_status_ab(cycles: int) -> None:
    """The 1-GPU prepare latency with the claims' status writes off and on, in blocks back to back."""
    memory = Path(tempfile.mkdtemp(prefix="drab", dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp(prefix="dra-bench-state-", dir="/var/tmp"))
    profile = profile_with_vfs(64, memory)
    agents: list[AgentProcess] = []
    latency: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    writes_made, cycles_made = 0, 0
    order = (False, True, True, False, False, True, True, False)
    try:
        async with TestApiServer() as server:
            server.add_node(NODE)
            kubeconfig = server.write_kubeconfig(memory / "kubeconfig")
            for block, on in enumerate(order):
                for obj in server.objects("resourceslices"):
                    server.delete_object("resourceslices", obj["metadata"]["name"])
                writes = server.count_requests("PATCH", STATUS)
                agent, kubelet, plugins, _, _ = await start_agent(server, memory, disk, profile, kubeconfig, block,
                                                                  agents, claim_status=on)
                slices = server.objects("resourceslices")
                gpus = [d["name"] for s in slices if s["spec"]["driver"] == GPU for d in s["spec"].get("devices", [])]
                assert agent.process is not None
                measured = cycles // order.count(on)
                await prepare_latency(server, plugins[GPU], gpus, 50, f"w{block}")  # warm-up
                before = cpu_seconds(agent.process.pid)
                latency[on] += await prepare_latency(server, plugins[GPU], gpus, measured, f"b{block}")
                cpu[on].append((cpu_seconds(agent.process.pid) - before) / measured)
                cycles_made += (50 + measured) if on else 0
                if on:  # the writes did happen, in the background
                    await wait_until(
                        lambda before=writes: server.count_requests("PATCH", STATUS, status=200) > before, 30)
                    writes_made += server.count_requests("PATCH", STATUS) - writes
                else:
                    assert server.count_requests("PATCH", STATUS) == writes, "status written with the setting off"
                await kubelet.close()
                await agent.stop()
    finally:
        for started in agents:
            await started.stop()
        shutil.rmtree(memory, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    ms = 1000
    p50 = {on: percentile(values, 0.5) * ms for on, values in latency.items()}
    for on in (False, True):
        values = latency[on]
        print(f"1-GPU prepare, claim status {'on ' if on else 'off'} ({len(values)} calls): p50 {p50[on]:.3f} ms, "
              f"p99 {percentile(values, 0.99) * ms:.3f} ms, mean {statistics.fmean(values) * ms:.3f} ms; agent CPU "
              f"per prepare/unprepare cycle {statistics.fmean(cpu[on]) * ms:.3f} ms")
    print(f"p50 on - off: {p50[True] - p50[False]:+.3f} ms; status writes with it on: {writes_made} "
          f"({writes_made / cycles_made:.2f} per prepare/unprepare cycle; each cycle wants two)")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--device-metadata", dest="metadata", action="store_true",
                        help="with device metadata files (plugins folder on disk)")
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="leave the packages' bytecode as it is (a source tree without __pycache__ run with "
                             "PYTHONDONTWRITEBYTECODE compiles every module at every start)")
    parser.add_argument("--no-claim-status", dest="claim_status", action="store_false",
                        help="run the agent without writing the claims' status.devices")
    parser.add_argument("--claim-status-ab", action="store_true",
                        help="only compare the 1-GPU prepare latency with status writes off and on")
    args = parser.parse_args()
    if args.compile:
        compile_packages()
    print(conditions())
    if args.claim_status_ab:
        await claim_status_ab(args.cycles)
        return
    memory = Path(tempfile.mkdtemp(prefix="drab", dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp(prefix="dra-bench-state-", dir="/var/tmp"))
    profile = profile_with_vfs(64, memory)
    agents: list[AgentProcess] = []
    try:
        async with TestApiServer() as server:
            server.add_node(NODE)
            kubeconfig = server.write_kubeconfig(memory / "kubeconfig")
            startups = []
            for run in range(args.starts):
                for obj in server.objects("resourceslices"):
                    server.delete_object("resourceslices", obj["metadata"]["name"])
                agent, kubelet, _, began, seconds = await start_agent(server, memory, disk, profile, kubeconfig,
                                                                      run, agents, claim_status=args.claim_status,
                                                                      metadata=args.metadata)
                startups.append((began, seconds))
                await kubelet.close()
                await agent.stop()
            agent, kubelet, plugins, _, _ = await start_agent(server, memory, disk, profile, kubeconfig, 99, agents,
                                                              claim_status=args.claim_status, metadata=args.metadata)
            assert agent.process is not None
            pid = agent.process.pid
            rss_start = rss_mb(pid)
            slices = server.objects("resourceslices")
            gpus = [d["name"] for s in slices if s["spec"]["driver"] == GPU for d in s["spec"].get("devices", [])]
            vfs = [d["name"] for s in slices if s["spec"]["driver"] == NIC for d in s["spec"].get("devices", [])]

            empty = []
            for _ in range(300):
                t = time.perf_counter()
                await plugins[GPU].prepare([])
                empty.append(time.perf_counter() - t)

            claims = [allocate(server, f"gpu-{i}", [("gpu", GPU, gpus[i % len(gpus)])]) for i in range(8)]
            latency, rss_at = [], {}
            for cycle in range(2 * args.cycles):
                ref = claims[cycle % len(claims)]
                t = time.perf_counter()
                await plugins[GPU].prepare_or_raise([ref])
                latency.append(time.perf_counter() - t)
                await plugins[GPU].unprepare_or_raise([ref])
                if cycle + 1 in (args.cycles, 2 * args.cycles):
                    rss_at[cycle + 1] = rss_mb(pid)

            many = [allocate(server, f"vf-{i}", [("nic", NIC, vfs[i])]) for i in range(100)]
            t = time.perf_counter()
            results = await asyncio.gather(*(plugins[NIC].prepare_or_raise([ref]) for ref in many))
            concurrent = time.perf_counter() - t
            assert all(r[ref.uid].devices for r, ref in zip(results, many, strict=True))
            await asyncio.gather(*(plugins[NIC].unprepare_or_raise([ref]) for ref in many))

            await kubelet.close()
            await agent.stop()
        within = spans_within(memory / "kernel-start")
    finally:
        for started in agents:  # a run that failed midway leaves none behind
            await started.stop()
        shutil.rmtree(memory, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)

    ms = 1000
    p50, p99 = percentile(latency, 0.5) * ms, percentile(latency, 0.99) * ms
    e50 = percentile(empty, 0.5) * ms
    kernel = [sum(within("kernel", began, began + seconds)) for began, seconds in startups]
    own = [seconds - k for (_, seconds), k in zip(startups, kernel, strict=True)]
    print(f"start → registered and published (dgx-h100, 64 VFs/PF, {args.starts} starts): the agent's own "
          f"median {statistics.median(own):.3f} s, max {max(own):.3f} s; with the simulated kernel's process start "
          f"(median {statistics.median(kernel):.3f} s) median {statistics.median(s for _, s in startups):.3f} s")
    print(f"empty NodePrepareResources round trip: p50 {e50:.2f} ms, p99 {percentile(empty, 0.99) * ms:.2f} ms")
    print(f"1-GPU prepare ({len(latency)} calls): p50 {p50:.2f} ms, p99 {p99:.2f} ms, "
          f"mean {statistics.fmean(latency) * ms:.2f} ms; p50 = {p50 / e50:.1f} times the empty round trip")
    print(f"100 concurrent claims on distinct VFs: all prepared in {concurrent:.3f} s")
    print(f"agent RSS: {rss_start:.1f} MB after start-up, " +
          ", ".join(f"{v:.1f} MB after {k} cycles" for k, v in rss_at.items()))


if __name__ == "__main__":
    asyncio.run(main())
