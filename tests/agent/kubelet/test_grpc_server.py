"""Unix socket servers as the kubelet's plugin watcher sees them appear."""

from __future__ import annotations

import os
import stat
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from agent.kubelet.grpc_server import MAX_SOCKET_PATH, SocketError, UnixServer


def no_services(server: grpc.aio.Server) -> None:
    """A server with nothing registered: enough to listen."""


@contextmanager
def watching(folder: Path) -> Iterator[set[tuple[str, int, int, int]]]:
    """Record, as fast as a thread can look, every (name, inode, ctime, mode) a visible socket in `folder` has."""
    seen: set[tuple[str, int, int, int]] = set()
    done = threading.Event()

    def look() -> None:
        while not done.is_set():
            with os.scandir(folder) as entries:
                for entry in entries:
                    if entry.name.startswith("."):
                        continue  # the kubelet's watcher skips these
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if stat.S_ISSOCK(info.st_mode):
                        seen.add((entry.name, info.st_ino, info.st_ctime_ns, stat.S_IMODE(info.st_mode)))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # let the watcher run between any two steps of the start-up
    thread = threading.Thread(target=look, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(interval)


async def test_a_socket_appears_once_and_only_with_its_final_mode(scratch: Path) -> None:
    folder = scratch / "plugins"
    folder.mkdir(mode=0o750)
    for attempt in range(20):
        path = folder / f"s{attempt}.sock"
        server = UnixServer(path, no_services)
        with watching(folder) as seen:
            await server.start()
            await server.stop(None)
        views = {s for s in seen if s[0] == path.name}
        # One socket (a second inode would be a re-created one, which the kubelet re-registers), 0600 only. The
        # ctime may still move within the rename itself: the kernel updates it around the directory change.
        assert len({inode for _, inode, _, _ in views}) <= 1 and all(mode == 0o600 for *_, mode in views), views
    assert sorted(os.listdir(folder)) == [], "no socket, hidden or not, left behind"


async def test_a_socket_in_place_serves_and_is_private(scratch: Path) -> None:
    path = scratch / "d" / "dra.sock"
    server = UnixServer(path, no_services)
    await server.start()
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o750
        async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
            await channel.channel_ready()
    finally:
        await server.stop(None)
    assert not path.exists()


def test_a_path_too_long_for_a_socket_is_refused(scratch: Path) -> None:
    path = scratch / ("x" * (MAX_SOCKET_PATH - len(os.fsencode(scratch))))  # one byte over, with the "/"
    with pytest.raises(SocketError, match="longer than"):
        UnixServer(path, no_services)
    UnixServer(path.with_name(path.name[1:]), no_services)  # at the limit: accepted
