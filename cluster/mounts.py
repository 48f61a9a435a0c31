"""The mounts the node's components leave under their folders, and taking them away.

The kubelet bind-mounts its root folder onto itself (to make it shared) and mounts pod volumes below it; containerd
mounts the containers' root file systems, the sandboxes' /dev/shm and network namespaces below its state folder.
Each component unmounts its own as pods go, but a component killed, or stopped with pods still running, leaves them:
removing the folder then would fail on every mount point, or delete a volume's content through it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

__all__ = ["mounts_below", "unmount_below"]

_MNT_DETACH = 2
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _unescape(field: str) -> str:
    """A path of /proc/self/mountinfo: space, tab, newline and backslash are written as octal escapes."""
    for code in ("040", "011", "012", "134"):
        field = field.replace("\\" + code, chr(int(code, 8)))
    return field


def mounts_below(folder: Path) -> list[str]:
    """The mount points at or below `folder`, in the order they were mounted."""
    top = os.path.realpath(folder)
    found = []
    with open("/proc/self/mountinfo") as table:
        for line in table:
            point = _unescape(line.split()[4])
            if point == top or point.startswith(top + "/"):
                found.append(point)
    return found


def unmount_below(folder: Path) -> None:
    """Detach every mount at or below `folder`, the last mounted first (a mount below another goes before it)."""
    for _ in range(3):  # a detached shared mount can take its propagated copies along, or leave them to a next round
        points = mounts_below(folder)
        if not points:
            return
        for point in reversed(points):
            _libc.umount2(point.encode(), _MNT_DETACH)
