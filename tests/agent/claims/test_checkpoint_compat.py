"""Rolling back to an older agent on a node with prepared claims: the checkpoint's format number changes only when
an older reader would misread a journal, so a journal a later release writes with fields of its own (an additive
change, which keeps the number) is read by this release exactly as if the fields were not there; and a journal of
a newer format number is refused with what to do, never misread (docs/deploy.md, "Rolling back")."""

from __future__ import annotations

import json
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from agent.claims import checkpoint as cp
from agent.claims.checkpoint import Checkpoint, CheckpointError
from agent.claims.records import DeviceRecord
from backends.contract import NetworkData
from cdi.spec import ContainerEdits, DeviceNode

BOOT = "boot-1"


def later_release(line: bytes) -> bytes:
    """The same record as a later release of the same format would write it: a field of its own at every level it
    may add one (the record, the claim, each device, a backend's restore record), the checksum made for what it
    wrote. Not in the container edits: a kind of edit an older release does not know is one it could not give a
    container again, so adding one changes the format number."""
    record: dict[str, Any] = json.loads(line.decode().partition(" ")[2])
    record["writtenBy"] = "dra-agent 9.9"
    claim = record.get("claim")
    if claim is not None:
        claim["priority"] = 3
        for device in claim["devices"]:
            device["healthAtPrepare"] = "Healthy"
            device["restore"] = {**device["restore"], "firmware": "96.00.5e.00.01"}
    body = json.dumps(record, sort_keys=True, separators=(",", ":"))
    return f"{zlib.crc32(body.encode()):08x} {body}\n".encode()


def test_a_journal_with_a_later_releases_fields_reads_as_without_them(scratch: Path) -> None:
    path = scratch / "checkpoint.journal"
    journal = Checkpoint(path, BOOT, driver="gpu.nvidia.com", owner="pod-a")
    journal.load()
    started = journal.start("u1", "default", "vm", [("gpu-0", "nvidia-gpu"), ("vf-1", "sriov-nic", "s1")])
    device = DeviceRecord("gpu-0", "nvidia-gpu", requests=("gpu",), cdi_ids=("k8s.gpu.nvidia.com/claim=u1-gpu-0",),
                          edits=ContainerEdits(device_nodes=(DeviceNode("/dev/vfio/3"),)),
                          restore={"members": {"0000:18:00.0": "nvidia"}}, facts={"pciBusID": "0000:18:00.0"},
                          network=NetworkData("net1", "02:00:00:00:00:01", ("192.0.2.5/24",)))
    journal.complete(started, (device,))
    journal.start("u2", "default", "gone", [("gpu-1", "nvidia-gpu")])
    journal.remove("u2")
    journal.close()
    as_written = journal.claims

    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(later_release(line) for line in lines))
    assert path.read_bytes() != b"".join(lines), "the journal holds the later release's fields"
    older = Checkpoint(path, BOOT, driver="gpu.nvidia.com")
    older.load()
    assert {uid: [(d.device, d.restore) for d in c.devices] for uid, c in older.claims.items()} == {
        "u1": [("gpu-0", {"members": {"0000:18:00.0": "nvidia"}, "firmware": "96.00.5e.00.01"})]}, \
        "a backend's restore record is handed back whole"
    assert {uid: replace(c, devices=tuple(replace(d, restore={}) for d in c.devices))
            for uid, c in older.claims.items()} == {
        uid: replace(c, devices=tuple(replace(d, restore={}) for d in c.devices)) for uid, c in as_written.items()}


def test_a_newer_format_is_refused_with_what_to_do(scratch: Path) -> None:
    """An older release meets a journal whose format it cannot read: it stops (its pod does not become ready, so the
    rollout stops there) and says so; it changes nothing."""
    path = scratch / "checkpoint.journal"
    record = {"format": cp.FORMAT + 1, "op": "header", "driver": "gpu.nvidia.com"}
    path.write_bytes(cp._line(record))
    with pytest.raises(CheckpointError) as refused:
        Checkpoint(path, BOOT, driver="gpu.nvidia.com").load()
    assert str(refused.value) == (
        f"checkpoint {path} was written by a newer dra-agent (format {cp.FORMAT + 1}; this one reads up to "
        f"{cp.FORMAT}): run that version or a newer one on this node")
    assert path.read_bytes() == cp._line(record)
