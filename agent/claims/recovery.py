"""Start-up recovery of one driver: make the checkpoint, the CDI directory and the hardware agree after a restart,
a crash, or while another instance of the agent runs beside this one (a rolling update).

All of it happens under the cross-instance lock, after reading the checkpoint afresh:

1. A journal that cannot be trusted stops the driver (`CheckpointDamaged` reaches the caller): nothing is rolled
   back, no CDI spec deleted, no device handed out on a guess.
2. A CDI spec of this driver whose claim has no record at all proves that the claim was prepared (the spec is
   written before the `completed` record, and deleted before the record goes), so the records were lost (the
   journal moved aside or deleted): the claim is taken back as prepared, from its spec, and its devices stay
   refused to other claims until the kubelet unprepares it. A spec that does not read as one is left alone.
3. A `started` record whose instance is gone (it crashed mid-prepare) is rolled back; one whose instance still
   runs is that instance's business.
4. Completed claims of this boot get their CDI specs back (the CDI directory is a tmpfs), their device metadata
   specs too; specs of claims prepared before a reboot are removed, and device metadata files of claims without
   a record.
5. Backends that keep records of their own (`reconcile`) release what no claim of this boot holds: the checkpoint
   is complete at this point, or step 1 would have stopped.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack

from agent.claims.cdi import cdi_device_id
from agent.claims.metadata import MetadataError
from agent.claims.preparer import Preparer
from agent.claims.records import ClaimRecord, DeviceRecord
from backends.capabilities import Reconciles
from cdi.spec import CdiSpecError, Spec

__all__ = ["records_from_spec", "recover"]


async def recover(preparer: Preparer) -> None:
    """Run the recovery of one driver's preparer (see the module's description)."""
    checkpoint, log = preparer.checkpoint, preparer.log
    async with AsyncExitStack() as stack:
        if preparer.instance_lock is not None:
            await stack.enter_async_context(preparer.instance_lock.hold())
        await asyncio.to_thread(checkpoint.load)
        unreadable = await _adopt_unaccounted_specs(preparer)
        for record in list(checkpoint.claims.values()):
            if record.state == "started":
                if record.boot_id == checkpoint.boot_id and preparer.owner_alive(record.owner):
                    log.info("a prepare of another instance is in progress; left to it",
                             claim=f"{record.namespace}/{record.name}:{record.uid}", instance=record.owner)
                    continue
                await preparer.roll_back(record)
            elif record.boot_id == checkpoint.boot_id:
                await preparer.ensure_spec(record)
        live = {c.uid for c in checkpoint.claims.values() if c.boot_id == checkpoint.boot_id}
        removed = await asyncio.to_thread(preparer.store.sweep, live | unreadable)
        for uid in removed:
            log.info("removed CDI spec of a claim prepared before the node rebooted", spec=uid)
        await _sweep_metadata(preparer, unreadable)
        await _reconcile(preparer)


async def _sweep_metadata(preparer: Preparer, unreadable: set[str]) -> None:
    """Remove device metadata files of claims the checkpoint does not know (their records and CDI specs lost); a
    claim whose CDI spec could not be read keeps them, as it keeps the spec."""
    if preparer.metadata is None:
        return
    try:
        removed = await asyncio.to_thread(preparer.metadata.sweep, set(preparer.checkpoint.claims) | unreadable)
    except (OSError, MetadataError) as e:
        preparer.log.error("cannot remove device metadata of unknown claims", error=str(e))
        return
    for uid in removed:
        preparer.log.info("removed device metadata of a claim the checkpoint does not know", claim=uid)


async def _adopt_unaccounted_specs(preparer: Preparer) -> set[str]:
    """Take back as prepared every claim whose CDI spec exists without any record; the ids of specs that could not
    be read (kept, and reported)."""
    checkpoint, store, log = preparer.checkpoint, preparer.store, preparer.log
    unreadable: set[str] = set()
    for uid in await asyncio.to_thread(store.list_ids):
        if uid in checkpoint.claims:
            continue
        try:
            spec = await asyncio.to_thread(store.read, uid)
        except (CdiSpecError, OSError, ValueError) as e:
            spec, error = None, str(e)
        else:
            error = "no devices of the claim in it" if spec is None or not spec.devices else ""
        record = records_from_spec(preparer.driver, uid, spec, checkpoint.boot_id, _backend_of(preparer)) if (
            spec is not None and not error) else None
        if record is None:
            unreadable.add(uid)
            log.error("CDI spec of an unknown claim cannot be read; left in place", spec=str(store.path(uid)),
                      error=error or "its devices are not named after the claim")
            continue
        await asyncio.to_thread(checkpoint.record, record)
        log.error("CDI spec of a claim the checkpoint does not know: the claim is taken back as prepared and its "
                  "devices are held until it is unprepared", spec=str(store.path(uid)),
                  devices=[d.device for d in record.devices])
    return unreadable


_SHARE_SUFFIX = re.compile(r"(?P<device>.+)-(?P<share>[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})")


def records_from_spec(driver: str, uid: str, spec: Spec, boot_id: str,
                      backend_of: Callable[[str], str]) -> ClaimRecord | None:
    """The record of a claim rebuilt from its CDI spec (devices `<uid>-<device>`, shares `<uid>-<device>-<share
    ID>`); None when the spec names no device of that claim. Request names, restore records and the claim's name
    are not in a spec: the record is marked `recovered`."""
    prefix = f"{uid}-"
    devices = [d for d in spec.devices if d.name.startswith(prefix) and len(d.name) > len(prefix)]
    if not devices or len(devices) != len(spec.devices):
        return None
    records = []
    for i, d in enumerate(devices):
        name, share = _device_and_share(d.name.removeprefix(prefix), backend_of)
        records.append(DeviceRecord(
            device=name,
            backend=backend_of(name),
            cdi_ids=(cdi_device_id(driver, uid, name, share),),
            edits=d.container_edits,
            common_edits=spec.container_edits if i == 0 else None,
            share_id=share,
        ))
    return ClaimRecord(uid, "", "", "completed", boot_id, tuple(records), recovered=True)


def _device_and_share(name: str, backend_of: Callable[[str], str]) -> tuple[str, str | None]:
    """`<device>` or `<device>-<share ID>`: a name ending in a UUID is a share when what comes before it is a device
    of this node and the whole name is not."""
    match = _SHARE_SUFFIX.fullmatch(name)
    if match is not None and not backend_of(name) and backend_of(match["device"]):
        return match["device"], match["share"]
    return name, None


def _backend_of(preparer: Preparer) -> Callable[[str], str]:
    def backend(device: str) -> str:
        owner = preparer.owner_of(device)
        return owner.name if owner is not None else ""

    return backend


async def _reconcile(preparer: Preparer) -> None:
    """Tell each backend that keeps records of what it made which claims still hold its devices, so that it
    releases what no claim holds (made for a claim whose record is gone). A claim prepared before the node
    rebooted holds nothing: what was made for it (a compute mode, an MPS daemon, a MIG instance, a vfio-pci
    binding) ended with the boot, and the kubelet's next prepare makes it afresh."""
    boot = preparer.checkpoint.boot_id
    claims = [c for c in preparer.checkpoint.claims.values() if c.boot_id == boot]
    for name, backend in preparer.backends.items():
        if not isinstance(backend, Reconciles):
            continue
        held: dict[str, Sequence[str]] = {}
        for claim in claims:
            devices = tuple(d.device for d in claim.devices if d.backend == name and not d.admin_access)
            if devices:
                held[claim.uid] = devices
        try:
            await backend.reconcile(held)
        except Exception as e:  # a backend's bug must not keep the driver from serving
            preparer.log.error("backend reconcile failed", backend=name, error=f"{type(e).__name__}: {e}",
                               exc_info=True)
