"""The MIG devices this agent created, kept on disk so that a restart can tell its own instances from the ones an
operator or another tool made, and can finish or undo a prepare a crash cut short.

Each entry is written before NVML is asked to create anything (the intent: claim, device, GPU, profile,
placement), and again once the GPU instance and its compute instance exist (their ids). An entry goes when its
instance is destroyed. Stored in a `Journal` that is not synced: GPU and compute instances end with a reboot, so
a power cut that loses records also takes their instances away; a crash of the agent loses no written record.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from backends.journal import Journal

__all__ = ["LedgerEntry", "MigLedger"]


@dataclass(frozen=True)
class LedgerEntry:
    """One MIG device made (or being made) for a claim; `gpu_instance` is None until its ids are recorded."""

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
        self._journal = Journal(path, durable=False)  # instances end with a reboot
        self.problems: list[str] = []

    def load(self) -> None:
        self._journal.load()
        self.problems = list(self._journal.problems)
        for key, value in self._journal:
            try:
                LedgerEntry(**value)
            except TypeError as e:
                self.problems.append(f"MIG ledger entry {key} ignored: {e}")
                self._journal.remove(key)

    def __iter__(self) -> Iterator[LedgerEntry]:
        return iter([LedgerEntry(**value) for _, value in self._journal])

    def get(self, claim: str, device: str) -> LedgerEntry | None:
        value = self._journal.get(f"{claim}/{device}")
        return LedgerEntry(**value) if value is not None else None

    def put(self, entry: LedgerEntry) -> LedgerEntry:
        self._journal.put(entry.key, asdict(entry))
        return entry

    def update(self, entry: LedgerEntry, **changes: Any) -> LedgerEntry:
        """Add what an intent led to (the instances' ids)."""
        updated = replace(entry, **changes)
        self._journal.put(updated.key, asdict(updated))
        return updated

    def remove(self, entry: LedgerEntry) -> None:
        self._journal.remove(entry.key)

    def close(self) -> None:
        self._journal.close()
