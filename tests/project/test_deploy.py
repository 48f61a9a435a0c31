"""The manifests under deploy/: valid for a 1.37 API server, and consistent with the agent they deploy.

The DaemonSet's arguments go through the agent's own parser and settings; the DeviceClasses and the example
claims are checked against the drivers the agent's backends declare and against what the agent publishes on
the built-in simulated nodes, with their CEL selectors evaluated by a small evaluator for the subset of CEL they
use.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path, PurePosixPath
from typing import Any

import aiohttp
import kubernetes_validate
import pytest
import yaml

from agent.claims.records import ClaimRecord, DeviceRecord
from agent.claims.status_writer import ClaimStatusWriter
from agent.commands.cli import build_parser, main
from agent.events.recorder import EventRecorder, Pacing
from agent.kube.client import KubeClient
from agent.kube.paths import DEVICE_CLASSES, api_path
from agent.kube.quantity import parse_quantity
from agent.metrics import Metrics, MetricsServer
from agent.node.plugins import find_plugins, load_plugins
from agent.node.udev import DEFAULT_SOURCE
from agent.settings import Settings, SettingsError, load_settings
from backends.contract import ClaimRef
from simulator.apiserver.deviceclasses import is_extended_resource_name
from simulator.apiserver.server import TestApiServer
from simulator.node.profile import builtin_profiles
from tests.support.agent_env import wait_until
from tests.support.repository import ROOT

DEPLOY = ROOT / "deploy"
BASE = DEPLOY / "base"
KUBERNETES_VERSION = "1.37"
NAMESPACE = "dra-agent"
# Attribute domains every PCI device carries besides its driver's: the upstream standard one and the agent's own.
STANDARD_DOMAIN = "resource.kubernetes.io"
AGENT_DOMAIN = "dra-agent.io"

# What the downward API would give the agent's pod, by field path.
SAMPLE_FIELDS = {
    "spec.nodeName": "gpu-node-17",
    "metadata.uid": "3f8e4c1a-5b2d-4e6f-8a9b-0c1d2e3f4a5b",
    "metadata.name": "dra-agent-x7k2p",
    "metadata.namespace": NAMESPACE,
}

Doc = dict[str, Any]


# ---------------------------------------------------------------------------------------------------------------
# Loading


def _base_files() -> list[Path]:
    """The manifests the base kustomization lists, in its order."""
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    return [BASE / name for name in kustomization["resources"]]


def _load_documents() -> list[tuple[str, Doc]]:
    """Every object of the base and of the example claims, named by file and position."""
    found = []
    for path in [*_base_files(), *sorted((DEPLOY / "examples").glob("*.yaml"))]:
        with path.open() as f:
            for index, doc in enumerate(yaml.safe_load_all(f)):
                if doc is not None:
                    found.append((f"{path.relative_to(DEPLOY)}#{index}", doc))
    return found


DOCUMENTS = _load_documents()


def _of_kind(kind: str, under: str | None = None) -> list[Doc]:
    return [doc for where, doc in DOCUMENTS
            if doc.get("kind") == kind and (under is None or where.startswith(under + "/"))]


def _one(kind: str) -> Doc:
    docs = _of_kind(kind)
    assert len(docs) == 1, f"expected exactly one {kind} under deploy/, found {len(docs)}"
    return docs[0]


@pytest.fixture(scope="module")
def agent_drivers() -> set[str]:
    """The DRA driver names of the agent's installed backends."""
    found, failures = find_plugins()
    loaded, more = load_plugins(found)
    assert not failures and not more, [str(f) for f in failures + more]
    drivers = {plugin.backend.driver for plugin in loaded}
    assert drivers, "no backend loaded"
    return drivers


# ---------------------------------------------------------------------------------------------------------------
# Every document


def test_the_base_lists_every_manifest() -> None:
    listed = [path.name for path in _base_files()]
    assert {"00-namespace.yaml", "05-critical-pods-quota.yaml", "10-rbac.yaml", "20-daemonset.yaml",
            "25-metrics-service.yaml", "30-deviceclasses.yaml", "40-admission-policy.yaml",
            "45-reconfiguration-namespaces.yaml"} <= set(listed)
    # A manifest left out of the kustomization would never be applied (the settings file is a ConfigMap's data).
    generated = {name for generator in yaml.safe_load((BASE / "kustomization.yaml").read_text())["configMapGenerator"]
                 for name in generator["files"]}
    assert generated == {"config.yaml"}
    on_disk = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"} - generated
    assert on_disk == set(listed), f"not listed in deploy/base/kustomization.yaml: {on_disk - set(listed)}"
    # kubectl apply -k deploy/ applies the base only: a manifest beside it would be left out.
    beside = {p.name for p in DEPLOY.glob("*.y*ml")} - {"kustomization.yaml"}
    assert not beside, f"move {beside} to deploy/base/ and list it in deploy/base/kustomization.yaml"
    assert len(list((DEPLOY / "examples").glob("*.yaml"))) >= 5


@pytest.mark.parametrize(("where", "doc"), DOCUMENTS, ids=[where for where, _ in DOCUMENTS])
def test_document_validates(where: str, doc: Doc) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_namespaced_objects_are_in_the_agents_namespace() -> None:
    (namespace,) = _of_kind("Namespace")
    assert namespace["metadata"]["name"] == NAMESPACE
    for kind in ("ServiceAccount", "DaemonSet", "Service"):
        for doc in _of_kind(kind):
            assert doc["metadata"].get("namespace") == NAMESPACE, f"{kind} {doc['metadata']['name']}"
    # Privileged pods are refused by Pod Security admission at any level but privileged.
    labels = namespace["metadata"].get("labels", {})
    assert labels.get("pod-security.kubernetes.io/enforce") == "privileged"


# ---------------------------------------------------------------------------------------------------------------
# RBAC

EXPECTED_GRANTS = {
    ("resource.k8s.io", "resourceslices"): {"create", "get", "list", "watch", "update", "patch", "delete",
                                            "deletecollection"},
    ("resource.k8s.io", "resourceclaims"): {"get", "list", "watch"},
    ("resource.k8s.io", "resourceclaims/status"): {"get", "patch", "update"},
    ("resource.k8s.io", "resourceclaims/driver"): {"associated-node:patch", "associated-node:update"},
    ("", "nodes"): {"get"},
    ("events.k8s.io", "events"): {"create", "patch"},
}


def _grants() -> dict[tuple[str, str], set[str]]:
    grants: dict[tuple[str, str], set[str]] = {}
    for rule in _one("ClusterRole")["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                grants.setdefault((group, resource), set()).update(rule["verbs"])
    return grants


_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}


def _verb(method: str, path: str) -> tuple[str, str, str]:
    """(API group, resource or resource/subresource, RBAC verb) of a request the test API server logged."""
    parts = path.strip("/").split("/")
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    if rest[0] == "namespaces" and len(rest) > 2:
        rest = rest[2:]
    verb = _VERBS.get(method) or ("get" if len(rest) > 1 else "list")
    return group, "/".join(rest[0:1] + rest[2:3]), verb


async def test_the_role_allows_every_request_of_the_event_recorder(scratch: Path) -> None:
    """The recorder's whole repertoire against the test API server (create, the series' patch, a create again
    when its Event is gone): every request it makes is one the ClusterRole grants."""
    async with TestApiServer() as server:
        kube = await KubeClient.connect(server.write_kubeconfig(scratch / "kubeconfig"))
        recorder = EventRecorder(kube, "node-a", pacing=Pacing(heartbeat=0.0))
        recorder.start()
        claim = ClaimRef("0b6f0c52-9d6f-4d4e-9c1e-2a1f0d1f7e11", "team-a", "my-claim")
        try:
            recorder.prepare_failed("gpu.nvidia.com", claim, "no such device")
            recorder.node_event("Warning", "CheckpointRefused", "ReadCheckpoint", "bad file")
            await wait_until(lambda: len(server.events()) == 2)
            recorder.prepare_failed("gpu.nvidia.com", claim, "no such device")
            await wait_until(lambda: server.count_requests("PATCH") == 1)
            for event in server.events():
                server.delete_object("events.events.k8s.io", event["metadata"]["name"],
                                     event["metadata"]["namespace"])
            recorder.prepare_failed("gpu.nvidia.com", claim, "no such device")
        finally:
            await recorder.stop()
            await kube.close()
        made = {_verb(r.method, r.path) for r in server.find_requests()}
    assert made == {("events.k8s.io", "events", "create"), ("events.k8s.io", "events", "patch")}
    grants = _grants()
    assert all(verb in grants.get((group, resource), set()) for group, resource, verb in made), made


async def test_the_role_allows_every_request_of_the_claim_status_writer(scratch: Path,
                                                                       agent_drivers: set[str]) -> None:
    """A driver's status writes (apply, removal, the re-apply after a restart with its read of the claim) are
    granted, and so is the per-driver check the API server makes since 1.36 for each driver whose entries change:
    `resourceclaims/driver` named after the driver, verb `associated-node:<verb>`."""
    async with TestApiServer() as server:
        kube = await KubeClient.connect(server.write_kubeconfig(scratch / "kubeconfig"))
        claim = ClaimRef("0b6f0c52-9d6f-4d4e-9c1e-2a1f0d1f7e11", "team-a", "my-claim")
        server.put_claim({"metadata": {"name": claim.name, "namespace": claim.namespace, "uid": claim.uid},
                          "spec": {}, "status": {"allocation": {"devices": {"results": [
                              {"request": "r", "driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-0"}]}}}})
        record = ClaimRecord(claim.uid, claim.namespace, claim.name, "completed", "boot",
                             (DeviceRecord("gpu-0", "nvidia-gpu"),))
        writer = ClaimStatusWriter(kube, "gpu.nvidia.com", "node-a")
        try:
            writer.resume(claim, record)
            await wait_until(lambda: server.count_requests("PATCH", status=200) == 1)
            writer.released(claim, record)
            await wait_until(lambda: server.count_requests("PATCH", status=200) == 2)
        finally:
            await writer.close()
            await kube.close()
        made = {_verb(r.method, r.path) for r in server.find_requests()}
    assert made == {("resource.k8s.io", "resourceclaims", "get"), ("resource.k8s.io", "resourceclaims/status", "patch")}
    grants = _grants()
    assert all(verb in grants.get((group, resource), set()) for group, resource, verb in made), made
    (driver_rule,) = [r for r in _one("ClusterRole")["rules"] if r["resources"] == ["resourceclaims/driver"]]
    assert set(driver_rule["resourceNames"]) == agent_drivers
    assert "associated-node:patch" in driver_rule["verbs"]


def test_cluster_role_grants_exactly_what_the_agent_needs() -> None:
    role = _one("ClusterRole")
    assert not role.get("aggregationRule"), "an aggregated role gets its rules from elsewhere"
    for rule in role["rules"]:
        # Only the per-driver status check names objects: the driver names.
        allowed = {"apiGroups", "resources", "verbs"} | (
            {"resourceNames"} if rule["resources"] == ["resourceclaims/driver"] else set())
        assert set(rule) <= allowed, f"unexpected fields (resourceNames, URLs): {rule}"
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], f"wildcard in {field}: {rule}"
    assert _grants() == EXPECTED_GRANTS
    assert not _of_kind("Role") and not _of_kind("RoleBinding"), "the agent needs no namespaced role"


def test_binding_gives_the_role_to_the_daemonsets_service_account() -> None:
    role, binding, account = _one("ClusterRole"), _one("ClusterRoleBinding"), _one("ServiceAccount")
    daemonset = _one("DaemonSet")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": account["metadata"]["namespace"]}]
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert daemonset["metadata"]["namespace"] == account["metadata"]["namespace"]
    assert pod.get("automountServiceAccountToken", True), "the agent talks to the API server with this token"


# ---------------------------------------------------------------------------------------------------------------
# The DaemonSet and the agent's own flags


def _pod_spec() -> Doc:
    spec: Doc = _one("DaemonSet")["spec"]["template"]["spec"]
    return spec


def _container() -> Doc:
    (container,) = _pod_spec()["containers"]
    return dict(container)


def _container_env(container: Mapping[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet would set it, downward API fields filled with samples."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _expand(var["value"], env)
        else:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in SAMPLE_FIELDS, f"env {var['name']}: no sample for field {path}"
            env[var["name"]] = SAMPLE_FIELDS[path]
    return env


def _expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion; a reference to an undefined variable would be left as is: an error here."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        assert name in env, f"$({name}) in {text!r} refers to no environment variable of the container"
        return env[name]

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, text)


def _agent_settings(container: Mapping[str, Any]) -> Settings:
    """The settings the agent resolves from the container's arguments and environment, as `main` does."""
    assert container.get("command") in (None, ["dra-agent"]), "the image's entrypoint is dra-agent"
    env = _container_env(container)
    argv = [_expand(arg, env) for arg in container["args"]]
    assert argv[0] == "run", "the DaemonSet runs the node agent"
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"dra-agent does not accept the DaemonSet's arguments: {argv}")
    flags = {key: value for key, value in vars(args).items() if key in Settings.model_fields}
    return load_settings(flags, env)


def test_arguments_and_environment_are_the_agents() -> None:
    settings = _agent_settings(_container())
    # The node name and pod UID come from the downward API fields that hold them.
    assert settings.node_name == SAMPLE_FIELDS["spec.nodeName"]
    assert settings.pod_uid == SAMPLE_FIELDS["metadata.uid"]
    assert settings.metrics_address is not None
    assert settings.log_format == "json"
    assert settings.simulate is None, "the DaemonSet serves real hardware"


def _mounts(container: Mapping[str, Any]) -> dict[str, Doc]:
    return {m["mountPath"].rstrip("/") or "/": m for m in container.get("volumeMounts", [])}


def _volumes() -> dict[str, Doc]:
    return {v["name"]: v for v in _pod_spec()["volumes"]}


def _host_path_at(path: Path) -> tuple[Doc, Doc]:
    """The volume mount at exactly `path` in the container and its hostPath volume."""
    mount = _mounts(_container()).get(str(path))
    assert mount is not None, f"nothing is mounted at {path}"
    volume = _volumes()[mount["name"]]
    assert "hostPath" in volume, f"{path} is not a hostPath volume"
    return mount, volume["hostPath"]


def test_kubelet_and_cdi_directories_are_mounted_at_their_host_paths() -> None:
    settings = _agent_settings(_container())
    # The kubelet dials the socket paths exactly as reported; the runtime reads CDI specs from the host's folder.
    for name in ("registry_dir", "plugins_dir", "cdi_dir"):
        path = getattr(settings, name)
        mount, host_path = _host_path_at(path)
        assert host_path["path"] == str(path), f"{name}: {path} in the container is {host_path['path']} on the host"
        assert not mount.get("readOnly"), f"{name} must be writable"
        assert not mount.get("subPath"), f"{name} must be the directory itself"
    # Defaults the kubelet and the container runtimes use.
    assert str(settings.registry_dir) == "/var/lib/kubelet/plugins_registry"
    assert str(settings.plugins_dir) == "/var/lib/kubelet/plugins"
    assert str(settings.cdi_dir) == "/var/run/cdi"


def test_checkpoint_is_on_the_host() -> None:
    """The checkpoint of prepared claims outlives the pod and is shared by the old and the new pod in an update."""
    settings = _agent_settings(_container())
    mount, host_path = _host_path_at(settings.state_dir)
    assert not mount.get("readOnly")
    assert host_path["path"] == str(settings.state_dir) == "/var/lib/dra-agent"
    assert host_path.get("type") == "DirectoryOrCreate"


def test_host_views_are_the_hosts() -> None:
    settings = _agent_settings(_container())
    mount, host_path = _host_path_at(settings.host_root)
    assert host_path["path"] == "/" and str(settings.host_root) != "/"
    assert mount.get("readOnly") is True
    assert mount.get("mountPropagation") == "HostToContainer"
    for setting, host in (("sysfs_root", "/sys"), ("dev_root", "/dev")):
        mount, host_path = _host_path_at(getattr(settings, setting))
        assert host_path["path"] == host, setting
        assert not mount.get("readOnly"), f"{setting}: the agent writes there"


def test_the_driver_root_is_the_hosts_root_or_the_driver_containers() -> None:
    container = _container()
    settings = _agent_settings(container)
    assert settings.driver_root == settings.host_root, "a driver installed on the host: explicit, not a default"
    mount, host_path = _host_path_at(settings.effective_driver_root)
    assert host_path["path"] == "/" and mount.get("mountPropagation") == "HostToContainer"
    # The value the manifest's comment gives for the GPU operator's driver container is accepted, and names
    # /run/nvidia/driver on the host, where the operator mounts the driver container's root.
    args = [a for a in container["args"] if not a.startswith("--driver-root")]
    assert "set /host/run/nvidia/driver" in (BASE / "20-daemonset.yaml").read_text()
    operator = _agent_settings({**container, "args": [*args, "--driver-root=/host/run/nvidia/driver"]})
    assert "/" + str(operator.effective_driver_root.relative_to(operator.host_root)) == "/run/nvidia/driver"
    with pytest.raises(SettingsError, match="must lie under host_root /host"):
        _agent_settings({**container, "args": [*args, "--driver-root=/run/nvidia/driver"]})


def test_volume_mounts_and_volumes_match() -> None:
    mounts = _container()["volumeMounts"]
    volumes = _volumes()
    assert {m["name"] for m in mounts} == set(volumes), "every volume mounted, every mount backed"
    for volume in volumes.values():
        if "hostPath" in volume:
            assert volume["hostPath"].get("type") in ("Directory", "DirectoryOrCreate"), volume["name"]


def _port_number(container: Mapping[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    return int(number)


def test_probes_use_the_metrics_endpoint() -> None:
    container = _container()
    settings = _agent_settings(container)
    assert settings.metrics_address is not None
    port = int(settings.metrics_address.rpartition(":")[2])
    expected = {"livenessProbe": "/healthz", "readinessProbe": "/readyz", "startupProbe": "/healthz"}
    for probe, path in expected.items():
        if probe == "startupProbe" and probe not in container:
            continue
        get = container[probe]["httpGet"]
        assert get["path"] == path, probe
        assert _port_number(container, get["port"]) == port, f"{probe} probes another port than --metrics-address"
        assert get.get("scheme", "HTTP") == "HTTP"
    # A liveness probe that fires before the HTTP endpoint exists restarts the agent in a loop.
    liveness = container["livenessProbe"]
    assert liveness.get("periodSeconds", 10) * liveness.get("failureThreshold", 3) >= 20


async def test_probe_paths_are_served_by_the_agent() -> None:
    container = _container()
    server = MetricsServer("127.0.0.1:0", Metrics(), lambda: ())
    await server.start()
    try:
        async with aiohttp.ClientSession() as client:
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                if probe not in container:
                    continue
                path = container[probe]["httpGet"]["path"]
                async with client.get(f"http://127.0.0.1:{server.port}{path}") as response:
                    assert response.status == 200, f"{probe}: the agent does not serve {path}"
    finally:
        await server.stop()


def test_rolling_update_lets_two_agents_coexist() -> None:
    daemonset = _one("DaemonSet")
    strategy = daemonset["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"]["maxSurge"] == 1
    assert strategy["rollingUpdate"]["maxUnavailable"] == 0
    # Two agents on one node at once need socket names of their own.
    assert _agent_settings(_container()).pod_uid is not None


def test_pod_settings() -> None:
    daemonset = _one("DaemonSet")
    pod, container = _pod_spec(), _container()
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= daemonset["spec"]["template"]["metadata"][
        "labels"].items()
    assert container["image"] == "dra-agent:0.1.0", "a site pulls from its own registry (kustomize images:)"
    assert pod["priorityClassName"] == "system-node-critical"
    # The agent stops within 10 s of SIGTERM; it must not be killed before.
    assert 10 < pod["terminationGracePeriodSeconds"] <= 30
    tolerations = {(t.get("key"), t.get("operator"), t.get("effect")) for t in pod["tolerations"]}
    assert {("nvidia.com/gpu", "Exists", "NoSchedule"), ("google.com/tpu", "Exists", "NoSchedule"),
            ("CriticalAddonsOnly", "Exists", None)} <= tolerations
    resources = container["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"])
    assert parse_quantity(resources["limits"]["memory"]) >= parse_quantity(resources["requests"]["memory"])


def test_pod_keeps_its_network_namespace_and_watches_kernel_uevents() -> None:
    """docs/deploy.md, "Hot-plug events": hostNetwork would turn the metrics port into a host port and block the
    surge pod of an update; the agent opens its link and uevent sockets in the host's namespace instead, found
    through the host root (`<host_root>/proc/1/ns/net`) and entered with the privileged pod's CAP_SYS_ADMIN."""
    assert not _pod_spec().get("hostNetwork", False)
    assert DEFAULT_SOURCE == "kernel", "udevd's events reach only the host's network namespace"
    assert all("hostPort" not in p for p in _container().get("ports", []))
    settings = _agent_settings(_container())
    assert settings.host_netns == "auto" and str(settings.host_root) != "/"


def test_pod_shares_the_hosts_pid_namespace_for_mps_daemons() -> None:
    """docs/deploy.md, "Rolling updates": a claim's MPS daemon outlives the agent's pod only outside a PID namespace
    of the pod's own, which ends with it."""
    assert _pod_spec().get("hostPID") is True


def test_security_context() -> None:
    container = _container()
    security = container["securityContext"]
    assert security["privileged"] is True
    assert security["readOnlyRootFilesystem"] is True
    # With a read-only root, /tmp must be a volume of its own.
    tmp = _mounts(container).get("/tmp")
    assert tmp is not None and "emptyDir" in _volumes()[tmp["name"]]
    # The kubelet creates the termination message file: never inside a directory shared with the host.
    message = PurePosixPath(container.get("terminationMessagePath", "/dev/termination-log"))
    for path, mount in _mounts(container).items():
        if "hostPath" in _volumes()[mount["name"]]:
            assert not message.is_relative_to(path), f"{message} would be created in the host's {path}"


# ---------------------------------------------------------------------------------------------------------------
# CEL: the subset the manifests use, evaluated on the devices the agent publishes


class CelError(Exception):
    """A CEL evaluation error: in the API server's allocator, one aborts the allocation."""


class _Fields:
    """The attributes or capacities of one domain; an unknown field is an error, as in Kubernetes."""

    def __init__(self, what: str, values: Mapping[str, Any]) -> None:
        self._what, self._values = what, values

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self[name]

    def __getitem__(self, name: str) -> Any:
        if name not in self._values:
            raise CelError(f"no such key: {name} (in {self._what})")
        return self._values[name]


class _Domains:
    """device.attributes or device.capacity: an unknown domain gives an empty map, as in Kubernetes."""

    def __init__(self, what: str, by_domain: Mapping[str, Mapping[str, Any]]) -> None:
        self._what, self._by_domain = what, by_domain

    def __getitem__(self, domain: str) -> _Fields:
        return _Fields(f"{self._what}[{domain!r}]", self._by_domain.get(domain, {}))


@dataclass(frozen=True)
class _Quantity:
    value: Fraction

    def compareTo(self, other: object) -> int:  # the CEL method's name
        if not isinstance(other, _Quantity):
            raise CelError(f"no such overload: compareTo({other!r})")
        return (self.value > other.value) - (self.value < other.value)


@dataclass(frozen=True)
class _Version:
    text: str

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Version):
            raise CelError(f"no such overload: version == {other!r}")
        return self.text == other.text

    def __hash__(self) -> int:
        return hash(self.text)


@dataclass(frozen=True)
class SimDevice:
    """One published device, as a CEL expression and a matchAttribute constraint see it."""

    profile: str
    driver: str
    name: str
    attributes: Mapping[str, Mapping[str, Any]]  # domain -> name -> value
    capacity: Mapping[str, Mapping[str, _Quantity]]

    def qualified(self, attribute: str) -> Any:
        domain, _, name = attribute.rpartition("/")
        return self.attributes.get(domain, {}).get(name)


_CEL_TOKEN = re.compile(r"""\s*(?:(?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')|(?P<num>[0-9]+)"""
                        r"""|(?P<op>&&|\|\||==|!=|>=|<=|[<>!()\[\].,])|(?P<name>[A-Za-z_][A-Za-z0-9_]*))""")
_CEL_NAMES = {"device": "device", "quantity": "quantity", "true": "True", "false": "False"}


def _cel_to_python(expression: str) -> str:
    """Translate the CEL subset used here; anything else fails the test, pointing at this evaluator."""
    out: list[str] = []
    pos, previous = 0, ""
    text = expression.strip()
    while pos < len(text):
        match = _CEL_TOKEN.match(text, pos)
        assert match and match.end() > pos, f"CEL not covered by this test's evaluator at {text[pos:]!r}"
        pos = match.end()
        kind, token = match.lastgroup, match.group(match.lastgroup or "")
        if kind == "op":
            out.append({"&&": " and ", "||": " or ", "!": " not "}.get(token, token))
        elif kind == "name" and previous != ".":
            assert token in _CEL_NAMES, f"CEL identifier {token!r} not covered by this test's evaluator"
            out.append(_CEL_NAMES[token])
        else:
            out.append(token)
        previous = token
    return "".join(out)


def cel_matches(expression: str, device: SimDevice) -> bool:
    """Evaluate a selector on a device; CelError when Kubernetes would report an evaluation error.

    One difference, on the strict side: `&&` and `||` are read left to right, where CEL's absorb an error when
    the other operand decides. Selectors here test device.driver first, so that never matters to them.
    """
    env = {
        "__builtins__": {},
        "device": _Device(device),
        "quantity": lambda text: _Quantity(parse_quantity(text)),
    }
    try:
        result = eval(_cel_to_python(expression), env)
    except CelError:
        raise
    except Exception as e:
        raise CelError(f"{type(e).__name__}: {e}") from None
    if not isinstance(result, bool):
        raise CelError(f"the expression gives {result!r}, not a bool")
    return result


class _Device:
    def __init__(self, device: SimDevice) -> None:
        self.driver = device.driver
        self.attributes = _Domains("device.attributes", device.attributes)
        self.capacity = _Domains("device.capacity", device.capacity)


def _attribute_value(value: Mapping[str, Any]) -> Any:
    ((kind, raw),) = value.items()
    return _Version(raw) if kind == "version" else raw


def _sim_devices(slices: Sequence[Mapping[str, Any]], profile: str) -> list[SimDevice]:
    devices = []
    for s in slices:
        driver = s["spec"]["driver"]
        for d in s["spec"].get("devices", []):
            attributes: dict[str, dict[str, Any]] = {}
            for key, value in d.get("attributes", {}).items():
                domain, _, name = key.rpartition("/")
                attributes.setdefault(domain or driver, {})[name] = _attribute_value(value)
            capacity: dict[str, dict[str, _Quantity]] = {}
            for key, value in d.get("capacity", {}).items():
                domain, _, name = key.rpartition("/")
                capacity.setdefault(domain or driver, {})[name] = _Quantity(parse_quantity(value["value"]))
            devices.append(SimDevice(profile, driver, d["name"], attributes, capacity))
    return devices


@pytest.fixture(scope="module")
def published() -> dict[str, list[SimDevice]]:
    """What the agent publishes on each built-in simulated node, by profile."""
    by_profile = {}
    with pytest.MonkeyPatch.context() as patch:
        for key in list(os.environ):
            if key.startswith("DRA_AGENT_") or key in ("NODE_NAME", "KUBECONFIG"):
                patch.delenv(key)
        for profile in builtin_profiles():
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(["discover", "--simulate", profile, "-o", "json", "--log-format", "json"])
            assert code == 0, err.getvalue()
            by_profile[profile] = _sim_devices(json.loads(out.getvalue() or "[]"), profile)
    assert any(by_profile.values())
    return by_profile


def test_cel_evaluator() -> None:
    """The evaluator the checks below rely on: errors where Kubernetes reports them, values elsewhere."""
    gpu = SimDevice("p", "gpu.nvidia.com", "gpu-0", {"gpu.nvidia.com": {"type": "gpu"}},
                    {"gpu.nvidia.com": {"memory": _Quantity(parse_quantity("80Gi"))}})
    assert cel_matches('device.driver == "gpu.nvidia.com" && device.attributes["gpu.nvidia.com"].type == "gpu"', gpu)
    assert cel_matches("device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('80Gi')) >= 0", gpu)
    assert not cel_matches("device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('81Gi')) >= 0", gpu)
    assert not cel_matches('device.driver == "x" && device.attributes["x"].rdma', gpu)
    assert not cel_matches('!(device.attributes["gpu.nvidia.com"].type == "gpu")', gpu)
    for failing in ('device.attributes["gpu.nvidia.com"].rdma', 'device.attributes["other.io"].type == "gpu"',
                    'device.attributes["gpu.nvidia.com"].type'):
        with pytest.raises(CelError):
            cel_matches(failing, gpu)


# ---------------------------------------------------------------------------------------------------------------
# DeviceClasses


def _device_classes() -> dict[str, Doc]:
    return {doc["metadata"]["name"]: doc for doc in _of_kind("DeviceClass")}


def _class_expressions(device_class: Mapping[str, Any]) -> list[str]:
    return [s["cel"]["expression"] for s in device_class["spec"].get("selectors", [])]


_DRIVER_TEST = re.compile(r"""device\.driver\s*==\s*(?:"([^"]*)"|'([^']*)')""")
_DOMAIN_LOOKUP = re.compile(r"""device\.(attributes|capacity)\s*\[\s*(?:"([^"]*)"|'([^']*)')\s*\]""")


def test_device_classes_are_the_documented_ones() -> None:
    assert set(_device_classes()) == {"gpu.nvidia.com", "mig.nvidia.com", "tpu.google.com", "vf.sriov.dra-agent.io",
                                      "rdma-vf.sriov.dra-agent.io"}


# The extended-resource names the classes carry (docs/devices.md "Extended-resource names"): the whole-GPU class
# takes the device plugin's name, as NVIDIA's chart does; the others keep their implicit names only.
EXTENDED_RESOURCE_NAMES = {"gpu.nvidia.com": "nvidia.com/gpu"}


def test_device_classes_carry_the_documented_extended_resource_names() -> None:
    named = {n: c["spec"]["extendedResourceName"] for n, c in _device_classes().items()
             if c["spec"].get("extendedResourceName") is not None}
    assert named == EXTENDED_RESOURCE_NAMES
    for name, extended in named.items():
        assert is_extended_resource_name(extended), f"DeviceClass {name}: {extended!r} is no extended resource name"
    # The API server accepts a shared name, but the scheduler would then serve it from one class only.
    assert len(set(named.values())) == len(named), "two classes share an extended resource name"


async def test_the_device_classes_are_accepted_by_the_api_server(scratch: Path) -> None:
    """Created through the API (not stored as given): the test API server checks extendedResourceName as the
    real one does."""
    async with TestApiServer() as server:
        kube = await KubeClient.connect(server.write_kubeconfig(scratch / "kubeconfig"))
        try:
            for device_class in _device_classes().values():
                await kube.request("POST", api_path(DEVICE_CLASSES), body=device_class)
        finally:
            await kube.close()
        stored = {c["metadata"]["name"]: c["spec"].get("extendedResourceName") for c in server.objects("deviceclasses")}
    assert {n: v for n, v in stored.items() if v} == EXTENDED_RESOURCE_NAMES


def test_every_device_class_selects_a_driver_of_the_agent(agent_drivers: set[str]) -> None:
    for name, device_class in _device_classes().items():
        drivers = {a or b for e in _class_expressions(device_class) for a, b in _DRIVER_TEST.findall(e)}
        assert len(drivers) == 1, f"DeviceClass {name} must select exactly one driver with device.driver =="
        assert drivers <= agent_drivers, f"DeviceClass {name}: {drivers} is not a driver of the agent's backends"


def _all_expressions() -> list[tuple[str, str]]:
    found = [(f"DeviceClass {n}", e) for n, c in _device_classes().items() for e in _class_expressions(c)]
    for template in _of_kind("ResourceClaimTemplate"):
        for request in template["spec"]["spec"]["devices"].get("requests", []):
            for exact in [request.get("exactly", {}), *request.get("firstAvailable", [])]:
                for selector in exact.get("selectors", []):
                    found.append((f"template {template['metadata']['name']}", selector["cel"]["expression"]))
    return found


def test_cel_expressions_reference_the_agents_domains(agent_drivers: set[str]) -> None:
    expressions = _all_expressions()
    assert len(expressions) >= 7
    allowed = agent_drivers | {STANDARD_DOMAIN, AGENT_DOMAIN}
    for where, expression in expressions:
        lookups = [b or c for _, b, c in _DOMAIN_LOOKUP.findall(expression)]
        assert lookups or _DRIVER_TEST.search(expression), f"{where}: {expression!r} looks at no device property"
        for domain in lookups:
            assert domain in allowed, f"{where}: domain {domain!r} is not one the agent publishes"


def test_device_class_selectors_never_fail_and_each_selects(published: dict[str, list[SimDevice]]) -> None:
    """Class selectors run on every device in the cluster: an evaluation error on any device aborts allocations."""
    every = [d for devices in published.values() for d in devices]
    for name, device_class in _device_classes().items():
        matched = [d for d in every if all(cel_matches(e, d) for e in _class_expressions(device_class))]
        assert matched, f"DeviceClass {name} matches no device the agent publishes on the simulated nodes"


def test_device_classes_split_the_devices(published: dict[str, list[SimDevice]]) -> None:
    every = [d for devices in published.values() for d in devices]
    classes = _device_classes()

    def members(name: str) -> set[tuple[str, str]]:
        return {(d.profile, d.name) for d in every if all(cel_matches(e, d) for e in _class_expressions(classes[name]))}

    gpus, migs, tpus = members("gpu.nvidia.com"), members("mig.nvidia.com"), members("tpu.google.com")
    vfs, rdma = members("vf.sriov.dra-agent.io"), members("rdma-vf.sriov.dra-agent.io")
    assert not gpus & migs, "a MIG device is not a full GPU"
    assert gpus | migs == {(d.profile, d.name) for d in every if d.driver == "gpu.nvidia.com"}
    assert tpus == {(d.profile, d.name) for d in every if d.driver == "tpu.google.com"}
    assert vfs == {(d.profile, d.name) for d in every if d.driver == "sriov.dra-agent.io"}
    assert rdma == {(d.profile, d.name) for d in every
                    if d.driver == "sriov.dra-agent.io" and d.attributes[d.driver]["rdma"]}
    # The simulated nodes' VFs all have RDMA: one without, as an Intel iavf VF on a NIC without RoCE.
    plain = SimDevice("p", "sriov.dra-agent.io", "vf-0", {"sriov.dra-agent.io": {"type": "vf", "rdma": False}}, {})
    assert all(cel_matches(e, plain) for e in _class_expressions(classes["vf.sriov.dra-agent.io"]))
    assert not all(cel_matches(e, plain) for e in _class_expressions(classes["rdma-vf.sriov.dra-agent.io"]))


def _opaque_configs() -> list[tuple[str, Doc]]:
    found = [(f"DeviceClass {n}", entry["opaque"]) for n, c in _device_classes().items()
             for entry in c["spec"].get("config", []) if "opaque" in entry]
    for template in _of_kind("ResourceClaimTemplate"):
        for entry in template["spec"]["spec"]["devices"].get("config", []):
            if "opaque" in entry:
                found.append((f"template {template['metadata']['name']}", entry["opaque"]))
    return found


def test_opaque_configuration_is_accepted_by_the_backends() -> None:
    found, _ = find_plugins()
    loaded, failures = load_plugins(found)
    assert not failures
    configs = _opaque_configs()
    assert configs, "the GpuConfig example is gone"
    for where, opaque in configs:
        # Backends of one driver may share a kind (nvidia-gpu and nvidia-mig both take GpuConfig).
        types = list({t for p in loaded if p.backend.driver == opaque["driver"]
                      for t in getattr(p.backend, "config_types", ())})
        assert types, f"{where}: no backend of driver {opaque['driver']} takes opaque configuration"
        params = opaque["parameters"]
        (model,) = [t for t in types if (params.get("apiVersion"), params.get("kind")) == (t.API_VERSION, t.KIND)]
        model.model_validate(params)


# ---------------------------------------------------------------------------------------------------------------
# Example claims and pods


def _templates() -> dict[str, Doc]:
    return {doc["metadata"]["name"]: doc for doc in _of_kind("ResourceClaimTemplate", under="examples")}


def _requests(template: Mapping[str, Any]) -> list[Doc]:
    requests: list[Doc] = template["spec"]["spec"]["devices"]["requests"]
    return requests


def test_example_claims_reference_existing_device_classes() -> None:
    classes = set(_device_classes())
    assert len(_templates()) >= 5
    for name, template in _templates().items():
        for request in _requests(template):
            for exact in [request.get("exactly", {}), *request.get("firstAvailable", [])]:
                if exact:
                    assert exact["deviceClassName"] in classes, f"{name}: no DeviceClass {exact['deviceClassName']}"


def test_example_constraints_name_their_requests() -> None:
    for name, template in _templates().items():
        requests = {r["name"] for r in _requests(template)}
        for constraint in template["spec"]["spec"]["devices"].get("constraints", []):
            assert set(constraint.get("requests", [])) <= requests, name
            assert "/" in constraint["matchAttribute"], f"{name}: matchAttribute needs its domain"


def test_example_pods_use_their_claims() -> None:
    pods = _of_kind("Pod", under="examples")
    templates = _templates()
    assert len(pods) >= 5
    used = set()
    for pod in pods:
        spec = pod["spec"]
        claims = {c["name"]: c for c in spec["resourceClaims"]}
        for claim in claims.values():
            assert claim.get("resourceClaimTemplateName") in templates, f"pod {pod['metadata']['name']}"
            used.add(claim["resourceClaimTemplateName"])
        referenced = {c["name"] for container in spec["containers"] for c in container["resources"].get("claims", [])}
        assert referenced == set(claims), f"pod {pod['metadata']['name']}: claims and containers disagree"
    assert used == set(templates), "every template is used by a pod"


def test_examples_cover_the_documented_cases() -> None:
    requests = [(r["exactly"], t) for t in _templates().values() for r in _requests(t)]
    all_of = {e["deviceClassName"] for e, _ in requests if e.get("allocationMode") == "All"}
    assert {"gpu.nvidia.com", "tpu.google.com"} <= all_of
    constraints = {c["matchAttribute"] for t in _templates().values()
                   for c in t["spec"]["spec"]["devices"].get("constraints", [])}
    assert {"resource.kubernetes.io/pcieRoot", "dra-agent.io/pcieSwitch"} <= constraints
    selectors = [s["cel"]["expression"] for e, _ in requests for s in e.get("selectors", [])]
    assert any('quantity("80Gi")' in s for s in selectors)
    assert any("1g.10gb" in s for s in selectors)


def _candidates(request: Mapping[str, Any], devices: Sequence[SimDevice]) -> list[SimDevice]:
    exact = request["exactly"]
    expressions = [*_class_expressions(_device_classes()[exact["deviceClassName"]]),
                   *(s["cel"]["expression"] for s in exact.get("selectors", []))]

    def matches(device: SimDevice) -> bool:
        # The allocator evaluates the class's selectors, then the request's, and stops at the first false.
        return all(cel_matches(e, device) for e in expressions)

    return [d for d in devices if matches(d)]


def _satisfiable(template: Mapping[str, Any], devices: Sequence[SimDevice]) -> bool:
    """Whether the claim can be allocated on a node with these devices (ExactCount and All, matchAttribute)."""
    spec = template["spec"]["spec"]["devices"]
    requests = {r["name"]: r for r in spec["requests"]}
    for request in requests.values():
        assert "exactly" in request, "this check covers exactly requests only"
    pools = {name: _candidates(r, devices) for name, r in requests.items()}

    def enough(name: str, pool: Sequence[SimDevice]) -> bool:
        exact = requests[name]["exactly"]
        if exact.get("allocationMode") == "All":
            return bool(pool) and len(pool) == len(pools[name])  # all of them, and at least one
        count: int = exact.get("count", 1)
        return len(pool) >= count

    def solve(constraints: Sequence[Mapping[str, Any]], current: Mapping[str, list[SimDevice]]) -> bool:
        if not constraints:
            return all(enough(n, p) for n, p in current.items())
        constraint, rest = constraints[0], constraints[1:]
        names = constraint.get("requests") or list(requests)
        attribute = constraint["matchAttribute"]
        values = {d.qualified(attribute) for n in names for d in current[n]} - {None}
        return any(solve(rest, {n: [d for d in p if n not in names or d.qualified(attribute) == value]
                                for n, p in current.items()}) for value in values)

    return solve(spec.get("constraints", []), pools)


def test_every_example_claim_can_be_allocated_on_a_simulated_node(published: dict[str, list[SimDevice]]) -> None:
    for name, template in _templates().items():
        nodes = [p for p, devices in published.items() if _satisfiable(template, devices)]
        assert nodes, f"claim template {name} cannot be allocated on any built-in simulated node"


def test_pcie_switch_is_stricter_than_pcie_root(published: dict[str, list[SimDevice]]) -> None:
    """Sanity check of the allocation model: the switch constraint never admits a node the root one refuses."""
    templates = _templates()
    by_root, by_switch = templates["gpu-rdma-same-pcie-root"], templates["gpu-rdma-same-pcie-switch"]
    for devices in published.values():
        if _satisfiable(by_switch, devices):
            assert _satisfiable(by_root, devices)

