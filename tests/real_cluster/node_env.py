"""The tier's cluster whose node runs pods: the real kubelet and containerd (`cluster.worker`), the agent registered
with that kubelet, and what the pods print.

The agent runs as a `dra-agent run` host process with the DaemonSet's arguments, its sockets in the kubelet's plugin
folders (`--registry-dir`, `--plugins-dir`), its CDI specs in the folder containerd reads (`--cdi-dir`), on a
simulated node whose /dev entries are character devices (containerd stats each device node a spec names). The
node's root is where containerd, on this machine, finds the node's /dev and driver files: `--cdi-host-root`. It
holds a token of the DaemonSet's ServiceAccount bound to a pod on the node, as the kubelet projects it into the
agent's pod. The DaemonSet itself is left out of deploy/ on this cluster (`cluster.incluster.apply_deploy` says
why). A pod of the busybox image stands in for the agent's pod: it runs on the node under the agent's
ServiceAccount, with the DaemonSet's labels, so the token names its node as the agent pod's would.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import urllib.request
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.claims.checkpoint import Checkpoint
from agent.settings import Settings
from cluster.kubectl import Kubectl
from cluster.worker import WorkerNode
from simulator.node.variants import with_char_devices
from tests.real_cluster.cluster_env import AGENT_NAMESPACE, GPU, NODE, KubectlError, RealCluster, agent_ready, poll
from tests.real_cluster.objects import pod
from tests.support.agent_env import AgentProcess, free_port, settings_for
from tests.support.checkpoint_journal import journal_histories
from tests.support.timing import scaled

__all__ = ["AgentOnRealNode", "agent_on_real_node", "finished_pod_log", "node_image",
           "reported", "reporter", "running_pod", "sleeper", "stand_in_aside", "start_agent_stand_in"]

_AGENT_LABELS = {"app.kubernetes.io/name": "dra-agent"}
_DONE = "-- reported --"
_STAND_IN = "dra-agent-host-process"


def start_agent_stand_in(kubectl: Kubectl, worker: WorkerNode) -> None:
    """The pod that carries the agent's identity on the node (see the module's description); returns once it
    runs."""
    kubectl.apply({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"namespace": AGENT_NAMESPACE, "name": _STAND_IN, "labels": _AGENT_LABELS},
        "spec": {"serviceAccountName": "dra-agent", "nodeName": NODE, "hostNetwork": True,
                 "terminationGracePeriodSeconds": 0,
                 "containers": [{"name": "agent", "image": worker.busybox, "imagePullPolicy": "Never",
                                 "command": ["sleep", "2147483647"]}]}})
    wait = scaled(60)
    kubectl.run("wait", "--for=condition=Ready", f"pod/{_STAND_IN}", "-n", AGENT_NAMESPACE,
                f"--timeout={wait:.0f}s", timeout=wait + 10)


@contextmanager
def stand_in_aside(kubectl: Kubectl) -> Iterator[None]:
    """The stand-in out of the DaemonSet's selector for the block (deploy/'s DaemonSet runs on the node meanwhile,
    whose controller would adopt a pod its selector matches), back in it afterwards."""
    label = "app.kubernetes.io/name"
    kubectl.run("label", "pod", _STAND_IN, "-n", AGENT_NAMESPACE, "--overwrite", f"{label}={_STAND_IN}")
    try:
        yield
    finally:
        kubectl.run("label", "pod", _STAND_IN, "-n", AGENT_NAMESPACE, "--overwrite", f"{label}={_AGENT_LABELS[label]}")


@dataclass
class AgentOnRealNode:
    """`dra-agent run` registered with the node's kubelet."""

    cluster: RealCluster
    settings: Settings
    process: AgentProcess
    metrics: str

    def log(self) -> list[dict[str, Any]]:
        """The agent's log lines (JSON) so far."""
        lines = []
        for line in self.process.output().splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue
        return lines

    def checkpointed(self, driver: str) -> set[str]:
        """The claims (uids) the driver's checkpoint holds as prepared or being prepared, read as a new agent would
        read it (from a copy: the running agent keeps writing)."""
        journal = self.settings.state_dir / driver / "checkpoint.journal"
        if not journal.exists():
            return set()
        sim = self.settings.sim_root
        assert sim is not None
        with tempfile.TemporaryDirectory() as scratch:
            copy = Path(scratch) / "checkpoint.journal"
            shutil.copyfile(journal, copy)
            checkpoint = Checkpoint(copy, (sim / "proc/sys/kernel/random/boot_id").read_text().strip())
            checkpoint.load()
            claims = set(checkpoint.claims)
            checkpoint.close()
        return claims

    def histories(self, driver: str) -> dict[str, list[str]]:
        """What the driver's checkpoint recorded of each claim, in order: `started` (a preparation began),
        `completed`, `removed`. A claim prepared once reads `started, completed` however often the kubelet asked;
        one whose preparation a crash cut short reads `started, removed, started, completed` (rolled back at start,
        then prepared again)."""
        return journal_histories(self.settings.state_dir, driver)

    def on_node(self, uid: str, drivers: Sequence[str] = (GPU,)) -> list[str]:
        """What the node holds of claim `uid`: its CDI specs (by file name) and its checkpoint records (by
        driver)."""
        specs = sorted(p.name for p in self.settings.cdi_dir.glob(f"*{uid}*"))
        return [*specs, *(f"checkpoint of {d}" for d in drivers if uid in self.checkpointed(d))]

    def scrape(self) -> str:
        with urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=scaled(5)) as response:
            text: str = response.read().decode()
            return text


@asynccontextmanager
async def agent_on_real_node(cluster: RealCluster, root: Path, profile: str = "dgx-h100", *,
                             backend_config: Mapping[str, Any] | None = None,
                             drivers: Sequence[str] = (GPU,), env: Mapping[str, str] | None = None,
                             **extra: Any) -> AsyncIterator[AgentOnRealNode]:
    """Start the agent on a simulated node under `root` (`profile` with character devices, `extra` settings, `env`
    added to its environment) registered with the node's kubelet; return once the kubelet accepted every driver in
    `drivers` and the agent is ready (its slices published). Stopped at the end."""
    worker = cluster.worker
    assert worker is not None and worker.kubelet is not None, "the cluster's node runs no kubelet"
    await asyncio.to_thread(root.mkdir, parents=True, exist_ok=True)
    # An earlier test's pods were force-deleted after its agent stopped (`RealCluster.release`), so the kubelet never
    # had their claims unprepared and their CDI specs stayed: this agent, its state new, would take them back as
    # claims of its own.
    for stale in worker.cdi_dir.glob("*.json"):
        await asyncio.to_thread(stale.unlink)
    kubeconfig = await cluster.agent_kubeconfig(root / "agent.kubeconfig")
    char_profile = await asyncio.to_thread(with_char_devices, profile, root)
    metrics = f"127.0.0.1:{free_port()}"
    settings = settings_for(root, kubeconfig, str(char_profile), node_name=NODE, metrics_address=metrics,
                            registry_dir=worker.kubelet.registry_dir, plugins_dir=worker.kubelet.plugins_dir,
                            cdi_dir=worker.cdi_dir, cdi_host_root=root / "node", log_level="info", **extra)
    environment = dict(env or {})
    if backend_config:
        environment["DRA_AGENT_BACKEND_CONFIG"] = json.dumps(dict(backend_config))
    process = AgentProcess(settings, environment)
    await process.start()
    assert process.process is not None
    cluster.loopback.watch([process.process.pid])
    agent = AgentOnRealNode(cluster, settings, process, metrics)
    try:
        def registered() -> bool:
            assert process.process is not None and process.process.returncode is None, "the agent exited"
            accepted = {line.get("driver") for line in agent.log()
                        if line.get("event") == "registered with the kubelet"}
            return accepted >= set(drivers)
        await poll(registered, timeout=scaled(60), what=f"the kubelet accepting {', '.join(drivers)}")
        await poll(lambda: agent_ready(metrics), timeout=scaled(60), what="the agent ready (its slices published)")
        yield agent
    except BaseException:
        print(process.output()[-4000:])
        raise
    finally:
        await process.stop()


def node_image(cluster: RealCluster) -> str:
    """The test image (busybox) imported on the node."""
    assert cluster.worker is not None
    return cluster.worker.busybox


def sleeper(cluster: RealCluster, namespace: str, name: str, claims: dict[str, str], *,
            host_network: bool = True) -> dict[str, Any]:
    """A pod that runs until deleted, in the host's network namespace unless `host_network` is False (then in one
    of its own, see cluster/runtime.py). Its deletion is graceful (a second), so the kubelet ends it and lets it
    go: a pod whose grace period is 0 is removed from the API at once, before the kubelet has even stopped it."""
    made = pod(namespace, name, claims=claims, image=node_image(cluster), host_network=host_network,
               command=["sleep", "2147483647"])
    made["spec"]["terminationGracePeriodSeconds"] = 1
    return made


async def running_pod(cluster: RealCluster, namespace: str, name: str, *,
                      timeout: float = scaled(120)) -> dict[str, Any]:
    """The pod once its container runs."""
    def running() -> dict[str, Any] | None:
        found = cluster.kubectl.get("pod", name, "-n", namespace) or {}
        statuses = found.get("status", {}).get("containerStatuses", [])
        return found if statuses and all("running" in s.get("state", {}) for s in statuses) else None
    started: dict[str, Any] = await poll(running, timeout=timeout, what=f"pod {namespace}/{name} running")
    return started


async def reported(cluster: RealCluster, namespace: str, name: str, *, timeout: float = scaled(120)) -> str:
    """The output of a pod made with `reporter`, once it has run its commands (the pod keeps running, and so keeps
    its claims allocated)."""
    def done() -> str | None:
        try:
            log = cluster.kubectl.run("logs", name, "-n", namespace)
        except KubectlError:  # not started yet
            return None
        return log if _DONE in log.splitlines() else None
    log: str = await poll(done, timeout=timeout, what=f"pod {namespace}/{name} reporting")
    return log


def reporter(cluster: RealCluster, namespace: str, name: str, claims: dict[str, str], script: str, *,
             host_network: bool = True) -> dict[str, Any]:
    """A pod with `claims` that runs the shell `script` and then sleeps until deleted (see `reported`)."""
    made = sleeper(cluster, namespace, name, claims, host_network=host_network)
    made["spec"]["containers"][0]["command"] = ["sh", "-c", f"{script}; echo {_DONE}; exec sleep 2147483647"]
    return made


async def finished_pod_log(cluster: RealCluster, namespace: str, name: str, *,
                           timeout: float = scaled(120)) -> tuple[str, str]:
    """Wait until the pod ran to its end; its phase (Succeeded or Failed) and its container's log, as
    `kubectl logs` shows it."""
    def phase() -> str | None:
        pod = cluster.kubectl.get("pod", name, "-n", namespace) or {}
        value = pod.get("status", {}).get("phase")
        return value if value in ("Succeeded", "Failed") else None
    ended: str = await poll(phase, timeout=timeout, what=f"pod {namespace}/{name} run to its end")
    return ended, await cluster.run("logs", name, "-n", namespace)
