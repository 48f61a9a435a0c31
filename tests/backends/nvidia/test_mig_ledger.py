"""The MIG ledger on its journal: durable records that survive a restart, a torn last line, and compaction."""

from __future__ import annotations

import json
from pathlib import Path

from backends.nvidia.mig_ledger import LedgerEntry, MigLedger


def reopened(path: Path) -> MigLedger:
    ledger = MigLedger(path)
    ledger.load()
    return ledger


def test_records_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "nvidia-mig/mig-ledger.json"
    ledger = reopened(path)
    a = ledger.put(LedgerEntry("uid-a", "gpu-0-mig-1g10gb-19-0", "0000:18:00.0", 19, 0))
    a = ledger.update(a, gpu_instance=7, compute_instance=0, uuid="MIG-x")
    b = ledger.put(LedgerEntry("uid-b", "gpu-0-mig-1g10gb-19-1", "0000:18:00.0", 19, 1))
    ledger.remove(b)
    ledger.close()
    again = reopened(path)
    assert list(again) == [a] and again.problems == []
    assert again.get("uid-a", "gpu-0-mig-1g10gb-19-0") == a and again.get("uid-b", b.device) is None


def test_a_line_torn_by_a_crash_is_ignored_and_the_next_record_lands(tmp_path: Path) -> None:
    path = tmp_path / "ledger.json"
    ledger = reopened(path)
    a = ledger.put(LedgerEntry("uid-a", "d", "0000:18:00.0", 19, 0))
    ledger.close()
    with path.open("ab") as f:
        f.write(b'{"put":{"claim":"uid-b","dev')  # the process died in the middle of this write
    again = reopened(path)
    assert list(again) == [a] and again.problems == []
    c = again.put(LedgerEntry("uid-c", "d", "0000:18:00.0", 19, 2))
    again.close()
    assert list(reopened(path)) == [a, c]


def test_damage_before_the_last_line_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "ledger.json"
    entry = {"claim": "u", "device": "d", "bus_id": "0000:18:00.0", "profile_id": 19, "start": 0}
    path.write_text("not json\n" + json.dumps({"put": ["u/d", entry]}) + "\n")
    ledger = reopened(path)
    assert [e.claim for e in ledger] == ["u"]
    assert ledger.problems and "line 1 ignored" in ledger.problems[0]


def test_the_journal_is_compacted(tmp_path: Path) -> None:
    path = tmp_path / "ledger.json"
    ledger = reopened(path)
    for i in range(400):
        entry = ledger.put(LedgerEntry(f"uid-{i}", "d", "0000:18:00.0", 19, i % 7))
        ledger.remove(entry)
    kept = ledger.put(LedgerEntry("kept", "d", "0000:18:00.0", 19, 3))
    ledger.close()
    assert len(path.read_text().splitlines()) < 300
    assert list(reopened(path)) == [kept]
