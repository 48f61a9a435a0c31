"""The control plane itself: the pinned release, ready, the node registered as a kubelet registers it, and every
component on loopback only."""

from __future__ import annotations

import json
import os
import socket

import pytest

from cluster.loopback import LoopbackWatch, breaches, sockets_of
from cluster.node import node_labels
from tests.real_cluster.cluster_env import NODE, RealCluster

pytestmark = pytest.mark.xdist_group("real-cluster")

RELEASE = "v1.37.2"


def test_every_component_is_the_pinned_release_and_ready(real_cluster: RealCluster) -> None:
    versions = json.loads(real_cluster.kubectl.run("version", "-o", "json"))
    assert versions["clientVersion"]["gitVersion"] == RELEASE
    assert versions["serverVersion"]["gitVersion"] == RELEASE
    status, body = real_cluster.plane.readyz()
    assert status == 200, body
    # Every check the server runs passed, the RBAC bootstrap roles and the priority classes among them.
    assert "readyz check passed" in body
    assert "[+]poststarthook/rbac/bootstrap-roles ok" in body
    real_cluster.plane.check_alive()
    names = [c.name for c in real_cluster.plane.components]
    assert names == ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"]


def test_the_node_carries_what_a_kubelet_gives_it(real_cluster: RealCluster) -> None:
    node = real_cluster.kubectl.get("node", NODE)
    assert node["metadata"]["uid"] == real_cluster.node_uid
    assert node_labels(NODE).items() <= node["metadata"]["labels"].items()
    assert node["status"]["allocatable"]["pods"] == "110"
    assert [c["status"] for c in node["status"]["conditions"] if c["type"] == "Ready"] == ["True"]
    assert not node["spec"].get("taints"), "nothing may keep the scheduler off the node"


def test_components_use_loopback_only(real_cluster: RealCluster, loopback_watch: LoopbackWatch) -> None:
    sockets = sockets_of(real_cluster.plane.pids())
    # The API server listens, and the other components hold connections to it and to etcd.
    assert any(s.listening and s.local.endswith(f":{real_cluster.plane.api_port}") for s in sockets)
    assert sum(not s.listening for s in sockets) >= 4
    assert breaches(sockets) == []
    assert loopback_watch.samples > 0
    assert not loopback_watch.seen


def test_the_watch_would_see_a_wildcard_or_a_remote_address() -> None:
    """The loopback check is not vacuous: a socket bound to every address is a breach."""
    with socket.socket() as wildcard, socket.socket() as local:
        wildcard.bind(("0.0.0.0", 0))
        wildcard.listen()
        local.bind(("127.0.0.1", 0))
        local.listen()
        found = breaches(sockets_of([os.getpid()]))
        assert [s.local for s in found] == [f"0.0.0.0:{wildcard.getsockname()[1]}"]
