"""The demo's scenarios that need no reconfiguration: node readiness, one claim on many GPU nodes, and a GPU
aligned with a NIC by PCIe topology. Each tells what it does, does it for real and checks what happened."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.claims.results import ClaimResult
from simulator.demo.claims import (
    attribute,
    cdi_summary,
    claim_spec,
    request,
    show_allocation,
    show_claim,
)
from simulator.demo.cluster import DemoCluster, DemoNode
from simulator.demo.story import Story
from simulator.scheduler.allocation import Unallocatable

GPU, NIC = "gpu.nvidia.com", "sriov.dra-agent.io"
PCIE_ROOT, PCIE_SWITCH = "resource.kubernetes.io/pcieRoot", "dra-agent.io/pcieSwitch"
NUMA_NODE = "resource.kubernetes.io/numaNode"
# What "one compute class, many GPU nodes" must give on each GKE shape: the GPU count and product name.
GKE_NODES = (("gke-n1-t4x2", 2, "Tesla T4"), ("gke-g2-l4", 1, "NVIDIA L4"), ("gke-n1-p4x4", 4, "Tesla P4"))


async def readiness(cluster: DemoCluster, story: Story, nodes: Sequence[DemoNode]) -> None:
    story.say("Each node runs `dra-agent run` on its simulated hardware. At start it discovers the devices and "
              "their PCIe topology, publishes them as ResourceSlices (one pool per driver and node, split into "
              "slices), and registers with the kubelet. A pool is complete when every slice of its newest "
              "generation is in the API server: the scheduler uses a pool only then.")
    rows = []
    for node in nodes:
        for driver in node.ready_drivers:
            slices = cluster.slices(node.name, driver)
            devices = sum(len(s["spec"].get("devices") or ()) for s in slices)
            counters = sum(len(s["spec"].get("sharedCounters") or ()) for s in slices)
            rows.append([node.name, Path(node.profile).name.removesuffix(".yaml"), driver, len(slices), devices,
                         counters, _seconds(node.set_up, 1), _seconds(node.agent_start)])
    story.table(["node", "profile", "driver", "slices", "devices", "counters", "set-up", "agent"], rows)
    story.say("set-up: from launching `dra-agent run` to its start-up line: Python and its imports, and building "
              "the simulated node (its sysfs tree and kernel), for all nodes at once on this machine's CPUs; a "
              "first run also compiles the modules to bytecode and the simulated NVML library. agent: from that "
              "line until every pool is complete and registered with the kubelet, the part a real node's agent "
              "has too.")
    story.step("A few of the published devices, with attributes the claims below select on (every PCI device "
               "gets the same topology attributes, whatever its driver):")
    sample = []
    for node in nodes:
        for driver in node.ready_drivers:
            for device in cluster.devices(node.name, driver)[:2]:
                values = [attribute(device, a) for a in ("productName", "pfName", PCIE_ROOT, PCIE_SWITCH,
                                                         NUMA_NODE)]
                product, pf, *topology = ("" if v is None else str(v) for v in values)
                sample.append([node.name, device["name"], product or pf, *topology])
    story.table(["node", "device", "product / PF", "pcieRoot", "pcieSwitch", "NUMA"], sample)
    for node in nodes:
        complete = [d for d in node.ready_drivers if cluster.pool_complete(node.name, d)]
        registered = [d for d in node.ready_drivers if node.kubelet is not None and node.kubelet.plugins(d)]
        story.check(bool(node.ready_drivers) and complete == node.ready_drivers and registered == complete,
                    f"{node.name}: {len(complete)} pool(s) complete and registered with the kubelet "
                    f"{_seconds(node.agent_start)} after its start-up line",
                    otherwise=f"complete {complete}, registered {registered}, served {node.ready_drivers}")


def _seconds(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f} s"


async def all_gpus(cluster: DemoCluster, story: Story) -> None:
    story.say("One ResourceClaim asks for every full GPU of a node (allocationMode: All) of the class "
              "gpu.nvidia.com. The same claim (one copy per node) lands on three different GKE machine shapes and gets "
              "what each has.")
    spec = claim_spec(request("gpus", "gpu.nvidia.com", all_devices=True))
    show_claim(story, "all-gpus-<node>", spec)
    for node, count, product in GKE_NODES:
        name = f"all-gpus-{node}"
        cluster.create_claim(name, spec)
        story.step(f"Allocate on node {node}:")
        allocation = await cluster.allocate(name, node)
        picked = show_allocation(story, cluster, node, allocation, ("productName", "capacity:memory"))
        products = {attribute(d, "productName") for d in picked}
        story.check(len(picked) == count and products == {product}, f"{count} x {product}",
                    otherwise=f"{len(picked)} device(s): {sorted(map(str, products))}")
        answers = await cluster.prepare(name, node)
        ids = [i for a in answers.values() for d in a.devices for i in d.cdi_device_ids]
        story.check(all(not a.error for a in answers.values()) and len(ids) == count,
                    f"prepared on {node}: {len(ids)} CDI device(s) for the container runtime",
                    otherwise="; ".join(a.error for a in answers.values()))
        for cdi_id in ids:
            story.detail(cdi_id)
        await unprepare_and_release(cluster, story, name, node)


async def aligned_nic(cluster: DemoCluster, story: Story, node: str) -> None:
    story.say("A GPU with at least 80 GiB of memory and an RDMA-capable SR-IOV VF, constrained to share the "
              f"attribute {PCIE_ROOT}: GPUDirect RDMA traffic then stays below one PCIe root complex. Every PCI "
              "device the agent publishes carries the same topology attributes, whatever its driver.")
    gpu80 = request("gpu", "gpu.nvidia.com",
                    selectors=['device.capacity["gpu.nvidia.com"].memory.compareTo(quantity("80Gi")) >= 0'])
    nic = request("nic", "rdma-vf.sriov.dra-agent.io")
    spec = claim_spec(gpu80, nic, match=PCIE_ROOT)
    show_claim(story, "gpu-and-nic", spec)
    cluster.create_claim("gpu-and-nic", spec)
    story.step(f"Allocate on node {node}:")
    await expect_refusal(cluster, story, "gpu-and-nic", node, cause="selector", what="not allocated: no GPU has 80Gi",
                         unexpected="an H100 80GB should not match memory >= 80Gi (it reports 81559Mi to NVML)")
    story.note("An \"80GB\" H100 has 81559Mi (79.6 GiB) usable, which is what NVML reports and the agent "
               "publishes. The claim asks for 79Gi instead.")
    cluster.server.delete_object("resourceclaims", "gpu-and-nic")
    gpu79 = request("gpu", "gpu.nvidia.com",
                    selectors=['device.capacity["gpu.nvidia.com"].memory.compareTo(quantity("79Gi")) >= 0'])
    for attr, label in ((PCIE_ROOT, "root complex"), (PCIE_SWITCH, "PCIe switch")):
        name = "gpu-and-nic-same-" + label.split()[-1].lower().replace("complex", "root")
        spec = claim_spec(gpu79, nic, match=attr)
        cluster.create_claim(name, spec)
        story.step(f"Claim {name}: the same, matching {attr}. Allocate on node {node}:")
        allocation = await cluster.allocate(name, node)
        picked = show_allocation(story, cluster, node, allocation, (PCIE_ROOT, PCIE_SWITCH, "capacity:memory"))
        shared = {attribute(d, attr) for d in picked}
        story.check(len(picked) == 2 and len(shared) == 1 and None not in shared,
                    f"GPU and VF under one {label}: {next(iter(shared))}", otherwise=f"values {shared}")
        answers = await cluster.prepare(name, node)
        await show_prepared(cluster, story, node, name, answers)
        await unprepare_and_release(cluster, story, name, node)
    await _other_roots_busy(cluster, story, node, spec_for=claim_spec(gpu79, nic, match=PCIE_ROOT))


async def _other_roots_busy(cluster: DemoCluster, story: Story, node: str, spec_for: dict[str, Any]) -> None:
    """Fill the node so the free GPUs and the free VFs sit on different roots: the aligned claim must fail."""
    roots = sorted({attribute(d, PCIE_ROOT) for d in cluster.devices(node, GPU)})
    half = len(roots) // 2
    gpu_roots, nic_roots = roots[half:], roots[:half]
    story.step(f"Other workloads take every GPU on {', '.join(gpu_roots)} and every RDMA VF on "
               f"{', '.join(nic_roots)}: the free GPUs and the free VFs are now on different root complexes.")
    busy = {
        "busy-gpus": claim_spec(request("gpus", "gpu.nvidia.com", all_devices=True, selectors=[
            f'device.attributes["resource.kubernetes.io"].pcieRoot in {gpu_roots}'])),
        "busy-vfs": claim_spec(request("vfs", "rdma-vf.sriov.dra-agent.io", all_devices=True, selectors=[
            f'device.attributes["resource.kubernetes.io"].pcieRoot in {nic_roots}'])),
    }
    for name, spec in busy.items():
        cluster.create_claim(name, spec)
        allocation = await cluster.allocate(name, node)
        story.detail(f"{name} holds {len(allocation.results)} devices")
    cluster.create_claim("gpu-and-nic-late", spec_for)
    story.step(f"Allocate the root-aligned claim again on node {node}:")
    await expect_refusal(cluster, story, "gpu-and-nic-late", node, cause=PCIE_ROOT,
                         what="not allocated, and the allocator names the unmet pcieRoot constraint",
                         unexpected="allocated although no free GPU shares a root with a free VF")
    cluster.server.delete_object("resourceclaims", "gpu-and-nic-late")
    for name in busy:
        await cluster.release(name)


async def expect_refusal(cluster: DemoCluster, story: Story, name: str, node: str, *, cause: str, what: str,
                         unexpected: str) -> None:
    """Allocate a claim that must not fit: the allocator's reasons are shown, and one must mention `cause`."""
    try:
        await cluster.allocate(name, node)
        story.fail(unexpected)
    except Unallocatable as e:
        show_reasons(story, e)
        story.check(any(cause in r for r in e.reasons), what, otherwise="; ".join(e.reasons))


def show_reasons(story: Story, error: Unallocatable) -> None:
    story.detail("the allocator says why:")
    for reason in error.reasons:
        story.detail(f"  {reason}")


async def show_prepared(cluster: DemoCluster, story: Story, node: str, name: str,
                        answers: dict[str, ClaimResult]) -> None:
    """The kubelet's answer from NodePrepareResources and the CDI specs behind it."""
    errors = {d: a.error for d, a in answers.items() if a.error}
    if not story.check(not errors, f"NodePrepareResources on {node} succeeded for {', '.join(answers)}",
                       otherwise=str(errors)):
        return
    story.detail("the kubelet passes these CDI device IDs to the container runtime:")
    for device in (d for a in answers.values() for d in a.devices):
        story.detail(f"  {device.device}: {', '.join(device.cdi_device_ids)}")
    uid = cluster.claim(name)["metadata"]["uid"]
    here = cluster.nodes[node]
    files = here.cdi_files(uid)
    if story.check(len(files) == len(answers), "the claim's CDI spec(s) are written: one per driver"):
        story.detail("and the specs give the container:")
        rows = [row for path in files for row in cdi_summary(here.read_cdi(path))]
        story.table(["CDI device (k8s.<driver>/claim=)", "container edits"], rows, indent=6)


async def unprepare_and_release(cluster: DemoCluster, story: Story, name: str, node: str) -> None:
    errors = await cluster.unprepare(name, node)
    uid = cluster.claim(name)["metadata"]["uid"]
    story.check(not any(errors.values()) and not cluster.nodes[node].cdi_files(uid),
                "unprepared: the CDI specs are gone", otherwise=str(errors))
    await cluster.release(name)


async def tour(cluster: DemoCluster, story: Story, node: str) -> None:
    """One device of every driver on the node: allocated, prepared, shown, unprepared."""
    here = cluster.nodes[node]
    story.say(f"One claim per driver that node {node} serves, each for one device of that driver, through a "
              "DeviceClass that selects the driver's devices.")
    for driver in here.ready_drivers:
        class_name = f"any.{driver}"
        cluster.apply_classes([{"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                                "metadata": {"name": class_name},
                                "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]}}])
        name = f"one-{driver.split('.')[0]}"
        cluster.create_claim(name, claim_spec(request("device", class_name)))
        story.step(f"Claim {name} (class {class_name}) on node {node}:")
        allocation = await cluster.allocate(name, node)
        show_allocation(story, cluster, node, allocation, ("type", "resource.kubernetes.io/pcieRoot"))
        await show_prepared(cluster, story, node, name, await cluster.prepare(name, node))
        await unprepare_and_release(cluster, story, name, node)
