"""Where a claim's MPS control daemon lives among the host's cgroups, so that it outlives the agent's pod.

An agent run as the DaemonSet's pod starts each daemon as a child, in the pod's cgroup. When the pod ends (a
rolling update, a deletion) the runtime signals every process left in that cgroup (the kubelet does too when it
removes the pod's cgroup), which would end the daemon with it and leave the claim's containers without their MPS
server. So, before it becomes the daemon, the launcher moves itself into a cgroup of the claim's own beside the
kubelet's pod tree: `<parent of kubepods>/dra-agent-mps/<claim UID>` in every hierarchy (`kubepods` with the
kubelet's cgroupfs driver, `kubepods.slice` with its systemd driver). An agent run otherwise (as a systemd
service, or by hand) is in no pod's cgroup and leaves the daemon where it was started: the service's unit stops
only the agent (`KillMode=process`).

A pod sees only its own cgroup in the cgroup file systems the runtime mounted for it, and may have a cgroup
namespace of its own (cgroup v2), in which the host's cgroups are out of reach. So the launcher joins the host's
cgroup namespace (that of the host's PID 1, which the pod sees with `hostPID`, as it must for its daemons to outlive
it anyway: a PID namespace of the pod's own ends with the pod), and mounts each hierarchy afresh in a mount
namespace of its own, where it shows the host's whole tree. Nothing of it is seen outside that namespace.

The cgroups made are listed in a file beside the daemon's pid file before the launcher joins them; stopping the
daemon removes them, through `python -m backends.nvidia.mps_cgroup RECORD` (a mount namespace of its own is one
thing a threaded process such as the agent cannot make).
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

__all__ = ["CGROUPS_RECORD", "DAEMONS_CGROUP", "Hierarchy", "daemon_cgroup", "in_own_pid_namespace", "leave_pod_cgroup",
           "read_membership", "remove_cgroups", "unshare_mounts"]

CGROUPS_RECORD = "cgroups"
"""The file in a claim's MPS folder, beside the daemon's pid file, that lists the cgroups made for its daemon."""
DAEMONS_CGROUP = "dra-agent-mps"
"""The cgroup beside the kubelet's pod tree that holds one cgroup per claim's daemon."""
_UNIFIED = "unified"  # how a record names the cgroup v2 hierarchy, whose /proc/<pid>/cgroup line has no controllers
_HOST_CGROUP_NS = "/proc/1/ns/cgroup"
_CLONE_NEWCGROUP, _CLONE_NEWNS = 0x02000000, 0x00020000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
_MNT_DETACH = 2


@dataclass(frozen=True)
class Hierarchy:
    """One line of /proc/<pid>/cgroup: a hierarchy's controllers (`""` for the unified one, `name=systemd` for a
    named one) and the process's cgroup in it."""

    controllers: str
    path: str


def daemon_cgroup(path: str, claim: str) -> str | None:
    """The cgroup of the claim's daemon, beside the kubelet's pod tree in which `path` (the agent's cgroup) lies;
    None when `path` is no pod's cgroup."""
    parts = PurePosixPath(path).parts
    for i, part in enumerate(parts):
        if part == "kubepods" or part.startswith("kubepods."):
            return str(PurePosixPath(*parts[:i], DAEMONS_CGROUP, claim))
    return None


def read_membership(text: str) -> list[Hierarchy]:
    """The hierarchies of a /proc/<pid>/cgroup file's text."""
    lines = (line.split(":", 2) for line in text.splitlines() if line.count(":") >= 2)
    return [Hierarchy(controllers, path) for _, controllers, path in lines]


@functools.cache
def in_own_pid_namespace() -> bool:
    """Whether this process is in a PID namespace below the host's (a pod without `hostPID`): its processes end
    when the pod does, whatever their cgroup. Read once: a process never changes its PID namespace."""
    with open("/proc/self/status") as status:
        nspid = next((line.split()[1:] for line in status if line.startswith("NSpid:")), [])
    return len(nspid) > 1


def leave_pod_cgroup(claim: str, record: Path) -> list[str]:
    """Move this process into the claim's daemon cgroup in every hierarchy, when it is in a pod's; the cgroups,
    each as `<controllers> <path>`, are written to `record` before it moves. Returns them ([] when not in a pod's).
    Call in a mount namespace of this process's own (the hierarchies are mounted there, beside `record`). OSError
    when a cgroup cannot be made or joined."""
    _join_host_cgroup_namespace()
    moves = [(h, target) for h in read_membership(Path("/proc/self/cgroup").read_text())
             if (target := daemon_cgroup(h.path, claim)) is not None]
    if not moves:
        return []
    made = [f"{h.controllers or _UNIFIED} {target}" for h, target in moves]
    record.write_text("".join(f"{m}\n" for m in made))
    with _mounted([h for h, _ in moves], record.with_name(f".{record.name}.fs")) as tops:
        for top, (_, target) in zip(tops, moves, strict=True):
            folder = top / target.lstrip("/")
            folder.mkdir(parents=True, exist_ok=True)
            _fill_cpuset(folder, top)
            (folder / "cgroup.procs").write_text(f"{os.getpid()}\n")
    return made


@contextmanager
def _mounted(hierarchies: Sequence[Hierarchy], where: Path) -> Iterator[list[Path]]:
    """Each hierarchy mounted afresh below `where` (its whole tree, as this process's cgroup namespace shows it),
    unmounted and removed afterwards."""
    libc = ctypes.CDLL(None, use_errno=True)
    tops: list[Path] = []
    try:
        for i, hierarchy in enumerate(hierarchies):
            top = where / str(i)
            top.mkdir(parents=True, exist_ok=True)
            tops.append(top)
            kind, options = (b"cgroup2", None) if not hierarchy.controllers else (
                b"cgroup", (hierarchy.controllers if "=" not in hierarchy.controllers
                            else f"none,{hierarchy.controllers}").encode())
            if libc.mount(b"cgroup", str(top).encode(), kind, _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, options) != 0:
                error = ctypes.get_errno()
                raise OSError(error, f"cannot mount the {hierarchy.controllers or _UNIFIED} cgroup hierarchy: "
                                     f"{os.strerror(error)}")
        yield tops
    finally:
        for top in tops:
            libc.umount2(str(top).encode(), _MNT_DETACH)
        shutil.rmtree(where, ignore_errors=True)


def _join_host_cgroup_namespace() -> None:
    """Join the host's cgroup namespace, unless this process is in it (or cannot tell: a host whose PID 1 hides
    its namespaces): /proc/self/cgroup then names cgroups from the host's root, and the host's cgroups may be
    joined."""
    try:
        own, host = os.stat("/proc/self/ns/cgroup"), os.stat(_HOST_CGROUP_NS)
    except OSError:
        return
    if (own.st_dev, own.st_ino) == (host.st_dev, host.st_ino):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(_HOST_CGROUP_NS, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, _CLONE_NEWCGROUP) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"cannot join the host's cgroup namespace: {os.strerror(error)}")
    finally:
        os.close(fd)


def _fill_cpuset(folder: Path, top: Path) -> None:
    """A new v1 cpuset cgroup has no CPUs and memory nodes, and no process may join it until it has: it gets its
    parent's, from the top down (the kernel's own rule for each level)."""
    level = top
    for part in folder.relative_to(top).parts:
        level = level / part
        for setting in ("cpuset.cpus", "cpuset.mems"):
            file = level / setting
            if file.exists() and not file.read_text().strip():
                file.write_text((level.parent / setting).read_text())


def unshare_mounts() -> None:
    """A mount namespace of this process's own, whose mounts go nowhere else."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNS) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"cannot make a mount namespace of its own: {os.strerror(error)}")
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"cannot make its mounts private: {os.strerror(error)}")


def remove_cgroups(record: Path) -> None:
    """Remove the cgroups listed in `record` (left empty once the daemon ended) and the record, in a process of
    its own; a cgroup still in use or gone is left as it is."""
    if record.exists():
        subprocess.run([sys.executable, "-m", "backends.nvidia.mps_cgroup", str(record)],
                       stdin=subprocess.DEVNULL, capture_output=True, check=False, timeout=30)
        record.unlink(missing_ok=True)


def _remove(record: Path) -> None:
    made = [line.split(" ", 1) for line in record.read_text().splitlines() if " " in line]
    hierarchies = [Hierarchy("" if c == _UNIFIED else c, path) for c, path in made]
    _join_host_cgroup_namespace()
    unshare_mounts()
    with _mounted(hierarchies, record.with_name(f".{record.name}.fs")) as tops:
        for top, hierarchy in zip(tops, hierarchies, strict=True):
            with suppress(OSError):
                (top / hierarchy.path.lstrip("/")).rmdir()


if __name__ == "__main__":
    with suppress(OSError):
        _remove(Path(sys.argv[1]))
