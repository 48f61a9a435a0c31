"""A VF's network interface handed to a pod (`VfConfig.netDevice`) through the real kubelet, containerd and runc: the
agent's CDI spec names the VF's interface in `netDevices`, and runc moves it into the pod's network namespace under
the name the claim asked for.

The VF's interface exists only in the simulated node's sysfs. The test stands a real kernel link in for it: a link
that drops what it is sent (`cluster.cni_dummy.add_dropping_link`), made in the machine's network namespace, where
containerd and runc run, with the VF's name and MAC, before the pod starts. The agent does not mind it: it reads
the VF from the simulated sysfs and the host's routes from the simulated /proc, and its link monitor, which hears
the machine's links here, acts only on the names of the node's SR-IOV physical functions. When the pod's namespace
goes, the kernel deletes the moved link with it (a virtual link, unlike a VF's, is not given back to the host).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from pyroute2 import IPRoute

from cluster.cni_dummy import add_dropping_link
from tests.real_cluster.cluster_env import GPU, SRIOV, RealCluster, every_reconfiguration_allowed, poll
from tests.real_cluster.node_env import agent_on_real_node, reported, reporter
from tests.real_cluster.objects import claim, exactly
from tests.support.timing import scaled

pytestmark = pytest.mark.xdist_group("real-node")

API = "dra-agent.io/v1alpha1"
VF = "vf.sriov.dra-agent.io"
IN_POD = "net1"
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
SHOW = f"cat /sys/class/net/{IN_POD}/address; ip -o link show {IN_POD}; echo $(ls /sys/class/net)"
"""What the pod prints: the MAC of its interface `IN_POD`, the interface, and the names of all its interfaces."""


@pytest.fixture(scope="module", autouse=True)
def _reconfigurations_allowed(real_node: RealCluster) -> Iterator[None]:
    """The VF's interface asked for in the test's own namespace, as an operator allows it by deploy/'s
    ConfigMap."""
    with every_reconfiguration_allowed(real_node.kubectl):
        yield


def host_links() -> set[str]:
    """The names of the links in the machine's network namespace (this process's)."""
    return {name for _, name in socket.if_nameindex()}


def a_vf(cluster: RealCluster, sim_root: Path) -> tuple[str, str, str]:
    """One VF the node publishes: its PCI address, and the name and MAC of its interface in the simulated node's
    sysfs."""
    slices = cluster.kubectl.json("get", "resourceslices", f"--field-selector=spec.driver={SRIOV}")["items"]
    bus_id = min(d["attributes"][PCI_BUS_ID]["string"] for s in slices for d in s["spec"].get("devices", [])
                 if d["attributes"].get("type", {}).get("string") == "vf")
    [net] = (sim_root / "sys/bus/pci/devices" / bus_id / "net").iterdir()
    return bus_id, net.name, (net / "address").read_text().strip()


def _add_link(name: str, mac: str) -> None:
    with IPRoute() as ipr:
        add_dropping_link(ipr, name, mac)


def _remove_link(name: str) -> None:
    with IPRoute() as ipr:
        for index in ipr.link_lookup(ifname=name):
            ipr.link("del", index=index)


@contextlib.asynccontextmanager
async def stand_in_link(name: str, mac: str) -> AsyncIterator[None]:
    """A real link named `name` with the hardware address `mac` in the machine's network namespace for the block;
    removed at the end if it is still there (a pod did not take it). pyroute2's rtnetlink socket runs an event
    loop of its own: it is used from a thread."""
    assert name not in host_links(), f"the machine has a link {name} of its own: the VF's stand-in needs the name"
    await asyncio.to_thread(_add_link, name, mac)
    try:
        yield
    finally:
        await asyncio.to_thread(_remove_link, name)


def sriov_entry(cluster: RealCluster, namespace: str, name: str) -> dict[str, Any] | None:
    """The claim's `status.devices` entry of the SR-IOV driver, or None."""
    found = cluster.kubectl.get("resourceclaim", name, "-n", namespace) or {}
    entries = [d for d in found.get("status", {}).get("devices", []) if d["driver"] == SRIOV]
    return entries[0] if entries else None


async def test_a_vfs_interface_reaches_the_pod_under_the_name_the_claim_asked_for(real_node: RealCluster,
                                                                                 node_root: Path) -> None:
    config = [{"requests": ["nic"], "opaque": {"driver": SRIOV, "parameters": {
        "apiVersion": API, "kind": "VfConfig", "netDevice": {"name": IN_POD}}}}]
    async with agent_on_real_node(real_node, node_root, drivers=(GPU, SRIOV),
                                  allowed_configs=("VfConfig.netDevice",)) as agent:
        ns = await real_node.namespace("netdev")
        assert agent.settings.sim_root is not None
        bus_id, name, mac = a_vf(real_node, agent.settings.sim_root)
        only_it = f'device.attributes["resource.kubernetes.io"].pciBusID == "{bus_id}"'
        async with stand_in_link(name, mac):
            await real_node.apply([
                claim(ns, "nic", [exactly("nic", VF, selectors=[only_it])], config=config),
                reporter(real_node, ns, "nic", {"nic": "nic"}, host_network=False, script=SHOW),
            ])
            log = await reported(real_node, ns, "nic")
            uid = (await real_node.allocated(ns, "nic"))["metadata"]["uid"]
            lines = log.splitlines()
            # The pod sees the VF's interface under the asked name with the VF's MAC, beside its own lo and eth0.
            assert lines[0] == mac, log
            assert f": {IN_POD}: " in lines[1] and mac in lines[1], log
            assert sorted(lines[2].split()) == ["eth0", "lo", IN_POD], log
            assert name not in host_links(), "runc moved the link out of the machine's namespace"
            entry = await poll(lambda: sriov_entry(real_node, ns, "nic"), timeout=scaled(30),
                               what="the claim's status entry written")
            assert entry["networkData"]["interfaceName"] == IN_POD, entry
            assert entry["networkData"]["hardwareAddress"] == mac, entry
            held = agent.on_node(uid, (SRIOV,))
            assert any(f.endswith(".json") for f in held) and f"checkpoint of {SRIOV}" in held, held

            await real_node.run("delete", "pod", "nic", "-n", ns, "--wait=true", f"--timeout={scaled(60):.0f}s")
            # The kubelet unprepares the claim before it lets the pod go: nothing of it is left on the node.
            assert agent.on_node(uid, (SRIOV,)) == []
            await poll(lambda: sriov_entry(real_node, ns, "nic") is None, timeout=scaled(30),
                       what="the claim's status entry removed")
            # The pod's namespace took the stand-in with it (the kernel tears a namespace down in the background).
            await poll(lambda: name not in host_links(), timeout=scaled(30), what=f"{name} gone with the pod")
