"""The cgroup of a claim's MPS daemon: found beside the kubelet's pod tree from the agent's cgroup, and joined by
the launcher, so that killing every process of the agent pod's cgroup (what the runtime does when the pod ends)
leaves the daemon serving."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from backends.nvidia.mps_cgroup import CGROUPS_RECORD, Hierarchy, daemon_cgroup, read_membership, remove_cgroups
from cluster.cgroups import CGROUP_FS, make_cgroup, remove_cgroup
from tests.support.timing import scaled

CLAIM = "5f0c3b52-6d1e-4a43-9c1f-0e3d2b9a7c11"


@pytest.mark.parametrize(("agent", "daemon"), [
    # The kubelet's cgroupfs driver, under its default root and under a root of its own.
    ("/kubepods/besteffort/pod1/c0ffee", f"/dra-agent-mps/{CLAIM}"),
    ("/node-a/kubepods/burstable/pod1/c0ffee", f"/node-a/dra-agent-mps/{CLAIM}"),
    # Its systemd driver.
    ("/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice/cri-containerd-c0ffee.scope",
     f"/dra-agent-mps/{CLAIM}"),
    # A guaranteed pod sits right below kubepods.
    ("/kubepods/pod1/c0ffee", f"/dra-agent-mps/{CLAIM}"),
])
def test_the_daemons_cgroup_is_beside_the_kubelets_pod_tree(agent: str, daemon: str) -> None:
    assert daemon_cgroup(agent, CLAIM) == daemon


@pytest.mark.parametrize("agent", ["/system.slice/dra-agent.service", "/", "/user.slice/kubepodsx/a"])
def test_outside_a_pods_cgroup_the_daemon_stays_where_it_was_started(agent: str) -> None:
    assert daemon_cgroup(agent, CLAIM) is None


def test_membership_is_read_per_hierarchy() -> None:
    assert read_membership("12:memory:/kubepods/pod1/c0ffee\n1:name=systemd:/a:b\n0::/\n") == [
        Hierarchy("memory", "/kubepods/pod1/c0ffee"), Hierarchy("name=systemd", "/a:b"), Hierarchy("", "/")]


# The launcher against the machine's own cgroups.

def _membership(pid: int) -> dict[str, str]:
    return {h.controllers: h.path for h in read_membership(Path(f"/proc/{pid}/cgroup").read_text())}


@pytest.fixture
def pod_cgroup() -> Iterator[str]:
    """A cgroup standing in for a node's cgroup root, with a pod's cgroup below its `kubepods`; removed with
    whatever still runs in it."""
    if os.geteuid() != 0:
        pytest.skip("cgroups are made as root")
    node = f"dra-mps-test-{uuid.uuid4().hex[:8]}"
    make_cgroup(node)
    for part in ("kubepods", "kubepods/pod1", "kubepods/pod1/c0ffee"):
        make_cgroup(f"{node}/{part}")
    try:
        yield node
    finally:
        remove_cgroup(node)


def _top(controllers: str) -> Path:
    """Where this machine mounts the hierarchy of `controllers` (`""`: the unified one)."""
    if (CGROUP_FS / "cgroup.procs").exists():
        return CGROUP_FS
    return CGROUP_FS / ("unified" if not controllers else controllers.removeprefix("name="))


def _exists(controllers: str, cgroup: str) -> bool:
    return (_top(controllers) / cgroup.lstrip("/") / "cgroup.procs").exists()


def _join(cgroup: str) -> None:
    """Run in the child before it starts the launcher: join `cgroup` in every hierarchy, as a pod's process is."""
    for controllers in _membership(os.getpid()):
        if _exists(controllers, cgroup):
            (_top(controllers) / cgroup / "cgroup.procs").write_text("0\n")


def _launch(folder: Path, cgroup: str) -> subprocess.Popen[bytes]:
    program = folder.parent / "daemon"
    program.write_text("#!/bin/sh\nexec sleep 600\n")
    program.chmod(0o755)
    (folder / "shm").mkdir(parents=True)
    with open(folder.parent / "output", "wb") as output:
        return subprocess.Popen([sys.executable, "-m", "backends.nvidia.mps_launch", str(folder / "daemon.pid"),
                                 str(folder / "shm"), str(program)], preexec_fn=lambda: _join(cgroup),
                                stdout=output, stderr=output)


def _became_daemon(daemon: subprocess.Popen[bytes], folder: Path) -> None:
    deadline = time.monotonic() + scaled(20)
    while Path(f"/proc/{daemon.pid}/comm").read_text().strip() != "sleep":
        assert daemon.poll() is None, (folder.parent / "output").read_text()
        assert time.monotonic() < deadline, "the launcher never became the daemon"
        time.sleep(0.02)


def test_the_launcher_leaves_the_pods_cgroup_and_outlives_it(pod_cgroup: str, tmp_path: Path) -> None:
    folder = tmp_path / CLAIM
    daemon = _launch(folder, f"{pod_cgroup}/kubepods/pod1/c0ffee")
    try:
        _became_daemon(daemon, folder)
        membership = _membership(daemon.pid)
        wanted = f"/{pod_cgroup}/dra-agent-mps/{CLAIM}"
        # In every hierarchy the pod's cgroup was in (all those this machine mounts).
        joined = {c for c, path in _membership(os.getpid()).items() if _exists(c, pod_cgroup)}
        assert joined and {c: membership[c] for c in joined} == dict.fromkeys(joined, wanted)
        made = dict(line.split(" ", 1) for line in (folder / CGROUPS_RECORD).read_text().splitlines())
        assert made == {c or "unified": wanted for c in joined}
        assert all(_exists(c, wanted) for c in joined)

        # The runtime ends the pod: every process in its cgroup is killed. The daemon is not among them.
        remove_cgroup(f"{pod_cgroup}/kubepods")
        time.sleep(scaled(0.2))
        assert daemon.poll() is None

        daemon.send_signal(signal.SIGKILL)
        daemon.wait()
        remove_cgroups(folder / CGROUPS_RECORD)
        assert not (folder / CGROUPS_RECORD).exists()
        assert [c for c in joined if _exists(c, wanted)] == []
        # Nothing the launcher or the removal mounted is left in the claim's folder or anywhere else.
        assert sorted(p.name for p in folder.iterdir()) == ["daemon.pid", "shm"]
        assert str(folder) not in Path("/proc/self/mountinfo").read_text()
    finally:
        daemon.kill()
        daemon.wait()


def test_a_launcher_outside_a_pods_cgroup_stays_in_its_cgroup(pod_cgroup: str, tmp_path: Path) -> None:
    folder = tmp_path / CLAIM
    daemon = _launch(folder, pod_cgroup)
    try:
        _became_daemon(daemon, folder)
        assert set(_membership(daemon.pid).values()) <= {f"/{pod_cgroup}", "/"}
        assert not (folder / CGROUPS_RECORD).exists()
    finally:
        daemon.kill()
        daemon.wait()
