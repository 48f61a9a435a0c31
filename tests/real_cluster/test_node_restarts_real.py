"""Restarts on the node as the real kubelet and containerd go through them: the kubelet restarted (it wipes the
node's slices when it starts, the agent publishes them again, running pods keep their devices, new pods start); the
agent killed while pods start (every pod starts once, nothing leaks); a rolling update, two instances side by side
(pods keep starting, each claim prepared once)."""

from __future__ import annotations

import asyncio
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.real_cluster.cluster_env import GPU, NODE, KubectlError, RealCluster, poll
from tests.real_cluster.node_env import AgentOnRealNode, agent_on_real_node, running_pod, sleeper
from tests.real_cluster.objects import claim, exactly, template
from tests.support.agent_env import AgentProcess, free_port
from tests.support.timing import scaled

pytestmark = pytest.mark.xdist_group("real-node")


def node_slices(cluster: RealCluster, driver: str) -> dict[str, dict[str, Any]]:
    """The node's slices of `driver` by uid."""
    found = cluster.kubectl.json("get", "resourceslices",
                                 f"--field-selector=spec.nodeName={NODE},spec.driver={driver}")["items"]
    return {s["metadata"]["uid"]: s for s in found}


def gpus_in_log(log: str) -> list[str]:
    """The GPU device nodes a pod's last listing (a line per listing, see `gpu_lister`) shows."""
    lines = [line for line in log.splitlines() if line.startswith("gpus:")]
    return lines[-1].split()[1:] if lines else []


def gpu_lister(cluster: RealCluster, namespace: str, name: str) -> dict[str, Any]:
    """A pod with claim `name` that lists its GPU device nodes every second until deleted."""
    made = sleeper(cluster, namespace, name, {"gpu": name})
    made["spec"]["containers"][0]["command"] = [
        "sh", "-c", "while true; do echo gpus: $(ls /dev | grep '^nvidia[0-9]'); sleep 1; done"]
    return made


async def test_a_restarted_kubelet_wipes_the_slices_and_the_agent_publishes_them_again(
        real_node: RealCluster, node_root: Path) -> None:
    worker = real_node.worker
    assert worker is not None and worker.kubelet is not None
    async with agent_on_real_node(real_node, node_root) as agent:
        ns = await real_node.namespace("kubelet-restart")
        await real_node.apply([claim(ns, "before", [exactly("gpu", GPU)]), gpu_lister(real_node, ns, "before")])
        running = await running_pod(real_node, ns, "before")
        [container] = running["status"]["containerStatuses"]
        before_uid = (await real_node.allocated(ns, "before"))["metadata"]["uid"]
        published = await asyncio.to_thread(node_slices, real_node, GPU)
        assert published

        await asyncio.to_thread(worker.restart_kubelet, timeout=scaled(120))
        real_node.loopback.watch(worker.pids())

        # Every slice the agent had published was deleted, and the agent made them again: the same devices.
        def republished() -> dict[str, dict[str, Any]] | None:
            now = node_slices(real_node, GPU)
            return now if now and not set(now) & set(published) else None
        again = await poll(republished, timeout=scaled(60), what="the node's slices wiped and published again")
        devices = sorted(d["name"] for s in again.values() for d in s["spec"]["devices"])
        assert devices == sorted(d["name"] for s in published.values() for d in s["spec"]["devices"])

        # The running pod kept its container (not restarted) and its GPU; its claim is still prepared.
        def listed() -> list[str] | None:
            try:  # the API server reaches the restarted kubelet for the log once it knows the pod again
                log = real_node.kubectl.run("logs", "before", "-n", ns, "--since=3s")
            except KubectlError:
                return None
            return gpus_in_log(log) or None
        assert len(await poll(listed, timeout=scaled(30), what="the running pod's GPU listing")) == 1
        now = await real_node.get("pod", "before", "-n", ns)
        [status] = now["status"]["containerStatuses"]
        assert (status["containerID"], status["restartCount"]) == (container["containerID"], 0), status
        assert agent.on_node(before_uid), "the running pod's claim was unprepared"
        assert agent.histories(GPU) == {before_uid: ["started", "completed"]}
        # The restarted kubelet knows the claim prepared from its own checkpoint: it does not ask again.
        assert len([line for line in agent.log() if line.get("event") == "prepared claim"]) == 1

        # A pod started after the restart gets a GPU of its own.
        await real_node.apply([claim(ns, "after", [exactly("gpu", GPU)]), gpu_lister(real_node, ns, "after")])
        await running_pod(real_node, ns, "after")
        def after_listed() -> list[str] | None:
            return gpus_in_log(real_node.kubectl.run("logs", "after", "-n", ns)) or None
        [after_gpu] = await poll(after_listed, timeout=scaled(30), what="the new pod's GPU listing")
        assert [after_gpu] != await poll(listed, timeout=scaled(30), what="the running pod's GPU listing")


@pytest.mark.parametrize("kill", [None, "prepare-after-started", "prepare-after-completed"])
async def test_an_agent_killed_while_pods_start_starts_every_pod_once(real_node: RealCluster, node_root: Path,
                                                                      kill: str | None) -> None:
    """SIGKILL while six pods start, the kubelet retrying the rest against the restarted agent: every pod runs with a
    GPU of its own, and once they are deleted nothing is left on the node. The kill comes from outside once the
    first claim is prepared (the others on their way), or from the agent itself at its first prepare: with the
    claim recorded `started` and nothing prepared yet (the restarted agent must roll it back, then prepare it), or
    with the claim recorded `completed` and the kubelet not yet answered (it must answer from its records, not
    prepare the claim again)."""
    names = [f"pod-{i}" for i in range(6)]
    env = {"DRA_AGENT_FAILPOINTS": kill} if kill else None
    async with agent_on_real_node(real_node, node_root, env=env) as agent:
        ns = await real_node.namespace("agent-killed")
        pods = []
        for name in names:
            made = gpu_lister(real_node, ns, name)
            made["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "gpu"}]
            pods.append(made)
        await real_node.apply([template(ns, "gpu", [exactly("gpu", GPU)]), *pods])

        if kill is None:
            def prepared() -> list[dict[str, Any]] | None:
                return [line for line in agent.log() if line.get("event") == "prepared claim"] or None
            await poll(prepared, timeout=scaled(60), what="a first claim prepared", interval=0.02)
            await agent.process.signal(signal.SIGKILL)
        assert await agent.process.wait(timeout=scaled(60)) == -signal.SIGKILL
        killed_at = agent.histories(GPU)
        agent.process.env.pop("DRA_AGENT_FAILPOINTS", None)
        await agent.process.start()
        assert agent.process.process is not None
        real_node.loopback.watch([agent.process.process.pid])

        gpus, uids = {}, []
        for name in names:
            running = await running_pod(real_node, ns, name, timeout=scaled(180))
            [status] = running["status"]["containerStatuses"]
            assert status["restartCount"] == 0, status
            [claim_status] = running["status"]["resourceClaimStatuses"]
            uids.append((await real_node.allocated(ns, claim_status["resourceClaimName"]))["metadata"]["uid"])
            def listed(pod_name: str = name) -> list[str] | None:
                return gpus_in_log(real_node.kubectl.run("logs", pod_name, "-n", ns)) or None
            gpus[name] = await poll(listed, timeout=scaled(30), what=f"pod {name}'s GPU listing")
        assert all(len(found) == 1 for found in gpus.values()), gpus
        assert len({found[0] for found in gpus.values()}) == len(names), f"a GPU in two pods: {gpus}"
        # Each claim prepared by one of the two agents, once: its CDI spec and its checkpoint record.
        for uid in uids:
            assert len([f for f in agent.on_node(uid) if f.endswith(".json")]) == 1, agent.on_node(uid)
        assert agent.checkpointed(GPU) == set(uids)
        # A claim the first agent had prepared was not prepared again; one whose preparation the kill cut short
        # was rolled back by the second agent (its log says so) and prepared once more.
        histories = agent.histories(GPU)
        assert set(histories) == set(uids), histories
        rolled_back = {line["claim"].rpartition(":")[2] for line in agent.log()
                       if line.get("event") == "rolling back a prepare that did not complete"}
        for uid, history in histories.items():
            if uid in rolled_back:
                assert history == ["started", "removed", "started", "completed"], (uid, history)
            else:
                assert history == ["started", "completed"], (uid, history)
        # What the kill cut short, and only that, was rolled back.
        cut_short = {uid for uid, history in killed_at.items() if history == ["started"]}
        assert all(history in (["started"], ["started", "completed"]) for history in killed_at.values()), killed_at
        assert rolled_back == cut_short, (rolled_back, killed_at)
        if kill == "prepare-after-started":
            assert cut_short, killed_at
        elif kill == "prepare-after-completed":
            completed = set(killed_at) - cut_short
            assert completed, killed_at
            # The first agent died before it answered: the kubelet asked the restarted one, which answered once.
            answered = [line["claim"].rpartition(":")[2] for line in agent.log()
                        if line.get("event") == "prepared claim"]
            assert all(answered.count(uid) == 1 for uid in completed), (answered, killed_at)

        await real_node.run("delete", "pods", "--all", "-n", ns, "--wait=true", f"--timeout={scaled(120):.0f}s")
        leaks = {uid: agent.on_node(uid) for uid in uids if agent.on_node(uid)}
        assert not leaks, leaks
        assert agent.checkpointed(GPU) == set()


async def test_a_rolling_update_keeps_pods_starting_and_prepares_each_claim_once(real_node: RealCluster,
                                                                                  node_root: Path) -> None:
    """Two instances side by side as the DaemonSet's maxSurge runs them (`--pod-uid`: sockets of their own, one
    shared state): pods go on being created before, while and after the new instance registers and the old one is
    stopped (SIGTERM); every pod runs with a GPU of its own, each claim is prepared once, and the new instance
    unprepares them all, the old one's too."""
    names = [f"pod-{i}" for i in range(6)]
    async with agent_on_real_node(real_node, node_root, pod_uid=str(uuid.uuid4())) as old:
        ns = await real_node.namespace("rolling")
        await real_node.apply(template(ns, "gpu", [exactly("gpu", GPU)]))

        async def create(name: str) -> None:
            made = gpu_lister(real_node, ns, name)
            made["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "gpu"}]
            await real_node.apply(made)

        for name in names[:2]:
            await create(name)
        settings = old.settings.model_copy(update={"pod_uid": str(uuid.uuid4()),
                                                   "metrics_address": f"127.0.0.1:{free_port()}"})
        process = AgentProcess(settings, old.process.env)
        process.log = node_root / "new-instance.log"
        await process.start()
        assert process.process is not None
        real_node.loopback.watch([process.process.pid])
        new = AgentOnRealNode(real_node, settings, process, settings.metrics_address or "")
        try:
            await create(names[2])
            await poll(lambda: {line.get("driver") for line in new.log()
                                if line.get("event") == "registered with the kubelet"} >= {GPU} or None,
                       timeout=scaled(60), what="the new instance registered with the kubelet")
            await create(names[3])
            await old.process.signal(signal.SIGTERM)
            await create(names[4])
            assert await old.process.wait(timeout=scaled(30)) == 0
            await create(names[5])

            gpus, uids = {}, []
            for name in names:
                running = await running_pod(real_node, ns, name, timeout=scaled(180))
                [claim_status] = running["status"]["resourceClaimStatuses"]
                uids.append((await real_node.allocated(ns, claim_status["resourceClaimName"]))["metadata"]["uid"])
                def listed(pod_name: str = name) -> list[str] | None:
                    return gpus_in_log(real_node.kubectl.run("logs", pod_name, "-n", ns)) or None
                gpus[name] = await poll(listed, timeout=scaled(30), what=f"pod {name}'s GPU listing")
            assert len({found[0] for found in gpus.values() if len(found) == 1}) == len(names), gpus
            assert new.histories(GPU) == {uid: ["started", "completed"] for uid in uids}, "prepared twice"
            for uid in uids:
                assert len([f for f in new.on_node(uid) if f.endswith(".json")]) == 1, new.on_node(uid)
            assert new.checkpointed(GPU) == set(uids)

            await real_node.run("delete", "pods", "--all", "-n", ns, "--wait=true", f"--timeout={scaled(120):.0f}s")
            assert {uid: new.on_node(uid) for uid in uids if new.on_node(uid)} == {}
            unprepared = [line["claim"] for line in new.log() if line.get("event") == "unprepared claim"]
            assert sorted(c.rpartition(":")[2] for c in unprepared) == sorted(uids)
        finally:
            await process.stop()
