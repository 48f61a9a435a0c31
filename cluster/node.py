"""The Node object of the simulated node, as a kubelet would register it, for a cluster that runs no kubelet.

A kubelet creates its Node with the well-known labels (hostname, OS, architecture), then keeps its status: the
capacity the scheduler fits pods into and the Ready condition. Without a kubelet the tests write both once and
lift the not-ready taint the API server puts on every new Node; the node lifecycle controller, which would taint
a node whose kubelet never reports, is not run then (see cluster/controlplane.py).
"""

from __future__ import annotations

import datetime
import json
import platform

from cluster.kubectl import Kubectl

__all__ = ["register_node"]

_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}


def node_labels(name: str) -> dict[str, str]:
    """The labels every kubelet sets on its Node (kubelet_node_status.go, initialNode)."""
    arch = _ARCH.get(platform.machine(), platform.machine())
    return {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": arch,
        "beta.kubernetes.io/os": "linux",
        "beta.kubernetes.io/arch": arch,
    }


def register_node(kubectl: Kubectl, name: str, *, cpu: str = "64", memory: str = "512Gi", pods: str = "110") -> str:
    """Create the Node `name` with a kubelet's labels, a capacity and a Ready condition; its UID."""
    node = kubectl.create({"apiVersion": "v1", "kind": "Node",
                           "metadata": {"name": name, "labels": node_labels(name)}})
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    resources = {"cpu": cpu, "memory": memory, "pods": pods}
    status = {"status": {
        "capacity": resources, "allocatable": resources,
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                        "message": "the simulated node stands in for a kubelet",
                        "lastHeartbeatTime": now, "lastTransitionTime": now}],
        "addresses": [{"type": "Hostname", "address": name}],
    }}
    kubectl.run("patch", "node", name, "--subresource=status", "--type=merge", "-p", json.dumps(status))
    # The API server taints every new Node not-ready (its TaintNodesByCondition admission plugin); the node
    # lifecycle controller lifts the taint once the kubelet reports Ready. Neither runs here: lift it as it would.
    kubectl.run("taint", "node", name, "node.kubernetes.io/not-ready:NoSchedule-")
    uid: str = node["metadata"]["uid"]
    return uid
