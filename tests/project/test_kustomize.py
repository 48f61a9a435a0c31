"""The kustomizations under deploy/: each renders with `kubectl kustomize`, and what it renders is valid and does
what the overlay says.

Every object is checked against the Kubernetes 1.34 to 1.37 schemas in strict mode (the manifests serve every
release from 1.34 on, so no overlay per release is needed); the ServiceMonitor, a custom resource outside those
schemas, is checked against the fields the Prometheus Operator defines and against the Service it scrapes. The
kustomizations are written for kustomize v2.0 (the one in Debian 12's kubectl 1.20) and current kustomize alike;
whichever kubectl is on the PATH renders them here.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from agent.commands.cli import build_parser
from agent.node.plugin_settings import plugin_settings_problems
from agent.settings import Settings, load_settings, resolve_settings
from tests.support.repository import ROOT
from tests.support.timing import scaled

DEPLOY = ROOT / "deploy"
BASE = DEPLOY / "base"
OVERLAYS = sorted(p.parent for p in (DEPLOY / "overlays").glob("*/kustomization.yaml"))
KUSTOMIZATIONS = [DEPLOY, BASE, *OVERLAYS]
KUBERNETES_VERSIONS = ["1.34", "1.35", "1.36", "1.37"]
KUBECTL = shutil.which("kubectl")
# Kinds that are not in Kubernetes' own schemas, each checked by a test of its own below.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (Debian: kubernetes-client)")

Doc = dict[str, Any]
Key = tuple[str, str, str, str]


def _render(directory: Path) -> list[Doc]:
    assert KUBECTL is not None
    done = subprocess.run([KUBECTL, "kustomize", str(directory)], capture_output=True, text=True,
                          timeout=scaled(60))
    # Current kustomize warns on stderr that the kustomize v2 forms are deprecated; only the exit status counts.
    assert done.returncode == 0, f"kubectl kustomize {directory}: {done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc is not None]


def _key(doc: Mapping[str, Any]) -> Key:
    meta = doc["metadata"]
    return (doc["apiVersion"], doc["kind"], meta.get("namespace", ""), meta["name"])


@pytest.fixture(scope="module")
def rendered() -> dict[Path, dict[Key, Doc]]:
    """Each kustomization's objects, by (apiVersion, kind, namespace, name)."""
    found = {}
    for directory in KUSTOMIZATIONS:
        docs = _render(directory)
        by_key = {_key(doc): doc for doc in docs}
        assert len(by_key) == len(docs), f"{directory}: the same object twice"
        found[directory] = by_key
    return found


def _only(objects: Mapping[Key, Doc], kind: str) -> Doc:
    (doc,) = [doc for (_, k, _, _), doc in objects.items() if k == kind]
    return doc


def _changed(base: Mapping[Key, Doc], overlay: Mapping[Key, Doc]) -> set[Key]:
    """The objects an overlay adds or changes."""
    return {key for key, doc in overlay.items() if base.get(key) != doc}


def test_the_overlays_are_there() -> None:
    assert {p.name for p in OVERLAYS} == {"driver-container", "nfd", "metrics", "dynamic-mig", "sriov-vfs",
                                          "gpu-sharing", "debug-logging"}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=[str(d.relative_to(ROOT)) for d in KUSTOMIZATIONS])
def test_every_rendered_object_validates(rendered: dict[Path, dict[Key, Doc]], directory: Path,
                                         version: str) -> None:
    objects = rendered[directory]
    assert objects, f"{directory} renders nothing"
    for key, doc in objects.items():
        if (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{directory.relative_to(ROOT)}: {key} on {version}: {e.message}")


def test_deploy_applies_the_base(rendered: dict[Path, dict[Key, Doc]]) -> None:
    assert rendered[DEPLOY] == rendered[BASE]
    # kubectl apply -k applies in the rendered order: the namespace before what lives in it.
    assert next(iter(rendered[BASE]))[1] == "Namespace"
    kinds = {kind for _, kind, _, _ in rendered[BASE]}
    assert {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "DaemonSet", "Service",
            "DeviceClass"} <= kinds, kinds


def test_the_base_renders_the_manifests_unchanged(rendered: dict[Path, dict[Key, Doc]]) -> None:
    # Kustomize adds no label, prefix or namespace: the objects are the files' own, but for the settings file's
    # ConfigMap, which it makes, and the DaemonSet's reference to it by the name it gave it.
    listed = yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"]
    from_files = {_key(doc): doc for name in listed for doc in yaml.safe_load_all((BASE / name).read_text())
                  if doc is not None}
    config = _config_map(rendered[BASE])
    daemonset = _only(from_files, "DaemonSet")
    for volume in daemonset["spec"]["template"]["spec"]["volumes"]:
        if volume["name"] == "config":
            volume["configMap"]["name"] = config["metadata"]["name"]
    assert rendered[BASE] == {**from_files, _key(config): config}


# ---------------------------------------------------------------------------------------------------------------
# The settings file and the overlays that set it

CONFIG_OVERLAYS = ["dynamic-mig", "sriov-vfs", "gpu-sharing", "debug-logging"]


def _config_map(objects: Mapping[Key, Doc]) -> Doc:
    (doc,) = [doc for (_, kind, _, name), doc in objects.items()
              if kind == "ConfigMap" and name.startswith("dra-agent-config-")]
    return doc


def _settings_file(objects: Mapping[Key, Doc], folder: Path) -> tuple[Settings, dict[str, str]]:
    """What the agent makes of the DaemonSet's arguments with the settings file it mounts, written to `folder`
    (the path --config names, below it), and where each setting came from."""
    pod = _only(objects, "DaemonSet")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (config,) = [a.removeprefix("--config=") for a in container["args"] if a.startswith("--config=")]
    (mount,) = [m for m in container["volumeMounts"] if config.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mount.get("readOnly") is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    config_map = _config_map(objects)
    assert volume["configMap"]["name"] == config_map["metadata"]["name"], "the DaemonSet mounts the ConfigMap made"
    assert config_map["metadata"]["namespace"] == _only(objects, "DaemonSet")["metadata"]["namespace"]
    key = config.removeprefix(mount["mountPath"].rstrip("/") + "/")
    path = folder / key
    path.write_text(config_map["data"][key])
    argv = [a.replace("$(NODE_NAME)", "gpu-node-17").replace("$(POD_UID)", "3f8e4c1a-5b2d-4e6f-8a9b-0c1d2e3f4a5b")
            for a in container["args"]]
    parsed = build_parser().parse_args(argv)
    return resolve_settings({k: v for k, v in vars(parsed).items() if k in Settings.model_fields}, {}, path)


def test_the_base_mounts_an_empty_settings_file(rendered: dict[Path, dict[Key, Doc]], tmp_path: Path) -> None:
    settings, origins = _settings_file(rendered[BASE], tmp_path)
    assert [key for key, origin in origins.items() if origin.startswith("config file")] == []
    assert settings.backend_config == {} and settings.allowed_configs == ()


@pytest.mark.parametrize("overlay", CONFIG_OVERLAYS)
def test_a_settings_overlay_changes_the_file_and_so_the_daemonset(rendered: dict[Path, dict[Key, Doc]],
                                                                   overlay: str, tmp_path: Path) -> None:
    base, objects = rendered[BASE], rendered[DEPLOY / "overlays" / overlay]
    changed = _changed(base, objects)
    # A new ConfigMap name: the DaemonSet changes with it, and `kubectl apply -k` rolls it out.
    assert {kind for _, kind, _, _ in changed} == {"ConfigMap", "DaemonSet"}, changed
    assert _config_map(objects)["metadata"]["name"] != _config_map(base)["metadata"]["name"]
    daemonset, base_daemonset = copy.deepcopy(_only(objects, "DaemonSet")), _only(base, "DaemonSet")
    for volume in daemonset["spec"]["template"]["spec"]["volumes"]:
        if volume["name"] == "config":
            volume["configMap"]["name"] = _config_map(base)["metadata"]["name"]
    assert daemonset == base_daemonset, "nothing else of the DaemonSet changes"
    settings, origins = _settings_file(objects, tmp_path)
    assert plugin_settings_problems(settings, origins) == [], "the agent takes the file"
    expected: dict[str, Callable[[Settings], bool]] = {
        "dynamic-mig": lambda s: s.backend_config == {"nvidia-mig": {"mode": "dynamic"}},
        "sriov-vfs": lambda s: s.backend_config["sriov-nic"]["numVfs"][0]["count"] == 8,
        "gpu-sharing": lambda s: s.backend_config == {"nvidia-gpu": {"sharing": {"byMemory": True,
                                                                                 "memoryStep": 2**30}}},
        "debug-logging": lambda s: s.log_level == "debug" and not s.backend_config,
    }
    assert expected[overlay](settings), settings


def test_the_critical_pods_quota_admits_the_daemonsets_pods(rendered: dict[Path, dict[Key, Doc]]) -> None:
    """Where the API server lets pods of system-node-critical only into namespaces with a covering quota (GKE),
    the base's quota is one: same namespace, a scope that selects the pods' priority class, room for every node."""
    base = rendered[BASE]
    daemonset, quota = _only(base, "DaemonSet"), _only(base, "ResourceQuota")
    assert quota["metadata"]["namespace"] == daemonset["metadata"]["namespace"]
    priority_class = daemonset["spec"]["template"]["spec"]["priorityClassName"]
    assert priority_class == "system-node-critical"
    (expression,) = quota["spec"]["scopeSelector"]["matchExpressions"]
    assert expression["scopeName"] == "PriorityClass" and expression["operator"] == "In"
    assert priority_class in expression["values"]
    assert set(quota["spec"]["hard"]) == {"pods"}, "it limits nothing but the number of pods"
    assert int(quota["spec"]["hard"]["pods"]) >= 2 * 5000, "the largest cluster upstream supports, in an update"


# ---------------------------------------------------------------------------------------------------------------
# What each overlay changes


def _daemonset_args(objects: Mapping[Key, Doc]) -> list[str]:
    (container,) = _only(objects, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    return list(container["args"])


def _settings(args: list[str]) -> Settings:
    """What the agent makes of the DaemonSet's arguments (downward API values filled with samples)."""
    fields = {"$(NODE_NAME)": "gpu-node-17", "$(POD_UID)": "3f8e4c1a-5b2d-4e6f-8a9b-0c1d2e3f4a5b"}
    argv = list(args)
    for reference, value in fields.items():
        argv = [a.replace(reference, value) for a in argv]
    parsed = build_parser().parse_args(argv)
    return load_settings({k: v for k, v in vars(parsed).items() if k in Settings.model_fields}, {})


def test_driver_container_sets_the_driver_root(rendered: dict[Path, dict[Key, Doc]]) -> None:
    base, overlay = rendered[BASE], rendered[DEPLOY / "overlays/driver-container"]
    (daemonset,) = _changed(base, overlay)
    assert daemonset[1] == "DaemonSet"
    args, base_args = _daemonset_args(overlay), _daemonset_args(base)
    assert [a for a in args if a.startswith("--driver-root")] == ["--driver-root=/host/run/nvidia/driver"]
    # Only that argument changed, in its place.
    assert [i for i, (a, b) in enumerate(zip(args, base_args, strict=True)) if a != b] == [
        base_args.index("--driver-root=/host")]
    settings = _settings(args)
    assert settings.effective_driver_root.relative_to(settings.host_root) == Path("run/nvidia/driver")


NFD = "feature.node.kubernetes.io/"


def test_nfd_selects_the_nodes_with_devices_the_agent_serves(rendered: dict[Path, dict[Key, Doc]]) -> None:
    base, overlay = rendered[BASE], rendered[DEPLOY / "overlays/nfd"]
    (daemonset,) = _changed(base, overlay)
    assert daemonset[1] == "DaemonSet"
    pod = overlay[daemonset]["spec"]["template"]["spec"]
    base_pod = base[daemonset]["spec"]["template"]["spec"]
    assert {k: v for k, v in pod.items() if k != "affinity"} == base_pod, "only the affinity is added"
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    # Terms are ORed; within one, expressions are ANDed: each term must stand for one label alone.
    labels = set()
    for term in terms:
        (expression,) = term["matchExpressions"]
        assert expression["operator"] == "In" and expression["values"] == ["true"], expression
        labels.add(expression["key"])
    assert labels == {
        # NVIDIA (0x10de) display (0300) and 3D (0302) controllers, NFD's default class_vendor labels.
        NFD + "pci-0300_10de.present", NFD + "pci-0302_10de.present",
        # Google TPUs (0x1ae0), processing accelerators (1200).
        NFD + "pci-1200_1ae0.present",
        # The same vendors under `deviceLabelFields: [vendor]` (the GPU operator's NFD configuration).
        NFD + "pci-10de.present", NFD + "pci-1ae0.present",
        NFD + "network-sriov.capable",
    }


def _metrics_service(objects: Mapping[Key, Doc]) -> Doc:
    return _only(objects, "Service")


def test_the_metrics_service_reaches_every_agents_metrics_port(rendered: dict[Path, dict[Key, Doc]]) -> None:
    base = rendered[BASE]
    service, daemonset = _metrics_service(base), _only(base, "DaemonSet")
    assert service["metadata"]["namespace"] == daemonset["metadata"]["namespace"]
    # Headless: one endpoint per agent pod, each scraped for its own node.
    assert service["spec"]["clusterIP"] == "None"
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items(), "the Service selects the agent's pods"
    assert service["spec"]["selector"] == daemonset["spec"]["selector"]["matchLabels"], "and no other pods"
    (port,) = service["spec"]["ports"]
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    by_name = {p["name"]: p for p in container["ports"]}
    assert port["name"] == "metrics" and port["targetPort"] in by_name
    container_port = by_name[port["targetPort"]]["containerPort"]
    assert port["port"] == container_port
    # The port the agent serves /metrics on is the one the container declares.
    host, _, listen = (_settings(container["args"]).metrics_address or "").rpartition(":")
    assert int(listen) == container_port, host


SERVICE_MONITOR_FIELDS = {
    "spec": {"selector", "namespaceSelector", "endpoints", "jobLabel", "targetLabels", "podTargetLabels",
             "sampleLimit", "attachMetadata"},
    "endpoint": {"port", "targetPort", "path", "scheme", "interval", "scrapeTimeout", "honorLabels",
                 "relabelings", "metricRelabelings"},
    "relabeling": {"sourceLabels", "separator", "targetLabel", "regex", "modulus", "replacement", "action"},
}


def test_metrics_adds_a_service_monitor_for_the_metrics_service(rendered: dict[Path, dict[Key, Doc]]) -> None:
    base, overlay = rendered[BASE], rendered[DEPLOY / "overlays/metrics"]
    (added,) = _changed(base, overlay)
    assert added[:2] == ("monitoring.coreos.com/v1", "ServiceMonitor")
    assert set(base) < set(overlay), "the base's objects are kept unchanged"
    monitor, service = overlay[added], _metrics_service(overlay)
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    spec = monitor["spec"]
    assert set(spec) <= SERVICE_MONITOR_FIELDS["spec"], set(spec) - SERVICE_MONITOR_FIELDS["spec"]
    # It selects the metrics Service, and only it, in the Service's namespace.
    namespace = service["metadata"]["namespace"]
    assert spec["namespaceSelector"] == {"matchNames": [namespace]}
    assert set(spec["selector"]) == {"matchLabels"}
    selected = spec["selector"]["matchLabels"]
    assert selected.items() <= service["metadata"]["labels"].items()
    others = [doc for doc in overlay.values() if doc is not service and doc["metadata"].get("namespace") == namespace
              and doc["kind"] == "Service"]
    assert not [doc for doc in others if selected.items() <= doc["metadata"].get("labels", {}).items()]
    (endpoint,) = spec["endpoints"]
    assert set(endpoint) <= SERVICE_MONITOR_FIELDS["endpoint"], set(endpoint) - SERVICE_MONITOR_FIELDS["endpoint"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}, "scrapes the Service's port by name"
    assert endpoint.get("path", "/metrics") == "/metrics"
    for relabeling in endpoint.get("relabelings", []):
        assert set(relabeling) <= SERVICE_MONITOR_FIELDS["relabeling"], relabeling
    # Each series names the node of the agent that reports it.
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"} in endpoint["relabelings"]


# ---------------------------------------------------------------------------------------------------------------
# Combining overlays, as docs/deploy.md shows it


def _documented_files() -> dict[str, str]:
    """The files of docs/deploy.md's own kustomization: each YAML block there that starts with a comment
    `# my-dra-agent/<file>`."""
    text = (ROOT / "docs/deploy.md").read_text()
    blocks = re.findall(r"^```yaml\n(# my-dra-agent/([\w.-]+)[^\n]*\n.*?)^```$", text, re.M | re.S)
    return {name: body for body, name in blocks}


def test_the_documented_combination_renders(tmp_path: Path) -> None:
    """docs/deploy.md's own kustomization: on the nfd overlay, with the driver-container and metrics overlays'
    files copied next to it, a toleration and a memory limit of its own, and another image."""
    files = _documented_files()
    assert set(files) == {"kustomization.yaml", "node-pool.yaml"}, set(files)
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    shutil.copy(DEPLOY / "overlays/driver-container/driver-root.yaml", tmp_path)
    shutil.copy(DEPLOY / "overlays/metrics/servicemonitor.yaml", tmp_path)
    kustomization = yaml.safe_load(files["kustomization.yaml"])
    # The docs' clone of the repository next to the user's directory is this one (kustomize v2 takes no
    # absolute path here).
    assert kustomization["bases"] == ["../dra-agent/deploy/overlays/nfd"]
    kustomization["bases"] = [os.path.relpath(DEPLOY / "overlays/nfd", tmp_path)]
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))

    objects = {_key(doc): doc for doc in _render(tmp_path)}
    pod = _only(objects, "DaemonSet")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "nodeAffinity" in pod["affinity"]
    assert "--driver-root=/host/run/nvidia/driver" in container["args"]
    assert container["resources"]["limits"]["memory"] == "512Mi"
    assert container["image"] == "registry.example.com/dra-agent:0.1.0"
    # Added to the base's tolerations, not in their place.
    toleration = {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}
    assert pod["tolerations"][-1] == toleration and len(pod["tolerations"]) > 1
    assert _only(objects, "ServiceMonitor")
    for doc in objects.values():
        if (doc["apiVersion"], doc["kind"]) not in CUSTOM_KINDS:
            kubernetes_validate.validate(doc, "1.37", strict=True)


def test_the_documented_settings_of_your_own_render_and_are_taken(tmp_path: Path) -> None:
    """docs/deploy.md's own settings file, in a kustomization on the base: the DaemonSet mounts it, and the agent
    takes every setting in it."""
    text = (ROOT / "docs/deploy.md").read_text()
    files = {name: body for body, name in
             re.findall(r"^```yaml\n(# my-settings/([\w.-]+)[^\n]*\n.*?)^```$", text, re.M | re.S)}
    assert set(files) == {"kustomization.yaml", "config.yaml"}, set(files)
    kustomization = yaml.safe_load(files["kustomization.yaml"])
    assert kustomization["bases"] == ["../dra-agent/deploy/base"]
    kustomization["bases"] = [os.path.relpath(BASE, tmp_path)]
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    (tmp_path / "config.yaml").write_text(files["config.yaml"])
    objects = {_key(doc): doc for doc in _render(tmp_path)}
    mounted = tmp_path / "mounted"
    mounted.mkdir()
    settings, origins = _settings_file(objects, mounted)
    assert plugin_settings_problems(settings, origins) == []
    assert settings.backend_config["nvidia-mig"] == {"mode": "dynamic"}
    assert settings.allowed_configs == ("VfioConfig",)
