"""The demo's health scenario: a GPU fails under a running claim, is reported and tainted, and recovers."""

from __future__ import annotations

import asyncio
from typing import Any

from agent.kubelet.services import HealthStatus
from simulator.demo.claims import attribute, claim_spec, request, show_allocation
from simulator.demo.cluster import DemoCluster
from simulator.demo.scenarios import GPU, expect_refusal, unprepare_and_release
from simulator.demo.story import Story
from simulator.kubelet import HealthView

# The agent re-checks an unwell GPU this often (seconds); the demo's nodes use a short period so a reset is
# seen at once (the default is 30 s, and on real hardware a uevent for the GPU usually comes first).
RECHECK_SECONDS = 0.3
HEALTH_CONFIG = {"nvidia-gpu": {"recheckSeconds": RECHECK_SECONDS}}
WAIT = 10.0


def _taints(cluster: DemoCluster, node: str, device: str) -> list[tuple[str, str, str]]:
    return [(t["key"], str(t.get("value", "")), t["effect"]) for d in cluster.devices(node, GPU)
            if d["name"] == device for t in d.get("taints") or ()]


async def _until(check: Any, timeout: float = WAIT) -> bool:
    try:
        async with asyncio.timeout(timeout):
            # The slices are in the API server of this process: polled, there is no event to wait on here.
            while not check():  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        return True
    except TimeoutError:
        return False


async def gpu_failure(cluster: DemoCluster, story: Story, node: str) -> None:
    story.say("The agent watches device health without polling (NVML events for GPUs, udev and netlink for "
              "PCI devices and links). A failed device is reported to the kubelet, which shows it in the status "
              "of the pods using it, and tainted in its ResourceSlice, so the scheduler places no new claim on "
              "it. When the device recovers, both are undone.")
    cluster.create_claim("training", claim_spec(request("gpu", "gpu.nvidia.com")))
    allocation = await cluster.allocate("training", node)
    (device,) = show_allocation(story, cluster, node, allocation, ("index", "resource.kubernetes.io/pciBusID"))
    name, index = device["name"], attribute(device, "index")
    answers = await cluster.prepare("training", node)
    story.check(not answers[GPU].error, f"claim training is prepared on {name}", otherwise=answers[GPU].error)
    here = cluster.nodes[node]
    assert here.kubelet is not None
    key = (node, name)

    def health(status: HealthStatus) -> Any:
        return lambda view: key in view and view[key].health == status

    async def reported(status: HealthStatus) -> HealthView | None:
        """The kubelet's view once it says `status` for the device; None (a failed check) if it never does."""
        assert here.kubelet is not None
        try:
            return await here.kubelet.wait_for_health(GPU, health(status), timeout=WAIT)
        except TimeoutError:
            state = here.kubelet.health_state(GPU).get(key)
            story.fail(f"the kubelet's health stream says {status.name} for {name} within {WAIT:g} s; it says "
                       + (f"{state.health.name}: {state.message}" if state else "nothing about it"))
            return None

    story.step(f"GPU {index} raises Xid 79 (\"GPU has fallen off the bus\") in the simulated NVML.")
    await here.nvml("xid", gpu=str(index), xid=79)
    view = await reported(HealthStatus.UNHEALTHY)
    if view is not None:
        story.check(True, f"the kubelet's health stream says {name} is UNHEALTHY: {view[key].message}")
    tainted = await _until(lambda: bool(_taints(cluster, node, name)))
    story.check(tainted, "its ResourceSlice carries the taint " + ", ".join(
        f"{k}={v}:{e}" for k, v, e in _taints(cluster, node, name)))
    story.check(bool(here.cdi_files(cluster.claim("training")["metadata"]["uid"])),
                "claim training stays prepared: its pod decides what to do (the kubelet reports the health)")
    bus_id = attribute(device, "resource.kubernetes.io/pciBusID")
    same_gpu = claim_spec(request("gpu", "gpu.nvidia.com", selectors=[
        f'device.attributes["resource.kubernetes.io"].pciBusID == "{bus_id}"']))
    cluster.create_claim("next-job", same_gpu)
    story.step("A new claim for that same GPU:")
    await expect_refusal(cluster, story, "next-job", node, cause="taint",
                         what="not allocated: the claim does not tolerate the taint",
                         unexpected="a tainted GPU was allocated to a claim without a toleration")
    story.step("The GPU is reset and answers NVML again.")
    await here.nvml("reset", gpu=str(index))
    if await reported(HealthStatus.HEALTHY) is not None:
        story.check(True, f"the kubelet's health stream says {name} is HEALTHY")
    story.check(await _until(lambda: not _taints(cluster, node, name)), "the taint is gone from the ResourceSlice")
    await unprepare_and_release(cluster, story, "training", node)
    allocation = await cluster.allocate("next-job", node)
    story.check([r.device for r in allocation.results] == [name], f"the waiting claim now gets {name}")
    await cluster.release("next-job")
