"""The real-cluster tier's world: the control plane from cluster/, the agent on the simulated node as operators run
it, and the kubelet's part played by the kubelet simulator for the pods the real scheduler binds to the node.

The agent runs as a `dra-agent run` host process with the arguments of the DaemonSet in deploy/ and the identity of
its pod: deploy/ is applied to the real API server, the DaemonSet controller makes the agent's pod for the node,
the real scheduler binds it there, and the agent authenticates with a token bound to that pod, as the kubelet
projects it into the pod. So deploy/'s RBAC and the server's authorizers decide every request the agent makes,
including the per-node check of `status.devices` writes, which needs the node name such a token carries.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from agent.admission.policy import builtin_drivers
from agent.admission.reconfigurations import PARAMS_NAME, PARAMS_NAMESPACE, reconfigurations
from agent.kube.client import KubeClient
from agent.settings import Settings
from backends.contract import ClaimRef
from cluster.controlplane import ControlPlane
from cluster.kubectl import Kubectl, KubectlError
from cluster.loopback import LoopbackWatch
from cluster.pki import write_kubeconfig
from cluster.worker import WorkerNode
from simulator.kubelet import KubeletSimulator
from simulator.kubelet_connection import Plugin
from tests.support.agent_env import AgentProcess, free_port, settings_for
from tests.support.timing import scaled

__all__ = ["NODE", "AgentOnNode", "RealCluster", "agent_on_node", "agent_ready", "every_reconfiguration_allowed",
           "reconfiguration_namespaces"]

# The node's name, as upstream's local-up-cluster names its node: it resolves to loopback everywhere.
NODE = "127.0.0.1"
AGENT_NAMESPACE = "dra-agent"
GPU, SRIOV = "gpu.nvidia.com", "sriov.dra-agent.io"
T = TypeVar("T")


async def poll(probe: Callable[[], T | None], *, timeout: float, what: str, interval: float = 0.2) -> T:
    """Call a blocking `probe` (kubectl, a file) in a thread until it returns something other than None or False;
    AssertionError naming `what` when `timeout` seconds pass first."""
    try:
        async with asyncio.timeout(timeout):
            while True:
                value = await asyncio.to_thread(probe)
                if value is not None and value is not False:
                    return value
                await asyncio.sleep(interval)
    except TimeoutError:
        raise AssertionError(f"{what}: not within {timeout:.0f} s") from None


def reconfiguration_namespaces(kubectl: Kubectl, data: Mapping[str, str]) -> None:
    """Replace deploy/'s ConfigMap of the namespaces allowed each reconfiguration (the admission policy's parameter)
    with `data`."""
    config_map = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"name": PARAMS_NAME, "namespace": PARAMS_NAMESPACE,
                               "labels": {"app.kubernetes.io/name": "dra-agent"}},
                  **({"data": dict(data)} if data else {})}
    kubectl.run("replace", "-f", "-", input=json.dumps(config_map))


@contextmanager
def every_reconfiguration_allowed(kubectl: Kubectl) -> Iterator[None]:
    """Every reconfiguration allowed in every namespace by the admission policy, for tests of something else; the
    base's empty ConfigMap again at the end. Returns once the policy has taken it: it reads its parameter from a
    cache that follows the ConfigMap within moments."""
    reconfiguration_namespaces(kubectl, {r.name: "*" for r, _, _ in reconfigurations(builtin_drivers())})
    passthrough = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                   "metadata": {"name": "passthrough", "namespace": "default"},
                   "spec": {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": "c"}}],
                                        "config": [{"opaque": {"driver": GPU, "parameters": {
                                            "apiVersion": "dra-agent.io/v1alpha1", "kind": "VfioConfig"}}}]}}}
    deadline = time.monotonic() + scaled(30)
    while True:
        try:
            kubectl.run("create", "--dry-run=server", "-f", "-", input=json.dumps(passthrough))
            break
        except KubectlError:
            assert time.monotonic() < deadline, "the admission policy never took the ConfigMap allowing everything"
            time.sleep(scaled(0.2))
    try:
        yield
    finally:
        reconfiguration_namespaces(kubectl, {})


@dataclass
class RealCluster:
    """A started control plane with the simulated node registered and deploy/ applied."""

    plane: ControlPlane
    kubectl: Kubectl
    node_uid: str
    loopback: LoopbackWatch = field(default_factory=LoopbackWatch)
    """Watches the sockets of the components and of every agent started on the node."""
    namespaces: list[str] = field(default_factory=list)
    """The namespaces made since the last `release`."""
    worker: WorkerNode | None = None
    """The node's containerd and kubelet, on the cluster whose node runs pods (None: the node is only registered)."""

    async def run(self, *argv: str, input: str | None = None) -> str:
        return await asyncio.to_thread(self.kubectl.run, *argv, input=input)

    async def get(self, kind: str, name: str = "", *argv: str) -> Any:
        return await asyncio.to_thread(self.kubectl.get, kind, name, *argv)

    async def create(self, obj: dict[str, Any]) -> Any:
        return await asyncio.to_thread(self.kubectl.create, obj)

    async def apply(self, objects: Sequence[dict[str, Any]] | dict[str, Any]) -> str:
        return await asyncio.to_thread(self.kubectl.apply, objects)

    async def namespace(self, prefix: str, labels: Mapping[str, str] | None = None) -> str:
        """A new namespace (its default service account made, so pods can be created in it)."""
        name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        await self.create({"apiVersion": "v1", "kind": "Namespace",
                           "metadata": {"name": name, "labels": dict(labels or {})}})
        self.namespaces.append(name)
        await poll(lambda: self.kubectl.get("serviceaccount", "default", "-n", name), timeout=scaled(30),
                   what=f"the default service account of {name}")
        return name

    def release(self) -> None:
        """Delete the namespaces made since the last release and wait until they are gone, so their claims no
        longer hold devices. Their pods are deleted at once: without a kubelet none would confirm a graceful end
        and the namespace would never go; with one, the agent that would unprepare their claims may be gone, and
        the kubelet keeps a pod until its claims are unprepared."""
        for name in self.namespaces:
            self.kubectl.run("delete", "pods", "--all", "-n", name, "--grace-period=0", "--force", "--wait=false")
            self.kubectl.run("delete", "namespace", name, "--wait=false")
        for name in self.namespaces:
            self.kubectl.run("wait", "--for=delete", f"namespace/{name}", f"--timeout={scaled(120):.0f}s")
        self.namespaces.clear()

    async def agent_pod(self) -> dict[str, Any]:
        """The DaemonSet's pod on the node, once the scheduler bound it there."""
        def bound() -> dict[str, Any] | None:
            pods = self.kubectl.get("pods", "", "-n", AGENT_NAMESPACE, "-l", "app.kubernetes.io/name=dra-agent")
            for pod in (pods or {}).get("items", []):
                if pod["spec"].get("nodeName") == NODE and not pod["metadata"].get("deletionTimestamp"):
                    return dict(pod)
            return None
        pod: dict[str, Any] = await poll(bound, timeout=scaled(60), what="the agent's pod bound to the node")
        return pod

    async def agent_kubeconfig(self, path: Path) -> Path:
        """A kubeconfig with a token of the agent's service account bound to its pod, as the kubelet projects it
        (the token carries the pod's node, which the per-node authorization of claim status writes reads)."""
        pod = await self.agent_pod()
        token = (await self.run(
            "create", "token", "dra-agent", "-n", AGENT_NAMESPACE, "--duration=2h",
            "--bound-object-kind=Pod", f"--bound-object-name={pod['metadata']['name']}",
            f"--bound-object-uid={pod['metadata']['uid']}")).strip()
        return write_kubeconfig(path, self.plane.server, self.plane.ca, token=token, user="dra-agent")

    async def claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        found: dict[str, Any] | None = await self.get("resourceclaim", name, "-n", namespace)
        return found

    async def allocated(self, namespace: str, name: str, *, timeout: float = scaled(60)) -> dict[str, Any]:
        """The claim once the scheduler allocated it."""
        def done() -> dict[str, Any] | None:
            claim = self.kubectl.get("resourceclaim", name, "-n", namespace)
            return claim if claim and claim.get("status", {}).get("allocation") else None
        claim: dict[str, Any] = await poll(done, timeout=timeout, what=f"claim {namespace}/{name} allocated")
        return claim

    async def bound_pod(self, namespace: str, name: str, *, timeout: float = scaled(60)) -> dict[str, Any]:
        """The pod once the scheduler bound it to the node."""
        def done() -> dict[str, Any] | None:
            pod = self.kubectl.get("pod", name, "-n", namespace)
            return pod if pod and pod["spec"].get("nodeName") == NODE else None
        pod: dict[str, Any] = await poll(done, timeout=timeout, what=f"pod {namespace}/{name} bound to {NODE}")
        return pod

    async def unschedulable(self, namespace: str, name: str, *, timeout: float = scaled(60)) -> str:
        """The scheduler's message for a pod it could not place (its PodScheduled=False condition)."""
        def reason() -> str | None:
            pod = self.kubectl.get("pod", name, "-n", namespace) or {}
            for condition in pod.get("status", {}).get("conditions", []):
                if condition["type"] == "PodScheduled" and condition["status"] == "False":
                    return str(condition.get("message", ""))
            return None
        message: str = await poll(reason, timeout=timeout, what=f"pod {namespace}/{name} found unschedulable")
        return message

    async def pod_claims(self, pod: Mapping[str, Any]) -> list[ClaimRef]:
        """The claims the kubelet would prepare for a bound pod: those its status names (made from templates or
        by the scheduler for extended resources) and those its spec names directly."""
        namespace = pod["metadata"]["namespace"]
        status = pod.get("status", {})
        names = [s["resourceClaimName"] for s in status.get("resourceClaimStatuses", []) if s.get("resourceClaimName")]
        names += [c["resourceClaimName"] for c in pod["spec"].get("resourceClaims", []) if c.get("resourceClaimName")]
        extended = status.get("extendedResourceClaimStatus")
        if extended:
            names.append(extended["resourceClaimName"])
        refs = []
        for name in dict.fromkeys(names):
            claim = await self.allocated(namespace, name)
            refs.append(ClaimRef(claim["metadata"]["uid"], namespace, name))
        return refs


@dataclass
class AgentOnNode:
    """`dra-agent run` on the simulated node against the real API server, and the kubelet simulator it registered
    with."""

    cluster: RealCluster
    settings: Settings
    process: AgentProcess
    kubelet: KubeletSimulator
    metrics: str

    def plugin(self, driver: str) -> Plugin:
        return self.kubelet.plugin(driver)

    async def prepare_pod(self, namespace: str, name: str) -> dict[str, dict[str, Any]]:
        """What the kubelet does when a pod is bound to its node: NodePrepareResources for the pod's claims, per
        driver of their allocation; each claim's answer by claim name (errors raise)."""
        pod = await self.cluster.bound_pod(namespace, name)
        answers: dict[str, dict[str, Any]] = {}
        for ref in await self.cluster.pod_claims(pod):
            claim = await self.cluster.allocated(namespace, ref.name)
            drivers = {r["driver"] for r in claim["status"]["allocation"]["devices"]["results"]}
            for driver in sorted(drivers):
                result = await self.plugin(driver).prepare_or_raise([ref])
                answers.setdefault(ref.name, {})[driver] = result[ref.uid]
        return answers

    async def unprepare(self, claims: Sequence[ClaimRef], driver: str) -> None:
        await self.plugin(driver).unprepare_or_raise(claims)

    def log(self) -> str:
        return self.process.output()


@asynccontextmanager
async def agent_on_node(cluster: RealCluster, root: Path, profile: str = "dgx-h100", *,
                        backend_config: Mapping[str, Any] | None = None, drivers: Sequence[str] = (GPU, SRIOV),
                        **extra: Any) -> AsyncIterator[AgentOnNode]:
    """Start the agent on a simulated node under `root` with the DaemonSet's identity, wait until every driver in
    `drivers` registered with the kubelet simulator and the agent is ready (its slices published), and stop it at
    the end."""
    await asyncio.to_thread(root.mkdir, parents=True, exist_ok=True)
    kubeconfig = await cluster.agent_kubeconfig(root / "agent.kubeconfig")
    metrics = f"127.0.0.1:{free_port()}"
    settings = settings_for(root, kubeconfig, profile, node_name=NODE, metrics_address=metrics, **extra)
    env = {"DRA_AGENT_BACKEND_CONFIG": json.dumps(dict(backend_config))} if backend_config else None
    process = AgentProcess(settings, env)
    await process.start()
    assert process.process is not None
    cluster.loopback.watch([process.process.pid])
    try:
        async with KubeletSimulator(settings.registry_dir) as kubelet:
            for driver in drivers:
                await kubelet.wait_for_plugin(driver, timeout=scaled(30))
            await poll(lambda: agent_ready(metrics), timeout=scaled(60), what="the agent ready (its slices published)")
            yield AgentOnNode(cluster, settings, process, kubelet, metrics)
    except BaseException:
        print(process.output()[-4000:])
        raise
    finally:
        await process.stop()


def agent_ready(metrics: str) -> bool:
    """The agent's /readyz answers 200: every driver's sockets are served and its slices are published."""
    try:
        with urllib.request.urlopen(f"http://{metrics}/readyz", timeout=scaled(2)) as response:
            return bool(response.status == 200)
    except OSError:
        return False


async def kube_client(cluster: RealCluster) -> KubeClient:
    """The agent's own API client with the admin's credentials, for reading objects as they are stored."""
    return await KubeClient.connect(cluster.plane.admin_kubeconfig)


__all__ += ["GPU", "SRIOV", "KubectlError", "kube_client", "poll"]
