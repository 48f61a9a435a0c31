"""What a container gets from the agent's CDI specs through the real kubelet and containerd, beyond one GPU: a GPU
and an RDMA VF on one PCIe root (both drivers' device nodes); a VM's GPU bound to vfio-pci (its /dev/vfio group
node, no NVIDIA node); the device metadata file (KEP-5304) at the upstream in-container path."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.real_cluster.cluster_env import GPU, SRIOV, RealCluster, every_reconfiguration_allowed
from tests.real_cluster.node_env import agent_on_real_node, reported, reporter
from tests.real_cluster.objects import claim, exactly

pytestmark = pytest.mark.xdist_group("real-node")


@pytest.fixture(scope="module", autouse=True)
def _reconfigurations_allowed(real_node: RealCluster) -> Iterator[None]:
    """The VM's passthrough and the VF's interface asked for in the tests' own namespaces, as an operator allows
    them by deploy/'s ConfigMap."""
    with every_reconfiguration_allowed(real_node.kubectl):
        yield

API = "dra-agent.io/v1alpha1"
RDMA_VF = "rdma-vf.sriov.dra-agent.io"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
ONLY_GPU_ZERO = 'device.attributes["resource.kubernetes.io"].pciBusID == "0000:18:00.0"'
METADATA = "/var/run/kubernetes.io/dra-device-attributes"
"""Where a container finds its claims' device metadata (upstream's kubeletplugin helper names the folder)."""


def published(cluster: RealCluster, driver: str, device: str) -> dict[str, Any]:
    """A device's attributes, as the node's slices publish them."""
    slices = cluster.kubectl.json("get", "resourceslices", f"--field-selector=spec.driver={driver}")["items"]
    [found] = [d for s in slices for d in s["spec"].get("devices", []) if d["name"] == device]
    return {k: next(iter(v.values())) for k, v in found.get("attributes", {}).items()}


def character_devices(log: str) -> list[str]:
    """The character devices an `ls -l` of device nodes printed, by path."""
    return re.findall(r"^c\S+\s.*\s(/dev/\S+)$", log, re.MULTILINE)


def pcie_root_in_sysfs(sim_root: Path, bus_id: str) -> str:
    """The PCI root complex (`pci<domain>:<bus>`) the node's sysfs puts a device under."""
    real = (sim_root / "sys/bus/pci/devices" / bus_id).resolve()
    return next(part for part in real.parts if re.fullmatch(r"pci[0-9a-f]{4}:[0-9a-f]{2}", part))


async def test_a_gpu_and_an_rdma_vf_on_one_pcie_root_reach_the_container(real_node: RealCluster,
                                                                         node_root: Path) -> None:
    async with agent_on_real_node(real_node, node_root, drivers=(GPU, SRIOV)) as agent:
        ns = await real_node.namespace("gpu-vf")
        await real_node.apply([
            claim(ns, "gpu-rdma", [exactly("gpu", GPU, selectors=[ONLY_GPU_ZERO]), exactly("nic", RDMA_VF)],
                  constraints=[{"requests": ["gpu", "nic"], "matchAttribute": PCIE_ROOT}]),
            reporter(real_node, ns, "trainer", {"devices": "gpu-rdma"}, "ls -l /dev/nvidia[0-9]* /dev/infiniband/*"),
        ])
        log = await reported(real_node, ns, "trainer")
        allocated = await real_node.allocated(ns, "gpu-rdma")
        results = {r["request"]: r for r in allocated["status"]["allocation"]["devices"]["results"]}
        gpu, nic = published(real_node, GPU, results["gpu"]["device"]), published(real_node, SRIOV,
                                                                                     results["nic"]["device"])
        assert gpu[PCIE_ROOT] == nic[PCIE_ROOT]
        # The published root is the one the node's PCI tree puts each device under: the constraint put the two
        # on one root complex, not merely on one published value.
        sim_root = agent.settings.sim_root
        assert sim_root is not None
        for attributes in (gpu, nic):
            bus_id = attributes["resource.kubernetes.io/pciBusID"]
            assert pcie_root_in_sysfs(sim_root, bus_id) == attributes[PCIE_ROOT], attributes
    nodes = character_devices(log)
    assert len([n for n in nodes if re.fullmatch(r"/dev/nvidia\d+", n)]) == 1, log
    assert [n for n in nodes if n.startswith("/dev/infiniband/uverbs")], log
    assert "/dev/infiniband/rdma_cm" in nodes, log


async def test_a_vm_pods_gpu_bound_to_vfio_pci_shows_its_vfio_group(real_node: RealCluster, node_root: Path) -> None:
    vfio = [{"requests": ["gpu"], "opaque": {"driver": GPU, "parameters": {"apiVersion": API, "kind": "VfioConfig"}}}]
    async with agent_on_real_node(real_node, node_root) as agent:
        ns = await real_node.namespace("vm")
        await real_node.apply([
            claim(ns, "vm-gpu", [exactly("gpu", GPU)], config=vfio),
            reporter(real_node, ns, "virt-launcher", {"gpu": "vm-gpu"}, "ls -l /dev/vfio/*; ls /dev | grep '^nvidia'"),
        ])
        log = await reported(real_node, ns, "virt-launcher")
        [result] = (await real_node.allocated(ns, "vm-gpu"))["status"]["allocation"]["devices"]["results"]
        bus_id = published(real_node, GPU, result["device"])["resource.kubernetes.io/pciBusID"]
        sim_root = agent.settings.sim_root
        assert sim_root is not None
        group = (sim_root / "sys/bus/pci/devices" / bus_id / "iommu_group").readlink().name
    assert sorted(character_devices(log)) == sorted(["/dev/vfio/vfio", f"/dev/vfio/{group}"]), log
    assert "nvidia" not in log, "a GPU passed through to a VM has no NVIDIA device node in the pod"


async def test_a_pod_reads_its_device_metadata_at_the_upstream_path(real_node: RealCluster, node_root: Path) -> None:
    path = f"{METADATA}/resourceclaims/gpu/gpu/{GPU}-metadata.json"
    async with agent_on_real_node(real_node, node_root, device_metadata=True):
        ns = await real_node.namespace("metadata")
        await real_node.apply([
            claim(ns, "gpu", [exactly("gpu", GPU)]),
            reporter(real_node, ns, "reader", {"gpu": "gpu"}, f"cat {path}"),
        ])
        log = await reported(real_node, ns, "reader")
        allocated = await real_node.allocated(ns, "gpu")
        [result] = allocated["status"]["allocation"]["devices"]["results"]
        bus_id = published(real_node, GPU, result["device"])["resource.kubernetes.io/pciBusID"]
    metadata = json.loads(log.splitlines()[0])
    assert metadata["kind"] == "DeviceMetadata", metadata
    assert metadata["apiVersion"].startswith("metadata.resource.k8s.io/"), metadata
    [device] = [d for r in metadata["requests"] for d in r["devices"]]
    assert (device["driver"], device["name"]) == (GPU, result["device"]), device
    assert device["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": bus_id}, device
