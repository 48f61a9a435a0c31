"""The prepared-claims checkpoint of one driver: which claims are being or have been prepared, durably.

Two-phase records per claim: `started` (written before any hardware is touched, naming the agent instance that
writes it) and `completed` (written after the CDI spec, before the kubelet gets its answer); `removed` when
unprepared. The file is an append-only journal of JSON lines, each with a format version and a CRC-32 of its content,
made durable with fdatasync: one small append per state change costs ~0.35 ms on a disk where rewriting a file
atomically costs ~2 ms. A `started` record may be written without a sync when the backends keep their own durable
records of what they change (`Backend.records_own_changes`): written, it survives any crash of the agent's process
(the kernel holds it), and the sync of the claim's `completed` record takes it to the disk too.

The journal begins with a header, written together with the file (temporary file, fsync, rename), so a journal
that lacks it was damaged after it was made: emptied, cut short, overwritten. When the journal grows it is compacted
by the same atomic rewrite. A torn last line (a crash during its write) was never acknowledged and is dropped; any
other line that does not read back exactly as written makes the whole journal untrusted (`CheckpointDamaged`): a
lost `completed` record would turn a running claim into one to roll back, a lost `removed` one would block a device
for ever, and nothing in the file tells which was lost. Every record carries the boot id, so claims prepared before a
reboot are known.
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from agent.claims.records import ClaimRecord, DeviceRecord

__all__ = ["FORMAT", "Checkpoint", "CheckpointDamaged", "CheckpointError", "Started", "read_boot_id"]

Started = tuple[str, str] | tuple[str, str, str | None]
"""A device whose preparation begins: (device, backend), or (device, backend, share id) for a share of it."""

FORMAT = 2
"""Journal format. Readers refuse records of a newer format rather than misread them. A change an older reader can
ignore keeps the number (a new field of a record, a claim, a device or a restore record: the older reader drops it,
so rolling back to it needs nothing); a change it could not follow raises it (a new operation, a new kind of
container edit, a field whose absence changes what is undone). See docs/deploy.md, "Rolling back"."""

_COMPACT_AFTER = 256  # records beyond the live claims before the journal is rewritten
_SHOWN_PROBLEMS = 3  # damaged lines named in the error; the count says how many more there are

class CheckpointError(Exception):
    """The checkpoint cannot be read or written."""


class CheckpointDamaged(CheckpointError):
    """The journal holds lines that do not read back as written: which claims are prepared cannot be known from it.

    `problems` names each damaged place; the message says what an operator can do.
    """

    def __init__(self, path: Path, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        shown = "; ".join(problems[:_SHOWN_PROBLEMS])
        more = f" (and {len(problems) - _SHOWN_PROBLEMS} more)" if len(problems) > _SHOWN_PROBLEMS else ""
        super().__init__(
            f"checkpoint {path} is damaged: {shown}{more}. The agent does not guess which claims are prepared. "
            f"Restore the file from a backup, or move it aside (mv {path} {path}.damaged) and start again: the "
            "agent then keeps the CDI specs of the claims it finds prepared and refuses their devices to other "
            "claims until the kubelet unprepares them")


def read_boot_id(proc: Path = Path("/proc")) -> str:
    """The kernel's boot id: it changes at every reboot, which invalidates hardware state."""
    try:
        return (proc / "sys/kernel/random/boot_id").read_text().strip()
    except OSError as e:
        raise CheckpointError(f"cannot read the boot id: {e}") from None


def _line(record: Mapping[str, Any]) -> bytes:
    body = json.dumps(record, sort_keys=True, separators=(",", ":"))
    return f"{zlib.crc32(body.encode()):08x} {body}\n".encode()


def _unreadable(e: ValueError | TypeError | KeyError) -> str:
    """Why a line is not a record, in the journal's terms (the checks above word their own)."""
    if isinstance(e, KeyError):
        return f"it lacks {e.args[0]}"
    if isinstance(e, json.JSONDecodeError):
        return f"it is not JSON ({e.msg[0].lower()}{e.msg[1:]}, at column {e.colno})"
    if isinstance(e, UnicodeDecodeError):
        return "it is not UTF-8 text"
    return str(e)


class _NewerFormat(Exception):
    def __init__(self, found: int) -> None:
        self.found = found


def _parse(line: bytes) -> dict[str, Any]:
    """One record, checked against its checksum; ValueError or TypeError describe why it is not one."""
    text = line.decode()  # UnicodeDecodeError is a ValueError
    checksum, _, body = text.partition(" ")
    if len(checksum) != 8 or f"{zlib.crc32(body.encode()):08x}" != checksum:
        raise ValueError("checksum mismatch")
    record = json.loads(body)
    if not isinstance(record, dict):
        raise TypeError("not a record")
    found = record.get("format")
    if type(found) is not int or found < 1:
        raise TypeError(f"format {json.dumps(found)} is not a format number")
    if found > FORMAT:
        raise _NewerFormat(found)
    return record


class Checkpoint:
    """The journal of one driver's claims and its in-memory view. Methods block: call them off the loop, from
    any number of threads (appends are committed in groups; one claim's records are ordered by its caller).

    `claims` is replaced, never changed in place, so a reader on another thread may iterate the dict it got. It
    changes only once a record is written, by the thread that wrote it and under the journal's lock, so a
    compaction (which copies it under that lock once no write is pending) writes exactly what the journal says.
    """

    def __init__(self, path: Path, boot_id: str, *, driver: str = "", owner: str = "") -> None:
        self.path = path
        self.boot_id = boot_id
        self.driver = driver  # checked against the header when set: another driver's journal is refused
        self.owner = owner  # the instance of this process, written into its records
        self.claims: dict[str, ClaimRecord] = {}
        self.created = False  # whether the last load found no journal and made one
        self._records = 0  # claim and removal records in the file, to know when to compact
        self._lines = 0  # lines read or written, to name a damaged one
        self._offset = 0
        self._inode = 0  # of the journal last read: a compaction by another instance replaces the file
        self._fd: int | None = None
        # Group commit: lines queued by concurrent callers (whether their caller waits for a sync, and what the
        # line changes in `claims`), how many were ever queued and how many are written.
        self._lock = threading.Condition()
        self._queue: list[tuple[bytes, bool, Callable[[], None]]] = []
        self._queued = 0
        self._written = 0
        self._writing = False
        self._failed: dict[int, CheckpointError] = {}

    def load(self) -> None:
        """Replay the journal, or make an empty one with its header if there is none. Only at start, while no other
        instance writes (a torn last line is cut off here, where `refresh` leaves it to its writer).

        Raises CheckpointDamaged when the journal cannot be trusted, CheckpointError when it is of a newer agent or
        cannot be read.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with self._lock:
            self.close()
            self.claims = {}
            self._records = self._lines = self._offset = self._inode = 0
            self.created = False
            if not self.path.exists():
                self._rewrite({})
                self.created = True
                return
            self._refresh()
            self._cut_torn_tail()

    def refresh(self) -> None:
        """Apply records appended since the last read (by another agent instance during a rolling update)."""
        with self._lock:
            self._refresh()

    def _refresh(self) -> None:
        try:
            with open(self.path, "rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                if inode != self._inode:  # first read, or compacted by another instance: read it all
                    self.close()
                    claims: dict[str, ClaimRecord] = {}
                    records = offset = lines_before = 0
                else:
                    claims, records, offset, lines_before = dict(self.claims), self._records, self._offset, self._lines
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            raise CheckpointDamaged(self.path, ["the file is gone"]) from None
        except OSError as e:
            raise CheckpointError(f"cannot read {self.path}: {e.strerror or e}") from None
        lines = data.split(b"\n")
        complete = lines[:-1]  # the last piece is a torn line, or empty
        if offset == 0 and not complete:
            raise CheckpointDamaged(self.path, ["it is empty" if not data else "it holds no complete line"])
        problems: list[str] = []
        at = offset
        for number, line in enumerate(complete):
            try:
                record = _parse(line)
                if at == 0:
                    self._check_header(record)
                else:
                    self._apply(record, claims)
                    records += 1
            except _NewerFormat as e:
                raise CheckpointError(
                    f"checkpoint {self.path} was written by a newer dra-agent (format {e.found}; this one reads up to "
                    f"{FORMAT}): run that version or a newer one on this node") from None
            except (ValueError, TypeError, KeyError) as e:
                where = "the header" if at == 0 else f"the record at byte {at}"
                problems.append(f"{where} (line {lines_before + number + 1}) does not read back: {_unreadable(e)}")
            at += len(line) + 1
        if problems:
            raise CheckpointDamaged(self.path, problems)
        # A torn tail stays unread: either it is still being written by another instance, or it never will be.
        self.claims, self._records, self._offset, self._inode = claims, records, at, inode
        self._lines = lines_before + len(complete)

    def _cut_torn_tail(self) -> None:
        """Drop a line a crash tore (never acknowledged), so that the next record starts on a line of its own."""
        try:
            if os.stat(self.path).st_size > self._offset:
                os.truncate(self.path, self._offset)
        except OSError as e:
            raise CheckpointError(f"cannot write {self.path}: {e.strerror or e}") from None

    def _check_header(self, record: Mapping[str, Any]) -> None:
        if record.get("op") != "header":
            raise ValueError("the journal does not begin with its header")
        driver = record.get("driver", "")
        if self.driver and driver != self.driver:
            raise ValueError(f"it is the journal of driver {driver!r}, not of {self.driver!r}")

    @staticmethod
    def _apply(record: Mapping[str, Any], claims: dict[str, ClaimRecord]) -> None:
        op = record["op"]
        if op == "claim":
            claim = ClaimRecord.from_json(record["claim"])
            claims[claim.uid] = claim
        elif op == "removed":
            uid = record["uid"]
            if not isinstance(uid, str):
                raise TypeError("uid is not a string")
            claims.pop(uid, None)
        else:
            raise ValueError(f"unknown operation {json.dumps(op)}")

    def record(self, claim: ClaimRecord, durable: bool = True) -> None:
        """Store a claim's new state; durably unless `durable` is False (written, synced by a later record)."""
        self._append(_claim_line(claim), durable, lambda: self._set(claim.uid, claim))

    def start(self, uid: str, namespace: str, name: str, devices: Sequence[Started],
              durable: bool = True, admin: frozenset[str] = frozenset()) -> ClaimRecord:
        """Record that preparing (device, backend) pairs, or (device, backend, share id) for shares, for a claim
        begins; `admin` names the devices allocated with admin access."""
        claim = self._started(uid, namespace, name, devices, admin)
        self.record(claim, durable)
        return claim

    def start_unsynced_now(self, uid: str, namespace: str, name: str, devices: Sequence[Started],
                           admin: frozenset[str] = frozenset()) -> ClaimRecord | None:
        """`start` without a sync, made only if the journal is idle this instant: one write to the page cache, so
        the event loop may call it; None (nothing recorded) when another thread is writing."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._writing or self._queue or self._fd is None:
                return None
            claim = self._started(uid, namespace, name, devices, admin)
            self._write(_claim_line(claim), 1, sync=False)
            self._set(uid, claim)
            return claim
        finally:
            self._lock.release()

    def complete(self, started: ClaimRecord, devices: tuple[DeviceRecord, ...]) -> ClaimRecord:
        claim = replace(started, state="completed", devices=devices, owner=self.owner or started.owner,
                        recovered=False)
        self.record(claim)
        return claim

    def remove(self, uid: str) -> None:
        """Durably forget a claim."""
        if uid not in self.claims:
            return
        self._append(_line({"format": FORMAT, "op": "removed", "uid": uid}), True, lambda: self._drop(uid))
        if self._records > len(self.claims) + _COMPACT_AFTER:
            self.compact()

    def compact(self) -> None:
        """Rewrite the journal with only the live claims, atomically."""
        with self._lock:
            while self._writing or self._queue:
                self._lock.wait()
            self._rewrite(self.claims)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _started(self, uid: str, namespace: str, name: str, devices: Sequence[Started],
                 admin: frozenset[str]) -> ClaimRecord:
        return ClaimRecord(uid, namespace, name, "started", self.boot_id,
                           tuple(DeviceRecord(device=d[0], backend=d[1], admin_access=d[0] in admin,
                                              share_id=d[2] if len(d) > 2 else None) for d in devices),
                           owner=self.owner)

    # Both run under the lock, by the thread whose record was just written.
    def _set(self, uid: str, claim: ClaimRecord) -> None:
        self.claims = {**self.claims, uid: claim}

    def _drop(self, uid: str) -> None:
        self.claims = {u: c for u, c in self.claims.items() if u != uid}

    def _rewrite(self, claims: Mapping[str, ClaimRecord]) -> None:
        """Replace the journal with a header and `claims` (temporary file, fsync, rename, directory fsync); the
        caller holds the lock and no write is pending."""
        tmp = self.path.with_suffix(".tmp")
        header = _line({"format": FORMAT, "op": "header", "driver": self.driver})
        data = header + b"".join(_claim_line(c) for c in claims.values())
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            _fsync_dir(self.path.parent)
            inode = os.stat(self.path).st_ino
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise CheckpointError(f"cannot write {self.path}: {e.strerror or e}") from None
        self.close()
        self._records = len(claims)
        self._lines = len(claims) + 1
        self._offset = len(data)
        self._inode = inode

    def _append(self, line: bytes, durable: bool, apply: Callable[[], None]) -> None:
        """Append one journal line, synced unless `durable` is False, then `apply` its change to `claims`.
        Concurrent callers commit as a group: whoever finds no write in progress writes every queued line, with
        one fdatasync if any of them needs it, applies their changes, and the others wait for it."""
        with self._lock:
            self._queue.append((line, durable, apply))
            self._queued += 1
            ticket = self._queued
            while self._written < ticket:
                if self._writing:
                    self._lock.wait()
                    continue
                batch, self._queue, upto = self._queue, [], self._queued
                self._writing = True
                self._lock.release()
                error: CheckpointError | None = None
                try:
                    self._write(b"".join(b for b, _, _ in batch), len(batch), sync=any(d for _, d, _ in batch))
                except CheckpointError as e:
                    error = e
                finally:
                    self._lock.acquire()
                    if error is None:
                        for _, _, change in batch:
                            change()
                    else:
                        for waiting in range(upto - len(batch) + 1, upto + 1):
                            self._failed[waiting] = error
                    self._writing = False
                    self._written = upto
                    self._lock.notify_all()
            failure = self._failed.pop(ticket, None)
            if failure is not None:
                raise failure

    def _write(self, data: bytes, count: int, sync: bool = True) -> None:
        try:
            if self._fd is not None and _inode(self.path) != os.fstat(self._fd).st_ino:
                self.close()  # replaced by a compaction of another instance: append to the new file
            if self._fd is None:
                if not self.path.exists():
                    raise CheckpointError(f"cannot write {self.path}: it is gone (load the checkpoint first)")
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
                self._inode = os.fstat(self._fd).st_ino
            os.write(self._fd, data)
            if sync:
                os.fdatasync(self._fd)  # also takes every earlier unsynced line to the disk
            size = os.fstat(self._fd).st_size
        except OSError as e:
            raise CheckpointError(f"cannot write {self.path}: {e.strerror or e}") from None
        self._records += count
        self._lines += count
        if size == self._offset + len(data):
            self._offset = size  # nothing else was appended: no need to read our own lines back


def _claim_line(claim: ClaimRecord) -> bytes:
    return _line({"format": FORMAT, "op": "claim", "claim": claim.to_json(shared=True)})


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
