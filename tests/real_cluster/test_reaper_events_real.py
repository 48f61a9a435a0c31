"""What the agent does on its own against the real API server: it unprepares a claim deleted while it was stopped
once its grace period is over, reaps nothing while the server refuses it the claims (an API error proves nothing
gone), and writes Events the server accepts and `kubectl get events` shows, on claims and on the Node."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agent.claims import checkpoint
from agent.events.recorder import CONTROLLER
from backends.contract import ClaimRef
from tests.real_cluster.cluster_env import GPU, NODE, RealCluster, agent_on_node, poll
from tests.real_cluster.objects import claim, exactly, pod
from tests.support.agent_env import AgentProcess, metrics_of, settings_for
from tests.support.timing import scaled

pytestmark = pytest.mark.xdist_group("real-cluster")

REAP_FAST: dict[str, Any] = {"reap_interval": 1.0, "reap_grace": 2.0}  # settings for agent_on_node
READ_CLAIMS_RULE = {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"],
                    "verbs": ["get", "list", "watch"]}


def total(metrics: dict[str, float], name: str, label: str = "") -> float:
    """The sum of a metric's samples whose labels contain `label`."""
    return sum(v for k, v in metrics.items() if k.split("{")[0] == name and label in k)


def specs_of(cdi_dir: Path, uid: str) -> list[Path]:
    return [p for p in cdi_dir.glob("*.json") if uid in p.name]


async def prepared_claim(cluster: RealCluster, agent: Any, ns: str, name: str) -> str:
    await cluster.apply([claim(ns, name, [exactly("gpu", GPU)]), pod(ns, name, claims={"gpu": name})])
    await agent.prepare_pod(ns, name)
    allocated = await cluster.allocated(ns, name)
    uid: str = allocated["metadata"]["uid"]
    return uid


async def delete_pod_and_claim(cluster: RealCluster, ns: str, name: str) -> None:
    # No kubelet confirms the pod's end here: the deletion is forced, as after a node's loss.
    await cluster.run("delete", "pod", name, "-n", ns, "--grace-period=0", "--force", "--wait=true")
    await cluster.run("delete", "resourceclaim", name, "-n", ns, "--wait=true", f"--timeout={scaled(60):.0f}s")


async def test_a_claim_deleted_while_the_agent_was_stopped_is_reaped(real_cluster: RealCluster,
                                                                     node_root: Path) -> None:
    ns = await real_cluster.namespace("reap")
    async with agent_on_node(real_cluster, node_root) as agent:
        uid = await prepared_claim(real_cluster, agent, ns, "gone")
        assert specs_of(agent.settings.cdi_dir, uid)
    await delete_pod_and_claim(real_cluster, ns, "gone")
    async with agent_on_node(real_cluster, node_root, **REAP_FAST) as agent:
        await poll(lambda: not specs_of(agent.settings.cdi_dir, uid), timeout=scaled(30),
                   what="the deleted claim unprepared by the reaper")
        assert total(metrics_of(agent.metrics), "dra_agent_reaped_claims_total", f'driver="{GPU}"') == 1.0


async def test_api_errors_reap_nothing(real_cluster: RealCluster, node_root: Path) -> None:
    """While the agent may not read claims, a deleted claim is not known to be gone; once it may, it is."""
    ns = await real_cluster.namespace("reap-refused")
    role = real_cluster.kubectl.get("clusterrole", "dra-agent")
    without_claims = [r for r in role["rules"] if r != READ_CLAIMS_RULE]
    assert len(without_claims) == len(role["rules"]) - 1, "the role's claim-reading rule changed"
    async with agent_on_node(real_cluster, node_root, **REAP_FAST) as agent:
        uid = await prepared_claim(real_cluster, agent, ns, "hidden")
        await real_cluster.run("patch", "clusterrole", "dra-agent", "--type=json",
                               "-p", json.dumps([{"op": "replace", "path": "/rules", "value": without_claims}]))
        try:
            await delete_pod_and_claim(real_cluster, ns, "hidden")
            def refusals() -> float:
                return total(metrics_of(agent.metrics), "dra_agent_api_errors_total", "get_resourceclaim")
            before = refusals()
            await poll(lambda: refusals() >= before + 3 or None, timeout=scaled(30),
                       what="the reaper refused the claim several times")
            assert specs_of(agent.settings.cdi_dir, uid), "a claim was reaped on an API error"
        finally:
            await real_cluster.run("patch", "clusterrole", "dra-agent", "--type=json",
                                   "-p", json.dumps([{"op": "replace", "path": "/rules", "value": role["rules"]}]))
        await poll(lambda: not specs_of(agent.settings.cdi_dir, uid), timeout=scaled(30),
                   what="the claim reaped once the agent may read claims again")


async def test_events_on_a_claim_and_on_the_node_are_stored(real_cluster: RealCluster, node_root: Path) -> None:
    ns = await real_cluster.namespace("events")
    async with agent_on_node(real_cluster, node_root) as agent:
        # A claim allocated by hand (a scheduler that lost count) to a device this node does not have.
        created = await real_cluster.create(claim(ns, "lost", [exactly("gpu", GPU)]))
        allocation = {"devices": {"results": [{"request": "gpu", "driver": GPU, "pool": NODE,
                                               "device": "gpu-0000-ff-00-0"}]},
                      "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                          {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]}}
        await real_cluster.run("patch", "resourceclaim", "lost", "-n", ns, "--subresource=status", "--type=merge",
                               "-p", json.dumps({"status": {"allocation": allocation}}))
        ref = ClaimRef(created["metadata"]["uid"], ns, "lost")
        for _ in range(2):
            answer = await agent.plugin(GPU).prepare([ref])
            assert "not a device of driver" in answer[ref.uid].error

        def series() -> dict[str, Any] | None:
            events = real_cluster.kubectl.json("get", "events.events.k8s.io", "-n", ns)["items"]
            found = [e for e in events if e["reason"] == "PrepareFailed"]
            return found[0] if found and found[0].get("series", {}).get("count", 1) >= 2 else None
        event = await poll(series, timeout=scaled(30), what="a PrepareFailed event with its series")
        assert event["regarding"]["uid"] == ref.uid and event["reportingController"] == CONTROLLER
        listed = await real_cluster.run("get", "events", "-n", ns)
        assert "PrepareFailed" in listed and "resourceclaim/lost" in listed

    # A checkpoint from a newer agent is refused at start, with an Event on the Node before the process exits.
    settings = settings_for(node_root, node_root / "agent.kubeconfig", "dgx-h100", node_name=NODE)
    journal = settings.state_dir / GPU / "checkpoint.journal"
    journal.write_bytes(checkpoint._line({"format": checkpoint.FORMAT + 1, "op": "removed", "uid": "u"}))
    process = AgentProcess(settings)
    await process.start()
    try:
        assert await process.wait(timeout=scaled(30)) == 1
    finally:
        await process.stop()
    events = real_cluster.kubectl.json("get", "events.events.k8s.io", "-n", "default")["items"]
    [refused] = [e for e in events if e["reason"] == "CheckpointRefused"]
    # The kubelet's convention for a Node's own Events: the node name in place of its uid, under which
    # `kubectl describe node` looks Events up too.
    assert refused["regarding"] == {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE}
    described = await real_cluster.run("describe", "node", NODE)
    assert "CheckpointRefused" in described
