"""deploy/ as operators apply it, judged by the real API server: every object of the base and of each overlay
accepted (server-side apply; dry-run for the overlays, which need a GPU operator, NFD or Prometheus Operator), the
DeviceClasses' CEL compiled and the admission policy type-checked by the server, the example claims accepted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.kubectl import KubectlError
from tests.real_cluster.cluster_env import RealCluster, every_reconfiguration_allowed, poll
from tests.support.timing import scaled

pytestmark = pytest.mark.xdist_group("real-cluster")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir() if (p / "kustomization.yaml").exists())
EXAMPLES = sorted((DEPLOY / "examples").glob("*.yaml"))

# The Prometheus Operator's ServiceMonitor, reduced to what lets the server store one: the metrics overlay needs
# the kind to exist, as it does in a cluster running the operator.
SERVICE_MONITOR_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
             "names": {"plural": "servicemonitors", "singular": "servicemonitor", "kind": "ServiceMonitor"},
             "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                 "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]},
}


def rendered(cluster: RealCluster, path: Path) -> list[dict[str, Any]]:
    return [o for o in yaml.safe_load_all(cluster.kubectl.run("kustomize", str(path))) if o]


def test_every_object_of_the_base_is_stored(real_cluster: RealCluster) -> None:
    for obj in rendered(real_cluster, DEPLOY / "base"):
        namespace = obj["metadata"].get("namespace")
        kind = obj["kind"].lower() + ("." + obj["apiVersion"].split("/")[0] if "/" in obj["apiVersion"] else "")
        found = real_cluster.kubectl.get(kind, obj["metadata"]["name"], *(["-n", namespace] if namespace else []))
        assert found is not None, f"{obj['kind']} {obj['metadata']['name']} is not stored"
    # Applied again, nothing changes and nothing conflicts.
    out = real_cluster.kubectl.run("apply", "--server-side", "-k", str(DEPLOY))
    assert "serverside-applied" in out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_is_accepted(real_cluster: RealCluster, overlay: str) -> None:
    if overlay == "metrics":
        real_cluster.kubectl.apply(SERVICE_MONITOR_CRD)
        poll_established(real_cluster, SERVICE_MONITOR_CRD["metadata"]["name"])
    folder = DEPLOY / "overlays" / overlay
    out = real_cluster.kubectl.run("apply", "--server-side", "--dry-run=server", "-k", str(folder))
    objects = rendered(real_cluster, folder)
    assert out.count("serverside-applied") == len(objects), out


def poll_established(cluster: RealCluster, name: str) -> None:
    cluster.kubectl.run("wait", "--for=condition=Established", f"crd/{name}", f"--timeout={scaled(30):.0f}s")


@pytest.fixture(scope="module")
def examples_allowed(real_cluster: RealCluster) -> Iterator[None]:
    """The reconfigurations examples ask for (time slicing) allowed in their namespace, as their comments say an
    operator must."""
    with every_reconfiguration_allowed(real_cluster.kubectl):
        yield


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_is_accepted(real_cluster: RealCluster, examples_allowed: None, example: Path) -> None:
    out = real_cluster.kubectl.run("apply", "--server-side", "--dry-run=server", "-n", "default", "-f", str(example))
    assert "serverside-applied" in out


def test_the_server_compiles_the_classes_cel(real_cluster: RealCluster) -> None:
    """The classes were accepted by a server that refuses CEL it cannot compile."""
    broken = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "broken.example.com"},
              "spec": {"selectors": [{"cel": {"expression": 'device.attributes["gpu.nvidia.com"].type == '}}]}}
    with pytest.raises(KubectlError, match=r"compilation failed|Syntax error"):
        real_cluster.kubectl.create(broken, "--dry-run=server")
    classes = json.loads(real_cluster.kubectl.run("get", "deviceclasses", "-o", "json"))["items"]
    assert {c["metadata"]["name"] for c in classes} >= {"gpu.nvidia.com", "mig.nvidia.com", "tpu.google.com",
                                                        "vf.sriov.dra-agent.io", "rdma-vf.sriov.dra-agent.io"}


async def test_the_admission_policy_type_checks(real_cluster: RealCluster) -> None:
    """The server type-checks a policy's expressions against the ResourceClaim schema after storing it and
    writes what it found into the policy's status: no warning for ours."""
    def checked() -> dict[str, Any] | None:
        policy = real_cluster.kubectl.get("validatingadmissionpolicy", "dra-agent-opaque-parameters")
        status = (policy or {}).get("status", {})
        return status if status.get("observedGeneration") == policy["metadata"]["generation"] else None
    status = await poll(checked, timeout=scaled(60), what="the admission policy type-checked")
    assert status.get("typeChecking", {}).get("expressionWarnings") in (None, [])
    binding = real_cluster.kubectl.get("validatingadmissionpolicybinding", "dra-agent-opaque-parameters")
    assert binding["spec"]["validationActions"] == ["Deny"]
