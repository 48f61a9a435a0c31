"""deploy/'s DaemonSet on the cluster's node, through a kustomize overlay made for the node: the agent's pod as
operators run it (the image of `cluster.agent_image`, deploy/'s arguments, probes, privileges and mounts), with
only what this node has elsewhere than a real node changed.

What the overlay changes, and why:

- the image: the one imported on the node, `imagePullPolicy: Never` (no registry);
- `hostNetwork`: a pod of its own network namespace gets only an `eth0` that reaches nothing on this node
  (cluster/runtime.py), so the kubelet's probes could not reach it, nor could the agent reach the API server at
  its loopback address, which is the pod's own there (docs/real-cluster.md). The metrics endpoint
  then listens in the host's namespace: on 127.0.0.1 and a port picked for the run instead of every address's
  9477, and the probes reach it there (a host-network pod's address is the node's, 127.0.0.1); `--host-netns=off`,
  as the agent already runs in the host's namespace;
- the host folders: the kubelet's plugin folders of this node's kubelet (below the cluster's folder, mounted at
  their host paths, as the DaemonSet mounts /var/lib/kubelet's: the kubelet dials the socket paths the agent
  reports), the CDI folder this node's containerd reads, the state folder (the caller's choice: below the
  simulated node's root, where `--cdi-host-root` expects every host path a CDI spec names, when claims' specs
  name folders of the state, as an MPS daemon's), and the simulated node's root, sysfs and /dev in place of the
  machine's `/`, `/sys` and `/dev`;
- `--cdi-host-root`: containerd on this machine finds the simulated node's /dev entries and driver files below its
  root (docs/running.md);
- the update strategy: the old pod goes before the new one starts (`maxSurge: 0`, `maxUnavailable: 1`, the
  DaemonSet's default) instead of deploy/'s new pod beside the old one. A host-network pod's container port is
  also a host port (the API server defaults `hostPort` to it), so the scheduler cannot place the new pod on the
  node while the old one holds the port: "0/1 nodes are available: 1 node(s) didn't have free ports for the
  requested pod ports", and the update would wait for ever. Nor could the two agents share one metrics address in
  one network namespace.

The in-cluster address needs no change here: the cluster's admission policy gives every new pod the API server's
loopback address (`cluster.incluster`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cluster import HERE

__all__ = ["DEPLOY", "NodeFolders", "write_overlay"]

DEPLOY = HERE.parent / "deploy"
_DAEMONSET = DEPLOY / "base/20-daemonset.yaml"
_CONTAINER = "/spec/template/spec/containers/0"


@dataclass(frozen=True)
class NodeFolders:
    """The host folders the agent's pod uses on this node."""

    sim_root: Path
    """The simulated node's root: its `sys/`, `dev/`, `proc/` and driver files (the DaemonSet's /host)."""
    registry_dir: Path
    plugins_dir: Path
    cdi_dir: Path
    state_dir: Path


def _index(items: list[dict[str, Any]], name: str) -> int:
    return next(i for i, item in enumerate(items) if item["name"] == name)


def _args(base: list[str], folders: NodeFolders, metrics_port: int) -> list[str]:
    """deploy/'s arguments, the metrics address on loopback, and this node's folders added."""
    args = [f"--metrics-address=127.0.0.1:{metrics_port}" if a.startswith("--metrics-address=") else a
            for a in base]
    return [*args, f"--registry-dir={folders.registry_dir}", f"--plugins-dir={folders.plugins_dir}",
            f"--cdi-host-root={folders.sim_root}", "--host-netns=off"]


def _patch(folders: NodeFolders, metrics_port: int, extra_env: dict[str, str]) -> list[dict[str, Any]]:
    """The JSON patch of the DaemonSet (indices found by name in deploy/'s DaemonSet)."""
    daemonset = yaml.safe_load(_DAEMONSET.read_text())
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ops: list[dict[str, Any]] = [
        {"op": "replace", "path": f"{_CONTAINER}/imagePullPolicy", "value": "Never"},
        {"op": "add", "path": "/spec/template/spec/hostNetwork", "value": True},
        {"op": "replace", "path": "/spec/updateStrategy/rollingUpdate", "value": {"maxSurge": 0, "maxUnavailable": 1}},
        {"op": "replace", "path": f"{_CONTAINER}/args", "value": _args(container["args"], folders, metrics_port)},
        {"op": "replace", "path": f"{_CONTAINER}/ports/{_index(container['ports'], 'metrics')}/containerPort",
         "value": metrics_port},
    ]
    for name, value in extra_env.items():
        ops.append({"op": "add", "path": f"{_CONTAINER}/env/-", "value": {"name": name, "value": value}})
    mounts = {"plugins-registry": folders.registry_dir, "plugins": folders.plugins_dir}
    for name, path in mounts.items():
        index = _index(container["volumeMounts"], name)
        ops.append({"op": "replace", "path": f"{_CONTAINER}/volumeMounts/{index}/mountPath", "value": str(path)})
    host_paths = {**mounts, "cdi": folders.cdi_dir, "state": folders.state_dir, "sys": folders.sim_root / "sys",
                  "dev": folders.sim_root / "dev", "host-root": folders.sim_root}
    for name, path in host_paths.items():
        index = _index(pod["volumes"], name)
        ops.append({"op": "replace", "path": f"/spec/template/spec/volumes/{index}/hostPath/path",
                    "value": str(path)})
    return ops


def write_overlay(folder: Path, image: str, folders: NodeFolders, metrics_port: int, *,
                  extra_env: dict[str, str] | None = None) -> Path:
    """Write the overlay of deploy/ for this node into `folder` (its `kustomization.yaml`); `image` is the agent's
    image as the node's containerd names it, `extra_env` entries are added to the container's environment.
    Returns `folder`, for `kubectl apply -k`."""
    name, _, tag = image.rpartition(":")
    folder.mkdir(parents=True, exist_ok=True)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(DEPLOY / "base", folder.resolve())],  # kustomize refuses absolute paths
        "images": [{"name": "dra-agent", "newName": name, "newTag": tag}],
        "patches": [{"target": {"kind": "DaemonSet", "name": "dra-agent"},
                     "patch": json.dumps(_patch(folders, metrics_port, extra_env or {}))}],
    }
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(kustomization, sort_keys=False))
    return folder
