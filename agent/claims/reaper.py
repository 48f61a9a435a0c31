"""The stale-claim reaper of one driver: claims this node still has prepared although their ResourceClaim is gone.

The kubelet unprepares a claim before its pod goes, but not when the agent was down meanwhile, nor when the kubelet
lost track of it; such a claim would hold its devices for ever (the double-allocation guard refuses them to every
other claim). At start and then periodically, the reaper reads each prepared claim from the API server. A claim
that is confirmed gone (not found, or found with another UID: deleted and created again), or no longer allocated
to this node, becomes a suspect; one still gone once the grace period has passed (the kubelet may still be on its
way with the unprepare) is unprepared, every change undone, as if the kubelet had asked. Anything short of a
confirmation (an API error, a timeout) reaps nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

from agent.claims.collaborators import ClaimReader
from agent.claims.preparer import Preparer
from agent.claims.records import ClaimRecord
from agent.metrics import Metrics
from agent.unexpected import unexpected
from backends.contract import ClaimRef

__all__ = ["Reaper", "gone_reason"]


def gone_reason(claim: Mapping[str, Any] | None, record: ClaimRecord, driver: str, pool: str) -> str | None:
    """Why the prepared `record` has no ResourceClaim any more (`claim` as the API server answered, None for not
    found), or None when the claim is still allocated to this node."""
    if claim is None:
        return "the ResourceClaim is gone"
    metadata = claim.get("metadata")
    uid = metadata.get("uid") if isinstance(metadata, Mapping) else None
    if uid != record.uid:
        return f"the ResourceClaim was deleted and created again (now UID {uid})"
    status = claim.get("status")
    allocation = status.get("allocation") if isinstance(status, Mapping) else None
    devices = allocation.get("devices") if isinstance(allocation, Mapping) else None
    results = devices.get("results") if isinstance(devices, Mapping) else None
    if not isinstance(results, list):
        return "the ResourceClaim is no longer allocated"
    ours = [r for r in results if isinstance(r, Mapping) and r.get("driver") == driver and r.get("pool") == pool]
    if not ours:
        return "the ResourceClaim is no longer allocated to this node"
    return None


class Reaper:
    """Finds and unprepares one driver's stale claims; `run` until cancelled."""

    def __init__(self, preparer: Preparer, claims: ClaimReader, metrics: Metrics, *, interval: float, grace: float,
                 clock: Callable[[], float] = time.monotonic,
                 on_reaped: Callable[[ClaimRecord, str], None] = lambda record, reason: None) -> None:
        self._preparer = preparer
        self._claims = claims
        self._metrics = metrics
        self._interval = interval
        self._grace = grace
        self._clock = clock
        self._on_reaped = on_reaped
        self._suspects: dict[str, float] = {}  # claim UID → when it was first found gone
        self._log = preparer.log.bind(component="reaper")

    async def run(self) -> None:
        while True:
            await self.sweep()
            # A suspect is looked at again when its grace period ends, not a whole interval later.
            due = min((t + self._grace for t in self._suspects.values()), default=None)
            wait = self._interval if due is None else min(self._interval, max(due - self._clock(), 0) + 0.001)
            await asyncio.sleep(wait)

    async def sweep(self) -> list[str]:
        """One pass over the prepared claims; the UIDs reaped."""
        preparer = self._preparer
        reaped: list[str] = []
        records = [r for r in preparer.checkpoint.claims.values() if r.state == "completed"]
        for record in records:
            if not record.name:
                continue  # known from its CDI spec alone: its name is unknown until the kubelet asks again
            try:
                async with asyncio.timeout(preparer.claim_read_seconds):
                    claim = await self._claims.get_claim(record.namespace, record.name)
            except Exception as e:  # not a confirmation of anything: try again next time
                self._metrics.api_errors.labels("get_resourceclaim").inc()
                self._log.warning("cannot check whether a prepared claim still exists", claim=_name(record),
                                  error=unexpected(e))
                continue
            reason = gone_reason(claim, record, preparer.driver, preparer.pool)
            if reason is None:
                self._suspects.pop(record.uid, None)
                continue
            first = self._suspects.setdefault(record.uid, self._clock())
            if self._clock() - first < self._grace:
                self._log.info("a prepared claim is gone; unprepared unless the kubelet does it first",
                               claim=_name(record), reason=reason, grace_seconds=self._grace)
                continue
            error = await preparer.forget(ClaimRef(record.uid, record.namespace, record.name), record)
            if error:
                self._log.error("cannot unprepare a claim that is gone; will retry", claim=_name(record),
                                reason=reason, error=error)
                continue
            self._suspects.pop(record.uid, None)
            reaped.append(record.uid)
            self._metrics.reaped_claims.labels(preparer.driver, _kind(reason)).inc()
            self._log.warning("unprepared a claim the API server no longer has for this node", claim=_name(record),
                              reason=reason, devices=[d.device for d in record.devices])
            self._on_reaped(record, reason)
        gone = set(self._suspects) - {r.uid for r in records}
        for uid in gone:  # unprepared by the kubelet meanwhile
            del self._suspects[uid]
        return reaped


def _kind(reason: str) -> str:
    """A short label for the metric."""
    if "gone" in reason:
        return "not-found"
    if "created again" in reason:
        return "replaced"
    return "not-allocated"


def _name(record: ClaimRecord) -> str:
    return f"{record.namespace}/{record.name}:{record.uid}"
