"""The demo's scenarios that change the hardware at prepare: MIG devices made to order (dynamic MIG) and a GPU
and a VF handed to a VM through vfio-pci and given back."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from simulator.demo.claims import VFIO, attribute, claim_spec, opaque, request, show_allocation, show_claim
from simulator.demo.cluster import DemoCluster
from simulator.demo.scenarios import GPU, NIC, expect_refusal, show_prepared, unprepare_and_release
from simulator.demo.story import Story
from simulator.node.variants import in_mig_mode

MIG_CONFIG = {"nvidia-mig": {"mode": "dynamic"}}


def dgx_h100_in_mig_mode(folder: Path) -> str:
    """The dgx-h100 profile with MIG mode enabled on every GPU and no MIG device made yet; its file's path."""
    return str(in_mig_mode("dgx-h100", folder))


def mig_instances(cluster: DemoCluster, node: str, bus_id: str) -> list[tuple[str, int]]:
    """The GPU instances the simulated GPU holds now: (profile, placement start)."""
    state: list[dict[str, Any]] = json.loads((cluster.nodes[node].sim_root / ".sim/nvml-mig.json").read_text())
    gpu: dict[str, Any] = next((g for g in state if g["bus_id"] == bus_id), {"gpu_instances": []})
    return sorted((gi["profile"], gi["start"]) for gi in gpu["gpu_instances"])


async def dynamic_mig(cluster: DemoCluster, story: Story, node: str) -> None:
    offered = [d for d in cluster.devices(node, GPU) if attribute(d, "type") == "mig"]
    bus_id = str(attribute(offered[0], "resource.kubernetes.io/pciBusID"))
    on_gpu = [d for d in offered if attribute(d, "resource.kubernetes.io/pciBusID") == bus_id]
    profiles = sorted({str(attribute(d, "profile")) for d in on_gpu})
    story.say(f"Node {node} has its GPUs in MIG mode with no MIG device made. In dynamic mode the agent offers "
              f"every MIG profile at every placement NVML allows: {len(on_gpu)} devices per GPU "
              f"({', '.join(profiles)}). They consume the GPU's counters (memory and compute slices), so the "
              "scheduler never picks two that overlap; the agent makes the MIG device at prepare and destroys it "
              "at unprepare.")
    select = ['device.attributes["gpu.nvidia.com"].profile == "1g.10gb"',
              f'device.attributes["resource.kubernetes.io"].pciBusID == "{bus_id}"']
    spec = claim_spec(request("mig", "mig.nvidia.com", selectors=select))
    show_claim(story, "mig-1g-N", spec)
    story.step(f"Seven claims for a 1g.10gb device on GPU {bus_id}, each allocated and prepared:")
    claims = [f"mig-1g-{i}" for i in range(1, 8)]
    rows = []
    for name in claims:
        cluster.create_claim(name, spec)
        allocation = await cluster.allocate(name, node)
        (result,) = allocation.results
        device = next(d for d in on_gpu if d["name"] == result.device)
        answers = await cluster.prepare(name, node)
        rows.append([name, result.device, attribute(device, "placementStart"),
                     answers[GPU].error or "prepared: GPU instance and compute instance made"])
    story.table(["claim", "device", "placement", "prepare"], rows)
    made = mig_instances(cluster, node, bus_id)
    story.check(made == [("1g.10gb", start) for start in range(7)],
                "the GPU holds seven 1g.10gb GPU instances, at placements 0-6", otherwise=str(made))
    any_profile = claim_spec(request("mig", "mig.nvidia.com", selectors=select[1:]))
    cluster.create_claim("mig-any", any_profile)
    story.step("An eighth claim, for a MIG device of any profile on the same GPU:")
    show_claim(story, "mig-any", any_profile)
    await expect_refusal(cluster, story, "mig-any", node, cause="counters",
                         what="not allocated: every other placement needs memory or compute slices the seven hold",
                         unexpected="an eighth MIG device was allocated on a full GPU")
    cluster.server.delete_object("resourceclaims", "mig-any")
    order = claims[:]
    random.Random(7).shuffle(order)
    story.step(f"The seven pods end, in this order: {', '.join(order)}. Each claim is unprepared and released.")
    for name in order:
        errors = await cluster.unprepare(name, node)
        if any(errors.values()):
            story.fail(f"unprepare {name}: {errors}")
        await cluster.release(name)
    made = mig_instances(cluster, node, bus_id)
    story.check(made == [], "every MIG device is destroyed: nothing leaked", otherwise=str(made))
    whole = claim_spec(request("mig", "mig.nvidia.com", selectors=[
        'device.attributes["gpu.nvidia.com"].profile == "7g.80gb"', select[1]]))
    cluster.create_claim("mig-7g", whole)
    story.step("A claim for the 7g.80gb profile, the whole GPU as one MIG device:")
    allocation = await cluster.allocate("mig-7g", node)
    show_allocation(story, cluster, node, allocation, ("profile", "placementStart", "capacity:memory"))
    answers = await cluster.prepare("mig-7g", node)
    story.check(not answers[GPU].error and mig_instances(cluster, node, bus_id) == [("7g.80gb", 0)],
                "prepared: the GPU is reused as one 7g.80gb device", otherwise=answers[GPU].error)
    await unprepare_and_release(cluster, story, "mig-7g", node)
    story.check(mig_instances(cluster, node, bus_id) == [], "and destroyed again at unprepare")


async def vfio(cluster: DemoCluster, story: Story, node: str) -> None:
    story.say("A virtual machine in a pod (KubeVirt, Kata) needs whole PCI devices, not drivers' device nodes. "
              "With the opaque config `VfioConfig` the agent binds the allocated GPU and VF, with every device "
              "of their IOMMU groups, to vfio-pci at prepare, gives the container /dev/vfio/<group>, and "
              "restores the original drivers at unprepare.")
    spec = claim_spec(request("gpu", "gpu.nvidia.com"), request("nic", "vf.sriov.dra-agent.io"),
                      config=[opaque(GPU, ["gpu"], VFIO), opaque(NIC, ["nic"], VFIO)])
    show_claim(story, "vm", spec)
    cluster.create_claim("vm", spec)
    story.step(f"Allocate on node {node}:")
    allocation = await cluster.allocate("vm", node)
    picked = show_allocation(story, cluster, node, allocation, ("resource.kubernetes.io/pciBusID",))
    bus_ids = [str(attribute(d, "resource.kubernetes.io/pciBusID")) for d in picked]
    here = cluster.nodes[node]
    before = {b: here.driver_of(b) for b in bus_ids}
    story.detail("kernel drivers now: " + ", ".join(f"{b} {d}" for b, d in before.items()))
    answers = await cluster.prepare("vm", node)
    await show_prepared(cluster, story, node, "vm", answers)
    during = {b: here.driver_of(b) for b in bus_ids}
    story.check(set(during.values()) == {"vfio-pci"}, "both devices are bound to vfio-pci",
                otherwise=str(during))
    spec_nodes = here.cdi_nodes(cluster.claim("vm")["metadata"]["uid"])
    story.check("/dev/vfio/vfio" in spec_nodes and any(p.startswith("/dev/vfio/") and p[10:].isdigit()
                                                       for p in spec_nodes),
                "the container gets /dev/vfio/vfio and the groups' nodes", otherwise=str(sorted(spec_nodes)))
    await unprepare_and_release(cluster, story, "vm", node)
    after = {b: here.driver_of(b) for b in bus_ids}
    story.check(after == before, "the original drivers are back: " + ", ".join(f"{b} {d}" for b, d in after.items()),
                otherwise=str(after))
