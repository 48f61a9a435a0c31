"""Prepare and unprepare claims for one DRA driver: crash-safe, idempotent, one result per claim.

Prepare: read the claim (outside any lock, within its own deadline), keep this driver's devices, resolve their
opaque configuration, then under the claim's and its devices' locks: answer from the checkpoint when already
prepared (re-creating a lost CDI spec), refuse devices prepared for another claim, record `started`, let the owning
backends prepare, write the device metadata files (agent/claims/metadata_files.py, when on) and the claim's CDI spec,
record `completed`, answer. Unprepare works from the checkpoint alone.
A failure fails that claim only; whatever was done for it is undone and its record goes (a claim whose metadata
files cannot be made is refused before anything is done). Devices allocated with admin access are not in
use: they neither block nor are blocked by other claims. A device shared by capacity is held by shares: its shares
may be prepared for many claims at once (each its own record, CDI device and share id; the owning backend decides
whether their configurations fit together), but never together with a claim holding it whole. Start-up recovery is
in agent/claims/recovery.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace

from agent.claims.backend_calls import prepare_on_backends, unprepare_on_backends
from agent.claims.cdi import cdi_device_id, claim_spec
from agent.claims.checkpoint import CheckpointError, Started
from agent.claims.collaborators import ClaimMemory, ClaimSource, DriverDevices, InstanceGuard, Reporting
from agent.claims.holding import held_elsewhere
from agent.claims.locks import KeyedLocks
from agent.claims.metadata import MetadataError
from agent.claims.metadata_files import MetadataFiles
from agent.claims.plan import Plan, one_per_uid, plan_claim
from agent.claims.read import ClaimAllocation, ClaimError, check_reference, read_allocation
from agent.claims.records import ClaimRecord, DeviceRecord
from agent.claims.results import ClaimResult, PreparedDeviceResult
from agent.unexpected import unexpected
from backends.capabilities import records_own_changes
from backends.contract import ClaimRef, Prepared
from backends.failpoints import failpoint

__all__ = ["Preparer"]

class Preparer:
    """Prepare/unprepare for one driver on this node (the parts it works with: agent/claims/collaborators.py)."""

    def __init__(self, devices: DriverDevices, memory: ClaimMemory, claims: ClaimSource, *,
                 instances: InstanceGuard | None = None, reporting: Reporting | None = None,
                 metadata: MetadataFiles | None = None) -> None:
        instances = instances or InstanceGuard()
        reporting = reporting or Reporting()
        self.driver = devices.driver
        self.pool = devices.pool
        self.backends = devices.backends
        self.owner_of = devices.owner_of
        self.allowed_configs = devices.allowed_configs
        self.checkpoint = memory.checkpoint
        self.store = memory.specs
        self.claim_read_seconds = claims.read_seconds
        self.instance_lock = instances.lock
        self.owner_alive = instances.owner_alive  # whether the agent instance that wrote a record still runs
        self.log = reporting.log.bind(driver=devices.driver)
        self._claims = claims.reader
        self._locks = KeyedLocks()
        self._serialize = instances.serialize and instances.lock is not None
        self._metrics = reporting.metrics
        self._unusable = devices.unusable  # device → why it must not be newly prepared (unhealthy), else None
        self._on_failure = reporting.on_failure  # told of every claim not prepared, with the error (never blocks)
        self._on_prepared = reporting.on_prepared  # told of every claim answered as prepared (never blocks)
        self._on_released = reporting.on_released  # told of every claim unprepared, rolled back or reaped
        self.metadata = metadata  # device metadata files (KEP-5304); None: none are written or removed

    # --- kubelet calls ----------------------------------------------------------------------------------

    async def prepare(self, claims: Sequence[ClaimRef], kubelet_api: str = "v1") -> dict[str, ClaimResult]:
        """One result per claim UID; never raises. `kubelet_api`: the DRA API version the kubelet called."""
        refusal = self._unsupported(kubelet_api)
        if len(claims) == 1:  # the kubelet's usual call: no tasks to make for one claim
            ref = claims[0]
            return {ref.uid: await self._prepare_planned(ref, refusal or await self._plan(ref))}
        refs, clashes = one_per_uid(claims, "prepared")
        plans: Sequence[Plan | str] = ([refusal] * len(refs) if refusal else
                                       await asyncio.gather(*(self._plan(ref) for ref in refs)))
        results = await asyncio.gather(*(self._prepare_planned(ref, plan) for ref, plan in zip(refs, plans,
                                                                                                 strict=True)))
        answers = {ref.uid: result for ref, result in zip(refs, results, strict=True)}
        return answers | {uid: ClaimResult(error=error) for uid, error in clashes.items()}

    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        """An error message per claim UID, empty on success; never raises."""
        if len(claims) == 1:
            return {claims[0].uid: await self._unprepare_one(claims[0])}
        refs, clashes = one_per_uid(claims, "unprepared")
        errors = await asyncio.gather(*(self._unprepare_one(ref) for ref in refs))
        return {ref.uid: error for ref, error in zip(refs, errors, strict=True)} | clashes

    # --- prepare ----------------------------------------------------------------------------------------

    def _unsupported(self, kubelet_api: str) -> str:
        """Why no claim of a call through this kubelet API version is prepared, or empty."""
        if self.metadata is not None and self.metadata.enabled and kubelet_api != "v1":
            return (f"device metadata (setting device_metadata) needs a kubelet that calls DRA API v1 (Kubernetes "
                    f"1.34 or later); this kubelet called {kubelet_api}: upgrade the kubelet or turn the setting off")
        return ""

    async def _plan(self, ref: ClaimRef) -> Plan | str:
        """Read and check the claim; an error message when it cannot be prepared."""
        try:
            check_reference(ref)
            try:
                async with asyncio.timeout(self.claim_read_seconds):
                    claim = await self._claims.get_claim(ref.namespace, ref.name)
            except TimeoutError:
                return (f"cannot read claim {ref.namespace}/{ref.name}: no answer from the API server within "
                        f"{self.claim_read_seconds:g} s")
            except Exception as e:
                return f"cannot read claim {ref.namespace}/{ref.name}: {e}"
            if claim is None:
                return f"claim {ref.namespace}/{ref.name} not found"
            allocation = read_allocation(claim, ref, self.driver)
            return plan_claim(allocation, self.pool, self.driver, self.owner_of, allowed=self.allowed_configs)
        except ClaimError as e:
            return str(e)

    async def _prepare_planned(self, ref: ClaimRef, plan: Plan | str) -> ClaimResult:
        result = ClaimResult(error=plan) if isinstance(plan, str) else await self._prepare_checked(ref, plan)
        if result.error and self._on_failure is not None:
            self._on_failure(ref, result.error)
        return result

    async def _prepare_checked(self, ref: ClaimRef, plan: Plan) -> ClaimResult:
        started = time.perf_counter()
        devices = plan.devices
        try:
            async with self._exclusive(ref.uid, devices):
                result = await self._prepare_locked(ref, plan)
        except Exception as e:  # a bug must fail this claim, not the batch
            self.log.exception("prepare failed unexpectedly", claim=_name(ref))
            result = ClaimResult(error=f"internal error while preparing: {unexpected(e)}")
        seconds = time.perf_counter() - started
        self._observe("prepare", seconds, bool(result.error))
        outcome = {"error": result.error} if result.error else {"devices": len(result.devices)}
        self.log.info("prepared claim" if not result.error else "claim not prepared", claim=_name(ref),
                      seconds=round(seconds, 4), **outcome)
        return result

    def _observe(self, operation: str, seconds: float, error: bool) -> None:
        if self._metrics is not None:
            self._metrics.observe(self.driver, operation, seconds, error)
            self._metrics.prepared_claims.labels(self.driver).set(
                sum(c.state == "completed" for c in self.checkpoint.claims.values()))

    async def _prepare_locked(self, ref: ClaimRef, plan: Plan) -> ClaimResult:
        record = self.checkpoint.claims.get(ref.uid)
        if record is not None and record.state == "started":
            await self.roll_back(record)  # an earlier attempt was cut short
            record = None
        if record is not None and record.boot_id == self.checkpoint.boot_id:
            if {(d.device, d.share_id) for d in record.devices} == set(plan.requests):
                if record.recovered:
                    record = await self._readopt(ref, plan, record)
                lost = await self.ensure_spec(record, plan.allocation)
                return ClaimResult(error=lost) if lost else self._answer(ref, record)
            return ClaimResult(error=f"claim {_name(ref)} was prepared with other devices; unprepare it first")
        # A claim prepared before its device turned unhealthy keeps its answer (above): its pods run already.
        unusable = [f"{d}: {why}" for d in plan.devices if (why := self._unusable(d))]
        if unusable:
            return ClaimResult(error=f"not prepared, unhealthy device(s): {'; '.join(unusable)}")
        conflict = held_elsewhere(ref.uid, plan, self.checkpoint.claims.values())
        if conflict:
            return ClaimResult(error=conflict)
        if self.metadata is not None and self.metadata.enabled:
            try:
                self.metadata.check(plan.allocation)  # names the files cannot have: refused before anything is done
            except MetadataError as e:
                return ClaimResult(error=str(e))
        failpoint("prepare-before-started")
        pairs = tuple((a.device, owner.name, a.share_id) for owner, allocated in plan.per_backend.values()
                      for a in allocated)
        started = await self._start(ref, plan, pairs)
        try:
            return await self._prepare_started(ref, plan, started)
        except Exception:
            # A bug on the way: undo from the record, as after a crash, so that the devices are not held.
            await self.roll_back(self.checkpoint.claims.get(ref.uid, started))
            raise

    async def _prepare_started(self, ref: ClaimRef, plan: Plan, started: ClaimRecord) -> ClaimResult:
        """Prepare on the backends and publish, once the claim is recorded `started`; a failure is undone."""
        failpoint("prepare-after-started")
        prepared, error = await prepare_on_backends(ref, plan, self.log)
        if error:
            await self._undo(ref, prepared, started)
            return ClaimResult(error=error)
        failpoint("prepare-after-backends")
        records = tuple(
            DeviceRecord(
                device=p.device,
                backend=backend,
                requests=plan.requests[(p.device, p.share_id)],
                cdi_ids=(cdi_device_id(self.driver, ref.uid, p.device, p.share_id),),
                edits=p.edits,
                common_edits=p.common_edits,
                restore=dict(p.restore),
                admin_access=p.device in plan.admin,
                share_id=p.share_id,
                facts=dict(p.facts),
                network=p.network,
            )
            for backend, items in prepared.items()
            for p in items
        )
        try:
            completed = await asyncio.to_thread(self._publish, started, records, plan.allocation)
        except Exception as e:
            await self._undo(ref, prepared, started)
            return ClaimResult(error=_publish_error(e))
        failpoint("prepare-after-completed")
        return self._answer(ref, completed)

    async def _start(self, ref: ClaimRef, plan: Plan, pairs: tuple[Started, ...]) -> ClaimRecord:
        """Record `started` before any backend runs: synced, unless every backend of the claim keeps durable
        records of its own changes (`records_own_changes`); then the record need only survive a crash of this
        process, and is written from the loop itself when the journal is idle (no worker thread, no disk wait)."""
        if all(records_own_changes(owner.backend) for owner, _ in plan.per_backend.values()):
            started = self.checkpoint.start_unsynced_now(ref.uid, ref.namespace, ref.name, pairs, plan.admin)
            if started is not None:
                return started
            return await asyncio.to_thread(self.checkpoint.start, ref.uid, ref.namespace, ref.name, pairs, False,
                                           plan.admin)
        return await asyncio.to_thread(self.checkpoint.start, ref.uid, ref.namespace, ref.name, pairs, True,
                                       plan.admin)

    def _publish(self, started: ClaimRecord, records: tuple[DeviceRecord, ...],
                 allocation: ClaimAllocation) -> ClaimRecord:
        """Write the device metadata files and the claim's CDI spec, then record it completed (one worker-thread hop
        for all: on a machine with few CPUs, two hops at once cost more than the one spends waiting for the disk).
        A crash before `completed` leaves a `started` record, whose roll-back removes the metadata files too."""
        if self.metadata is not None and self.metadata.enabled:
            records, claim, files = self.metadata.prepared(allocation, records)  # their CDI IDs go into the records
            self.metadata.write(claim, files)
            failpoint("prepare-after-metadata")
        self.store.write(started.uid, claim_spec(self.driver, started.uid, records))
        failpoint("prepare-after-cdi")
        return self.checkpoint.complete(started, records)

    async def _readopt(self, ref: ClaimRef, plan: Plan, record: ClaimRecord) -> ClaimRecord:
        """A claim known from its CDI spec alone (its journal records were lost) gets its names and request names
        back from the claim the kubelet asks for again."""
        devices = tuple(replace(d, requests=plan.requests[(d.device, d.share_id)], admin_access=d.device in plan.admin)
                        for d in record.devices)
        if self.metadata is not None:
            devices = await asyncio.to_thread(self.metadata.readopted, plan.allocation, devices)
        adopted = replace(record, namespace=ref.namespace, name=ref.name, devices=devices, recovered=False)
        await asyncio.to_thread(self.checkpoint.record, adopted)
        self.log.info("claim known from its CDI spec is prepared again", claim=_name(ref))
        return adopted


    async def _undo(self, ref: ClaimRef, prepared: Mapping[str, list[Prepared]], started: ClaimRecord) -> None:
        """Undo a prepare that failed part-way; the claim's devices must end up as they were."""
        for backend, items in prepared.items():
            try:
                await self.backends[backend].unprepare(ref, items)
            except Exception as e:
                # Keep the `started` record: the next prepare or restart rolls it back again.
                self.log.error("undoing a failed prepare failed", backend=backend, claim=_name(ref), error=str(e))
                return
        try:
            await asyncio.to_thread(self._drop, started)
        except Exception as e:
            # Keep the `started` record: the next prepare, unprepare or restart removes the files again.
            self.log.error("removing what a failed prepare wrote failed", claim=_name(ref), error=str(e))

    def _drop(self, started: ClaimRecord) -> None:
        """The end of `_undo`: the claim's metadata files and CDI spec, then its `started` record (one worker-thread
        hop)."""
        if self.metadata is not None:
            self.metadata.release(started)
        self.store.delete(started.uid)
        self.checkpoint.remove(started.uid)

    def _answer(self, ref: ClaimRef, record: ClaimRecord) -> ClaimResult:
        if self._on_prepared is not None:
            self._on_prepared(ref, record)
        return ClaimResult(devices=tuple(
            PreparedDeviceResult(pool=self.pool, device=d.device, cdi_device_ids=d.cdi_ids, request_names=d.requests,
                                 share_id=d.share_id)
            for d in record.devices
        ))

    async def ensure_spec(self, record: ClaimRecord, allocation: ClaimAllocation | None = None) -> str:
        """Re-create a completed claim's CDI spec if it is gone (the CDI directory is a tmpfs), and its lost device
        metadata files: all of them from the claim (`allocation`) when the kubelet asks again, at start the specs.
        Why the metadata could not be re-created, or empty."""
        claim = f"{record.namespace}/{record.name}:{record.uid}"
        if not await asyncio.to_thread(self.store.exists, record.uid):
            await asyncio.to_thread(self.store.write, record.uid, claim_spec(self.driver, record.uid, record.devices))
            self.log.info("re-created CDI spec", claim=claim)
        if self.metadata is None:
            return ""
        try:
            restored = await asyncio.to_thread(self.metadata.ensure, record, allocation)
        except MetadataError as e:
            self.log.error("cannot re-create device metadata", claim=claim, error=str(e))
            return str(e)
        if restored:
            self.log.info("re-created device metadata", claim=claim, requests=restored)
        return ""

    # --- unprepare --------------------------------------------------------------------------------------

    async def _unprepare_one(self, ref: ClaimRef) -> str:
        started = time.perf_counter()
        record = self.checkpoint.claims.get(ref.uid)
        if record is None and not self._serialize:
            return ""  # unknown claim: nothing to undo
        devices = [d.device for d in record.devices] if record else []
        try:
            async with self._exclusive(ref.uid, devices):
                record = self.checkpoint.claims.get(ref.uid)  # it may have changed while waiting
                if record is None:
                    return ""
                failpoint("unprepare-before-backends")
                error = await self.release(ref, record)
        except Exception as e:
            self.log.exception("unprepare failed unexpectedly", claim=_name(ref))
            error = f"internal error while unpreparing: {unexpected(e)}"
        self._observe("unprepare", time.perf_counter() - started, bool(error))
        self.log.info("unprepared claim" if not error else "claim not unprepared", claim=_name(ref),
                      **({"error": error} if error else {}))
        return error

    async def release(self, ref: ClaimRef, record: ClaimRecord) -> str:
        """Undo a claim's preparation from its record and forget it; an error message when a backend failed (the
        record is kept, so the next unprepare tries again). The caller holds the claim's locks."""
        if self.metadata is not None:
            try:
                await asyncio.to_thread(self.metadata.release, record)
            except MetadataError as e:
                return f"cannot remove the device metadata of claim {_name(ref)}: {e}"
        error = await unprepare_on_backends(self.backends, ref, record)
        if error:
            return error
        failpoint("unprepare-after-backends")
        await asyncio.to_thread(self._forget, record.uid)
        failpoint("unprepare-after-removed")
        if self._on_released is not None:
            self._on_released(ref, record)
        return ""

    def _forget(self, uid: str) -> None:
        """Delete the claim's CDI spec, then durably forget the claim: one worker-thread hop for both, as in
        `_publish`."""
        self.store.delete(uid)
        failpoint("unprepare-after-cdi")
        self.checkpoint.remove(uid)

    async def forget(self, ref: ClaimRef, record: ClaimRecord) -> str:
        """Unprepare a claim the kubelet will not unprepare (its ResourceClaim is gone), if it is still prepared as
        `record` says; under the cross-instance lock and the claim's locks. An error message, empty on success."""
        async with self.shared_state(), self._locks.hold(
                [f"claim/{ref.uid}", *(f"device/{d.device}" for d in record.devices)]):
            current = self.checkpoint.claims.get(ref.uid)
            if current is None or current.state != "completed":
                return ""
            return await self.release(ref, current)

    async def roll_back(self, record: ClaimRecord) -> None:
        """Undo a prepare that a crash cut short, from the device names the `started` record holds."""
        ref = ClaimRef(record.uid, record.namespace, record.name)
        self.log.warning("rolling back a prepare that did not complete", claim=_name(ref),
                         instance=record.owner or None)
        error = await self.release(ref, record)
        if error:
            self.log.error("roll-back failed; will retry", claim=_name(ref), error=error)

    # --- locking ----------------------------------------------------------------------------------------

    @asynccontextmanager
    async def shared_state(self) -> AsyncIterator[None]:
        """Hold the cross-instance lock, with the checkpoint brought up to date: what start-up recovery and the
        reaper hold while they change shared state."""
        async with AsyncExitStack() as stack:
            if self.instance_lock is not None:
                await stack.enter_async_context(self.instance_lock.hold())
                # The other instance may have changed the checkpoint while it held the lock: read that first.
                await asyncio.to_thread(self.checkpoint.refresh)
            yield

    @asynccontextmanager
    async def exclusive(self, uid: str, devices: Sequence[str]) -> AsyncIterator[None]:
        """Hold the claim's and its devices' locks, and during rolling updates the cross-instance lock."""
        async with self._exclusive(uid, devices):
            yield

    @asynccontextmanager
    async def _exclusive(self, uid: str, devices: Sequence[str]) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            if self._serialize:
                await stack.enter_async_context(self.shared_state())
            await stack.enter_async_context(self._locks.hold([f"claim/{uid}", *(f"device/{d}" for d in devices)]))
            yield


def _publish_error(e: Exception) -> str:
    """Why writing a prepared claim's files failed, in words for the claim."""
    if isinstance(e, MetadataError | CheckpointError):
        return str(e)  # they say what they were writing
    if isinstance(e, OSError) and e.strerror:
        where = f" {e.filename}" if e.filename else ""
        return f"cannot write the CDI spec{where}: {e.strerror}"
    return f"cannot write the CDI spec: {e}"


def _name(ref: ClaimRef) -> str:
    return f"{ref.namespace}/{ref.name}:{ref.uid}"
