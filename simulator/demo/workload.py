"""The demo's scenarios about what a workload gets and how it shares: the claim's status after prepare, a VM that
reads its GPU's PCI address from its device metadata file, two pods sharing one GPU by memory (consumable
capacity), a VF's network interface named in the pod (CDI netDevices).

Each tells what it does, does it for real through `dra-agent run` and the kubelet simulator, and checks what the
container runtime and the pod would see: the CDI spec the runtime reads, and the files the pod reads."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from simulator.demo.claims import VFIO, attribute, claim_spec, opaque, request, show_allocation, show_claim
from simulator.demo.cluster import DemoCluster
from simulator.demo.scenarios import GPU, NIC, expect_refusal, show_prepared, unprepare_and_release
from simulator.demo.story import Story

JsonObject = dict[str, Any]
SHARED_CONFIG = {"nvidia-gpu": {"sharing": {"byMemory": True}}}
SHARE_MEMORY_ENV = "DRA_AGENT_GPU_SHARE_MEMORY"
STATUS_WAIT = 10.0
"""Seconds the demo waits for the agents' status writes, which follow the kubelet's answer in the background."""


async def status_entries(cluster: DemoCluster, name: str, wanted: int) -> list[JsonObject]:
    """The claim's `status.devices` once it has `wanted` entries (or what it has after STATUS_WAIT)."""
    deadline = time.monotonic() + STATUS_WAIT
    while True:
        entries: list[JsonObject] = list((cluster.claim(name).get("status") or {}).get("devices") or ())
        if len(entries) == wanted or time.monotonic() > deadline:
            return entries
        await asyncio.sleep(0.05)


async def claim_status(cluster: DemoCluster, story: Story, node: str) -> None:
    story.say("Once a claim is prepared, each driver of the agent writes one entry per device it prepared into the "
              "ResourceClaim's status.devices (KEP-4817): a Ready condition, the device's facts (a GPU's UUID, a "
              "VF's PCI address and MAC) and, for network devices, networkData. Each driver writes by server-side "
              "apply as its own field manager, so it never touches another driver's entries; unprepare removes "
              "its entries again, so no Ready=True is left for a device no longer prepared. The writes follow the "
              "kubelet's answer and never hold up a prepare.")
    spec = claim_spec(request("gpu", "gpu.nvidia.com"), request("nic", "vf.sriov.dra-agent.io"),
                      match="resource.kubernetes.io/pcieRoot")
    show_claim(story, "train", spec)
    cluster.create_claim("train", spec)
    allocation = await cluster.allocate("train", node)
    show_allocation(story, cluster, node, allocation, ("resource.kubernetes.io/pciBusID",))
    answers = await cluster.prepare("train", node)
    if not story.check(not any(a.error for a in answers.values()), "prepared by both drivers",
                       otherwise=str({d: a.error for d, a in answers.items()})):
        return
    entries = await status_entries(cluster, "train", 2)
    story.detail("the claim's status now says:")
    story.document({"devices": entries}, indent=6)
    by_driver = {e["driver"]: e for e in entries}
    ready = all(any(c.get("type") == "Ready" and c.get("status") == "True" for c in e.get("conditions") or ())
                for e in entries)
    story.check(set(by_driver) == {GPU, NIC} and ready,
                "one entry per device, each Ready=True, written by the driver that prepared it",
                otherwise=str(entries))
    gpu_data = (by_driver.get(GPU) or {}).get("data") or {}
    nic_data = (by_driver.get(NIC) or {}).get("data") or {}
    story.check(str(gpu_data.get("uuid", "")).startswith("GPU-")
                and "resource.kubernetes.io/pciBusID" in nic_data,
                "the entries carry the GPU's UUID and the VF's PCI address", otherwise=f"{gpu_data} {nic_data}")
    managers = sorted({m.get("manager", "") for m in cluster.claim("train")["metadata"].get("managedFields") or ()
                       if m.get("subresource") == "status" and m.get("operation") == "Apply"})
    story.check(managers == sorted((GPU, NIC)), f"two field managers own them: {', '.join(managers)}",
                otherwise=str(managers))
    errors = await cluster.unprepare("train", node)
    left = await status_entries(cluster, "train", 0)
    story.check(not any(errors.values()) and not left, "unprepared: both drivers removed their entries",
                otherwise=str(errors if any(errors.values()) else left))
    await cluster.release("train")
VF_NETDEV = {"apiVersion": "dra-agent.io/v1alpha1", "kind": "VfConfig", "netDevice": {"name": "net1"}}


METADATA_DIR = "/var/run/kubernetes.io/dra-device-attributes"


async def vm_metadata(cluster: DemoCluster, story: Story, node: str) -> None:
    story.say(f"Node {node} runs the agent with device metadata on (--device-metadata, KEP-5304). A VM launcher "
              "(KubeVirt's virt-launcher) is given a GPU on vfio-pci and must know its PCI address to build the "
              "VM; /dev/vfio/<group> alone does not say it. For each request of a prepared claim the agent writes "
              "a metadata file (DeviceMetadata, metadata.resource.k8s.io/v1alpha1) and a CDI spec that mounts it "
              f"read-only at {METADATA_DIR}/resourceclaims/<claim>/<request>/<driver>-metadata.json (a path "
              "longer than some lines). The kubelet hands the mount to the runtime with the device's own CDI ID.")
    spec = claim_spec(request("gpu", "gpu.nvidia.com"), config=[opaque(GPU, ["gpu"], VFIO)])
    show_claim(story, "vm", spec)
    cluster.create_claim("vm", spec)
    allocation = await cluster.allocate("vm", node)
    (picked,) = show_allocation(story, cluster, node, allocation, ("resource.kubernetes.io/pciBusID",))
    bus_id = attribute(picked, "resource.kubernetes.io/pciBusID")
    answers = await cluster.prepare("vm", node)
    here = cluster.nodes[node]
    uid = cluster.claim("vm")["metadata"]["uid"]
    ids = [i for a in answers.values() for d in a.devices for i in d.cdi_device_ids]
    if not story.check(not answers[GPU].error and f"{GPU}/metadata={uid}_gpu" in ids,
                       "prepared: the GPU's CDI IDs include the metadata mount " f"{GPU}/metadata=<claim UID>_gpu",
                       otherwise=answers[GPU].error or str(ids)):
        return
    host_file = here.root / "plugins" / GPU / "dra-device-metadata" / "default_vm" / "gpu" / "metadata.json"
    metadata_spec = here.read_cdi(here.cdi_dir / f"{GPU}_metadata_{uid}_gpu.json")
    mounts = [m for d in metadata_spec.get("devices") or () for m in (d.get("containerEdits") or {}).get("mounts")
              or ()]
    inside = f"{METADATA_DIR}/resourceclaims/vm/gpu/{GPU}-metadata.json"
    story.check([(m.get("hostPath"), m.get("containerPath")) for m in mounts] == [(str(host_file), inside)],
                f"its CDI spec mounts the file at {inside}", otherwise=str(mounts))
    # What the VM launcher does: read the first object of the stream whose apiVersion it knows.
    first = json.loads(host_file.read_text().splitlines()[0])
    story.detail("the VM launcher reads:")
    story.document(first, indent=6)
    (device,) = [d for r in first["requests"] for d in r["devices"]]
    seen = (device.get("attributes") or {}).get("resource.kubernetes.io/pciBusID", {}).get("string")
    story.check(first.get("kind") == "DeviceMetadata" and seen == bus_id,
                f"the file names the GPU's PCI address {bus_id}, as KubeVirt reads it", otherwise=str(device))
    await unprepare_and_release(cluster, story, "vm", node)
    story.check(not host_file.exists(), "the metadata file is gone with the claim")


def memory_share(bus_id: str, memory: str) -> JsonObject:
    """A claim for `memory` of the GPU at `bus_id`."""
    spec = claim_spec(request("gpu", "gpu.nvidia.com",
                              selectors=[f'device.attributes["resource.kubernetes.io"].pciBusID == "{bus_id}"']))
    spec["devices"]["requests"][0]["exactly"]["capacity"] = {"requests": {"memory": memory}}
    return spec


def spec_env(spec: JsonObject) -> dict[str, str]:
    """The environment a CDI spec's devices set, by variable."""
    edits = [d.get("containerEdits") or {} for d in spec.get("devices") or ()]
    return dict(e.split("=", 1) for edit in edits for e in edit.get("env") or ())


async def gpu_shares(cluster: DemoCluster, story: Story, node: str) -> None:
    gpus = [d for d in cluster.devices(node, GPU) if attribute(d, "type") == "gpu"]
    shown = gpus[0]
    policy = shown.get("capacity", {}).get("memory", {})
    story.say(f"Node {node} opts in to sharing full GPUs by memory (backend_config nvidia-gpu sharing.byMemory). "
              "Each GPU is published with allowMultipleAllocations and a request policy on its memory capacity; "
              "a claim asks for an amount (exactly.capacity.requests.memory), the scheduler rounds it up to the "
              "policy's step, gives the claim a share (a shareID) with its consumedCapacity, and never gives out "
              "more than the GPU has. The agent prepares each share on its own: its own CDI device, checkpoint "
              "record and answer. The amount is a promise the scheduler keeps; nothing on the GPU enforces it.")
    story.document({"name": shown["name"], "allowMultipleAllocations": shown.get("allowMultipleAllocations"),
                    "capacity": {"memory": policy}})
    bus_id = str(attribute(shown, "resource.kubernetes.io/pciBusID"))
    spec = memory_share(bus_id, "30Gi")
    show_claim(story, "share-a", spec)
    rows, shares = [], {}
    for name in ("share-a", "share-b"):
        cluster.create_claim(name, spec)
        allocation = await cluster.allocate(name, node)
        (result,) = allocation.results
        answers = await cluster.prepare(name, node)
        devices = [d for a in answers.values() for d in a.devices]
        shares[name] = (result, answers[GPU].error, devices)
        rows.append([name, result.device, result.share_id or "-", result.consumed.get("memory", "-"),
                     answers[GPU].error or "prepared"])
    story.step("Two claims for 30Gi of that GPU, each allocated and prepared:")
    story.table(["claim", "device", "shareID", "consumed memory", "prepare"], rows)
    story.detail(f"each share's CDI device, of kind k8s.{GPU}/claim, is named <claim UID>-<device>-<shareID>:")
    for _, _, devices in shares.values():
        for cdi_id in (i for d in devices for i in d.cdi_device_ids):
            story.detail(f"  {cdi_id.partition('=')[2]}")
    (a, a_error, a_devices), (b, b_error, b_devices) = shares["share-a"], shares["share-b"]
    ids = [i for d in (*a_devices, *b_devices) for i in d.cdi_device_ids]
    story.check(not a_error and not b_error and a.device == b.device and a.share_id != b.share_id
                and None not in (a.share_id, b.share_id) and len(set(ids)) == 2,
                f"both share {a.device}, each with its own shareID and CDI device",
                otherwise=f"{a_error or b_error or ids}")
    here = cluster.nodes[node]
    env = {name: spec_env(here.read_cdi(path)) for name in shares
           for path in here.cdi_files(cluster.claim(name)["metadata"]["uid"])}
    story.check(all(e.get(SHARE_MEMORY_ENV) == str(30 * 2**30) for e in env.values()) and len(env) == 2,
                f"each container is told its share: {SHARE_MEMORY_ENV}={30 * 2**30}", otherwise=str(env))
    cluster.create_claim("share-c", spec)
    story.step("A third claim for 30Gi of the same GPU:")
    await expect_refusal(cluster, story, "share-c", node, cause="memory 30Gi asked",
                         what="not allocated: the two shares leave less than 30Gi of the GPU's memory",
                         unexpected="a third 30Gi share was allocated on the GPU")
    cluster.server.delete_object("resourceclaims", "share-c")
    story.step("The first pod ends: its share is unprepared and released.")
    await unprepare_and_release(cluster, story, "share-a", node)
    b_uid = cluster.claim("share-b")["metadata"]["uid"]
    again = await cluster.prepare("share-b", node)
    story.check(bool(here.cdi_files(b_uid)) and not again[GPU].error
                and [d.share_id for d in again[GPU].devices] == [b.share_id],
                "the other share stays prepared: its CDI spec is there and a repeated prepare answers the same share",
                otherwise=again[GPU].error or "its CDI spec is gone")
    await unprepare_and_release(cluster, story, "share-b", node)


def net_devices(spec: JsonObject) -> list[JsonObject]:
    """Every `netDevices` entry of a CDI spec, from its devices and its top level."""
    edits = [d.get("containerEdits") or {} for d in spec.get("devices") or ()]
    edits.append(spec.get("containerEdits") or {})
    return [n for e in edits for n in e.get("netDevices") or ()]


async def vf_interface(cluster: DemoCluster, story: Story, node: str) -> None:
    story.say("A network workload needs the VF's interface, not only its RDMA device. With the opaque config "
              "`VfConfig` and `netDevice: {name: net1}`, the agent writes a CDI `netDevices` edit (CDI 1.1.0): the "
              "container runtime (runc 1.4, crun 1.22 and the container managers built on CDI 1.1) moves the "
              "VF's interface into the pod's network namespace as net1, with its MAC and permanent addresses, and "
              "the kernel gives it back to the host when the pod's namespace goes.")
    spec = claim_spec(request("nic", "vf.sriov.dra-agent.io"), config=[opaque(NIC, ["nic"], VF_NETDEV)])
    show_claim(story, "net-job", spec)
    cluster.create_claim("net-job", spec)
    story.step(f"Allocate on node {node}:")
    allocation = await cluster.allocate("net-job", node)
    (picked,) = show_allocation(story, cluster, node, allocation, ("netdev", "resource.kubernetes.io/pciBusID"))
    host_name = str(attribute(picked, "netdev"))
    answers = await cluster.prepare("net-job", node)
    await show_prepared(cluster, story, node, "net-job", answers)
    here = cluster.nodes[node]
    uid = cluster.claim("net-job")["metadata"]["uid"]
    specs = [here.read_cdi(path) for path in here.cdi_files(uid)]
    moved = [n for s in specs for n in net_devices(s)]
    story.check(moved == [{"hostInterfaceName": host_name, "name": "net1"}]
                and all(s["cdiVersion"] == "1.1.0" for s in specs if net_devices(s)),
                f"the CDI spec (cdiVersion 1.1.0) moves {host_name} into the pod as net1", otherwise=str(moved))
    entries = await status_entries(cluster, "net-job", 1)
    network = (entries[0] if entries else {}).get("networkData") or {}
    story.detail("the claim's status tells the pod's network tooling what it got:")
    story.document({"networkData": network}, indent=6)
    mac = (here.sim_root / "sys/class/net" / host_name / "address").read_text().strip()
    story.check(network.get("interfaceName") == "net1" and network.get("hardwareAddress") == mac,
                f"status.devices[].networkData names net1 and the VF's MAC {mac}", otherwise=str(entries))
    await unprepare_and_release(cluster, story, "net-job", node)
