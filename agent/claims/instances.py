"""Which agent instances are alive on this node: each running agent holds a lock file of its own in the state
directory for as long as its process lives.

During a DaemonSet rolling update the old and the new pod share the state directory. A record of work in progress
names the instance that does it; another instance may undo that work only once the owner is gone. The kernel
drops a process's locks when it dies, however it dies (SIGKILL, OOM), so "its lock can be taken" is a reliable "it
is gone", on one host, whatever mount or PID namespace each instance runs in.

    me = Instances(state_dir).register(pod_uid)      # at start; raises InstanceError if two cannot coexist
    me.alive(record.owner)                           # from any instance
    me.close()                                       # at stop (or the process ends)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

__all__ = ["InstanceError", "InstanceInfo", "Instances"]

_FOLDER = "instances"
_REGISTER = ".register"  # held while an instance checks the others and appears


class InstanceError(Exception):
    """This instance cannot run beside the ones already running on the same state."""


@dataclass(frozen=True)
class InstanceInfo:
    """What an instance wrote about itself when it started."""

    id: str
    pid: int
    pod_uid: str | None
    started: float


class Instances:
    """The live-instance registry in `<state_dir>/instances/`; `id` is this process's instance once registered."""

    def __init__(self, state_dir: Path) -> None:
        self.folder = state_dir / _FOLDER
        self.id = ""
        self._fd: int | None = None

    def register(self, pod_uid: str | None) -> Instances:
        """Take this process's lock. Refused while another instance runs unless both are rolling-update
        instances (`pod_uid` set), the only mode in which every change of shared state is serialised."""
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        # Checking the others and appearing are one step: two instances starting together see each other.
        guard = os.open(self.folder / _REGISTER, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(guard, fcntl.LOCK_EX)
            others = [info for info in self.running() if info.id != self.id]
            lone = [info for info in others if info.pod_uid is None]
            if others and (pod_uid is None or lone):
                other = (lone or others)[0]
                pod = f", pod {other.pod_uid}" if other.pod_uid else ""
                raise InstanceError(
                    f"another dra-agent (pid {other.pid}{pod}) serves {self.folder.parent}; only instances given "
                    "--pod-uid (a DaemonSet rolling update) may share it")
            self.id = uuid.uuid4().hex[:16]
            fd = os.open(self.folder / f"{self.id}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh name: nobody else holds it
            os.write(fd, json.dumps({"pid": os.getpid(), "podUID": pod_uid, "started": time.time()}).encode())
            self._fd = fd
        finally:
            os.close(guard)
        return self

    def alive(self, instance: str) -> bool:
        """Whether `instance` still runs. An empty name (a record from before owners were written) is not."""
        if not instance:
            return False
        if instance == self.id:
            return self._fd is not None
        return self._held(self.folder / f"{instance}.lock")

    def running(self) -> list[InstanceInfo]:
        """The instances alive now, this one included; lock files of dead ones are removed on the way."""
        found: list[InstanceInfo] = []
        try:
            names = sorted(os.listdir(self.folder))
        except FileNotFoundError:
            return []
        for name in names:
            if not name.endswith(".lock"):
                continue
            path = self.folder / name
            instance = name.removesuffix(".lock")
            if instance != self.id and not self._held(path, remove_if_free=True):
                continue
            found.append(_info(instance, path))
        return found

    def close(self) -> None:
        """Stop being alive: remove and release this instance's lock (the process's end does the same)."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            (self.folder / f"{self.id}.lock").unlink()
        os.close(self._fd)
        self._fd = None

    @staticmethod
    def _held(path: Path, remove_if_free: bool = False) -> bool:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    return True
                raise
            if remove_if_free:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()  # under our lock: a dead instance's file, nobody can take it meanwhile
            return False
        finally:
            os.close(fd)


def _info(instance: str, path: Path) -> InstanceInfo:
    try:
        data = json.loads(path.read_bytes() or b"{}")
    except (OSError, ValueError):
        data = {}
    pod_uid = data.get("podUID")
    return InstanceInfo(instance, int(data.get("pid", 0)), pod_uid if isinstance(pod_uid, str) else None,
                        float(data.get("started", 0.0)))
