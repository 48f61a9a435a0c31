"""The host's network namespace, for an agent that may run in another one (a pod without `hostNetwork`).

A netlink socket hears the network namespace it was created in, for as long as it lives: rtnetlink link changes,
and the uevents of network devices, which the kernel tags with their namespace. (Other uevents, PCI functions
included, reach every namespace.) An agent in a pod of its own would hear none of the host's links, so it opens
those sockets inside the host's namespace: a short-lived thread enters it with setns(2), which changes only the
calling thread, creates the sockets and ends; the sockets keep the host's namespace and are read on the event
loop like any other.

The host's namespace is that of the host's PID 1, `<host_root>/proc/1/ns/net`: the DaemonSet mounts the host's
root, its /proc included, at /host, so the pod needs no `hostPID`. Entering needs CAP_SYS_ADMIN, which the
privileged container has. The setting `host_netns` ("auto", "off" or a namespace file) chooses; see
docs/deploy.md.

The same namespaces decide what sysfs shows: `class/net` and the `net/` folders of PCI functions list only the
network devices of the namespace sysfs was mounted in. `sysfs_netdevs_problem` tells when the sysfs the agent
reads is not the host's.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TypeVar

from agent.logs import get_logger

__all__ = ["AUTO", "HOST_NETNS_FILE", "OFF", "NetnsError", "in_netns", "resolve_host_netns",
           "sysfs_netdevs_problem"]

AUTO, OFF = "auto", "off"
HOST_NETNS_FILE = "proc/1/ns/net"
"""The host's network namespace, below the host's root."""

_OWN_NETNS = Path("/proc/thread-self/ns/net")  # the calling thread's: sockets it opens land there
_CLONE_NEWNET = 0x40000000
_NOT_SEEN = "link changes and the uevents of the host's network devices"

T = TypeVar("T")


class NetnsError(Exception):
    """A network namespace cannot be entered; the message names its file and why."""


def resolve_host_netns(setting: str, host_root: Path, simulated: bool = False) -> Path | None:
    """The namespace file to open the kernel event sockets in, or None to open them where the agent runs: it is
    in the host's namespace already, `setting` is "off", or the host's namespace cannot be found (then a warning
    names what will not be seen).

    `setting` is "auto" (the namespace of the host's PID 1, through `host_root`), "off", or the path of a
    namespace file. A simulated node normally has no namespace file of its own: "auto" then stays quietly.
    """
    log = get_logger("host-netns")
    if setting == OFF:
        log.info("kernel event sockets opened in the agent's own network namespace", host_netns=OFF)
        return None
    path = host_root / HOST_NETNS_FILE if setting == AUTO else Path(setting)
    if setting == AUTO and simulated and not os.path.lexists(path):
        return None
    try:
        same = _same_file(path, _OWN_NETNS)
    except OSError as e:
        log.warning(f"the host's network namespace cannot be read: unless the agent runs in it, {_NOT_SEEN} "
                    "will not be seen", netns=str(path), error=e.strerror or str(e))
        return None
    if same:
        log.debug("the agent runs in the host's network namespace", netns=str(path))
        return None
    log.info("kernel event sockets opened in the host's network namespace", netns=str(path))
    return path


def in_netns(netns: Path | None, work: Callable[[], T]) -> T:
    """`work()`, run in the network namespace whose file is `netns` (in this thread when None).

    A thread of its own enters the namespace and ends with `work`: nothing else runs there, and this thread's
    namespace never changes. What `work` raises is raised here; NetnsError when the namespace cannot be entered.
    """
    if netns is None:
        return work()
    outcome: Future[T] = Future()

    def enter_and_work() -> None:
        try:
            _enter(netns)
            outcome.set_result(work())
        except BaseException as e:  # handed to the caller, who decides
            outcome.set_exception(e)

    thread = threading.Thread(target=enter_and_work, name="host-netns", daemon=True)
    thread.start()
    thread.join()
    return outcome.result()


def _enter(netns: Path) -> None:
    try:
        fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise NetnsError(f"cannot open the network namespace {netns}: {e.strerror or e}") from None
    try:
        _setns(fd)
    except OSError as e:
        reason = {errno.EPERM: "not permitted: entering a namespace needs CAP_SYS_ADMIN",
                  errno.EINVAL: "not a network namespace"}.get(e.errno or 0, e.strerror or str(e))
        raise NetnsError(f"cannot enter the network namespace {netns}: {reason}") from None
    finally:
        os.close(fd)


def _setns(fd: int) -> None:
    """setns(2) into a network namespace: os.setns from Python 3.12, libc's before (one call; a netlink library
    would cost more to import than it saves)."""
    if sys.version_info >= (3, 12):
        os.setns(fd, os.CLONE_NEWNET)
        return
    if _libc().setns(fd, _CLONE_NEWNET) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _same_file(a: Path, b: Path) -> bool:
    first, second = os.stat(a), os.stat(b)
    return (first.st_dev, first.st_ino) == (second.st_dev, second.st_ino)


def sysfs_netdevs_problem(sysfs_root: Path, host_root: Path) -> str | None:
    """Why the network devices in `<sysfs_root>/class/net` are not the host's, or None when they are or the
    host's cannot be read (`<host_root>/proc/1/net/dev`, the devices of the host's PID 1's namespace).

    A sysfs mounted in a pod's network namespace shows the pod's devices and hides the host's, SR-IOV physical
    functions included. The lists are read twice before they are called different: a device may come or go
    between the two reads.
    """
    problem = None
    for _ in range(2):
        host = _proc_netdevs(host_root / "proc/1/net/dev")
        if host is None:
            return None
        try:
            seen = set(os.listdir(sysfs_root / "class/net"))
        except OSError as e:
            return f"{sysfs_root}/class/net cannot be read: {e.strerror or e}"
        problem = _difference(sysfs_root, seen, host)
        if problem is None:
            return None
    return problem


def _difference(sysfs_root: Path, seen: set[str], host: set[str]) -> str | None:
    if seen == host:
        return None
    parts = []
    if host - seen:
        parts.append(f"missing the host's {', '.join(sorted(host - seen)[:8])}")
    if seen - host:
        parts.append(f"showing {', '.join(sorted(seen - host)[:8])}, which the host does not have")
    return (f"the sysfs at {sysfs_root} does not show the host's network devices ({'; '.join(parts)}): it was "
            f"mounted in another network namespace, so SR-IOV physical functions and their VFs' interfaces are "
            f"missing or wrong; mount the host's /sys there")


def _proc_netdevs(path: Path) -> set[str] | None:
    """The interface names in a /proc/<pid>/net/dev (two header lines, then `name: counters`); None when it
    cannot be read."""
    try:
        lines = path.read_text().splitlines()[2:]
    except OSError:
        return None
    return {line.split(":", 1)[0].strip() for line in lines if ":" in line}
