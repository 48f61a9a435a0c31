"""gRPC servers on unix sockets, the way the kubelet expects them.

A stale socket file left by a killed process is removed before listening (a dead socket would keep the
kubelet retrying). The socket is bound under a hidden name, made 0600 and only then renamed into place in its
0750 directory, so the kubelet's plugin watcher (which ignores dot files) never sees it half set up, and never
sees it change after it appeared. On stop the server drains in-flight calls for a grace period and removes its
own socket file, never another's.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import grpc

__all__ = ["SocketError", "UnixServer"]

MAX_SOCKET_PATH = 106  # sun_path is 108 bytes with the terminating NUL, and the hidden name is a byte longer


class SocketError(Exception):
    """A socket cannot be created where it should be."""


class UnixServer:
    """One grpc.aio server listening on one unix socket."""

    def __init__(self, path: Path, register: Callable[[grpc.aio.Server], None]) -> None:
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise SocketError(f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes")
        self.path = path
        self._register = register
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        _prepare_directory(self.path.parent)
        _remove_stale(self.path)
        hidden = self.path.with_name("." + self.path.name)
        _remove_stale(hidden)
        server = grpc.aio.server()
        self._register(server)
        if server.add_insecure_port(f"unix:{hidden}") == 0:
            raise SocketError(f"cannot listen on {self.path}")
        await server.start()
        try:
            os.chmod(hidden, 0o600)
            os.rename(hidden, self.path)  # a listening socket keeps serving under its new name
        except OSError as e:
            await server.stop(None)
            raise SocketError(f"cannot put the socket in place at {self.path}: {e}") from e
        self._server = server

    async def stop(self, grace: float | None) -> None:
        """Refuse new calls, let running ones finish for `grace` seconds (None: abort them at once), remove the
        socket file."""
        if self._server is None:
            return
        server, self._server = self._server, None
        await server.stop(grace)
        try:
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)
        except FileNotFoundError:
            pass


def _prepare_directory(folder: Path) -> None:
    if not folder.exists():
        folder.mkdir(parents=True, mode=0o750)
        os.chmod(folder, 0o750)  # mkdir's mode is filtered by the umask


def _remove_stale(path: Path) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise SocketError(f"{path} exists and is not a socket; refusing to replace it")
    os.unlink(path)
