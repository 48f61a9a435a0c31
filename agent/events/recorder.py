"""Kubernetes Events (events.k8s.io/v1) about what an operator must see: a claim that could not be prepared (on
the ResourceClaim), a device tainted as unhealthy or recovered, a checkpoint refused (on the Node).

Recording never waits for the API server and never fails its caller: an occurrence is counted into its series
(agent/events/series.py) and the Event is queued; one background task writes the queue, oldest first, paced by a
token bucket. A write that fails for want of the server (unreachable, 5xx, 429, a timeout) is tried again with
exponential backoff, a bounded number of times; one the server refuses (4xx) is dropped. Failed attempts are
counted (`dra_agent_api_errors`) and logged once per outage, not at every attempt; what is never written is
counted by cause (`dra_agent_events_dropped`): the queue drops its oldest entry beyond its bound. At shutdown the
queue is flushed within a short deadline.

No Event is written about a claim whose reference (namespace, name, UID) is not one a ResourceClaim can have: its
namespace and name would go into the Event's URL and body. The failure is logged and counted instead, and the
kubelet has it in its answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from structlog.typing import FilteringBoundLogger

from agent.events.rules import (
    EVENTS_API_VERSION,
    NORMAL,
    WARNING,
    Reference,
    check_fields,
    cut_note,
    event_name,
    micro_time,
    reporting_instance,
)
from agent.events.series import SERIES_WINDOW, Occurrences, SeriesCache, TokenBucket
from agent.kube.client import KubeError
from agent.kube.names import claim_reference_problem
from agent.logs import get_logger
from agent.metrics import Metrics
from agent.node.health_board import DeviceState
from agent.slices.taints import TaintPolicy, device_taints
from backends.contract import ClaimRef, Health

__all__ = ["CONTROLLER", "FLUSH_SECONDS", "EventRecorder", "EventWriter", "Pacing"]

CONTROLLER = "dra-agent.io/agent"
"""`reportingController` of every Event the agent writes, whichever of its drivers it is about."""
FLUSH_SECONDS = 2.0
"""How long the shutdown waits for queued Events to be written."""


@dataclass(frozen=True)
class Pacing:
    """How Events are aggregated and written; the defaults are the agent's, tests shorten them."""

    window: float = SERIES_WINDOW
    heartbeat: float = 60.0  # seconds between two writes of one series' growing count
    rate: float = 10.0  # writes per second on average, `burst` at once: a node agent writes few Events
    burst: int = 100
    attempts: int = 8  # writes of one Event before it is given up (about 1.5 minutes of backoff)
    backoff: float = 0.5  # first wait after a failure, doubled each time up to `backoff_max`
    backoff_max: float = 30.0
    request_timeout: float = 10.0  # a server that hangs is a failure, retried like any other
    queue: int = 1000  # Events waiting to be written; beyond it the oldest is dropped


class EventWriter(Protocol):
    """The API calls the recorder makes (agent/kube/client.py's KubeClient)."""

    async def create_event(self, namespace: str, body: Mapping[str, Any], timeout: float) -> Mapping[str, Any]:
        """Create an events.k8s.io/v1 Event; KubeError on failure."""

    async def patch_event(self, namespace: str, name: str, patch: Mapping[str, Any],
                          timeout: float) -> Mapping[str, Any]:
        """Merge-patch an Event; KubeError on failure (404 when it is gone)."""


class EventRecorder:
    """Records the agent's Events and writes them to the API server in the background; `start`, then `stop`."""

    def __init__(self, writer: EventWriter, node: str, *, pod_uid: str | None = None,
                 metrics: Metrics | None = None, log: FilteringBoundLogger | None = None,
                 pacing: Pacing = Pacing()) -> None:
        self.node = node
        self.pacing = pacing
        self._writer = writer
        self._instance = reporting_instance(node, pod_uid)
        self._metrics = metrics
        self._log = log or get_logger("events")
        self._cache = SeriesCache(pacing.window)
        self._bucket = TokenBucket(pacing.rate, pacing.burst)
        self._pending: dict[Occurrences, None] = {}  # waiting to be written, oldest first
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._current: Occurrences | None = None  # being written
        self._closed = False
        self._outage: tuple[float, int] | None = None  # since when writes fail, and how many attempts failed
        self._refusals: set[tuple[str, int]] = set()  # (operation, status) already logged

    # --- what the agent reports ---------------------------------------------------------------------------

    def prepare_failed(self, driver: str, claim: ClaimRef, error: str) -> None:
        """A Warning on the claim: this driver could not prepare it on this node, and the error why; only logged
        and counted when the kubelet's reference to the claim is not a valid one (no Event is about it)."""
        problem = claim_reference_problem(claim.uid, claim.namespace, claim.name)
        if problem:
            if self._metrics is not None:
                self._metrics.events.labels(WARNING, "PrepareFailed").inc()
            self._drop("invalid-claim")
            # The problem names the bad field, cut short: the reference's values may be of any length.
            self._log.warning("claim not prepared; no Event about it: its reference is not a claim's", driver=driver,
                              refused=problem, error=error)
            return
        regarding = Reference("resource.k8s.io/v1", "ResourceClaim", claim.name, claim.namespace, claim.uid)
        self.record(regarding, WARNING, "PrepareFailed", "Prepare",
                    f"Driver {driver} could not prepare the claim on node {self.node}: {error}")

    def health_changed(self, driver: str, device: str, old: DeviceState, new: DeviceState,
                       policy: TaintPolicy) -> None:
        """On the Node, when a device becomes unhealthy (its slice gets a taint) or stops being so (Healthy
        again: the taint goes); other changes (to or from Unknown, a new reason) leave no Event."""
        if (old.health is Health.UNHEALTHY) == (new.health is Health.UNHEALTHY):
            return
        if new.health is Health.UNHEALTHY:
            self.node_event(WARNING, "DeviceUnhealthy", "Taint", f"Device {device} of driver {driver} is "
                            f"unhealthy: {new.reason or new.cause}; tainted {_taint(driver, device, new, policy)}")
        elif new.health is Health.HEALTHY:
            self.node_event(NORMAL, "DeviceRecovered", "Untaint", f"Device {device} of driver {driver} is healthy "
                            f"again; taint {_taint(driver, device, old, policy)} removed")

    def claim_reaped(self, driver: str, claim: str, devices: Sequence[str], why: str) -> None:
        """On the Node: a prepared claim was unprepared because its ResourceClaim is gone (agent/claims/reaper.py)."""
        self.node_event(NORMAL, "ClaimReaped", "Unprepare", f"Claim {claim} of driver {driver} unprepared without "
                        f"the kubelet: {why}; devices {', '.join(devices)} are free again")

    def checkpoint_refused(self, path: Path, why: str) -> None:
        """On the Node: the agent will not use this checkpoint (and cannot serve the driver it belongs to)."""
        self.node_event(WARNING, "CheckpointRefused", "ReadCheckpoint", f"Checkpoint {path} refused: {why}")

    def node_event(self, type_: str, reason: str, action: str, note: str) -> None:
        """An Event about this node (`regarding` the Node; kept in the namespace `default`)."""
        # The kubelet's convention for its own Node Events: the node name in place of the uid, which spares a
        # read of the Node; `kubectl describe node` looks Events up under both.
        self.record(Reference("v1", "Node", self.node, uid=self.node), type_, reason, action, note)

    def record(self, regarding: Reference, type_: str, reason: str, action: str, note: str) -> None:
        """Queue an Event (or count it into its series); returns at once. ValueError for a type, reason or
        action the API server would refuse; the note is cut to the server's limit."""
        check_fields(type_, reason, action)
        if self._closed:
            self._log.debug("event after shutdown not recorded", reason=reason, note=note)
            return
        try:
            note = cut_note(note)
            wall = time.time()
            entry = self._cache.observe((regarding, type_, reason, action, note), time.monotonic(), wall,
                                        lambda: self._event(regarding, type_, reason, action, note, wall))
            if self._metrics is not None:
                self._metrics.events.labels(type_, reason).inc()
            self._enqueue(entry)
        except Exception:  # a defect here must not fail the prepare or health change that reported it
            self._log.exception("event not recorded", reason=reason)

    def _event(self, regarding: Reference, type_: str, reason: str, action: str, note: str,
               wall: float) -> dict[str, Any]:
        return {
            "apiVersion": EVENTS_API_VERSION, "kind": "Event",
            "metadata": {"name": event_name(regarding.name, time.time_ns()), "namespace": regarding.event_namespace},
            "eventTime": micro_time(wall), "type": type_, "reason": reason, "action": action, "note": note,
            "regarding": regarding.to_json(), "reportingController": CONTROLLER, "reportingInstance": self._instance,
        }  # fmt: skip

    # --- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._write_loop(), name="events")

    async def stop(self, timeout: float = FLUSH_SECONDS) -> None:
        """Write what is queued (series counts included, without waiting for their heartbeat) for at most
        `timeout` seconds, then stop; what is left is counted as dropped."""
        self._closed = True
        if self._task is not None:
            self._wake.set()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._idle.wait()
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        left = len(self._pending) + (self._current is not None and self._current not in self._pending)
        if left:
            self._drop("stopped", left)
            self._log.warning("events not written before the agent stopped", events=left)
        self._pending.clear()
        self._current = None
        self._gauge()

    # --- writing ------------------------------------------------------------------------------------------

    def _enqueue(self, entry: Occurrences) -> None:
        if entry in self._pending:
            return
        self._pending[entry] = None
        self._idle.clear()
        if len(self._pending) > self.pacing.queue:
            del self._pending[next(iter(self._pending))]
            self._drop("queue-full")
        self._gauge()
        self._wake.set()

    def _next(self, now: float) -> tuple[Occurrences | None, float | None]:
        """The pending entry to write now, else how long until one is due (None: nothing is pending)."""
        heartbeat = 0.0 if self._closed else self.pacing.heartbeat
        best: tuple[float, Occurrences] | None = None
        for entry in list(self._pending):
            due = entry.due(heartbeat)
            if due is None:
                del self._pending[entry]
            elif best is None or due < best[0]:
                best = (due, entry)
        if best is None:
            return None, None
        return (best[1], None) if best[0] <= now else (None, best[0] - now)

    async def _write_loop(self) -> None:
        while True:
            entry, wait = self._next(time.monotonic())
            if entry is None:
                self._gauge()
                if wait is None:
                    self._idle.set()
                self._wake.clear()
                with contextlib.suppress(TimeoutError):  # not wait_for, which can swallow a cancellation (3.11)
                    async with asyncio.timeout(wait):
                        await self._wake.wait()
                continue
            # An occurrence while it is being written queues it again (it is no longer pending).
            del self._pending[entry]
            self._current = entry
            delay = self._bucket.take(time.monotonic())
            if delay:
                await asyncio.sleep(delay)
            if await self._deliver(entry) and entry.due(self.pacing.heartbeat) is not None:
                self._enqueue(entry)  # written, but not all of it (the create of an Event that was there)
            self._current = None

    async def _deliver(self, entry: Occurrences) -> bool:
        """Write one Event (or its series), retrying what the server may take later; whether it was written."""
        pacing = self.pacing
        for attempt in range(1, pacing.attempts + 1):
            operation = "create event" if entry.written == 0 else "patch event"
            try:
                await self._write(entry)
            except KubeError as e:
                if not _retryable(e):
                    self._refused(entry, operation, e)
                    return False
                self._failed(entry, operation, e)
                if attempt < pacing.attempts:
                    await asyncio.sleep(min(pacing.backoff * 2 ** (attempt - 1), pacing.backoff_max)
                                        * random.uniform(0.8, 1.2))
                continue
            except Exception:  # a defect (an answer that is no JSON...) must not end the writer
                self._log.exception("writing an event failed", operation=operation, event_reason=entry.body["reason"])
                self._drop("error")
                return False
            self._recovered()
            return True
        self._drop("gave-up")
        return False

    async def _write(self, entry: Occurrences) -> None:
        count, timeout = entry.count, self.pacing.request_timeout
        if entry.written:
            try:
                await self._writer.patch_event(entry.namespace, entry.name, {"series": entry.series()}, timeout)
                entry.mark_written(count, time.monotonic())
                return
            except KubeError as e:
                if e.status != 404:
                    raise
                # Gone (its time to live ran out, or someone deleted it): create it again, series and all.
        try:
            await self._writer.create_event(entry.namespace, entry.create_body(), timeout)
        except KubeError as e:
            if e.status != 409:
                raise
            # Already there: an earlier attempt reached the server though its answer was lost. The stored count
            # is unknown; counting it as a single occurrence makes the next write patch in the real one.
            count = 1
        entry.mark_written(count, time.monotonic())

    # --- reporting on the writes --------------------------------------------------------------------------

    def _failed(self, entry: Occurrences, operation: str, error: KubeError) -> None:
        if self._metrics is not None:
            self._metrics.api_errors.labels(operation).inc()
        if self._outage is None:
            self._outage = (time.monotonic(), 0)
            self._log.warning("cannot write events to the API server; retrying in the background (further "
                              "failures are not logged until it works again)", error=str(error),
                              event_reason=entry.body["reason"])
        self._outage = (self._outage[0], self._outage[1] + 1)

    def _recovered(self) -> None:
        if self._outage is not None:
            since, failures = self._outage
            self._outage = None
            self._log.info("events are written again", failed_attempts=failures,
                           seconds=round(time.monotonic() - since, 1))

    def _refused(self, entry: Occurrences, operation: str, error: KubeError) -> None:
        self._drop("refused")
        first = (operation, error.status) not in self._refusals
        self._refusals.add((operation, error.status))
        (self._log.error if first else self._log.debug)(
            "the API server refused an event", operation=operation, error=str(error),
            event_reason=entry.body["reason"], regarding=entry.body["regarding"])

    def _drop(self, cause: str, count: int = 1) -> None:
        if self._metrics is not None:
            self._metrics.events_dropped.labels(cause).inc(count)

    def _gauge(self) -> None:
        if self._metrics is not None:
            self._metrics.events_pending.set(len(self._pending))


def _retryable(error: KubeError) -> bool:
    """Unreachable (0), timed out on the server (408, 504), throttled (429) or failing (5xx): try again later."""
    return error.status in (0, 408, 429) or error.status >= 500


def _taint(driver: str, device: str, state: DeviceState, policy: TaintPolicy) -> str:
    """The device's taint for this state, as `key=value:Effect` (kubectl's notation)."""
    taints = device_taints(driver, {device: state}, policy).get(device) or [{}]
    taint = taints[0]
    value = f"={taint['value']}" if taint.get("value") else ""
    return f"{taint.get('key', '')}{value}:{taint.get('effect', '')}"
