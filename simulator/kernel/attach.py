"""One kernel side per simulated node root, shared by every process that uses the node, as the processes of a real
node share its kernel: a second `dra-agent run` on a node root already served attaches to the serving kernel
instead of starting its own (which would apply every sysfs write twice and keep a second GPU state).

The serving side (`services`) listens on `<root>/.sim/kernel.sock` and greets each process that connects;
a process stays attached while its connection is open, so its death detaches it. Finding the serving kernel, or
starting one, happens under an exclusive lock on `<root>/.sim/kernel.lock`, which a kernel process also takes
before it decides to end (when no process is attached any more): a process never attaches to a kernel that is
ending, and two processes never both start one.
"""

from __future__ import annotations

import fcntl
import os
import select
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from types import TracebackType

from simulator.nvml.control import socket_address

__all__ = ["AttachListener", "Attachment", "attach", "kernel_socket", "node_lock"]

_GREETING = b"attached\n"
_GREETING_TIMEOUT = 10.0


def kernel_socket(root: Path) -> Path:
    """Where the kernel serving the node at `root` takes attachments."""
    return root / ".sim" / "kernel.sock"


@contextmanager
def node_lock(root: Path, create: bool = True) -> Iterator[None]:
    """Hold the node's lock (between processes; not re-entrant within one). Without `create`, a node whose folder
    is gone (removed under a kernel still running) is not locked, nor made again: nobody can attach to it."""
    path = root / ".sim" / "kernel.lock"
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o600)
    except FileNotFoundError:
        if create:
            raise
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


class Attachment:
    """This process's attachment to the kernel serving a node: it keeps that kernel alive until `close()` or this
    process's end."""

    def __init__(self, root: Path, sock: socket.socket) -> None:
        self.root = root
        self._sock: socket.socket | None = sock

    def start(self) -> Attachment:
        return self

    def stop(self) -> None:
        self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Attachment:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()


def attach(root: Path) -> Attachment | None:
    """Attach to the kernel serving the node at `root` (hold `node_lock`); None when none serves it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(_GREETING_TIMEOUT)
        with socket_address(kernel_socket(root)) as address:
            sock.connect(address)
        greeting = sock.recv(len(_GREETING), socket.MSG_WAITALL)
    except OSError:  # no socket, or one left by a kernel that was killed
        sock.close()
        return None
    if greeting != _GREETING:
        sock.close()
        return None
    return Attachment(root, sock)


class AttachListener:
    """The serving side: counts the processes attached to this kernel, from a daemon thread."""

    def __init__(self, root: Path) -> None:
        self.path = kernel_socket(root)
        self._listener: socket.socket | None = None
        self._wake: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self._attached: set[socket.socket] = set()
        self._changed = threading.Condition()
        self._inode = 0

    @property
    def attached(self) -> int:
        """How many processes are attached now."""
        with self._changed:
            return len(self._attached)

    def wait_until_none(self) -> None:
        """Return once no process is attached."""
        with self._changed:
            self._changed.wait_for(lambda: not self._attached)

    def start(self) -> AttachListener:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with suppress(FileNotFoundError):
            self.path.unlink()  # left by a kernel that was killed (the caller holds the node's lock)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            with socket_address(self.path) as address:
                listener.bind(address)
            listener.listen(16)
            self._inode = self.path.stat().st_ino
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self._wake = os.pipe()
        self._thread = threading.Thread(target=self._serve, name="simulated-kernel-attach", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is None or self._wake is None or self._listener is None:
            return
        os.write(self._wake[1], b"x")
        self._thread.join()
        with suppress(FileNotFoundError):
            if self.path.stat().st_ino == self._inode:
                self.path.unlink()
        self._listener.close()
        with self._changed:
            for sock in self._attached:
                sock.close()
            self._attached.clear()
            self._changed.notify_all()
        for fd in self._wake:
            os.close(fd)
        self._thread = self._wake = self._listener = None

    def _serve(self) -> None:
        assert self._listener is not None and self._wake is not None
        poller = select.poll()
        poller.register(self._listener.fileno(), select.POLLIN)
        poller.register(self._wake[0], select.POLLIN)
        by_fd: dict[int, socket.socket] = {}
        while True:
            for fd, _ in poller.poll():
                if fd == self._wake[0]:
                    return
                if fd == self._listener.fileno():
                    try:
                        sock, _ = self._listener.accept()
                    except OSError:
                        continue
                    # Counted before it is greeted: a process that has its greeting is attached, so a kernel
                    # deciding to end (under the node's lock, which the attacher held) cannot miss it.
                    with self._changed:
                        self._attached.add(sock)
                    try:
                        sock.sendall(_GREETING)
                    except OSError:
                        with self._changed:
                            self._attached.discard(sock)
                            self._changed.notify_all()
                        sock.close()
                        continue
                    by_fd[sock.fileno()] = sock
                    poller.register(sock.fileno(), select.POLLIN)
                    continue
                sock = by_fd.pop(fd)  # the attached process closed its end, or died
                poller.unregister(fd)
                with self._changed:
                    self._attached.discard(sock)
                    self._changed.notify_all()
                sock.close()
