"""The priority class of the agent's pods on an API server that limits the critical classes as GKE does: its
ResourceQuota admission plugin configured with `limitedResources`, so that pods of system-node-critical and
system-cluster-critical are admitted only into namespaces holding a quota that covers them. The real Priority and
ResourceQuota admission plugins decide: without deploy/'s quota the DaemonSet controller cannot make the agent's
pod; with it, the pod is made, with the class's priority.

This module starts a control plane of its own (about 10 s): the admission configuration is a flag of the API
server, which the tier's shared one does not have.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.controlplane import ControlPlane
from cluster.kubectl import Kubectl, KubectlError
from cluster.loopback import LoopbackWatch
from cluster.node import register_node
from tests.real_cluster.cluster_env import NODE, poll
from tests.real_cluster.conftest import VERBOSITY, built_binaries
from tests.support.timing import scaled

pytestmark = pytest.mark.xdist_group("real-cluster")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CRITICAL = ["system-node-critical", "system-cluster-critical"]
# The ResourceQuota admission plugin's configuration that limits the critical classes to namespaces with a quota
# for them (Kubernetes' "Limit Priority Class consumption by default"; GKE configures its API servers so).
ADMISSION = {
    "apiVersion": "apiserver.config.k8s.io/v1", "kind": "AdmissionConfiguration",
    "plugins": [{"name": "ResourceQuota", "configuration": {
        "apiVersion": "apiserver.config.k8s.io/v1", "kind": "ResourceQuotaConfiguration",
        "limitedResources": [{"resource": "pods", "matchScopes": [
            {"scopeName": "PriorityClass", "operator": "In", "values": CRITICAL}]}]}}],
}


@pytest.fixture(scope="module")
def limiting_cluster(loopback_watch: LoopbackWatch) -> Iterator[Kubectl]:
    binaries = built_binaries()
    folder = Path(tempfile.mkdtemp(prefix="dra-rq-"))
    config = folder / "admission.yaml"
    config.write_text(yaml.safe_dump(ADMISSION))
    plane = ControlPlane(folder / "plane", binaries, verbosity=int(os.environ.get(VERBOSITY, "1")),
                         apiserver_args=[f"--admission-control-config-file={config}"])
    try:
        plane.start(timeout=scaled(120))
        loopback_watch.watch(plane.pids())
        kubectl = Kubectl(binaries / "kubectl", plane.admin_kubeconfig)
        register_node(kubectl, NODE)
        yield kubectl
    finally:
        plane.stop(keep=True)
        shutil.rmtree(folder, ignore_errors=True)


def base_without_quota(kubectl: Kubectl) -> list[dict[str, Any]]:
    objects = [o for o in yaml.safe_load_all(kubectl.run("kustomize", str(DEPLOY))) if o]
    return [o for o in objects if o["kind"] != "ResourceQuota"]


def agent_pods(kubectl: Kubectl) -> list[dict[str, Any]]:
    found = kubectl.get("pods", "", "-n", "dra-agent", "-l", "app.kubernetes.io/name=dra-agent") or {}
    return list(found.get("items", []))


async def test_the_agents_pod_is_admitted_only_with_the_bases_quota(limiting_cluster: Kubectl) -> None:
    kubectl = limiting_cluster
    await poll(lambda: kubectl.get("serviceaccount", "default", "-n", "default"), timeout=scaled(30),
               what="the default service account")
    # A pod of the class in a namespace without a quota: refused, as everywhere on such a server.
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "critical", "namespace": "default"},
           "spec": {"priorityClassName": "system-node-critical", "containers": [{"name": "c", "image": "x"}]}}
    with pytest.raises(KubectlError, match="insufficient quota to match these scopes"):
        kubectl.create(pod, "--dry-run=server")

    # deploy/ without its quota: the DaemonSet controller's pod for the node is refused, and it says so.
    kubectl.apply(base_without_quota(kubectl))

    def refused() -> str | None:
        events = kubectl.get("events", "", "-n", "dra-agent", "--field-selector", "reason=FailedCreate") or {}
        messages = [e.get("message", "") for e in events.get("items", [])]
        return next((m for m in messages if "insufficient quota to match these scopes" in m), None)

    message = await poll(refused, timeout=scaled(60), what="the DaemonSet's pod refused for want of a quota")
    assert "system-node-critical" in message
    assert agent_pods(kubectl) == []

    # deploy/ as it is: with the quota the controller's next attempt makes the pod.
    kubectl.run("apply", "--server-side", "--field-manager=cluster-tests", "-k", str(DEPLOY))
    (made,) = await poll(lambda: agent_pods(kubectl) or None, timeout=scaled(120),
                         what="the DaemonSet's pod made once the quota is there")
    assert made["spec"]["priorityClassName"] == "system-node-critical"
    assert made["spec"]["priority"] == 2000001000, "the Priority plugin gave it the class's priority"
    quota = await asyncio.to_thread(kubectl.get, "resourcequota", "dra-agent-critical-pods", "-n", "dra-agent")
    await poll(lambda: kubectl.get("resourcequota", "dra-agent-critical-pods", "-n", "dra-agent")["status"]
               .get("used", {}).get("pods") == "1", timeout=scaled(60), what="the quota counting the pod")
    assert quota["spec"]["scopeSelector"]["matchExpressions"][0]["values"] == ["system-node-critical"]
