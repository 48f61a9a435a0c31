"""A map of string keys to JSON objects, kept as an append-only journal: what a backend changed on the hardware, so
that a restart can finish or undo it.

Each change is one JSON line (`{"put": [key, value]}` or `{"remove": key}`). A written line survives any crash of
the agent's process (the kernel's page cache outlives it); a power cut keeps only what was synced. So how much is
synced follows what the journal records. A change that ends with a reboot (a vfio binding, a MIG instance, a
compute mode) needs no sync at all: the power cut that loses its record also undoes the change, as the node
restarts. A journal of changes that outlive a reboot (a GPU's MIG mode) is `durable`: each line is made durable
with one `fdatasync`. A line torn by a crash is the last one and is dropped. When the journal holds many more
lines than entries, or when it is loaded with lines to drop, it is rewritten whole, atomically (temporary file,
rename; with an fsync of the file before and of the folder after when it is durable).

Two agent instances share the file during a rolling update, each with a journal object of its own: every call
takes a lock on a file beside the journal and first reads what the other instance appended (or re-reads the file
it rewrote), so each sees the other's changes and no append lands in a replaced file.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["Journal"]

_COMPACT_SLACK = 256  # lines beyond the live entries before the journal is rewritten


class Journal:
    """The entries, in memory and in the file at `path`; not thread-safe: one owner in a process serialises its
    calls. `problems` lists what reading skipped, for the owner to log."""

    def __init__(self, path: Path, durable: bool = True) -> None:
        self.path = path
        self.durable = durable  # whether its records must survive a power cut: they record what outlives a reboot
        self._entries: dict[str, dict[str, Any]] = {}
        self._lines = 0
        self._fd: int | None = None
        self._inode = 0  # of the file read or written last
        self._size = 0  # bytes of it read or written
        self._lock_fd: int | None = None
        self.problems: list[str] = []

    def load(self) -> None:
        with self._locked():
            self._entries, self._lines, self._inode, self._size = {}, 0, 0, 0
            self._catch_up()  # cuts a torn tail off
            if not self._inode or self._lines > len(self._entries):
                self._compact()  # start from a clean file: no removed, replaced or unreadable lines

    def __iter__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        with self._locked():
            self._catch_up()
            return iter(list(self._entries.items()))

    def get(self, key: str) -> dict[str, Any] | None:
        with self._locked():
            self._catch_up()
            return self._entries.get(key)

    def put(self, key: str, value: dict[str, Any]) -> None:
        with self._locked():
            self._catch_up()
            self._append({"put": [key, value]})
            self._entries[key] = value

    def remove(self, key: str) -> None:
        with self._locked():
            self._catch_up()
            if key in self._entries:
                self._append({"remove": key})
                del self._entries[key]
                if self._lines > len(self._entries) + _COMPACT_SLACK:
                    self._compact()

    def close(self) -> None:
        for fd in (self._fd, self._lock_fd):
            if fd is not None:
                os.close(fd)
        self._fd = self._lock_fd = None

    @contextmanager
    def _locked(self) -> Iterator[None]:
        if self._lock_fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.path.with_name(f".{self.path.name}.lock"),
                                    os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _catch_up(self) -> None:
        """Read what another instance wrote since this one last looked: appended lines, or the whole file when it
        was rewritten. Under the lock no one is writing, so a line without its end was torn by a crash."""
        try:
            stat = os.stat(self.path)
            if stat.st_ino == self._inode and stat.st_size == self._size:
                return  # the usual case: nothing new, one stat
            with open(self.path, "rb") as f:
                stat = os.fstat(f.fileno())
                if stat.st_ino != self._inode:
                    self._entries, self._lines, self._size = {}, 0, 0
                    self._inode = stat.st_ino
                    self._close_file()
                elif stat.st_size == self._size:
                    return
                f.seek(self._size)
                data = f.read()
        except FileNotFoundError:
            self._entries, self._lines, self._inode, self._size = {}, 0, 0, 0
            self._close_file()
            return
        except OSError as e:
            self.problems.append(f"journal {self.path} unreadable, ignored: {e}")
            return
        complete, _, torn = data.rpartition(b"\n")
        for line in complete.split(b"\n") if complete else ():
            self._lines += 1
            try:
                record = json.loads(line)
                if "put" in record:
                    key, value = record["put"]
                    if not isinstance(value, dict):
                        raise TypeError("an entry must be an object")
                    self._entries[str(key)] = value
                else:
                    self._entries.pop(str(record["remove"]), None)
            except (ValueError, TypeError, KeyError) as e:
                self.problems.append(f"journal {self.path} line {self._lines} ignored: {e}")
        self._size += len(data) - len(torn)
        if torn:
            os.truncate(self.path, self._size)

    def _close_file(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _append(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            if not self.path.exists():
                self._compact()
            else:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        assert self._fd is not None
        line = json.dumps(record, separators=(",", ":")).encode() + b"\n"
        os.write(self._fd, line)
        if self.durable:
            os.fdatasync(self._fd)
        self._lines += 1
        self._size += len(line)

    def _compact(self) -> None:
        self._close_file()
        temp = self.path.with_name(f".{self.path.name}.tmp")
        body = b"".join(json.dumps({"put": [k, v]}, separators=(",", ":")).encode() + b"\n"
                        for k, v in self._entries.items())
        with open(temp, "wb") as f:
            f.write(body)
            if self.durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(temp, self.path)  # atomic for any crash of the agent: what a power cut does, see above
        if self.durable:
            directory = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        self._lines = len(self._entries)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self._inode = os.fstat(self._fd).st_ino
        self._size = len(body)
