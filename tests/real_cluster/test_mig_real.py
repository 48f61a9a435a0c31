"""Dynamic MIG through the real scheduler: the agent publishes every profile at every placement of 8 H100s with
the counters that tie them (chunked into slices the server validates), the scheduler picks placements from those
counters, the agent makes the MIG devices at exactly those placements, and a claim that no longer fits stays
pending with the scheduler's reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.real_cluster.cluster_env import GPU, RealCluster, agent_on_node, poll
from tests.real_cluster.objects import claim, exactly, pod
from tests.support.mig_env import dgx_h100_in_mig_mode
from tests.support.timing import scaled

pytestmark = pytest.mark.xdist_group("real-cluster")

DYNAMIC = {"nvidia-mig": {"mode": "dynamic"}}
MIG = "mig.nvidia.com"


def gpu_slices(cluster: RealCluster) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = cluster.kubectl.json(
        "get", "resourceslices", f"--field-selector=spec.driver={GPU}")["items"]
    return found


def on_gpu_zero(profile: str) -> list[str]:
    return [f'device.attributes["gpu.nvidia.com"].profile == "{profile}"',
            'device.attributes["gpu.nvidia.com"].parentIndex == 0']


async def test_the_scheduler_places_mig_devices_from_the_published_counters(real_cluster: RealCluster,
                                                                          node_root: Path) -> None:
    profile = dgx_h100_in_mig_mode(node_root)
    async with agent_on_node(real_cluster, node_root / "n", str(profile), backend_config=DYNAMIC) as agent:
        def all_published() -> list[dict[str, Any]] | None:
            found = gpu_slices(real_cluster)
            return found if sum(len(x["spec"].get("devices", ())) for x in found) == 8 * 26 else None

        slices = await poll(all_published, timeout=scaled(30), what="every GPU and placement published")
        # What the server stored: one counter set per GPU in a slice of its own, the devices in slices of at most
        # 64, one pool generation across them all.
        assert sum(len(s["spec"].get("sharedCounters", ())) for s in slices) == 8
        assert all(len(s["spec"].get("devices", ())) <= 64 for s in slices)
        assert len({s["spec"]["pool"]["generation"] for s in slices}) == 1
        assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {len(slices)}

        ns = await real_cluster.namespace("mig")
        placed = {}
        # One after the other: 4g.40gb has one placement (0), which a 3g.40gb allocated first could take.
        for name, mig_profile in (("four", "4g.40gb"), ("three", "3g.40gb")):
            await real_cluster.apply([claim(ns, name, [exactly("mig", MIG, selectors=on_gpu_zero(mig_profile))]),
                                      pod(ns, name, claims={"mig": name})])
            await agent.prepare_pod(ns, name)
            allocated = await real_cluster.allocated(ns, name)
            [result] = allocated["status"]["allocation"]["devices"]["results"]
            placed[name] = result["device"]
        # 4g.40gb and 3g.40gb together take all eight memory slices of GPU 0, at placements that do not overlap.
        starts = {name: int(device.rsplit("-", 1)[1]) for name, device in placed.items()}
        assert sorted(starts.values()) == [0, 4], placed

        # Nothing is left on GPU 0: the third claim stays pending, and the scheduler says why.
        await real_cluster.apply([claim(ns, "one", [exactly("mig", MIG, selectors=on_gpu_zero("1g.10gb"))]),
                                  pod(ns, "one", claims={"mig": "one"})])
        message = await real_cluster.unschedulable(ns, "one")
        assert "cannot allocate all claims" in message, message
        assert not (await real_cluster.claim(ns, "one") or {}).get("status", {}).get("allocation")
