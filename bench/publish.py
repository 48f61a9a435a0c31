"""Benchmark: publishing the simulated dgx-h100 with 64 VFs per PF (8 GPUs, 512 VFs: 9 slices in 2 pools, 64
devices to a slice so that a device turning unhealthy rewrites its own slice only).

1. start-up: `dra-agent run` process start → every slice of both pools in the API server (5 starts, on a
   simulated node kept on disk between starts, as a real host's sysfs is there before the agent starts);
2. repair: the kubelet deletes all of the node's slices (as at its own start) → all back;
3. a single device changes → writes to the API server;
4. idle: every request the agent makes in `--minutes` minutes with nothing changing, extrapolated to an hour.

    python bench/publish.py [--minutes 12]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.kube.client import KubeClient
from agent.logs import get_logger
from agent.slices.build import pool_slices
from agent.slices.publisher import Publisher
from backends.contract import Device
from bench.discover import profile_with_vfs
from simulator.apiserver.server import TestApiServer
from tests.support.agent_env import NODE, AgentProcess, settings_for, wait_until

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
SLICES_PUBLISHED = 1 + 512 // 64  # the GPU pool's one slice, the VFs' eight


def slice_count(server: TestApiServer) -> int:
    return server.count("resourceslices")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=12.0)
    parser.add_argument("--starts", type=int, default=5)
    args = parser.parse_args()
    memory = Path(tempfile.mkdtemp(prefix="drap", dir="/dev/shm"))
    profile = profile_with_vfs(64, memory)
    try:
        async with TestApiServer() as server:
            server.add_node(NODE)
            kubeconfig = server.write_kubeconfig(memory / "kubeconfig")
            startups = []
            agent: AgentProcess | None = None
            for run in range(args.starts):
                for obj in server.objects("resourceslices"):
                    server.delete_object("resourceslices", obj["metadata"]["name"])
                # The simulated node is kept across starts, as a real host's sysfs is there before the agent.
                settings = settings_for(memory / f"run{run}", kubeconfig, str(profile)).model_copy(
                    update={"sim_root": memory / "node"})
                agent = AgentProcess(settings)
                started = time.perf_counter()
                await agent.start()
                await wait_until(lambda: slice_count(server) == SLICES_PUBLISHED, 30, interval=0.005)
                startups.append(time.perf_counter() - started)
                if run < args.starts - 1:
                    await agent.stop()
            assert agent is not None

            await asyncio.sleep(1)
            started = time.perf_counter()
            for obj in server.objects("resourceslices"):  # the kubelet's wipe at its start
                server.delete_object("resourceslices", obj["metadata"]["name"])
            await wait_until(lambda: slice_count(server) == SLICES_PUBLISHED, 30, interval=0.005)
            repair = time.perf_counter() - started

            await asyncio.sleep(1)
            window = time.monotonic()
            await asyncio.sleep(args.minutes * 60)
            idle = server.find_requests(since=window)
            await agent.stop()

            kube = await KubeClient.connect(kubeconfig)
            publisher = Publisher(kube, "node-b", get_logger("bench"))
            server.add_node("node-b")
            devices = [Device(name=f"vf-{i:04d}", attributes={"index": i}) for i in range(512)]
            state = {"devices": devices}
            build = lambda features: pool_slices("sriov.dra-agent.io", "node-b", state["devices"]).slices  # noqa: E731
            await publisher.publish("sriov.dra-agent.io", build).wait()
            await asyncio.sleep(1)
            before = time.monotonic()
            state["devices"] = [*devices[:300], Device(name="vf-0300", attributes={"index": 300, "x": 1}),
                                *devices[301:]]
            publisher.publish("sriov.dra-agent.io", build)
            await asyncio.sleep(2)
            change_writes = server.writes("resourceslices", since=before)
            await publisher.stop()
            await kube.close()
    finally:
        shutil.rmtree(memory, ignore_errors=True)

    per_hour = 60 / args.minutes
    writes = [r for r in idle if r.method in ("POST", "PUT", "PATCH", "DELETE")]
    watches = [r for r in idle if r.method == "GET" and r.query.get("watch") in ("true", "1")]
    print(f"start → all {SLICES_PUBLISHED} slices published (dgx-h100, 64 VFs/PF, {args.starts} starts): "
          f"median {statistics.median(startups):.3f} s, max {max(startups):.3f} s")
    print(f"kubelet wipe → all {SLICES_PUBLISHED} slices back: {repair:.3f} s")
    print(f"one device changed in a 512-device pool: {change_writes} write(s)")
    print(f"idle for {args.minutes:g} min: {len(idle)} requests ({len(writes)} writes, {len(watches)} watch "
          f"renewals over 2 pools) → {len(idle) * per_hour:.0f} requests/hour, "
          f"{len(watches) * per_hour / 2:.1f} watch renewals/hour per pool")


if __name__ == "__main__":
    asyncio.run(main())
