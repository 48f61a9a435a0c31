"""The MIG devices this agent created, kept on disk so that a restart can tell its own instances from the ones an
operator or another tool made, and can finish or undo a prepare a crash cut short.

Each entry is written durably before NVML is asked to create anything (the intent: claim, device, GPU, profile,
placement), and again once the GPU instance and its compute instance exist (their ids). An entry goes when its
instance is destroyed.

The file is an append-only journal of JSON lines (`{"put": entry}` or `{"remove": key}`), each made durable with
one `fdatasync` (a quarter of a millisecond here, against ten times that for rewriting and renaming a file): the
two records of a prepare stay well inside its latency budget. A line torn by a crash is the last one and is
ignored on load. When the journal holds many more lines than entries it is rewritten whole, atomically.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

__all__ = ["LedgerEntry", "MigLedger"]

_COMPACT_SLACK = 256  # lines beyond the live entries before the journal is rewritten


@dataclass(frozen=True)
class LedgerEntry:
    """One MIG device made (or being made) for a claim; `gpu_instance` is None until NVML created it."""

    claim: str  # the claim's UID
    device: str
    bus_id: str  # the parent GPU's PCI address
    profile_id: int
    start: int
    gpu_instance: int | None = None
    compute_instance: int | None = None
    uuid: str | None = None

    @property
    def key(self) -> str:
        return f"{self.claim}/{self.device}"


class MigLedger:
    """The entries, in memory and in the journal at `path`; not thread-safe: one owner serialises its calls."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._entries: dict[str, LedgerEntry] = {}
        self._lines = 0
        self._fd: int | None = None
        self.problems: list[str] = []

    def load(self) -> None:
        try:
            lines = self.path.read_bytes().splitlines()
        except FileNotFoundError:
            lines = []
        except OSError as e:
            self.problems.append(f"MIG ledger {self.path} unreadable, ignored: {e}")
            lines = []
        self._entries = {}
        for number, line in enumerate(lines, 1):
            try:
                self._apply(json.loads(line))
            except (ValueError, TypeError, KeyError) as e:
                if number < len(lines):  # not a torn last line: something else wrote here
                    self.problems.append(f"MIG ledger {self.path} line {number} ignored: {e}")
        self._lines = len(lines)
        self._compact()  # start from a clean file: no torn tail for the next append to follow

    def _apply(self, record: dict[str, Any]) -> None:
        if "put" in record:
            entry = LedgerEntry(**record["put"])
            self._entries[entry.key] = entry
        else:
            self._entries.pop(str(record["remove"]), None)

    def __iter__(self) -> Iterator[LedgerEntry]:
        return iter(list(self._entries.values()))

    def get(self, claim: str, device: str) -> LedgerEntry | None:
        return self._entries.get(f"{claim}/{device}")

    def put(self, entry: LedgerEntry) -> LedgerEntry:
        self._append({"put": asdict(entry)})
        self._entries[entry.key] = entry
        return entry

    def update(self, entry: LedgerEntry, **changes: Any) -> LedgerEntry:
        return self.put(replace(entry, **changes))

    def remove(self, entry: LedgerEntry) -> None:
        if entry.key in self._entries:
            self._append({"remove": entry.key})
            del self._entries[entry.key]
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
        os.fdatasync(self._fd)
        self._lines += 1

    def _compact(self) -> None:
        """Rewrite the journal with one line per live entry: temporary file, fsync, rename, directory fsync."""
        self.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temp = self.path.with_name(f".{self.path.name}.tmp")
        body = b"".join(json.dumps({"put": asdict(e)}, separators=(",", ":")).encode() + b"\n"
                        for e in self._entries.values())
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
