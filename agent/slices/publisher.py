"""Keeps this node's ResourceSlices in the API server equal to the desired ones, driver by driver.

Each driver's pool has a watch on its own slices (field selector `spec.nodeName`, `spec.driver`) that feeds a
local copy; any change there or in the desired slices schedules a sync, which writes only the difference
(see slice_plan). So a slice deleted or edited by someone else (the kubelet wipes a node's slices when it
starts) is put back within a fraction of a second, and a node where nothing changes costs the API server only
watch renewals, never writes. Errors never stop the agent: conflicts re-read and retry, other failures back off
exponentially with jitter up to 30 s, and the server's own validation errors are logged with the slice.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from structlog.typing import FilteringBoundLogger

from agent.kube.client import KubeClient, KubeError
from agent.metrics import Metrics
from agent.slices.plan import plan_pool

__all__ = ["Features", "Publisher"]

BACKOFF_START = 0.5
BACKOFF_MAX = 30.0
OWNER_RETRY = 30.0  # seconds between reads of a Node that could not be read
SYNC_DELAY = 0.05  # coalesce a burst of watch events (e.g. a collection delete) into one sync
WATCH_SECONDS = (300, 360)  # a renewal every ~5.5 min: about 11 requests an hour per pool at idle
_BURST_SYNCS, _BURST_SECONDS = 10, 10.0  # this many syncs that wrote, this quickly, means a fight

# Fields the API server drops when a feature gate is off, with the gate to name in the message.
_GATED = {"taints": "DRADeviceTaints", "consumesCounters": "DRAPartitionableDevices",
          "sharedCounters": "DRAPartitionableDevices", "allowMultipleAllocations": "DRAConsumableCapacity",
          "requestPolicy": "DRAConsumableCapacity"}
_FALLBACKS = {"taints": "tainted devices are left out",
              "allowMultipleAllocations": "shareable devices are published whole: one claim at a time each",
              "requestPolicy": "shareable devices are published whole: one claim at a time each"}


@dataclass(frozen=True)
class Features:
    """What this cluster stores in a ResourceSlice; a pool's desired slices are built for it."""

    taints: bool = True
    counters: bool = True
    shares: bool = True


Builder = Callable[[Features], Sequence[Mapping[str, Any]]]


@dataclass
class _Pool:
    driver: str
    build: Builder
    cache: dict[str, dict[str, Any]] = field(default_factory=dict)  # name → slice as the server has it
    dirty: asyncio.Event = field(default_factory=asyncio.Event)
    published: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    recent_writes: list[float] = field(default_factory=list)  # loop times of recent syncs that repaired
    synced: Sequence[Mapping[str, Any]] | None = None  # the desired slices of the last sync
    reachable: asyncio.Event = field(default_factory=asyncio.Event)  # the server answered a list again


class Publisher:
    """Publishes the pools of one node."""

    def __init__(self, kube: KubeClient, node: str, log: FilteringBoundLogger, metrics: Metrics | None = None,
                 node_uid: str | None = None) -> None:
        self._kube = kube
        self._node = node
        self._log = log.bind(node=node)
        self._metrics = metrics
        self._node_uid = node_uid
        self._pools: dict[str, _Pool] = {}
        self._owner_lookup: asyncio.Task[str | None] | None = None
        self.features = Features()
        self._reported: set[str] = set()
        self.writes = 0
        self.watch_renewals = 0

    def publish(self, driver: str, build: Builder) -> asyncio.Event:
        """Keep the driver's pool as `build(features)` says, from now on; the event is set once it is."""
        pool = self._pools.get(driver)
        if pool is None:
            self._look_up_owner()  # while the first list runs
            pool = self._pools[driver] = _Pool(driver, build)
            pool.tasks = [asyncio.create_task(self._watch(pool), name=f"watch slices {driver}"),
                          asyncio.create_task(self._sync_loop(pool), name=f"sync slices {driver}")]
        else:
            pool.build = build
        pool.dirty.set()
        return pool.published

    def published(self, driver: str) -> asyncio.Event:
        return self._pools[driver].published

    async def stop(self) -> None:
        tasks: list[asyncio.Task[Any]] = [t for p in self._pools.values() for t in p.tasks]
        if self._owner_lookup is not None:
            tasks.append(self._owner_lookup)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- the local copy of our slices -------------------------------------------------------------------

    async def _watch(self, pool: _Pool) -> None:
        resource_version = ""
        delay = BACKOFF_START
        while True:
            try:
                if not resource_version:
                    items, resource_version = await self._kube.list_slices_versioned(self._node, pool.driver)
                    pool.cache = {s["metadata"]["name"]: s for s in items}
                    pool.dirty.set()  # compare after every (re)list; nothing is written when nothing differs
                    pool.reachable.set()  # a sync waiting out its backoff can try now
                seconds = random.randint(*WATCH_SECONDS)
                async for event in self._kube.watch_slices(self._node, pool.driver, resource_version, seconds):
                    resource_version = self._apply(pool, event) or resource_version
                    delay = BACKOFF_START
                self.watch_renewals += 1  # the server ended the watch after its timeout: carry on from here
            except _Expired:
                resource_version = ""  # too old to resume: list again
            except KubeError as e:
                self._api_error("watch", e)
                if e.status == 410:
                    resource_version = ""
                    continue
                # Until the first list succeeds the pool cannot be published at all (its first sync waits for
                # it), so the operator reads that as what it is: publishing failing, not only a watch.
                what = "publishing" if pool.synced is None else "watching"
                self._log.warning(f"{what} slices failed; retrying", driver=pool.driver, error=str(e),
                                  retry_in=round(delay, 1))
                await asyncio.sleep(_jittered(delay))
                delay = min(delay * 2, BACKOFF_MAX)
                resource_version = ""  # events may have been missed: list again

    def _apply(self, pool: _Pool, event: Mapping[str, Any]) -> str:
        """Update the local copy from one watch event; the resourceVersion to resume from."""
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Expired
            raise KubeError(f"watch error: {obj.get('message', obj)}", int(obj.get("code") or 0))
        meta = obj.get("metadata") or {}
        if kind in ("ADDED", "MODIFIED"):
            pool.cache[meta["name"]] = obj
            pool.dirty.set()
        elif kind == "DELETED":
            pool.cache.pop(meta.get("name", ""), None)
            pool.dirty.set()
        return str(meta.get("resourceVersion") or "")

    # --- making the server's slices the desired ones ----------------------------------------------------

    async def _sync_loop(self, pool: _Pool) -> None:
        delay = BACKOFF_START
        while True:
            await pool.dirty.wait()
            if pool.synced is None:
                # The pool's first sync has no burst to coalesce: it goes as soon as the first list has brought
                # the server's slices, and never before, however slow the list: a write made without knowing what
                # the server holds would create a second slice beside one a previous run left, of the same
                # generation, and no scheduler allocates from such a pool until one of them goes.
                await pool.reachable.wait()
            else:
                await asyncio.sleep(SYNC_DELAY)
            pool.dirty.clear()
            try:
                await self._sync(pool)
                delay = BACKOFF_START
            except KubeError as e:
                self._api_error("publish", e)
                if e.status == 409:
                    # Our copy was stale: read the server's state and try again soon.
                    await self._refresh(pool)
                    await asyncio.sleep(_jittered(min(delay, 1.0)))
                elif e.status == 422:
                    self._log.error("the API server refused a slice; retrying later", driver=pool.driver,
                                    error=str(e))
                    await asyncio.sleep(_jittered(BACKOFF_MAX))
                else:
                    self._log.warning("publishing slices failed; retrying", driver=pool.driver, error=str(e),
                                      retry_in=round(delay, 1))
                    pool.reachable.clear()
                    with contextlib.suppress(TimeoutError):  # ends early once the watch reaches the server again
                        async with asyncio.timeout(_jittered(delay)):
                            await pool.reachable.wait()
                pool.dirty.set()
                delay = min(delay * 2, BACKOFF_MAX)
            except Exception:  # a bug: log it, keep the agent and the other pools alive
                self._log.exception("publishing slices failed unexpectedly", driver=pool.driver)
                await asyncio.sleep(_jittered(BACKOFF_MAX))
                pool.dirty.set()

    async def _refresh(self, pool: _Pool) -> None:
        try:
            items, _ = await self._kube.list_slices_versioned(self._node, pool.driver)
        except KubeError as e:
            self._api_error("list", e)
            return
        pool.cache = {s["metadata"]["name"]: s for s in items}

    async def _sync(self, pool: _Pool) -> None:
        desired = pool.build(self.features)
        owner = await self._owner()
        if not owner:  # publish now, and add the owner once the Node can be read
            asyncio.get_running_loop().call_later(_jittered(OWNER_RETRY), pool.dirty.set)
        plan = plan_pool(desired, list(pool.cache.values()), owner)
        # A write for slices we already made as desired repairs a change made by someone else; writes for our
        # own changes (health, hot-plug) are never paced, however many come.
        repair = desired == pool.synced
        pool.synced = desired
        if plan.writes:
            self._log.info("publishing slices", driver=pool.driver, generation=plan.generation,
                           deletes=len(plan.deletes), updates=len(plan.updates), creates=len(plan.creates))
            if repair:
                await self._pace(pool)
        for obj in plan.deletes:
            meta = obj["metadata"]
            await self._kube.delete_slice(meta["name"], meta.get("uid"), meta.get("resourceVersion"))
            pool.cache.pop(meta["name"], None)
            self.writes += 1
        # Updates, then creates, each group in parallel: readers ignore slices of an older generation and wait
        # for the pool to be complete, so the order within a group does not matter.
        for group, write in ((plan.updates, lambda b: self._kube.replace_slice(b["metadata"]["name"], b)),
                             (plan.creates, self._kube.create_slice)):
            results = await asyncio.gather(*(_explained(write, b) for b in group), return_exceptions=True)
            for body, result in zip(group, results, strict=True):
                if not isinstance(result, BaseException):
                    self._stored(pool, body, result)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
        if plan.writes and repair:
            pool.recent_writes.append(asyncio.get_running_loop().time())
        if self._metrics is not None:
            self._metrics.published_devices.labels(pool.driver).set(
                sum(len(s["spec"].get("devices") or ()) for s in desired))
            self._metrics.published_slices.labels(pool.driver).set(len(desired))
        pool.published.set()

    async def _pace(self, pool: _Pool) -> None:
        """Slow down when the pool is repaired again and again: something (a server default, another writer
        fighting over the slices) changes what we wrote, and a hot loop would load the API server. Only repairs
        whose writes all landed count: failed ones have their own backoff."""
        now = asyncio.get_running_loop().time()
        pool.recent_writes = [t for t in pool.recent_writes if now - t < _BURST_SECONDS]
        if len(pool.recent_writes) >= _BURST_SYNCS:
            self._log.error("slices keep changing after being written; slowing down", driver=pool.driver,
                            syncs=len(pool.recent_writes), seconds=_BURST_SECONDS)
            await asyncio.sleep(_jittered(BACKOFF_MAX))

    def _stored(self, pool: _Pool, sent: Mapping[str, Any], stored: dict[str, Any]) -> None:
        self.writes += 1
        pool.cache[stored["metadata"]["name"]] = stored
        dropped = _dropped_fields(sent, stored)
        if dropped:
            self._features_lost(dropped)

    def _features_lost(self, dropped: set[str]) -> None:
        """The server dropped fields we sent: its feature gate is off. Say so once, and publish without them."""
        for name in sorted(dropped - self._reported):
            self._reported.add(name)
            self._log.error("the API server dropped a ResourceSlice field: its feature gate is off in this "
                            "cluster", field=name, gate=_GATED[name],
                            fallback=_FALLBACKS.get(name, "devices that consume counters are left out"))
        features = Features(taints=self.features.taints and "taints" not in dropped,
                            counters=self.features.counters and not dropped & {"consumesCounters", "sharedCounters"},
                            shares=self.features.shares
                            and not dropped & {"allowMultipleAllocations", "requestPolicy"})
        if features != self.features:
            self.features = features
            for pool in self._pools.values():
                pool.dirty.set()

    async def _owner(self) -> list[dict[str, Any]]:
        """The Node as controlling owner, so the slices go when the Node goes; none while it cannot be read."""
        if self._node_uid is None:
            # Shielded: the lookup is shared by the pools, and one pool's sync being cancelled must not end it.
            self._node_uid = await asyncio.shield(self._look_up_owner())
            if self._node_uid is None:
                return []
        return [{"apiVersion": "v1", "kind": "Node", "name": self._node, "uid": self._node_uid, "controller": True}]

    def _look_up_owner(self) -> asyncio.Task[str | None]:
        """The one running lookup of the Node's uid; a new one after a lookup that failed."""
        lookup = self._owner_lookup
        if lookup is None or (lookup.done() and (lookup.cancelled() or lookup.result() is None)):
            lookup = self._owner_lookup = asyncio.create_task(self._node_uid_from_server(), name="node owner")
        return lookup

    async def _node_uid_from_server(self) -> str | None:
        if self._node_uid is not None:
            return self._node_uid
        try:
            return await self._kube.get_node_uid(self._node)
        except KubeError as e:
            if "node-owner" not in self._reported:
                self._reported.add("node-owner")
                self._log.warning("cannot read the Node; slices are published without an owner for now",
                                  error=str(e))
            return None

    def _api_error(self, operation: str, error: KubeError) -> None:
        if self._metrics is not None:
            self._metrics.api_errors.labels(operation).inc()


class _Expired(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


async def _explained(write: Callable[[Mapping[str, Any]], Awaitable[dict[str, Any]]],
                     body: Mapping[str, Any]) -> dict[str, Any]:
    """A write whose validation error (422) names the slice and the devices the server's message points at."""
    # The write's coroutine is made here, not by the caller: a task cancelled before its first step (the agent
    # stopping mid-publish) would leave a caller-made coroutine never awaited.
    try:
        return await write(body)
    except KubeError as e:
        if e.status != 422:
            raise
        devices = body["spec"].get("devices") or ()
        named = sorted({devices[int(i)]["name"] for i in re.findall(r"spec\.devices\[(\d+)\]", str(e))
                        if int(i) < len(devices)})
        slice_name = body["metadata"].get("name") or body["metadata"].get("generateName", "") + "…"
        detail = f" (slice {slice_name}" + (f"; devices {', '.join(named)})" if named else ")")
        raise KubeError(str(e) + detail, e.status, e.reason) from None


def _jittered(seconds: float) -> float:
    return seconds * random.uniform(0.8, 1.2)


def _dropped_fields(sent: Mapping[str, Any], stored: Mapping[str, Any]) -> set[str]:
    """Gated fields present in what was sent and missing from what the server stored."""
    dropped = set()
    if sent["spec"].get("sharedCounters") and not stored["spec"].get("sharedCounters"):
        dropped.add("sharedCounters")
    stored_devices = {d.get("name"): d for d in stored["spec"].get("devices") or ()}
    for device in sent["spec"].get("devices") or ():
        kept = stored_devices.get(device["name"], {})
        for name in ("taints", "consumesCounters", "allowMultipleAllocations"):
            if device.get(name) and not kept.get(name):
                dropped.add(name)
        for capacity_name, capacity in (device.get("capacity") or {}).items():
            if capacity.get("requestPolicy") and not (kept.get("capacity") or {}).get(capacity_name, {}).get(
                    "requestPolicy"):
                dropped.add("requestPolicy")
    return dropped
