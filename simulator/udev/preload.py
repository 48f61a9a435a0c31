"""umockdev's preload library for a simulated node: a process started under it with `UMOCKDEV_DIR` at the node's
root has its libudev read the node's sysfs as /sys and receive the uevents injected into the node.

Only libudev and the C library are redirected (paths below /sys, and below /dev and /proc where the node has
the file); the agent reads the node through its sysfs and dev roots as always. The library must be loaded
when the process starts, so a running process gets it by re-executing itself.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path

__all__ = ["PRELOAD", "UdevPreloadError", "active_for", "environment", "reexec_for"]

PRELOAD = "libumockdev-preload.so.0"
"""The library, by the name the dynamic loader finds it under (Debian package umockdev)."""

# The preload binds each netlink monitor at <root>/event<fd> in a sockaddr_un, whose path holds 107 bytes.
_SOCKET_PATH_MAX = 107 - len("/event65535")
# The trees the preload redirects into the testbed: the agent must reach the node by a path outside them (the
# node's folder may be in them, e.g. in /dev/shm, if reached through a link).
_DEVICE_TREES = ("/dev", "/sys", "/proc")


class UdevPreloadError(Exception):
    """A process cannot be run under the preload for this node; the message says why."""


def environment(root: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) plus what runs a process under the preload for `root`."""
    where = os.path.abspath(root)
    for special in _DEVICE_TREES:
        if where == special or where.startswith(special + "/"):
            raise UdevPreloadError(f"the node's path {where} lies below {special}, where umockdev's preload takes "
                                   "every file for one of the node's own (a device node: it would hold a socket "
                                   "open for each file the agent opens); keep the node elsewhere, e.g. below /tmp")
    if ctypes.util.find_library("umockdev-preload") is None:
        raise UdevPreloadError(f"umockdev is not installed ({PRELOAD} not found; Debian package umockdev)")
    testbed = str(root.resolve())
    if len(testbed) > _SOCKET_PATH_MAX:
        raise UdevPreloadError(f"the node's path {testbed} is longer than the {_SOCKET_PATH_MAX} characters "
                               "umockdev's event sockets allow")
    env = dict(os.environ if base is None else base)
    others = [lib for lib in env.get("LD_PRELOAD", "").split(":") if lib and "libumockdev-preload" not in lib]
    env["LD_PRELOAD"] = ":".join([PRELOAD, *others])
    env["UMOCKDEV_DIR"] = testbed
    return env


def active_for(root: Path) -> bool:
    """Whether this process runs under the preload with the node at `root` as its testbed."""
    testbed = os.environ.get("UMOCKDEV_DIR")
    if testbed is None or os.path.realpath(testbed) != os.path.realpath(root):
        return False
    # LD_PRELOAD may name it and the loader still refuse it; the process's mappings tell.
    try:
        with open("/proc/self/maps") as maps:
            return any("libumockdev-preload" in line for line in maps)
    except OSError:
        return False


def reexec_for(root: Path) -> str | None:
    """Re-execute this process, same interpreter and arguments, under the preload for the node at `root`.

    Returns None when the process already runs under it, or the reason it cannot (umockdev missing, the path too
    long); otherwise it does not return. A process whose environment already names this node is never re-executed
    again, so a preload the loader refused cannot cause a loop.
    """
    if active_for(root):
        return None
    if os.environ.get("UMOCKDEV_DIR") == str(root.resolve()):
        return f"{PRELOAD} was named in LD_PRELOAD but not loaded"
    try:
        env = environment(root)
    except UdevPreloadError as e:
        return str(e)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    raise AssertionError("unreachable")  # pragma: no cover - execve does not return
