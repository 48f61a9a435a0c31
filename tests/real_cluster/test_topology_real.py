"""A GPU and an RDMA VF on one PCIe root complex, and under one PCIe switch, chosen by the real scheduler from the
topology attributes the agent publishes (`matchAttribute`), then prepared by both of the agent's drivers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.real_cluster.cluster_env import GPU, SRIOV, RealCluster, agent_on_node
from tests.real_cluster.objects import exactly, pod, template

pytestmark = pytest.mark.xdist_group("real-cluster")

RDMA_VF = "rdma-vf.sriov.dra-agent.io"
ROOT, SWITCH = "resource.kubernetes.io/pcieRoot", "dra-agent.io/pcieSwitch"
# One GPU of the DGX H100 profile, chosen by its PCI address so the test knows where the VF must come from.
GPU_BUS_ID = "0000:18:00.0"


def attributes_of(cluster: RealCluster, driver: str, device: str) -> dict[str, Any]:
    slices = cluster.kubectl.json("get", "resourceslices", f"--field-selector=spec.driver={driver}")["items"]
    for slice_ in slices:
        for found in slice_["spec"].get("devices", []):
            if found["name"] == device:
                return {k: next(iter(v.values())) for k, v in found.get("attributes", {}).items()}
    raise AssertionError(f"{driver}/{device} is not published")


@pytest.mark.parametrize("attribute", [ROOT, SWITCH], ids=["pcie-root", "pcie-switch"])
async def test_gpu_and_rdma_vf_on_one_pcie_level(real_cluster: RealCluster, node_root: Path, attribute: str) -> None:
    ns = await real_cluster.namespace("topology")
    gpu_selector = f'device.attributes["resource.kubernetes.io"].pciBusID == "{GPU_BUS_ID}"'
    await real_cluster.apply([
        template(ns, "gpu-rdma", [exactly("gpu", GPU, selectors=[gpu_selector]), exactly("nic", RDMA_VF)],
                 constraints=[{"requests": ["gpu", "nic"], "matchAttribute": attribute}]),
        pod(ns, "trainer", templates={"gpu-and-nic": "gpu-rdma"}),
    ])
    async with agent_on_node(real_cluster, node_root) as agent:
        answers = await agent.prepare_pod(ns, "trainer")
        [(claim_name, by_driver)] = answers.items()
        claim = await real_cluster.allocated(ns, claim_name)
        results = {r["request"]: r for r in claim["status"]["allocation"]["devices"]["results"]}
        gpu = attributes_of(real_cluster, GPU, results["gpu"]["device"])
        nic = attributes_of(real_cluster, SRIOV, results["nic"]["device"])
        assert gpu["resource.kubernetes.io/pciBusID"] == GPU_BUS_ID
        assert nic["rdma"] is True
        assert gpu[attribute] == nic[attribute]
        assert set(by_driver) == {GPU, SRIOV}
        assert all(answer.devices[0].cdi_device_ids for answer in by_driver.values())


async def test_no_vf_on_the_gpus_root_leaves_the_pod_pending(real_cluster: RealCluster, node_root: Path) -> None:
    """The constraint is the scheduler's to enforce: a VF asked for on another root than the GPU's cannot match."""
    ns = await real_cluster.namespace("topology-miss")
    gpu_selector = f'device.attributes["resource.kubernetes.io"].pciBusID == "{GPU_BUS_ID}"'
    async with agent_on_node(real_cluster, node_root):
        gpu_root = attributes_of(real_cluster, GPU, "gpu-0000-18-00-0")[ROOT]
        nic_selector = f'device.attributes["resource.kubernetes.io"].pcieRoot != "{gpu_root}"'
        await real_cluster.apply([
            template(ns, "apart", [exactly("gpu", GPU, selectors=[gpu_selector]),
                                   exactly("nic", RDMA_VF, selectors=[nic_selector])],
                     constraints=[{"requests": ["gpu", "nic"], "matchAttribute": ROOT}]),
            pod(ns, "apart", templates={"devices": "apart"}),
        ])
        message = await real_cluster.unschedulable(ns, "apart")
        assert "cannot allocate all claims" in message, message
