"""Locks for prepare and unprepare: per claim and per device within the process, and across processes.

Keyed locks let unrelated claims proceed in parallel while two operations on one claim or one device never
overlap. The file lock serialises prepare and unprepare across agent instances during a rolling update, when
two instances share the same checkpoint and devices.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path

__all__ = ["FileLock", "KeyedLocks"]


class KeyedLocks:
    """asyncio locks created on demand per key and dropped when nobody holds or waits for them."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @asynccontextmanager
    async def hold(self, keys: Iterable[str]) -> AsyncIterator[None]:
        """Hold all keys; taken in sorted order so two holders of overlapping sets cannot deadlock."""
        ordered = sorted(set(keys))
        for key in ordered:
            lock, users = self._locks.get(key, (asyncio.Lock(), 0))
            self._locks[key] = (lock, users + 1)
        taken: list[asyncio.Lock] = []
        try:
            for key in ordered:
                lock = self._locks[key][0]
                await lock.acquire()
                taken.append(lock)
            yield
        finally:
            for lock in taken:
                lock.release()
            for key in ordered:
                lock, users = self._locks[key]
                if users == 1:
                    del self._locks[key]
                else:
                    self._locks[key] = (lock, users - 1)

    def __len__(self) -> int:
        return len(self._locks)


class FileLock:
    """An exclusive flock on a file, taken without blocking the event loop."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._local = asyncio.Lock()  # flock is per open file: serialise this process's holders first

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        async with self._local:
            waiting = asyncio.ensure_future(asyncio.to_thread(_lock, self.path))
            try:
                fd = await asyncio.shield(waiting)
            except asyncio.CancelledError:
                # The thread may still get the lock after we gave up: release it as soon as it does.
                waiting.add_done_callback(_release_late)
                raise
            try:
                yield
            finally:
                os.close(fd)  # closing the file releases the lock


def _release_late(done: asyncio.Future[int]) -> None:
    if not done.cancelled() and done.exception() is None:
        os.close(done.result())


def _lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd
