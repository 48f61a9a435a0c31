"""The real-cluster tier's fixtures: one control plane for the whole run (in one worker: every test module of the
tier is in the xdist group "real-cluster"), the simulated node registered, deploy/ applied; and, for the tests of
the node itself (`real_node`, their modules in the xdist group "real-node", so another worker runs them beside the
rest of the tier), a second cluster whose node runs the kubelet and containerd.

The binaries come from cluster/build.sh. Without them the tier skips with one line saying how to build them;
under CI=true it fails instead, so a CI run can never pass without it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import cluster
from cluster.agent_image import AgentImage, cached_agent_image
from cluster.controlplane import ControlPlane
from cluster.incluster import apply_deploy
from cluster.kubectl import Kubectl
from cluster.leftovers import remove_abandoned_nodes
from cluster.loopback import LoopbackWatch
from cluster.node import register_node
from cluster.worker import WorkerNode
from tests.real_cluster.agent_pod_env import import_agent_image
from tests.real_cluster.cluster_env import NODE, RealCluster
from tests.real_cluster.node_env import start_agent_stand_in
from tests.support.agent_env import memory_dir
from tests.support.timing import scaled

ROOT = Path(__file__).resolve().parents[2]
VERBOSITY = "DRA_AGENT_CLUSTER_VERBOSITY"
"""The components' log verbosity (their --v); the logs are kept under /tmp when a test of the tier fails."""


def built_binaries(part: str = "kubernetes") -> Path:
    folder = cluster.binaries(part)
    if folder is not None:
        return folder
    message = f"real-cluster tier: the {part} binaries are not built; run cluster/build.sh"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message + " (CI must build them before the tests)")
    pytest.skip(message)


def built_agent_image() -> AgentImage:
    image = cached_agent_image()
    if image is not None:
        return image
    message = "real-cluster tier: the agent's image is not built; run python -m cluster agent-image"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message + " (CI must build it before the tests)")
    pytest.skip(message)


@pytest.fixture(scope="session")
def loopback_watch() -> Iterator[LoopbackWatch]:
    """Every socket of the control plane's processes, sampled for the whole run."""
    watch = LoopbackWatch()
    watch.start()
    yield watch
    watch.stop()
    assert not watch.seen, "the cluster used addresses off loopback:\n" + "\n".join(map(str, sorted(
        watch.seen, key=str)))


@pytest.fixture(scope="session")
def real_cluster(request: pytest.FixtureRequest, loopback_watch: LoopbackWatch) -> Iterator[RealCluster]:
    binaries = built_binaries()
    folder = Path(tempfile.mkdtemp(prefix="dra-rc-"))
    plane = ControlPlane(folder, binaries, verbosity=int(os.environ.get(VERBOSITY, "1")))
    failed_before = request.session.testsfailed
    try:
        plane.start(timeout=scaled(120))
        loopback_watch.watch(plane.pids())
        kubectl = Kubectl(binaries / "kubectl", plane.admin_kubeconfig)
        node_uid = register_node(kubectl, NODE)
        kubectl.run("apply", "--server-side", "-k", str(ROOT / "deploy"))
        yield RealCluster(plane, kubectl, node_uid, loopback_watch)
    finally:
        plane.stop(keep=True)
        if request.session.testsfailed > failed_before:
            kept = Path(tempfile.gettempdir()) / f"dra-real-cluster-logs-{os.getpid()}"
            shutil.copytree(folder / "logs", kept, dirs_exist_ok=True)
            print(f"\nthe real cluster's logs are in {kept}")
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def real_node(request: pytest.FixtureRequest, loopback_watch: LoopbackWatch) -> Iterator[RealCluster]:
    """A cluster whose node `127.0.0.1` runs containerd and the kubelet (Ready), deploy/ applied without the
    DaemonSet, and the pod that stands in for the agent's running on the node (see node_env)."""
    binaries, node_binaries = built_binaries(), built_binaries("node")
    for removed in remove_abandoned_nodes(Path(tempfile.gettempdir())):
        print(f"removed the leftovers of a node of a killed run: {removed}")
    folder = Path(tempfile.mkdtemp(prefix="dra-rn-"))  # short: the shims' socket paths are below it
    plane = ControlPlane(folder, binaries, with_kubelet=True, node_name=NODE,
                         verbosity=int(os.environ.get(VERBOSITY, "1")))
    worker = WorkerNode(plane, node_binaries)
    failed_before = request.session.testsfailed
    started = False
    try:
        plane.start(timeout=scaled(120))
        loopback_watch.watch(plane.pids())
        worker.start(timeout=scaled(120))
        loopback_watch.watch(worker.pids())
        kubectl = Kubectl(binaries / "kubectl", plane.admin_kubeconfig)
        apply_deploy(kubectl, ROOT / "deploy")
        start_agent_stand_in(kubectl, worker)
        node = kubectl.get("node", NODE)
        started = True
        yield RealCluster(plane, kubectl, node["metadata"]["uid"], loopback_watch, worker=worker)
    finally:
        worker.stop()
        plane.stop(keep=True)
        if not started or request.session.testsfailed > failed_before:
            kept = Path(tempfile.gettempdir()) / f"dra-real-node-logs-{os.getpid()}"
            shutil.copytree(folder / "logs", kept, dirs_exist_ok=True)
            print(f"\nthe real node's cluster logs are in {kept}")
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def agent_image(request: pytest.FixtureRequest) -> AgentImage:
    """The agent's image (`python -m cluster agent-image`), imported into the node's containerd."""
    image = built_agent_image()
    import_agent_image(request.getfixturevalue("real_node"), image)
    return image


@pytest.fixture(autouse=True)
def released_namespaces(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test of the tier ends with its namespaces deleted and their devices free for the next test."""
    yield
    for name in ("real_cluster", "real_node"):
        if name in request.fixturenames:
            request.getfixturevalue(name).release()


@pytest.fixture
def node_root() -> Iterator[Path]:
    """A short-named folder in memory for one test's simulated node and agent files."""
    with memory_dir("dra-rn-") as path:
        yield path
