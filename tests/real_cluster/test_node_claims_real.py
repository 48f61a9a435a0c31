"""A claim's life on the node as the real kubelet drives it: prepared when its pod starts, unprepared when the pod is
deleted (the kubelet removes the pod only after the agent answered); a prepare the agent refuses leaves the pod in
ContainerCreating with the agent's message in its events, and nothing on the node."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.real_cluster.cluster_env import GPU, SRIOV, RealCluster, every_reconfiguration_allowed, poll
from tests.real_cluster.node_env import agent_on_real_node, running_pod, sleeper
from tests.real_cluster.objects import claim, exactly
from tests.support.timing import scaled

pytestmark = pytest.mark.xdist_group("real-node")


@pytest.fixture(scope="module", autouse=True)
def _reconfigurations_allowed(real_node: RealCluster) -> Iterator[None]:
    """The VM's passthrough and the VF's interface asked for in the tests' own namespaces, as an operator allows
    them by deploy/'s ConfigMap."""
    with every_reconfiguration_allowed(real_node.kubectl):
        yield

API = "dra-agent.io/v1alpha1"
VF = "vf.sriov.dra-agent.io"


def status_entries(cluster: RealCluster, namespace: str, name: str, driver: str) -> list[dict[str, Any]]:
    """The claim's `status.devices` entries of `driver`."""
    found = cluster.kubectl.get("resourceclaim", name, "-n", namespace) or {}
    return [d for d in found.get("status", {}).get("devices", []) if d["driver"] == driver]


def bound_driver(cluster: RealCluster, sim_root: Path | None, device: str) -> str | None:
    """The kernel driver the simulated node has bound to one of the SR-IOV driver's published devices."""
    assert sim_root is not None
    slices = cluster.kubectl.json("get", "resourceslices", f"--field-selector=spec.driver={SRIOV}")["items"]
    [bus_id] = [d["attributes"]["resource.kubernetes.io/pciBusID"]["string"]
                for s in slices for d in s["spec"].get("devices", []) if d["name"] == device]
    link = sim_root / "sys/bus/pci/devices" / bus_id / "driver"
    return os.path.basename(os.readlink(link)) if link.is_symlink() else None


async def test_deleting_the_pod_unprepares_its_claim(real_node: RealCluster, node_root: Path) -> None:
    async with agent_on_real_node(real_node, node_root) as agent:
        ns = await real_node.namespace("unprepare")
        await real_node.apply([claim(ns, "gpu", [exactly("gpu", GPU)]), sleeper(real_node, ns, "gpu", {"gpu": "gpu"})])
        await running_pod(real_node, ns, "gpu")
        uid = (await real_node.allocated(ns, "gpu"))["metadata"]["uid"]
        held = agent.on_node(uid)
        assert any(name.endswith(".json") for name in held) and f"checkpoint of {GPU}" in held, held
        await poll(lambda: status_entries(real_node, ns, "gpu", GPU) or None, timeout=scaled(30),
                   what="the claim's status entry written")

        await real_node.run("delete", "pod", "gpu", "-n", ns, "--wait=true", f"--timeout={scaled(60):.0f}s")
        # The kubelet unprepares a pod's claims after its containers stopped and before it lets the pod go: once
        # the pod is gone from the API, the node holds nothing of the claim.
        assert agent.on_node(uid) == []
        await poll(lambda: not status_entries(real_node, ns, "gpu", GPU), timeout=scaled(30),
                   what="the claim's status entry removed")
        unprepared = [line for line in agent.log()
                      if line.get("event") == "unprepared claim" and line.get("claim") == f"{ns}/gpu:{uid}"]
        assert len(unprepared) == 1, unprepared


async def test_a_refused_prepare_leaves_the_pod_creating_with_the_agents_message(real_node: RealCluster,
                                                                                 node_root: Path) -> None:
    """Two opaque configurations the admission policy lets through one by one and only the agent can refuse
    together: a VF's interface for the pod and the VF bound to vfio-pci."""
    config = [{"requests": ["nic"], "opaque": {"driver": SRIOV, "parameters": parameters}} for parameters in (
        {"apiVersion": API, "kind": "VfConfig", "netDevice": {"name": "net1"}},
        {"apiVersion": API, "kind": "VfioConfig"})]
    async with agent_on_real_node(real_node, node_root, drivers=(GPU, SRIOV)) as agent:
        ns = await real_node.namespace("refused")
        await real_node.apply([claim(ns, "nic", [exactly("nic", VF)], config=config),
                               sleeper(real_node, ns, "nic", {"nic": "nic"})])
        allocated = await real_node.allocated(ns, "nic")
        uid = allocated["metadata"]["uid"]

        def refused() -> list[str] | None:
            events = real_node.kubectl.json("get", "events", "-n", ns,
                                            "--field-selector=involvedObject.name=nic,involvedObject.kind=Pod")
            found = [e["message"] for e in events["items"] if e["reason"] == "FailedPrepareDynamicResources"]
            return found or None
        messages = await poll(refused, timeout=scaled(60), what="the kubelet's FailedPrepareDynamicResources event")
        assert "VfConfig.netDevice hands the VF's network interface to the pod" in messages[0], messages
        for word in ("Error", "Traceback", "Exception"):
            assert word not in messages[0].replace("Failed to prepare", ""), messages[0]

        def waiting() -> dict[str, Any] | None:
            # The kubelet may record the event before it first writes the pod's container statuses.
            found = real_node.kubectl.get("pod", "nic", "-n", ns) or {}
            statuses = found.get("status", {}).get("containerStatuses")
            if not statuses:  # an empty list too: poll would take it as the answer
                return None
            state: dict[str, Any] | None = statuses[0]["state"].get("waiting")
            return state
        state = await poll(waiting, timeout=scaled(30), what="the pod's container status")
        assert state["reason"] == "ContainerCreating", state
        assert agent.on_node(uid, (GPU, SRIOV)) == []
        [result] = allocated["status"]["allocation"]["devices"]["results"]
        assert not status_entries(real_node, ns, "nic", SRIOV)
        # The VF is still the network driver's: nothing bound it to vfio-pci.
        assert result["driver"] == SRIOV
        assert bound_driver(real_node, agent.settings.sim_root, result["device"]) != "vfio-pci"
