"""The prepared-claims checkpoint of one driver: which claims are being or have been prepared, durably.

Two-phase records per claim: `started` (written before any hardware is touched) and `completed` (written after
the CDI spec, before the kubelet gets its answer); `removed` when unprepared. The file is an append-only
journal of JSON lines, each with a format version and a CRC-32 of its content, made durable with fdatasync:
one small append per state change costs ~0.35 ms on a disk where rewriting a file atomically costs ~2 ms.
A `started` record may be written without a sync when the backends keep their own durable records of what they
change (`Backend.records_own_changes`): written, it survives any crash of the agent's process (the kernel
holds it), and the sync of the claim's `completed` record takes it to the disk too.
When the journal grows it is compacted by an atomic rewrite (temp file, fsync, rename, directory fsync).
A torn last line (a crash during its write) was never acknowledged and is dropped; a corrupt line elsewhere
is reported and skipped. Every record carries the boot id, so claims prepared before a reboot are known.
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from cdi.spec import ContainerEdits, edits_from_dict, edits_to_dict

__all__ = ["FORMAT", "Checkpoint", "CheckpointError", "ClaimRecord", "DeviceRecord", "read_boot_id"]

FORMAT = 1
"""Journal format. Readers refuse records of a newer format rather than misread them."""

_COMPACT_AFTER = 256  # records beyond the live claims before the journal is rewritten

State = Literal["started", "completed"]


class CheckpointError(Exception):
    """The checkpoint cannot be read or written."""


@dataclass(frozen=True)
class DeviceRecord:
    """A device as prepared for a claim: enough to answer the kubelet again and to undo it after a restart."""

    device: str
    backend: str
    requests: tuple[str, ...] = ()
    cdi_ids: tuple[str, ...] = ()
    edits: ContainerEdits = field(default_factory=ContainerEdits)
    common_edits: ContainerEdits | None = None
    restore: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "backend": self.backend,
            "requests": list(self.requests),
            "cdiIds": list(self.cdi_ids),
            "edits": edits_to_dict(self.edits),
            "commonEdits": None if self.common_edits is None else edits_to_dict(self.common_edits),
            "restore": dict(self.restore),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DeviceRecord:
        common = data.get("commonEdits")
        return cls(
            device=data["device"],
            backend=data["backend"],
            requests=tuple(data.get("requests", ())),
            cdi_ids=tuple(data.get("cdiIds", ())),
            edits=edits_from_dict(data.get("edits") or {}),
            common_edits=None if common is None else edits_from_dict(common),
            restore=dict(data.get("restore") or {}),
        )


@dataclass(frozen=True)
class ClaimRecord:
    """The state of one claim of this driver."""

    uid: str
    namespace: str
    name: str
    state: State
    boot_id: str
    devices: tuple[DeviceRecord, ...]  # for `started`, only device and backend are known

    def to_json(self) -> dict[str, Any]:
        return {
            "uid": self.uid,
            "namespace": self.namespace,
            "name": self.name,
            "state": self.state,
            "bootId": self.boot_id,
            "devices": [d.to_json() for d in self.devices],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ClaimRecord:
        state = data["state"]
        if state not in ("started", "completed"):
            raise ValueError(f"unknown claim state {state!r}")
        return cls(
            uid=data["uid"],
            namespace=data["namespace"],
            name=data["name"],
            state=state,
            boot_id=data["bootId"],
            devices=tuple(DeviceRecord.from_json(d) for d in data["devices"]),
        )


def read_boot_id(proc: Path = Path("/proc")) -> str:
    """The kernel's boot id: it changes at every reboot, which invalidates hardware state."""
    try:
        return (proc / "sys/kernel/random/boot_id").read_text().strip()
    except OSError as e:
        raise CheckpointError(f"cannot read the boot id: {e}") from None


def _line(record: Mapping[str, Any]) -> bytes:
    body = json.dumps(record, sort_keys=True, separators=(",", ":"))
    return f"{zlib.crc32(body.encode()):08x} {body}\n".encode()


def _parse(line: bytes) -> dict[str, Any]:
    checksum, _, body = line.decode().partition(" ")
    if len(checksum) != 8 or f"{zlib.crc32(body.encode()):08x}" != checksum:
        raise ValueError("checksum mismatch")
    record = json.loads(body)
    if not isinstance(record, dict):
        raise ValueError("not a record")
    if record.get("format", 0) > FORMAT:
        raise CheckpointError(f"written by a newer agent (format {record['format']}, this agent reads {FORMAT})")
    return record


class Checkpoint:
    """The journal of one driver's claims and its in-memory view. Methods block: call them off the loop, from
    any number of threads (appends are committed in groups; one claim's records are ordered by its caller)."""

    def __init__(self, path: Path, boot_id: str) -> None:
        self.path = path
        self.boot_id = boot_id
        self.claims: dict[str, ClaimRecord] = {}
        self.problems: list[str] = []
        self._records = 0
        self._offset = 0
        self._inode = 0  # of the journal last read: a compaction by another instance replaces the file
        self._fd: int | None = None
        # Group commit: lines queued by concurrent callers (with whether their caller waits for a sync), how many
        # were ever queued and how many are written (made durable when any of a batch needed it).
        self._lock = threading.Condition()
        self._queue: list[tuple[bytes, bool]] = []
        self._queued = 0
        self._written = 0
        self._writing = False
        self._failed: dict[int, CheckpointError] = {}

    def load(self) -> None:
        """Replay the journal (creating an empty one if there is none)."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.claims.clear()
        self.problems.clear()
        self._records = self._offset = 0
        self.refresh()

    def refresh(self) -> None:
        """Apply records appended since the last read (by another agent instance during a rolling update)."""
        try:
            with open(self.path, "rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                if inode != self._inode:  # first read, or compacted by another instance: read it all
                    self.claims.clear()
                    self._records = self._offset = 0
                    self._inode = inode
                    self.close()
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        except OSError as e:
            raise CheckpointError(f"cannot read {self.path}: {e.strerror or e}") from None
        lines = data.split(b"\n")
        complete, torn = lines[:-1], lines[-1]
        for number, line in enumerate(complete):
            if line.strip():
                self._apply(line, number)
        # A torn tail stays unread: either it is still being written by another instance, or it never will be.
        self._offset += len(data) - len(torn)

    def _apply(self, line: bytes, number: int) -> None:
        try:
            record = _parse(line)
            op = record["op"]
            if op == "claim":
                claim = ClaimRecord.from_json(record["claim"])
                self.claims[claim.uid] = claim
            elif op == "removed":
                self.claims.pop(record["uid"], None)
            else:
                raise ValueError(f"unknown operation {op!r}")
        except CheckpointError:
            raise
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            self.problems.append(f"{self.path}: record after byte {self._offset} (line {number + 1}) skipped: {e}")
            return
        self._records += 1

    def record(self, claim: ClaimRecord, durable: bool = True) -> None:
        """Store a claim's new state; durably unless `durable` is False (written, synced by a later record)."""
        self._append(_claim_line(claim), durable)
        self.claims[claim.uid] = claim

    def start(self, uid: str, namespace: str, name: str, devices: tuple[tuple[str, str], ...],
              durable: bool = True) -> ClaimRecord:
        """Record that preparing (device, backend) pairs for a claim begins."""
        claim = _started(uid, namespace, name, self.boot_id, devices)
        self.record(claim, durable)
        return claim

    def start_unsynced_now(self, uid: str, namespace: str, name: str,
                           devices: tuple[tuple[str, str], ...]) -> ClaimRecord | None:
        """`start` without a sync, made only if the journal is idle this instant: one write to the page cache, so
        the event loop may call it; None (nothing recorded) when another thread is writing."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._writing or self._queue or self._fd is None:
                return None
            claim = _started(uid, namespace, name, self.boot_id, devices)
            self._write(_claim_line(claim), 1, sync=False)
            self.claims[uid] = claim
            return claim
        finally:
            self._lock.release()

    def complete(self, started: ClaimRecord, devices: tuple[DeviceRecord, ...]) -> ClaimRecord:
        claim = replace(started, state="completed", devices=devices)
        self.record(claim)
        return claim

    def remove(self, uid: str) -> None:
        """Durably forget a claim."""
        if uid not in self.claims:
            return
        self._append(_line({"format": FORMAT, "op": "removed", "uid": uid}))
        del self.claims[uid]
        if self._records > len(self.claims) + _COMPACT_AFTER:
            self.compact()

    def compact(self) -> None:
        """Rewrite the journal with only the live claims, atomically."""
        with self._lock:
            while self._writing or self._queue:
                self._lock.wait()
            tmp = self.path.with_suffix(".tmp")
            data = b"".join(_claim_line(c) for c in list(self.claims.values()))
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    os.write(fd, data)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, self.path)
                _fsync_dir(self.path.parent)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                raise CheckpointError(f"cannot compact {self.path}: {e.strerror or e}") from None
            self.close()
            self._records = len(self.claims)
            self._offset = len(data)
            self._inode = os.stat(self.path).st_ino

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _append(self, line: bytes, durable: bool = True) -> None:
        """Append one journal line, synced unless `durable` is False. Concurrent callers commit as a group:
        whoever finds no write in progress writes every queued line, with one fdatasync if any of them needs it,
        and the others wait for it."""
        with self._lock:
            self._queue.append((line, durable))
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
                    self._write(b"".join(b for b, _ in batch), len(batch), sync=any(d for _, d in batch))
                except CheckpointError as e:
                    error = e
                finally:
                    self._lock.acquire()
                    self._writing = False
                    for waiting in range(upto - len(batch) + 1, upto + 1):
                        if error is not None:
                            self._failed[waiting] = error
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
                created = not self.path.exists()
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                self._inode = os.fstat(self._fd).st_ino
                if created:
                    _fsync_dir(self.path.parent)
            os.write(self._fd, data)
            if sync:
                os.fdatasync(self._fd)  # also takes every earlier unsynced line to the disk
            size = os.fstat(self._fd).st_size
        except OSError as e:
            raise CheckpointError(f"cannot write {self.path}: {e.strerror or e}") from None
        self._records += count
        if size == self._offset + len(data):
            self._offset = size  # nothing else was appended: no need to read our own lines back


def _claim_line(claim: ClaimRecord) -> bytes:
    return _line({"format": FORMAT, "op": "claim", "claim": claim.to_json()})


def _started(uid: str, namespace: str, name: str, boot_id: str, devices: tuple[tuple[str, str], ...]) -> ClaimRecord:
    return ClaimRecord(uid, namespace, name, "started", boot_id,
                       tuple(DeviceRecord(device=d, backend=b) for d, b in devices))


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
