"""The prepared-claims journal: replay, torn and corrupt records, compaction, two instances, versions."""

from __future__ import annotations

import functools
import os
import random
import re
import sys
import tempfile
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.claims import checkpoint as cp
from agent.claims.checkpoint import Checkpoint, CheckpointDamaged, CheckpointError
from agent.claims.records import DeviceRecord
from cdi.spec import ContainerEdits, DeviceNode, Mount
from tests.support.timing import scaled

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
    prepared(again, 2)  # appended after the torn line, which stays unread
    assert set(reopened(path).claims) == {uid(1), uid(2)}


def test_a_corrupt_record_in_the_middle_makes_the_journal_untrusted(scratch: Path) -> None:
    path = scratch / "j"
    journal = reopened(path)
    prepared(journal, 1)
    prepared(journal, 2)
    journal.close()
    lines = path.read_bytes().split(b"\n")
    lines[2] = lines[2].replace(b"claim-1", b"claim-X")  # the completed record of claim 1: checksum mismatch
    path.write_bytes(b"\n".join(lines))
    # Skipping it would turn claim 1, prepared and running, into a `started` claim to roll back.
    with pytest.raises(CheckpointDamaged, match=r"record at byte \d+ \(line 3\).*checksum mismatch") as caught:
        reopened(path)
    assert str(path) in str(caught.value) and "mv " in str(caught.value)


def test_newer_format_is_refused_naming_the_file(scratch: Path) -> None:
    path = scratch / "j"
    path.write_bytes(cp._line({"format": 9, "op": "header", "driver": ""}))
    with pytest.raises(CheckpointError, match=f"checkpoint {path} was written by a newer dra-agent \\(format 9"):
        reopened(path)


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "random bytes":
        path.write_bytes(random.Random(7).randbytes(len(data)))
    elif how == "emptied":
        path.write_bytes(b"")
    elif how == "cut to 30 bytes":
        path.write_bytes(data[:30])
    elif how == "NULs":
        path.write_bytes(b"\0" * len(data))
    elif how == "format one":
        header, *rest = data.split(b"\n")
        path.write_bytes(b"\n".join([header, cp._line({"format": "one", "op": "removed", "uid": uid(1)}).rstrip(),
                                     *rest]))
    elif how == "no header":  # a journal of an older agent, or one whose first lines were lost
        path.write_bytes(b"".join(line + b"\n" for line in data.split(b"\n")[1:] if line))
    elif how == "another driver's":
        path.write_bytes(data.replace(b'"driver":"gpu.nvidia.com"', b'"driver":"tpu.google.com"'))
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["random bytes", "emptied", "cut to 30 bytes", "NULs", "format one", "no header",
                                 "another driver's"])
def test_a_damaged_journal_is_refused_naming_the_file(scratch: Path, how: str) -> None:
    path = scratch / "gpu.nvidia.com/checkpoint.journal"
    journal = Checkpoint(path, BOOT, driver="gpu.nvidia.com")
    journal.load()
    prepared(journal, 1)
    prepared(journal, 2)
    journal.close()
    if how == "another driver's":
        journal.compact()  # the header's CRC must match the new driver name: rewrite it as that driver would
        path.write_bytes(path.read_bytes().replace(b'"driver":"gpu.nvidia.com"', b'"driver":"tpu.google.com"'))
        text = path.read_bytes().split(b"\n")
        body = text[0].split(b" ", 1)[1]
        text[0] = f"{zlib.crc32(body):08x} ".encode() + body
        path.write_bytes(b"\n".join(text))
    else:
        damage(path, how)
    before = path.read_bytes()
    again = Checkpoint(path, BOOT, driver="gpu.nvidia.com")
    with pytest.raises(CheckpointDamaged) as caught:
        again.load()
    message = str(caught.value)
    assert str(path) in message and "does not guess" in message
    assert "Traceback" not in message and len(message) < 1500
    assert path.read_bytes() == before, "a refused journal is left as it was"
    if how == "format one":
        assert 'format "one" is not a format number' in message


def test_a_missing_journal_starts_empty_with_a_header(scratch: Path) -> None:
    path = scratch / "gpu.nvidia.com/checkpoint.journal"
    journal = Checkpoint(path, BOOT, driver="gpu.nvidia.com")
    journal.load()
    assert journal.created and journal.claims == {}
    assert b'"op":"header"' in path.read_bytes().split(b"\n")[0]
    again = Checkpoint(path, BOOT, driver="gpu.nvidia.com")
    again.load()
    assert not again.created and again.claims == {}


def test_a_started_record_names_its_instance_and_admin_devices(scratch: Path) -> None:
    path = scratch / "j"
    journal = Checkpoint(path, BOOT, owner="a1b2")
    journal.load()
    started = journal.start(uid(1), "ns", "c", (("gpu-0", "nvidia-gpu"), ("gpu-1", "nvidia-gpu")),
                            admin=frozenset({"gpu-1"}))
    again = reopened(path).claims[uid(1)]
    assert again == started and again.owner == "a1b2"
    assert [(d.device, d.admin_access) for d in again.devices] == [("gpu-0", False), ("gpu-1", True)]


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
    real_sync = os.fdatasync

    def counting_sync(fd: int) -> None:
        nonlocal syncs
        syncs += 1
        real_sync(fd)

    monkeypatch.setattr(os, "fdatasync", counting_sync)
    journal = reopened(scratch / "j")
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda n: prepared(journal, n, device=f"gpu-{n}"), range(64)))
    assert set(reopened(scratch / "j").claims) == {uid(n) for n in range(64)}
    assert syncs <= 128, "never more than one fdatasync per record"


def test_a_failed_write_fails_its_callers_only(scratch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    journal = reopened(scratch / "j")
    prepared(journal, 1)
    real_sync = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (_ for _ in ()).throw(OSError(5, "Input/output error")))
    with pytest.raises(CheckpointError, match="Input/output error"):
        journal.start(uid(2), "ns", "claim-2", (("gpu-2", "nvidia-gpu"),))
    monkeypatch.setattr(os, "fdatasync", real_sync)
    prepared(journal, 3)
    assert {uid(1), uid(3)} <= set(reopened(scratch / "j").claims)


def test_a_started_record_may_skip_the_sync_and_is_synced_with_the_next(scratch: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = scratch / "gpu.nvidia.com/checkpoint.journal"
    journal = reopened(path)
    prepared(journal, 1)  # opens the journal
    syncs: list[int] = []
    real_sync = os.fdatasync

    def recording_sync(fd: int) -> None:
        syncs.append(os.fstat(fd).st_size)
        real_sync(fd)

    monkeypatch.setattr(os, "fdatasync", recording_sync)

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
            done.wait(scaled(5))

    other = threading.Thread(target=hold)
    other.start()
    holding.wait(scaled(5))
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


def _run_concurrently(journal: Checkpoint, programs: list[list[tuple[str, int]]]) -> dict[str, str]:
    """Each program in a thread of its own (its claims are its own, as the preparer's per-claim locks make them),
    and a compaction running all along; the state each claim must end in."""
    expected: dict[str, str] = {}
    done = threading.Event()

    def compacting() -> None:
        while not done.is_set():
            journal.compact()

    def run(thread: int, program: list[tuple[str, int]]) -> None:
        for op, n in program:
            claim = thread * 1000 + n
            if op == "prepare":
                prepared(journal, claim, device=f"gpu-{claim}")
            else:
                journal.remove(uid(claim))

    for thread, program in enumerate(programs):
        for op, n in program:
            expected[uid(thread * 1000 + n)] = op
    compactor = threading.Thread(target=compacting)
    workers = [threading.Thread(target=run, args=(t, p)) for t, p in enumerate(programs)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads preempted between any two bytecodes: the narrowest window shows
    try:
        compactor.start()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        done.set()
        compactor.join()
    finally:
        sys.setswitchinterval(interval)
    return {u: op for u, op in expected.items() if op == "prepare"}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.tuples(st.sampled_from(["prepare", "remove"]), st.integers(0, 5)), max_size=12),
                min_size=2, max_size=6))
def test_concurrent_records_removals_and_compactions_keep_every_answer(
        monkeypatch: pytest.MonkeyPatch, programs: list[list[tuple[str, int]]]) -> None:
    monkeypatch.setattr(cp, "_COMPACT_AFTER", 1)  # every removal may compact too
    with tempfile.TemporaryDirectory(prefix="dra-t-") as folder:
        path = Path(folder) / "j"
        journal = reopened(path)
        live = _run_concurrently(journal, programs)
        assert set(journal.claims) == set(live)
        assert set(reopened(path).claims) == set(live), "the file says what the answers said"
        journal.close()


def _all_at_once(work: list[Callable[[], None]]) -> None:
    threads = [threading.Thread(target=w) for w in work]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)


def test_a_batch_of_64_prepared_then_unprepared_leaves_nothing(scratch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kubelet's batch of 64 claims prepared concurrently, then unprepared concurrently: removals compact the
    journal while others are still returning from theirs."""
    monkeypatch.setattr(cp, "_COMPACT_AFTER", 8)
    for round_ in range(20):
        path = scratch / f"j{round_}"
        journal = reopened(path)
        _all_at_once([functools.partial(prepared, journal, n, device=f"gpu-{n}") for n in range(64)])
        _all_at_once([functools.partial(journal.remove, uid(n)) for n in range(64)])
        assert journal.claims == {}
        assert reopened(path).claims == {}, f"round {round_}: removed claims came back from the journal"
        journal.close()


def _crc_line(body: bytes) -> bytes:
    return f"{zlib.crc32(body):08x} ".encode() + body + b"\n"


@pytest.mark.parametrize(("record", "why"), [
    (_crc_line(b"{not json"), "it is not JSON (expecting property name enclosed in double quotes, at column 2)"),
    (_crc_line(b"\xff\xfe"), "it is not UTF-8 text"),
    (cp._line({"format": cp.FORMAT, "op": "claim"}), "it lacks claim"),
    (cp._line({"format": cp.FORMAT}), "it lacks op"),
    (cp._line({"format": cp.FORMAT, "op": "removed", "uid": 7}), "uid is not a string"),
    (cp._line({"format": cp.FORMAT, "op": "dance"}), 'unknown operation "dance"'),
    (cp._line({"format": "one", "op": "removed", "uid": "u"}), 'format "one" is not a format number'),
])  # fmt: skip
def test_a_damaged_record_is_told_in_the_journal_s_words(scratch: Path, record: bytes, why: str) -> None:
    path = scratch / "j"
    journal = reopened(path)
    prepared(journal, 1)
    journal.close()
    path.write_bytes(path.read_bytes() + record)
    with pytest.raises(CheckpointDamaged) as caught:
        reopened(path)
    assert f"(line 4) does not read back: {why}" in str(caught.value)
    assert not re.search(r"\b\w*(Error|Exception)\b|None|'", str(caught.value).split("does not read back")[1])
