"""A map of string keys to JSON objects, kept as an append-only journal: what a backend changed on the hardware, so
that a restart can finish or undo it.

Each change is one JSON line (`{"put": [key, value]}` or `{"remove": key}`). A written line survives any crash of
the agent's process (the kernel's page cache outlives it); a power cut keeps only what was synced. So how much is
synced follows what the journal records. A change that ends with a reboot (a vfio binding, a MIG instance, a
compute mode) needs no sync at all: the power cut that loses its record also undoes the change, as the node
restarts. A journal of changes that outlive a reboot (a GPU's MIG mode) is `durable`: each line is made durable
with one `fdatasync`. A line torn by a crash is the last one and is ignored on load. When the journal holds many
more lines than entries it is rewritten whole, atomically (temporary file, fsync, rename, directory fsync).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["Journal"]

_COMPACT_SLACK = 256  # lines beyond the live entries before the journal is rewritten


class Journal:
    """The entries, in memory and in the file at `path`; not thread-safe: one owner serialises its calls.
    `problems` lists what loading skipped, for the owner to log."""

    def __init__(self, path: Path, durable: bool = True) -> None:
        self.path = path
        self.durable = durable  # whether its records must survive a power cut: they record what outlives a reboot
        self._entries: dict[str, dict[str, Any]] = {}
        self._lines = 0
        self._fd: int | None = None
        self.problems: list[str] = []

    def load(self) -> None:
        try:
            lines = self.path.read_bytes().splitlines()
        except FileNotFoundError:
            lines = []
        except OSError as e:
            self.problems.append(f"journal {self.path} unreadable, ignored: {e}")
            lines = []
        self._entries = {}
        for number, line in enumerate(lines, 1):
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
                if number < len(lines):  # not a torn last line: something else wrote here
                    self.problems.append(f"journal {self.path} line {number} ignored: {e}")
        self._lines = len(lines)
        self._compact()  # start from a clean file: no torn tail for the next append to follow

    def __iter__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        return iter(list(self._entries.items()))

    def get(self, key: str) -> dict[str, Any] | None:
        return self._entries.get(key)

    def put(self, key: str, value: dict[str, Any]) -> None:
        self._append({"put": [key, value]})
        self._entries[key] = value

    def remove(self, key: str) -> None:
        if key in self._entries:
            self._append({"remove": key})
            del self._entries[key]
            if self._lines > len(self._entries) + _COMPACT_SLACK:
                self._compact()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _append(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            self._compact()
        assert self._fd is not None
        os.write(self._fd, json.dumps(record, separators=(",", ":")).encode() + b"\n")
        if self.durable:
            os.fdatasync(self._fd)
        self._lines += 1

    def _compact(self) -> None:
        self.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temp = self.path.with_name(f".{self.path.name}.tmp")
        body = b"".join(json.dumps({"put": [k, v]}, separators=(",", ":")).encode() + b"\n"
                        for k, v in self._entries.items())
        with open(temp, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, self.path)
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        self._lines = len(self._entries)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
