"""Leftovers of a node whose run was killed: found when no process names the node's folder any more, and removed
(its mounts, its cgroup with what still runs in it, its folder); a node whose processes run is left alone."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.cgroups import CGROUP_FS, make_cgroup, remove_cgroup
from cluster.leftovers import CGROUP_PREFIX, abandoned_nodes, remove_abandoned_nodes
from cluster.mounts import mounts_below, unmount_below
from tests.support.timing import scaled

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not (CGROUP_FS / "memory").is_dir(),
                                reason="needs root and the machine's cgroup v1 hierarchies")
GRACE_PASSED = 3600.0  # seconds: a moment, not a wait; past the grace period a new node gets
LATER = time.time() + GRACE_PASSED


@pytest.fixture
def nodes() -> Iterator[Path]:
    """A folder in which to make node folders; whatever the test left is removed."""
    with tempfile.TemporaryDirectory(prefix="leftovers-") as folder:
        yield Path(folder)
        for node in Path(folder).iterdir():
            unmount_below(node)
            remove_cgroup(f"{CGROUP_PREFIX}{node.name}")


def node(folder: Path, name: str) -> Path:
    """A node's folder with a mount below it and its cgroup, as a killed run leaves them."""
    path = folder / name / "kubelet"
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(path)], check=True)
    make_cgroup(f"{CGROUP_PREFIX}{name}")
    return folder / name


def test_an_abandoned_node_is_removed_and_a_running_one_is_not(nodes: Path) -> None:
    gone, running = node(nodes, "dra-rn-gone"), node(nodes, "dra-rn-running")
    # A container left in the abandoned node's cgroup; a component of the running node naming its folder.
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    component = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(600)", f"{running}/etcd"])
    try:
        (CGROUP_FS / "memory" / f"{CGROUP_PREFIX}{gone.name}" / "cgroup.procs").write_text(str(orphan.pid))
        assert abandoned_nodes(nodes) == [], "a node within its first minute was taken for abandoned"
        assert abandoned_nodes(nodes, now=LATER) == [gone]

        assert remove_abandoned_nodes(nodes, now=LATER) == [gone]
        assert orphan.wait(timeout=scaled(10)) != 0
        assert not gone.exists() and not mounts_below(gone)
        assert not (CGROUP_FS / "memory" / f"{CGROUP_PREFIX}{gone.name}").exists()
        assert running.exists() and mounts_below(running)
        assert (CGROUP_FS / "memory" / f"{CGROUP_PREFIX}{running.name}").exists()
    finally:
        for process in (orphan, component):
            process.kill()
            process.wait()
