"""The admission policy that admits reconfigurations only in the namespaces its ConfigMap lists, judged by the real
API server with the ConfigMap deploy/ applies as its parameter: a VfioConfig claim refused in a namespace not listed
and stored in one listed, each chosen case given the verdict and the message the project's own CEL evaluation
gives, every claim refused while the ConfigMap is gone. And the settings file the DaemonSet's pod mounts is a
ConfigMap the server holds."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agent.admission.policy import builtin_drivers
from agent.admission.reconfigurations import PARAMS_NAME, PARAMS_NAMESPACE, POLICY_NAME, reconfiguration_objects
from cluster.kubectl import KubectlError
from tests.real_cluster.cluster_env import RealCluster, poll
from tests.support.admission_cases import RECONFIGURATION_CASES, VFIO, claim
from tests.support.admission_cel import evaluate
from tests.support.timing import scaled

pytestmark = pytest.mark.xdist_group("real-cluster")

POLICY, _ = reconfiguration_objects(builtin_drivers())
GPU = "gpu.nvidia.com"


def config_map(data: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": PARAMS_NAME, "namespace": PARAMS_NAMESPACE,
                         "labels": {"app.kubernetes.io/name": "dra-agent"}},
            **({"data": data} if data else {})}


@pytest.fixture
def allow(real_cluster: RealCluster) -> Iterator[Callable[[dict[str, str]], None]]:
    """Replace the ConfigMap's data; the base's empty data again at the end."""
    def replace(data: dict[str, str]) -> None:
        real_cluster.kubectl.run("replace", "-f", "-", input=json.dumps(config_map(data)))

    yield replace
    replace({})


def verdict(cluster: RealCluster, obj: dict[str, Any], *, dry_run: bool = True) -> str | None:
    """The server's refusal (what follows "denied request: "), None when it admits the object."""
    try:
        cluster.kubectl.run("create", *(["--dry-run=server"] if dry_run else []), "-f", "-", input=json.dumps(obj))
    except KubectlError as e:
        assert "denied request: " in e.stderr, e.stderr
        return e.stderr.split("denied request: ", 1)[1].strip()
    return None


async def settled(cluster: RealCluster, obj: dict[str, Any], expected: str | None, what: str) -> str | None:
    """The server's verdict once it is `expected`: the policy reads its parameter from a cache that follows the
    ConfigMap within moments. A verdict that stays otherwise fails, showing the last one."""
    last: list[str | None] = []

    def agrees() -> bool:
        last[:] = [verdict(cluster, obj)]
        return last[0] == expected

    try:
        await poll(agrees, timeout=scaled(30), what=what)
    except AssertionError as e:
        raise AssertionError(f"{e}; the server said {last[0]!r}, expected {expected!r}") from None
    return last[0]


async def test_passthrough_only_in_the_namespaces_the_config_map_lists(
        real_cluster: RealCluster, allow: Callable[[dict[str, str]], None]) -> None:
    vms, other = await real_cluster.namespace("vms"), await real_cluster.namespace("team")
    refused = verdict(real_cluster, claim(GPU, VFIO, namespace=vms), dry_run=False)
    assert refused == (f"opaque parameters VfioConfig: asks for VfioConfig (binds the device's whole IOMMU group to "
                       f"vfio-pci for the claim), which is not allowed in namespace {vms}: the ConfigMap "
                       "dra-agent/dra-agent-reconfigurations lists under VfioConfig the namespaces allowed it")
    allow({"VfioConfig": f"{vms}, kubevirt"})
    await settled(real_cluster, claim(GPU, VFIO, namespace=vms), None, f"passthrough admitted in {vms}")
    assert verdict(real_cluster, claim(GPU, VFIO, namespace=vms), dry_run=False) is None
    assert real_cluster.kubectl.get("resourceclaim", "c", "-n", vms) is not None, "stored"
    assert verdict(real_cluster, claim(GPU, VFIO, template=True, namespace=vms), dry_run=False) is None
    assert verdict(real_cluster, claim(GPU, VFIO, namespace=other)) is not None, "still refused elsewhere"


@pytest.mark.parametrize(("driver", "params", "data", "name"), RECONFIGURATION_CASES)
async def test_the_server_gives_the_verdict_of_the_cel_evaluation(
        real_cluster: RealCluster, allow: Callable[[dict[str, str]], None], driver: str, params: Any,
        data: dict[str, str], name: str | None) -> None:
    namespace = await real_cluster.namespace("vms")
    # The cases list namespace "vms": here it is this test's own.
    data = {key: value.replace("vms", namespace) for key, value in data.items()}
    allow(data)
    obj = claim(driver, params, namespace=namespace)
    messages = evaluate(POLICY, obj, config_map(data)).messages
    assert (messages != []) == (name is not None)
    said = await settled(real_cluster, obj, messages[0] if messages else None, f"the verdict on {params}")
    if name is not None:
        assert said is not None and f" asks for {name} (" in said


async def test_without_the_config_map_every_claim_is_refused(real_cluster: RealCluster) -> None:
    namespace = await real_cluster.namespace("plain")
    bare = claim(GPU, {"apiVersion": "dra-agent.io/v1alpha1", "kind": "GpuConfig"}, namespace=namespace)
    assert verdict(real_cluster, bare) is None
    stored = real_cluster.kubectl.get("configmap", PARAMS_NAME, "-n", PARAMS_NAMESPACE)
    real_cluster.kubectl.run("delete", "configmap", PARAMS_NAME, "-n", PARAMS_NAMESPACE)
    try:
        def refused() -> str | None:
            try:
                real_cluster.kubectl.run("create", "--dry-run=server", "-f", "-", input=json.dumps(bare))
            except KubectlError as e:
                return e.stderr
            return None
        error = await poll(refused, timeout=scaled(30), what="a claim refused without the ConfigMap")
        assert POLICY_NAME in error and "no params found" in error, error
    finally:
        real_cluster.kubectl.run("create", "-f", "-", input=json.dumps(config_map(stored.get("data") or {})))
    await settled(real_cluster, bare, None, "claims admitted again with the ConfigMap back")


async def test_the_server_type_checks_the_policy(real_cluster: RealCluster) -> None:
    def checked() -> dict[str, Any] | None:
        policy = real_cluster.kubectl.get("validatingadmissionpolicy", POLICY_NAME)
        status = (policy or {}).get("status", {})
        return status if status.get("observedGeneration") == policy["metadata"]["generation"] else None
    status = await poll(checked, timeout=scaled(60), what="the reconfiguration policy type-checked")
    assert status.get("typeChecking", {}).get("expressionWarnings") in (None, [])


async def test_the_agents_pod_mounts_the_settings_file_the_server_holds(real_cluster: RealCluster) -> None:
    pod = await real_cluster.agent_pod()
    (container,) = pod["spec"]["containers"]
    assert "--config=/etc/dra-agent/config.yaml" in container["args"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/etc/dra-agent"]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    name = volume["configMap"]["name"]
    assert name.startswith("dra-agent-config-"), "the name kustomize gave it, after its content"
    stored = real_cluster.kubectl.get("configmap", name, "-n", pod["metadata"]["namespace"])
    assert stored is not None and "config.yaml" in stored["data"]
