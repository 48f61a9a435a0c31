"""The cgroup the node's pods live under, made before the kubelet starts and removed after everything stopped.

The kubelet puts its QoS and pod cgroups under `cgroupRoot` (its own default is the hierarchies' root, shared with
every other kubelet on the machine: two clusters would remove each other's pod cgroups as orphans). Each node gets a
cgroup of its own instead, in every hierarchy mounted under /sys/fs/cgroup (the v1 controllers, the named
`systemd` one and the unified one of a hybrid host such as this project's machines). The kubelet requires that it
exists (`cgroup-root ... doesn't exist`); v1 `cpuset` needs its CPUs and memory nodes filled in before a process
may join, as the kernel leaves them empty in a new cgroup.

Removal kills whatever still runs in it (a container whose shim was killed with containerd) and removes the cgroups
deepest first, as rmdir removes only an empty cgroup.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

__all__ = ["CGROUP_FS", "make_cgroup", "remove_cgroup"]

CGROUP_FS = Path("/sys/fs/cgroup")


def _hierarchies() -> list[Path]:
    """The cgroup hierarchies mounted under /sys/fs/cgroup (a cgroup v2-only host has one, at the top)."""
    with open("/proc/self/mountinfo") as table:
        points = [Path(line.split()[4]) for line in table if " - cgroup" in line]
    return sorted(p for p in points if p == CGROUP_FS or p.parent == CGROUP_FS)


def make_cgroup(name: str) -> None:
    """Create the cgroup `/<name>` in every hierarchy."""
    if not name.strip("/"):
        raise ValueError("the cgroup to make must be below the root")
    for hierarchy in _hierarchies():
        path = hierarchy / name
        path.mkdir(exist_ok=True)
        for setting in ("cpuset.cpus", "cpuset.mems"):
            if (path / setting).exists() and not (path / setting).read_text().strip():
                (path / setting).write_text((hierarchy / setting).read_text())


def remove_cgroup(name: str, *, timeout: float = 10.0) -> None:
    """Kill every process in `/<name>` and below, in every hierarchy, then remove those cgroups."""
    if not name.strip("/"):
        raise ValueError("the cgroup to remove must be below the root")
    for hierarchy in _hierarchies():
        top = hierarchy / name
        if not top.is_dir():
            continue
        folders = sorted((Path(d) for d, _, _ in os.walk(top)), key=lambda p: len(p.parts), reverse=True)
        deadline = time.monotonic() + timeout
        for folder in folders:
            while True:
                _kill_members(folder)
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # busy: its processes are still exiting
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)


def _kill_members(folder: Path) -> None:
    try:
        pids = (folder / "cgroup.procs").read_text().split()
    except OSError:
        return
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
