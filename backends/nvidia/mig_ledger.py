"""The MIG devices this agent created, kept on disk so that a restart can tell its own instances from the ones an
operator or another tool made, and can finish or undo a prepare a crash cut short.

Each entry is written durably before NVML is asked to create anything (the intent: claim, device, GPU, profile,
placement), and again once the GPU instance and the compute instance exist (their ids). An entry goes when its
instance is destroyed. The file is rewritten whole, atomically (temporary file, fsync, rename, directory fsync):
it holds a few entries per GPU at most.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

__all__ = ["LedgerEntry", "MigLedger"]


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
    """The entries, in memory and in `path`; not thread-safe: one backend owns it and serialises its calls."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._entries: dict[str, LedgerEntry] = {}
        self.problems: list[str] = []

    def load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
            self._entries = {e.key: e for e in (LedgerEntry(**item) for item in data["entries"])}
        except FileNotFoundError:
            self._entries = {}
        except (OSError, ValueError, TypeError, KeyError) as e:
            # Unreadable: act as if empty (nothing is destroyed that is not known to be ours) and say so.
            self.problems.append(f"MIG ledger {self.path} unreadable, ignored: {e}")
            self._entries = {}

    def __iter__(self) -> Iterator[LedgerEntry]:
        return iter(list(self._entries.values()))

    def get(self, claim: str, device: str) -> LedgerEntry | None:
        return self._entries.get(f"{claim}/{device}")

    def put(self, entry: LedgerEntry) -> LedgerEntry:
        self._entries[entry.key] = entry
        self._save()
        return entry

    def update(self, entry: LedgerEntry, **changes: object) -> LedgerEntry:
        return self.put(replace(entry, **changes))  # type: ignore[arg-type]

    def remove(self, entry: LedgerEntry) -> None:
        if self._entries.pop(entry.key, None) is not None:
            self._save()

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temp = self.path.with_name(f".{self.path.name}.tmp")
        body = json.dumps({"entries": [asdict(e) for e in self._entries.values()]}, indent=1)
        with open(temp, "w") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, self.path)
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
