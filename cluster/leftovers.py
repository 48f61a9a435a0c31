"""What the nodes of earlier runs left behind when their run was killed before it could stop them (SIGKILL, a CI
job's timeout), found and removed before a new node starts.

A node that stops removes its cgroup, detaches the mounts below its folder and deletes the folder (`WorkerNode`);
a killed run does none of it, and its mounts, cgroup and the containers still in it would stay until the machine
restarts. A node is abandoned when its cgroup (`dra-agent-cluster-<folder name>`) exists while no process on the
machine names its folder on its command line: etcd, the API server, containerd, every shim and the kubelet of a
running node all do, from before the cgroup is made until after it is removed. Nodes younger than a minute are left
alone all the same, so a node being set up or torn down by another run is never touched.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from cluster.cgroups import CGROUP_FS, remove_cgroup
from cluster.mounts import unmount_below

__all__ = ["CGROUP_PREFIX", "abandoned_nodes", "remove_abandoned_nodes"]

CGROUP_PREFIX = "dra-agent-cluster-"
"""A node's cgroup is this followed by its folder's name (`WorkerNode.cgroup`)."""
_GRACE = 60.0


def _command_lines() -> list[str]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    found.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:  # gone meanwhile, or not ours to read
                continue
    return found


def abandoned_nodes(folder: Path, *, now: float | None = None) -> list[Path]:
    """The folders in `folder` (the temporary folder the nodes are made in) of abandoned nodes."""
    hierarchy = next((p for p in (CGROUP_FS / "memory", CGROUP_FS) if p.is_dir()), CGROUP_FS)
    try:
        names = [e.name[len(CGROUP_PREFIX):] for e in os.scandir(hierarchy)
                 if e.is_dir() and e.name.startswith(CGROUP_PREFIX)]
    except OSError:
        return []
    now = time.time() if now is None else now
    commands = _command_lines()
    found = []
    for name in names:
        node = folder / name
        if not node.is_dir():  # a node made elsewhere, or its folder already gone
            continue
        try:
            age = now - (hierarchy / f"{CGROUP_PREFIX}{name}").stat().st_mtime
        except OSError:
            continue
        if age > _GRACE and not any(f"{node}/" in command for command in commands):
            found.append(node)
    return found


def remove_abandoned_nodes(folder: Path, *, now: float | None = None) -> list[Path]:
    """Detach the mounts below each abandoned node's folder, remove its cgroup (ending the containers still in it)
    and its folder; the folders removed."""
    removed = abandoned_nodes(folder, now=now)
    for node in removed:
        unmount_below(node)
        remove_cgroup(f"{CGROUP_PREFIX}{node.name}")
        shutil.rmtree(node, ignore_errors=True)
    return removed
