"""Writes a driver's entries of its prepared claims' `status.devices` (KEP-4817) to the API server, in the
background.

After a prepare the claim gets one entry per device, Ready=True; after an unprepare (or a rollback, or a reap) the
driver's entries are removed. Peers leave their entries until the claim is deallocated or deleted; this agent
removes them at unprepare, because a Ready=True entry for a device no longer prepared misleads whoever reads it
(an operator, a controller waiting for the network to be up).

Writes are server-side applies on `resourceclaims/<name>/status` with the driver's name as field manager and
`force=true`: the server keeps the entries other drivers wrote on the same claim, and removes exactly the entries
this driver wrote before and no longer applies (the whole unprepare is an apply of none).

Nothing here waits for the API server on the caller's behalf: `prepared` and `released` only note the state
wanted for the claim; one task per claim writes it, a few milliseconds later (`SETTLE_SECONDS`), the latest wanted
state winning over any not written yet. A write that fails for want of the server (unreachable, 5xx, 429, 409) is
tried again with exponential backoff, a bounded number of times. The server's refusal (422: its message is
logged) and a claim that is gone (404, or one of the same name with another UID) end it. Every attempt is counted
(`dra_agent_claim_status_writes_total`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from structlog.typing import FilteringBoundLogger

from agent.claims.records import ClaimRecord
from agent.claims.status import READY, StatusApply, released_status, rfc3339, status_apply
from agent.kube.client import KubeError
from agent.kube.times import is_rfc3339
from agent.logs import get_logger
from agent.metrics import Metrics
from backends.contract import ClaimRef

__all__ = ["FLUSH_SECONDS", "SETTLE_SECONDS", "Backoff", "ClaimStatusWriter", "StatusApi"]

FLUSH_SECONDS = 2.0
"""How long stopping waits for the writes still wanted."""

SETTLE_SECONDS = 0.05
"""A claim's first write waits this long after it is wanted: the kubelet's answer goes out first (the write's own
work would otherwise run on the loop before it), and a state replaced at once (a claim unprepared as soon as it
was prepared) is not written at all."""

Outcome = Literal["ok", "error", "gone", "refused"]


class StatusApi(Protocol):
    """The API calls the writer makes (agent/kube/client.py's KubeClient); each raises KubeError."""

    async def apply_claim_status(self, namespace: str, name: str, body: Mapping[str, Any], field_manager: str,
                                 timeout: float) -> None: ...

    async def get_claim(self, namespace: str, name: str) -> Mapping[str, Any] | None: ...


@dataclass(frozen=True)
class Backoff:
    """How failed writes are tried again: `first` seconds after the first failure, doubling up to `limit`, at most
    `attempts` tries in all; each request may take `timeout` seconds."""

    first: float = 0.5
    limit: float = 15.0
    attempts: int = 10
    timeout: float = 10.0

    def delay(self, failures: int) -> float:
        return min(self.first * 2.0 ** (failures - 1), self.limit) * random.uniform(0.8, 1.2)


class ClaimStatusWriter:
    """The `status.devices` entries of one driver: `prepared`/`released` are the Reporting hooks of its
    Preparer (agent/claims/collaborators.py); `resume` re-applies a claim prepared before a restart."""

    def __init__(self, api: StatusApi, driver: str, pool: str, *, metrics: Metrics | None = None,
                 log: FilteringBoundLogger | None = None, backoff: Backoff = Backoff(),
                 settle: float = SETTLE_SECONDS, clock: Callable[[], float] = time.time) -> None:
        self._api = api
        self.driver = driver
        self.pool = pool
        self._metrics = metrics
        self._log = (log or get_logger("claim-status")).bind(driver=driver)
        self._backoff = backoff
        self._settle = settle
        self._clock = clock
        self._wanted: dict[str, tuple[ClaimRef, ClaimRecord | None]] = {}  # claim UID → what to write next
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._since: dict[str, str] = {}  # claim UID → lastTransitionTime of its Ready condition
        self._resuming: set[str] = set()  # claims whose Ready time is to be read back from the server

    def prepared(self, ref: ClaimRef, record: ClaimRecord) -> None:
        """The claim is prepared (again): its devices' entries are to be Ready=True."""
        self._want(ref, record)

    def released(self, ref: ClaimRef, record: ClaimRecord) -> None:
        """The claim's preparation was undone: the driver's entries are to go."""
        self._since.pop(ref.uid, None)
        self._resuming.discard(ref.uid)
        self._want(ref, None)

    def resume(self, ref: ClaimRef, record: ClaimRecord) -> None:
        """A claim prepared before this process started: apply its entries again (the server may have missed the
        last write), keeping the Ready time the server holds. A claim taken back from its CDI spec alone (its
        checkpoint record was lost) has no name to write to until the kubelet names it again: nothing is done."""
        if not (ref.namespace and ref.name):
            return
        if ref.uid not in self._since:
            self._resuming.add(ref.uid)
        self._want(ref, record)

    @property
    def pending(self) -> int:
        """Claims whose wanted state is not written yet."""
        return len(self._workers)

    async def close(self, timeout: float = FLUSH_SECONDS) -> None:
        """Stop writing, after waiting up to `timeout` seconds for what is wanted to be written (an unprepare just
        before the agent stops still removes its entries); what is not written by then stays unwritten."""
        workers = list(self._workers.values())
        if workers and timeout > 0:
            await asyncio.wait(workers, timeout=timeout)
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        self._workers.clear()
        self._wanted.clear()

    def _want(self, ref: ClaimRef, record: ClaimRecord | None) -> None:
        self._wanted[ref.uid] = (ref, record)
        if ref.uid not in self._workers:
            self._workers[ref.uid] = asyncio.create_task(self._work(ref.uid), name=f"claim status {ref.uid}")

    async def _work(self, uid: str) -> None:
        """Write the claim's wanted state until there is none left to write."""
        failures = 0
        try:
            await asyncio.sleep(self._settle)
            while (wanted := self._wanted.pop(uid, None)) is not None:
                try:
                    outcome = await self._write(*wanted)
                except Exception:  # a defect must not end the claim's writes unseen, nor the others'
                    self._log.exception("writing the claim's status failed", uid=uid)
                    outcome = "refused"
                if outcome != "error":
                    failures = 0
                    continue
                failures += 1
                if failures >= self._backoff.attempts:
                    ref = wanted[0]
                    self._log.error("gave up writing the claim's status", claim=f"{ref.namespace}/{ref.name}",
                                    uid=uid, attempts=failures)
                    self._count("gave-up")
                    failures = 0
                    continue  # a state wanted since gets tries of its own
                self._wanted.setdefault(uid, wanted)  # unless a newer state is wanted by now
                await asyncio.sleep(self._backoff.delay(failures))
        finally:
            self._workers.pop(uid, None)

    async def _write(self, ref: ClaimRef, record: ClaimRecord | None) -> Outcome:
        where = f"{ref.namespace}/{ref.name}"
        if record is not None and ref.uid in self._resuming:
            await self._read_since(ref)
        apply = self._body(ref, record)
        for why in apply.omitted:
            self._log.warning("device left out of the claim's status: the API server would refuse it",
                              claim=where, uid=ref.uid, reason=why)
        try:
            await self._api.apply_claim_status(ref.namespace, ref.name, apply.body, self.driver,
                                               self._backoff.timeout)
        except KubeError as e:
            outcome = _outcome(e)
            self._count(outcome)
            if self._metrics is not None:
                self._metrics.api_errors.labels("apply claim status").inc()
            if outcome == "gone":
                self._log.info("claim gone; its status is not written", claim=where, uid=ref.uid, error=str(e))
            elif outcome == "refused":
                self._log.error("the API server refused the claim's status", claim=where, uid=ref.uid,
                                error=str(e))
            else:
                self._log.warning("cannot write the claim's status; trying again", claim=where, uid=ref.uid,
                                  error=str(e))
            return outcome
        self._count("ok")
        self._log.debug("claim status written", claim=where, uid=ref.uid,
                        devices=len(apply.devices), released=record is None)
        return "ok"

    def _body(self, ref: ClaimRef, record: ClaimRecord | None) -> StatusApply:
        if record is None:
            return released_status(ref)
        since = self._since.get(ref.uid)
        if since is None:
            since = self._since[ref.uid] = rfc3339(self._clock())
        return status_apply(record, self.driver, self.pool, since)

    async def _read_since(self, ref: ClaimRef) -> None:
        """Take the Ready time of this driver's entries on the claim as the server holds them, if it has any."""
        self._resuming.discard(ref.uid)
        with contextlib.suppress(KubeError):
            claim = await self._api.get_claim(ref.namespace, ref.name) or {}
            if (claim.get("metadata") or {}).get("uid") != ref.uid:
                return
            for entry in (claim.get("status") or {}).get("devices") or ():
                if not isinstance(entry, Mapping) or entry.get("driver") != self.driver:
                    continue
                for condition in entry.get("conditions") or ():
                    if (isinstance(condition, Mapping) and condition.get("type") == READY
                            and condition.get("status") == "True" and is_rfc3339(condition.get("lastTransitionTime"))):
                        self._since.setdefault(ref.uid, str(condition["lastTransitionTime"]))

    def _count(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.claim_status_writes.labels(self.driver, outcome).inc()


def _outcome(error: KubeError) -> Outcome:
    if error.status == 404 or (error.status == 409 and "UID" in str(error)):
        return "gone"  # deleted, or replaced by a claim of the same name
    if error.status in (0, 409, 429) or error.status >= 500:
        return "error"
    return "refused"  # 422 and the other refusals: the same body would be refused again
