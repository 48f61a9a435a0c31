"""The prepared-claims journal: replay, torn and corrupt records, compaction, two instances, versions."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from agent import checkpoint as cp
from agent.checkpoint import Checkpoint, CheckpointError, DeviceRecord
from cdi.spec import ContainerEdits, DeviceNode, Mount

BOOT = "11111111-1111-1111-1111-111111111111"


def uid(n: int) -> str:
    return f"00000000-0000-0000-0000-{n:012d}"


def prepared(journal: Checkpoint, n: int, device: str = "gpu-0") -> None:
    started = journal.start(uid(n), "ns", f"claim-{n}", ((device, "nvidia-gpu"),))
    journal.complete(started, (DeviceRecord(
        device=device, backend="nvidia-gpu", requests=("gpu",),
        cdi_ids=(f"k8s.gpu.nvidia.com/claim={uid(n)}-{device}",),
        edits=ContainerEdits(device_nodes=(DeviceNode("/dev/nvidia0"),)),
        common_edits=ContainerEdits(mounts=(Mount("/usr/lib/libcuda.so.1", "/usr/lib/libcuda.so.1"),)),
        restore={"gi": 3, "ci": 0},
    ),))


def reopened(path: Path, boot: str = BOOT) -> Checkpoint:
    journal = Checkpoint(path, boot)
    journal.load()
    return journal


def test_round_trip(scratch: Path) -> None:
    path = scratch / "gpu.nvidia.com/checkpoint.journal"
    journal = reopened(path)
    prepared(journal, 1)
    journal.start(uid(2), "ns", "claim-2", (("gpu-1", "nvidia-gpu"),))
    again = reopened(path)
    assert again.claims == journal.claims
    assert again.claims[uid(1)].state == "completed" and again.claims[uid(2)].state == "started"
    record = again.claims[uid(1)].devices[0]
    assert record.restore == {"gi": 3, "ci": 0}
    assert record.common_edits is not None and record.common_edits.mounts[0].host_path == "/usr/lib/libcuda.so.1"
    assert again.claims[uid(1)].boot_id == BOOT
    assert again.problems == []


def test_removed_claims_stay_removed(scratch: Path) -> None:
    path = scratch / "j"
    journal = reopened(path)
    prepared(journal, 1)
    journal.remove(uid(1))
    journal.remove(uid(99))  # unknown: nothing written
    assert reopened(path).claims == {}


def test_torn_last_record_is_dropped(scratch: Path) -> None:
    path = scratch / "j"
    journal = reopened(path)
    prepared(journal, 1)
    journal.close()
    with open(path, "ab") as f:
        f.write(b'0badc0de {"format": 1, "op": "removed", "uid"')  # the crash hit during this write
    again = reopened(path)
    assert set(again.claims) == {uid(1)}
    assert again.problems == []


def test_corrupt_record_in_the_middle_is_reported_and_skipped(scratch: Path) -> None:
    path = scratch / "j"
    journal = reopened(path)
    prepared(journal, 1)
    prepared(journal, 2)
    journal.close()
    lines = path.read_bytes().split(b"\n")
    lines[1] = lines[1].replace(b"claim-1", b"claim-X")  # checksum no longer matches
    path.write_bytes(b"\n".join(lines))
    again = reopened(path)
    assert again.claims[uid(1)].state == "started", "the completed record of claim 1 was lost, the started kept"
    assert again.claims[uid(2)].state == "completed"
    assert len(again.problems) == 1 and "checksum mismatch" in again.problems[0]


def test_newer_format_is_refused(scratch: Path) -> None:
    path = scratch / "j"
    path.write_bytes(cp._line({"format": 9, "op": "removed", "uid": uid(1)}))
    with pytest.raises(CheckpointError, match="newer agent"):
        reopened(path)


def test_compaction_keeps_live_claims_only(scratch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cp, "_COMPACT_AFTER", 4)
    path = scratch / "j"
    journal = reopened(path)
    for n in range(10):
        prepared(journal, n)
        if n % 3:
            journal.remove(uid(n))
    lines = [line for line in path.read_bytes().split(b"\n") if line]
    assert len(lines) < 3 * 10, "the journal was compacted"
    assert set(reopened(path).claims) == {uid(0), uid(3), uid(6), uid(9)}
    assert not (scratch / "j.tmp").exists()


def test_two_instances_share_one_journal(scratch: Path) -> None:
    path = scratch / "j"
    old, new = reopened(path), reopened(path)
    prepared(old, 1)
    new.refresh()
    assert set(new.claims) == {uid(1)}
    new.remove(uid(1))
    prepared(new, 2)
    old.refresh()
    assert set(old.claims) == {uid(2)}
    old.compact()  # the other instance replaces the file under the first one's open descriptor
    prepared(new, 3)
    old.refresh()
    assert set(old.claims) == {uid(2), uid(3)}
    assert set(reopened(path).claims) == {uid(2), uid(3)}


def test_boot_id(scratch: Path) -> None:
    (scratch / "sys/kernel/random").mkdir(parents=True)
    (scratch / "sys/kernel/random/boot_id").write_text(BOOT + "\n")
    assert cp.read_boot_id(scratch) == BOOT
    with pytest.raises(CheckpointError):
        cp.read_boot_id(scratch / "nope")


def test_concurrent_appends_commit_in_groups(scratch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from concurrent.futures import ThreadPoolExecutor

    syncs = 0
    real_sync = cp.os.fdatasync

    def counting_sync(fd: int) -> None:
        nonlocal syncs
        syncs += 1
        real_sync(fd)

    monkeypatch.setattr(cp.os, "fdatasync", counting_sync)
    journal = reopened(scratch / "j")
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda n: prepared(journal, n, device=f"gpu-{n}"), range(64)))
    assert set(reopened(scratch / "j").claims) == {uid(n) for n in range(64)}
    assert syncs <= 128, "never more than one fdatasync per record"


def test_a_failed_write_fails_its_callers_only(scratch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    journal = reopened(scratch / "j")
    prepared(journal, 1)
    real_sync = cp.os.fdatasync
    monkeypatch.setattr(cp.os, "fdatasync", lambda fd: (_ for _ in ()).throw(OSError(5, "Input/output error")))
    with pytest.raises(CheckpointError, match="Input/output error"):
        journal.start(uid(2), "ns", "claim-2", (("gpu-2", "nvidia-gpu"),))
    monkeypatch.setattr(cp.os, "fdatasync", real_sync)
    prepared(journal, 3)
    assert {uid(1), uid(3)} <= set(reopened(scratch / "j").claims)


def test_a_started_record_may_skip_the_sync_and_is_synced_with_the_next(scratch: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = scratch / "gpu.nvidia.com/checkpoint.journal"
    journal = reopened(path)
    prepared(journal, 1)  # opens the journal
    syncs: list[int] = []
    real_sync = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (syncs.append(os.fstat(fd).st_size), real_sync(fd)))

    first = journal.start_unsynced_now(uid(2), "ns", "claim-2", (("gpu-2", "nvidia-gpu"),))
    second = journal.start(uid(3), "ns", "claim-3", (("gpu-3", "nvidia-gpu"),), durable=False)
    assert first is not None and first.state == "started" and syncs == []
    # Written, though not synced: a restarted agent (the page cache outlives a crash) reads both.
    assert {u: c.state for u, c in reopened(path).claims.items()} == {
        uid(1): "completed", uid(2): "started", uid(3): "started"}
    journal.complete(second, ())
    assert syncs == [path.stat().st_size], "one sync, which takes the earlier lines along"


def test_an_unsynced_start_from_the_loop_never_waits_for_another_writer(scratch: Path) -> None:
    journal = reopened(scratch / "gpu.nvidia.com/checkpoint.journal")
    assert journal.start_unsynced_now(uid(1), "ns", "claim-1", ()) is None, "not open yet: opening may block"
    prepared(journal, 2)
    holding, done = threading.Event(), threading.Event()

    def hold() -> None:  # another thread in the middle of an append
        with journal._lock:
            holding.set()
            done.wait(5)

    other = threading.Thread(target=hold)
    other.start()
    holding.wait(5)
    try:
        assert journal.start_unsynced_now(uid(3), "ns", "claim-3", ()) is None
    finally:
        done.set()
        other.join()
    journal._writing = True  # another thread writing and syncing, the lock let go meanwhile
    assert journal.start_unsynced_now(uid(3), "ns", "claim-3", ()) is None
    journal._writing = False
    assert journal.start_unsynced_now(uid(3), "ns", "claim-3", ()) is not None
    assert uid(1) not in journal.claims and journal.claims[uid(3)].state == "started"
