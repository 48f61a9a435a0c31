"""The demo's scenarios about what a workload gets besides its devices: a VF's network interface named in the pod
(CDI netDevices).

Each tells what it does, does it for real through `dra-agent run` and the kubelet simulator, and checks what the
container runtime and the pod would see: the CDI spec the runtime reads, and the files the pod reads."""

from __future__ import annotations

from typing import Any

from simulator.demo.claims import attribute, claim_spec, opaque, request, show_allocation, show_claim
from simulator.demo.cluster import DemoCluster
from simulator.demo.scenarios import NIC, show_prepared, unprepare_and_release
from simulator.demo.story import Story

JsonObject = dict[str, Any]
VF_NETDEV = {"apiVersion": "dra-agent.io/v1alpha1", "kind": "VfConfig", "netDevice": {"name": "net1"}}


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
    await unprepare_and_release(cluster, story, "net-job", node)
