"""Claims that share or watch a GPU, through the real scheduler and API server: two claims share one GPU by memory
(consumable capacity) and a third that would overcommit it stays pending; a pod asking `nvidia.com/gpu: 1` gets a
claim the scheduler makes from the class's extended resource name; an admin-access claim beside a workload's claim
on one GPU in a namespace allowed to make one, and refused by the server in a namespace that is not."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.kubectl import KubectlError
from tests.real_cluster.cluster_env import GPU, RealCluster, agent_on_node
from tests.real_cluster.objects import claim, exactly, pod

pytestmark = pytest.mark.xdist_group("real-cluster")

SHARING = {"nvidia-gpu": {"sharing": {"byMemory": True}}}
ONE_GPU = 'device.attributes["resource.kubernetes.io"].pciBusID == "0000:18:00.0"'
ADMIN_LABEL = {"resource.kubernetes.io/admin-access": "true"}


async def test_two_claims_share_a_gpu_by_memory_and_a_third_waits(real_cluster: RealCluster,
                                                                  node_root: Path) -> None:
    async with agent_on_node(real_cluster, node_root, backend_config=SHARING) as agent:
        ns = await real_cluster.namespace("shares")
        # 81559Mi of memory: 40Gi and 39Gi fit, then 663Mi are left, under the policy's 1Gi minimum.
        for name, amount in (("a", "40Gi"), ("b", "39Gi")):
            await real_cluster.apply([
                claim(ns, name, [exactly("gpu", GPU, selectors=[ONE_GPU], capacity={"memory": amount})]),
                pod(ns, name, claims={"gpu": name})])
            answers = await agent.prepare_pod(ns, name)
            allocated = await real_cluster.allocated(ns, name)
            [result] = allocated["status"]["allocation"]["devices"]["results"]
            assert result["device"] == "gpu-0000-18-00-0"
            assert result["consumedCapacity"] == {"memory": amount}
            assert result["shareID"]
            [device] = answers[name][GPU].devices
            assert device.share_id == result["shareID"]
        await real_cluster.apply([
            claim(ns, "c", [exactly("gpu", GPU, selectors=[ONE_GPU], capacity={"memory": "1Gi"})]),
            pod(ns, "c", claims={"gpu": "c"})])
        message = await real_cluster.unschedulable(ns, "c")
        assert "cannot allocate all claims" in message, message


async def test_a_pod_asking_for_nvidia_com_gpu_gets_a_claim_the_agent_prepares(real_cluster: RealCluster,
                                                                             node_root: Path) -> None:
    async with agent_on_node(real_cluster, node_root) as agent:
        ns = await real_cluster.namespace("extended")
        await real_cluster.apply(pod(ns, "legacy", limits={"nvidia.com/gpu": "1"}))
        answers = await agent.prepare_pod(ns, "legacy")
        bound = await real_cluster.bound_pod(ns, "legacy")
        made = bound["status"]["extendedResourceClaimStatus"]
        assert list(answers) == [made["resourceClaimName"]]
        allocated = await real_cluster.allocated(ns, made["resourceClaimName"])
        assert allocated["metadata"]["annotations"]["resource.kubernetes.io/extended-resource-claim"] == "true"
        [result] = allocated["status"]["allocation"]["devices"]["results"]
        assert result["driver"] == GPU
        assert answers[made["resourceClaimName"]][GPU].devices[0].device == result["device"]


async def test_admin_access_beside_a_workload_on_one_gpu(real_cluster: RealCluster, node_root: Path) -> None:
    async with agent_on_node(real_cluster, node_root) as agent:
        workload = await real_cluster.namespace("workload")
        monitoring = await real_cluster.namespace("monitoring", labels=ADMIN_LABEL)
        await real_cluster.apply([claim(workload, "job", [exactly("gpu", GPU, selectors=[ONE_GPU])]),
                                  pod(workload, "job", claims={"gpu": "job"})])
        await agent.prepare_pod(workload, "job")
        await real_cluster.apply([claim(monitoring, "watch", [exactly("gpu", GPU, selectors=[ONE_GPU], admin=True)]),
                                  pod(monitoring, "watch", claims={"gpu": "watch"})])
        answers = await agent.prepare_pod(monitoring, "watch")
        allocated = await real_cluster.allocated(monitoring, "watch")
        [result] = allocated["status"]["allocation"]["devices"]["results"]
        assert result["device"] == "gpu-0000-18-00-0" and result["adminAccess"] is True
        assert answers["watch"][GPU].devices[0].device == "gpu-0000-18-00-0"

        plain = await real_cluster.namespace("plain")
        with pytest.raises(KubectlError, match="admin access to devices requires the"):
            await real_cluster.apply(claim(plain, "sneaky", [exactly("gpu", GPU, admin=True)]))
