"""Benchmark: device health on a `dra-agent run` process serving the simulated dgx-h100 (8 GPUs, 8 PFs, 64 VFs).

1. NVML: Xid 79 on GPU 3, injected through the simulated NVML's control socket → the GPU's Unhealthy report on
   a kubelet health stream, and → the API server receiving the slice write that carries its taint; then a reset
   (recovery is found by the watcher's probe, not timed);
2. udev: link down / link up of a PF's netdev, injected as uevents through umockdev → its 8 VFs Unhealthy /
   Healthy on the stream, and → the slice write that adds / removes their taints;
3. idle: the agent's CPU time (user + system, all threads, from /proc/<pid>/stat) over `--idle` seconds with
   health on, a kubelet health stream open and nothing happening; the stream messages and API writes in that
   window are counted too.

Latencies run from just before the injection to the observation, so they include the injection itself (a
datagram to the NVML control thread, or a uevent to the agent's netlink socket) on top of the agent's work.

    python bench/health.py [--events 100] [--idle 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.kubelet.services import DeviceHealthReport, HealthStatus
from simulator.apiserver.server import TestApiServer
from simulator.kubelet import KubeletSimulator
from simulator.kubelet_connection import Plugin
from simulator.nvml.control import request
from simulator.udev.hotplug import UdevInjector
from simulator.udev.preload import UdevPreloadError, environment
from tests.support.agent_env import NODE, AgentProcess, memory_dir, settings_for, wait_until

GPU_DRIVER, NIC_DRIVER = "gpu.nvidia.com", "sriov.dra-agent.io"
GPU_INDEX, GPU_DEVICE = 3, "gpu-0000-3e-00-0"
PF_NETDEV = "enp25s0f0np0"
PF_VFS = {f"vf-0000-19-00-{f}" for f in range(1, 8)} | {"vf-0000-19-01-0"}
SLICE_WRITES = ("PUT", "POST")


class Stream:
    """One kubelet health stream of a driver, each message stamped on arrival."""

    def __init__(self, plugin: Plugin) -> None:
        self.messages: list[tuple[float, dict[str, HealthStatus]]] = []
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._read(plugin))

    async def _read(self, plugin: Plugin) -> None:
        async for reports in plugin.health():
            self.messages.append((time.monotonic(), _by_device(reports)))
            self._changed.set()
            self._changed = asyncio.Event()

    async def first_after(self, since: float, check: Callable[[dict[str, HealthStatus]], bool],
                          timeout: float = 10) -> float:
        """When the first message received after `since` satisfying `check` arrived."""
        async with asyncio.timeout(timeout):
            while True:
                for at, message in self.messages:
                    if at >= since and check(message):
                        return at
                await self._changed.wait()

    def count(self, since: float, until: float) -> int:
        return sum(1 for at, _ in self.messages if since <= at < until)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def _by_device(reports: list[DeviceHealthReport]) -> dict[str, HealthStatus]:
    return {r.device: r.health for r in reports}


def _all(devices: set[str], health: HealthStatus) -> Callable[[dict[str, HealthStatus]], bool]:
    return lambda message: all(message.get(d) == health for d in devices)


async def slice_write_after(server: TestApiServer, since: float, check: Callable[[], bool],
                            timeout: float = 10) -> float:
    """When the API server received the first slice write after `since` that left the slices as `check` wants."""
    await wait_until(check, timeout=timeout, interval=0.005)
    writes = server.find_requests(SLICE_WRITES, "/apis/resource.k8s.io/v1/resourceslices*", since=since)
    if not writes:
        raise AssertionError("the slices changed without a write")
    return writes[0].time


def taints(server: TestApiServer, driver: str) -> dict[str, list[str]]:
    return {d["name"]: [t["key"] for t in d["taints"]] for s in server.objects("resourceslices")
            if s["spec"]["driver"] == driver for d in s["spec"].get("devices", ()) if d.get("taints")}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5), counted after the name
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def summary(name: str, values: list[float]) -> str:
    ms = sorted(v * 1000 for v in values)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return (f"{name}: n={len(ms)} p50 {statistics.median(ms):.1f} ms, p99 {p99:.1f} ms, max {ms[-1]:.1f} ms")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100, help="injections of each kind")
    parser.add_argument("--idle", type=float, default=60.0, help="seconds of the idle window")
    args = parser.parse_args()
    with memory_dir("drah") as memory:
        async with TestApiServer() as server:
            server.add_node(NODE)
            settings = settings_for(memory, server.write_kubeconfig(memory / "kubeconfig"), "dgx-h100")
            assert settings.sim_root is not None
            try:
                environment(settings.sim_root)
            except UdevPreloadError as e:
                sys.exit(f"bench/health.py needs umockdev: {e}")
            config = {name: {"recheckSeconds": 0.05} for name in ("nvidia-gpu", "nvidia-mig")}
            agent = AgentProcess(settings, env={"DRA_AGENT_BACKEND_CONFIG": json.dumps(config)})
            await agent.start()
            try:
                async with KubeletSimulator(settings.registry_dir) as kubelet:
                    await run(args, server, kubelet, agent, settings.sim_root)
            finally:
                await agent.stop()
                if "Traceback" in agent.output():
                    print(agent.output()[-4000:])


async def run(args: argparse.Namespace, server: TestApiServer, kubelet: KubeletSimulator, agent: AgentProcess,
              root: Path) -> None:
    gpu_plugin = await kubelet.wait_for_plugin(GPU_DRIVER, timeout=30)
    nic_plugin = await kubelet.wait_for_plugin(NIC_DRIVER, timeout=30)
    await wait_until(lambda: len(server.objects("resourceslices")) == 2, timeout=30)
    await wait_until(lambda: all(g["registered_events"] for g in request(root, {"op": "list"})["gpus"]), timeout=30)
    gpus, nics = Stream(gpu_plugin), Stream(nic_plugin)
    await gpus.first_after(0, lambda m: GPU_DEVICE in m)
    await nics.first_after(0, lambda m: set(m) >= PF_VFS)
    udev = UdevInjector(root)

    stream_latency: dict[str, list[float]] = {"nvml": [], "udev": []}
    write_latency: dict[str, list[float]] = {"nvml": [], "udev": []}
    for _ in range(args.events):
        start = time.monotonic()
        await asyncio.to_thread(request, root, {"op": "xid", "gpu": str(GPU_INDEX), "xid": 79})
        unhealthy = await gpus.first_after(start, _all({GPU_DEVICE}, HealthStatus.UNHEALTHY))
        stream_latency["nvml"].append(unhealthy - start)
        write_latency["nvml"].append(
            await slice_write_after(server, start, lambda: GPU_DEVICE in taints(server, GPU_DRIVER)) - start)
        await asyncio.to_thread(request, root, {"op": "reset", "gpu": str(GPU_INDEX)})
        await gpus.first_after(unhealthy, _all({GPU_DEVICE}, HealthStatus.HEALTHY))
        try:
            await wait_until(lambda: not taints(server, GPU_DRIVER), timeout=10, interval=0.005)
        except TimeoutError:
            raise AssertionError(f"GPU healthy on the stream, still tainted: {taints(server, GPU_DRIVER)}; "
                                 f"stream: {gpus.messages[-3:]}") from None
        await wait_until(lambda: request(root, {"op": "list"})["gpus"][GPU_INDEX]["registered_events"], timeout=10)

        for link, health in (("down", HealthStatus.UNHEALTHY), ("up", HealthStatus.HEALTHY)):
            start = time.monotonic()
            await asyncio.to_thread(udev.link_down if link == "down" else udev.link_up, PF_NETDEV)
            stream_latency["udev"].append(await nics.first_after(start, _all(PF_VFS, health)) - start)

            def as_linked(tainted: bool = link == "down") -> bool:
                return (set(taints(server, NIC_DRIVER)) == PF_VFS) == tainted

            write_latency["udev"].append(await slice_write_after(server, start, as_linked) - start)

    # Idle: let the last writes and log lines settle, then measure.
    await asyncio.sleep(3)
    assert agent.process is not None
    pid = agent.process.pid
    began, cpu_before, writes_before = time.monotonic(), cpu_seconds(pid), server.writes()
    await asyncio.sleep(args.idle)
    ended, cpu_after = time.monotonic(), cpu_seconds(pid)
    idle_writes = server.writes() - writes_before
    await gpus.close()
    await nics.close()

    print("event → kubelet health stream (from just before the injection):")
    for source, values in stream_latency.items():
        print("  " + summary(source, values))
    print("event → slice write received by the API server:")
    for source, values in write_latency.items():
        print("  " + summary(source, values))
    cpu = cpu_after - cpu_before
    print(f"idle {ended - began:.1f} s: agent CPU {cpu:.2f} s = {100 * cpu / (ended - began):.2f} % of one core; "
          f"slice writes {idle_writes}; full lists on one GPU stream {gpus.count(began, ended)}")


if __name__ == "__main__":
    asyncio.run(main())
