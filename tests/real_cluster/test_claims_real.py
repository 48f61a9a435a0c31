"""A claim's path through the real control plane: a pod with a ResourceClaimTemplate, the claim made by the
controller manager, allocated and reserved by the real scheduler, prepared by the agent, `status.devices` written
by the agent's server-side apply under the real server's validation and authorization, another driver's entry
left alone, ours removed at unprepare."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from backends.contract import ClaimRef
from tests.real_cluster.cluster_env import GPU, NODE, RealCluster, agent_on_node, poll
from tests.real_cluster.objects import claim, exactly, pod, template
from tests.support.agent_env import metrics_of
from tests.support.timing import scaled

pytestmark = pytest.mark.xdist_group("real-cluster")

OTHER = "other.example.com"


def entries(claim: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The claim's status.devices entries by driver/device."""
    return {f"{e['driver']}/{e['device']}": e for e in claim.get("status", {}).get("devices", [])}


def other_driver(cluster: RealCluster) -> None:
    """Another DRA driver on the node: one device in a slice of its own, and a class for it."""
    cluster.kubectl.apply([
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "other-driver-slice"},
         "spec": {"driver": OTHER, "nodeName": NODE, "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
                  "devices": [{"name": "widget-0"}]}},
        {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": OTHER},
         "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{OTHER}"'}}]}},
    ])


async def test_a_template_claim_is_allocated_prepared_and_its_status_written(real_cluster: RealCluster,
                                                                             node_root: Path) -> None:
    other_driver(real_cluster)
    ns = await real_cluster.namespace("template")
    await real_cluster.apply([
        template(ns, "gpu-and-widget", [exactly("gpu", GPU), exactly("widget", OTHER)]),
        pod(ns, "worker", templates={"devices": "gpu-and-widget"}),
    ])
    async with agent_on_node(real_cluster, node_root) as agent:
        bound = await real_cluster.bound_pod(ns, "worker")
        [ref] = await real_cluster.pod_claims(bound)
        claim = await real_cluster.allocated(ns, ref.name)
        # Made by the controller manager from the template, reserved for the pod by the scheduler.
        assert claim["metadata"]["ownerReferences"][0]["name"] == "worker"
        assert [r["name"] for r in claim["status"]["reservedFor"]] == ["worker"]
        results = {r["request"]: r for r in claim["status"]["allocation"]["devices"]["results"]}
        assert results["gpu"]["driver"] == GPU and results["gpu"]["pool"] == NODE

        answer = await agent.plugin(GPU).prepare_or_raise([ref])
        gpu_key = f"{GPU}/{results['gpu']['device']}"
        assert answer[ref.uid].devices[0].device == results["gpu"]["device"]

        # The other driver writes its entry as a driver would: server-side apply on /status, its own manager.
        widget = {"driver": OTHER, "pool": NODE, "device": "widget-0",
                  "conditions": [{"type": "Ready", "status": "True", "reason": "Ready", "message": "",
                                  "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
        await real_cluster.run(
            "apply", "--server-side", f"--field-manager={OTHER}", "--subresource=status", "-f", "-",
            input=json.dumps({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                              "metadata": {"name": ref.name, "namespace": ns},
                              "status": {"devices": [widget]}}))

        def both_written() -> dict[str, Any] | None:
            found = real_cluster.kubectl.get("resourceclaim", ref.name, "-n", ns)
            written = entries(found)
            return found if gpu_key in written and f"{OTHER}/widget-0" in written else None
        await poll(both_written, timeout=scaled(30), what="our entry written beside the other driver's")
        claim = real_cluster.kubectl.get("resourceclaim", ref.name, "-n", ns, "--show-managed-fields")
        ours = entries(claim)[gpu_key]
        assert [(c["type"], c["status"]) for c in ours["conditions"]] == [("Ready", "True")]
        assert ours["data"]["uuid"].startswith("GPU-")
        managers = {(m["manager"], m.get("subresource")) for m in claim["metadata"]["managedFields"]}
        assert {(GPU, "status"), (OTHER, "status")} <= managers

        await agent.plugin(GPU).unprepare_or_raise([ref])

        def ours_removed() -> dict[str, Any] | None:
            found = real_cluster.kubectl.get("resourceclaim", ref.name, "-n", ns)
            return found if gpu_key not in entries(found) else None
        claim = await poll(ours_removed, timeout=scaled(30), what="our entry removed at unprepare")
        assert list(entries(claim)) == [f"{OTHER}/widget-0"]
    assert_agent_requests_allowed(real_cluster)


def assert_agent_requests_allowed(cluster: RealCluster) -> None:
    """Every request the agent's service account made was authorized and succeeded (the audit log's record)."""
    events = cluster.plane.audit_events()
    assert events, "the audit log holds none of the agent's requests"
    refused = [(e["verb"], e["requestURI"], e["responseStatus"].get("code"), e["responseStatus"].get("message"))
               for e in events if e["responseStatus"].get("code", 200) >= 400
               and e["responseStatus"].get("code") != 404]
    assert not refused, refused


def claim_ref(claim: dict[str, Any]) -> ClaimRef:
    return ClaimRef(claim["metadata"]["uid"], claim["metadata"]["namespace"], claim["metadata"]["name"])


async def test_status_writes_need_the_drivers_per_node_permission(real_cluster: RealCluster, node_root: Path) -> None:
    """The server checks `associated-node:patch` on `resourceclaims/driver` for our driver name: without deploy/'s
    rule the agent's status write is refused (and counted), the prepare itself unaffected."""
    role = real_cluster.kubectl.get("clusterrole", "dra-agent")
    without_driver = [r for r in role["rules"] if "resourceclaims/driver" not in r["resources"]]
    assert len(without_driver) == len(role["rules"]) - 1, "the role's resourceclaims/driver rule changed"
    ns = await real_cluster.namespace("status-refused")
    await real_cluster.apply([claim(ns, "job", [exactly("gpu", GPU)]), pod(ns, "job", claims={"gpu": "job"})])
    async with agent_on_node(real_cluster, node_root) as agent:
        await real_cluster.run("patch", "clusterrole", "dra-agent", "--type=json",
                               "-p", json.dumps([{"op": "replace", "path": "/rules", "value": without_driver}]))
        try:
            await agent.prepare_pod(ns, "job")
            refused = f'dra_agent_claim_status_writes_total{{driver="{GPU}",outcome="refused"}}'
            await poll(lambda: metrics_of(agent.metrics).get(refused) or None, timeout=scaled(30),
                       what="the status write refused")
            # The server names both verbs it tried: associated-node (the token's node is the claim's) first.
            assert "changing status.devices requires resource" in agent.log()
            assert "associated-node:patch arbitrary-node:patch" in agent.log()
            assert not entries(await real_cluster.claim(ns, "job") or {})
        finally:
            await real_cluster.run("patch", "clusterrole", "dra-agent", "--type=json",
                                   "-p", json.dumps([{"op": "replace", "path": "/rules", "value": role["rules"]}]))
