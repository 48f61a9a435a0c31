"""One DRA driver on this node, from start to stop: its pool, the health of its devices, its preparer, its
kubelet sockets and its slices.

The driver follows its backends' health streams. A health change updates the board, which the kubelet's
health streams and the slices' taints read; a `DevicesChanged` (hot-plug) runs the backend's discovery again
and publishes the new pool. A driver without devices and without prepared claims stays dormant (no sockets,
no slices) until devices appear.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from agent.claims.cdi import CLASS, vendor
from agent.claims.checkpoint import Checkpoint, CheckpointError
from agent.claims.collaborators import ClaimMemory, ClaimSource, DriverDevices, InstanceGuard, Reporting
from agent.claims.instances import Instances
from agent.claims.locks import FileLock
from agent.claims.metadata_files import MetadataFiles
from agent.claims.plan import Owner
from agent.claims.preparer import Preparer
from agent.claims.reaper import Reaper
from agent.claims.records import ClaimRecord
from agent.claims.recovery import recover
from agent.claims.status_writer import ClaimStatusWriter
from agent.events.recorder import EventRecorder
from agent.kube.client import KubeClient
from agent.kubelet.health_stream import HealthStream
from agent.kubelet.plugin import KubeletPlugin
from agent.logs import get_logger
from agent.metrics import Metrics
from agent.node.health_board import HealthBoard
from agent.node.inventory import BackendReport, Pool, discover_all, log_unserved, merge_pools
from agent.settings import Settings
from agent.slices.build import pool_slices
from agent.slices.publisher import Features, Publisher
from agent.slices.taints import TaintPolicy, device_taints
from backends.capabilities import HasConfigTypes
from backends.contract import ClaimRef, DevicesChanged, Health, HealthEvent
from cdi.store import SpecStore

__all__ = ["Driver", "DriverSetup"]

SETTLE_SECONDS = 0.2
"""Hot-plug comes in bursts (a NIC and its VFs): discovery runs once the burst has settled this long."""
RETRY_SECONDS = 30.0
"""A backend whose health stream failed is followed again after this long."""


@dataclass(frozen=True)
class DriverSetup:
    """What every driver of the agent shares."""

    settings: Settings
    node: str
    kube: KubeClient
    publisher: Publisher
    metrics: Metrics
    boot_id: str
    instances: Instances
    events: EventRecorder | None = None


class Driver:
    """One DRA driver's devices, claims, sockets and slices."""

    def __init__(self, setup: DriverSetup, name: str, reports: Sequence[BackendReport]) -> None:
        self.name = name
        self._setup = setup
        self._reports = {r.name: r for r in reports}
        self.pool = _merged(name, self._reports.values())
        self.board = HealthBoard(d.name for d in self.pool.devices)
        self._owners: dict[str, Owner] = {}
        self._index_owners()
        self._policy = TaintPolicy.of(setup.settings.no_execute)
        self.preparer: Preparer | None = None
        self.claim_status: ClaimStatusWriter | None = None
        self.plugin: KubeletPlugin | None = None
        self.published = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._stale: set[str] = set()
        self._stale_event = asyncio.Event()
        self._log = get_logger("driver").bind(driver=name)
        for report in self._reports.values():
            self._count_unserved(report)

    @property
    def active(self) -> bool:
        """Serving the kubelet and publishing slices."""
        return self.plugin is not None

    def unserved(self) -> list[str]:
        """What the driver's backends know is on the node but cannot serve, one line each (for /readyz)."""
        lines: dict[str, None] = {}  # nvidia-gpu and nvidia-mig say the same of the same GPUs: once is enough
        for name in sorted(self._reports):
            inventory = self._reports[name].inventory
            for unserved in inventory.unserved if inventory else ():
                lines.setdefault(f"{self.name}: {len(unserved.devices)} device(s) cannot be served "
                                 f"({', '.join(unserved.devices)}): {unserved.reason}")
        return list(lines)

    def _count_unserved(self, report: BackendReport) -> None:
        if report.inventory is None:
            return  # a backend whose discovery failed is not running: the agent counts its hardware
        self._setup.metrics.unserved_devices.labels(self.name, report.name).set(
            sum(len(u.devices) for u in report.inventory.unserved))

    async def start(self) -> None:
        """Serve and publish if there is anything to offer or to clean up; follow the backends either way."""
        if self.pool.devices or _has_state(self._state_dir):
            await self._activate()
        for report in self._reports.values():
            self._tasks.append(asyncio.create_task(self._follow(report), name=f"health {report.name}"))
        self._tasks.append(asyncio.create_task(self._rediscover_loop(), name=f"rediscover {self.name}"))

    async def stop(self, grace: float) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.plugin is not None:
            await self.plugin.stop(grace)
        if self.claim_status is not None:
            await self.claim_status.close()
        if self.preparer is not None:
            await asyncio.to_thread(self.preparer.checkpoint.close)

    # --- serving ------------------------------------------------------------------------------------

    async def _activate(self) -> None:
        """Replay the checkpoint (claims prepared before a restart stay prepared), publish, serve."""
        preparer = self.preparer = self._preparer()
        await recover(preparer)
        if self.claim_status is not None:
            # The status of claims prepared before this start is applied again: the last write may not have been.
            for record in list(preparer.checkpoint.claims.values()):
                if record.state == "completed":
                    self.claim_status.resume(ClaimRef(record.uid, record.namespace, record.name), record)
        settings = self._setup.settings
        reaper = Reaper(preparer, self._setup.kube, self._setup.metrics, interval=settings.reap_interval,
                        grace=settings.reap_grace, on_reaped=self._reaped)
        self._tasks.append(asyncio.create_task(reaper.run(), name=f"reaper {self.name}"))
        self.board.in_use = lambda: {d.device for c in preparer.checkpoint.claims.values() for d in c.devices}
        for device in self.pool.devices:
            self._setup.metrics.set_health(self.name, device.name, Health.HEALTHY.value)
        # Publishing starts before the sockets: its round trips to the API server overlap with them.
        self._publish()
        clients = self._setup.metrics.stream_clients.labels(self.name)
        self.plugin = KubeletPlugin(
            driver=self.name,
            plugins_dir=settings.plugins_dir,
            registry_dir=settings.registry_dir,
            pod_uid=settings.pod_uid,
            preparer=preparer,
            health=HealthStream(self._setup.node, self.board, settings.health_timeout, clients.set),
            log=get_logger("kubelet-plugin"),
        )
        await self.plugin.start()

    def _publish(self) -> None:
        """Hand the pool, with the taints of its unhealthy devices, to the publisher (again)."""
        pool, board = self.pool, self.board
        built: dict[tuple[Features, int], Sequence[Mapping[str, Any]]] = {}

        def build(features: Features) -> Sequence[Mapping[str, Any]]:
            key = (features, board.version)  # the pool is fixed for this builder; health is not
            if key not in built:
                built.clear()
                desired = pool_slices(self.name, self._setup.node, pool.devices, pool.counter_sets,
                                      taints=device_taints(self.name, board.unhealthy(), self._policy),
                                      taints_supported=features.taints, counters_supported=features.counters,
                                      shares_supported=features.shares,
                                      taintable=True)
                for reason in desired.rejected:
                    self._log.error("device not publishable", reason=reason)
                built[key] = desired.slices
            return built[key]

        published = self._setup.publisher.publish(self.name, build)
        if not self.published.is_set():
            self._tasks.append(asyncio.create_task(self._mark_published(published), name=f"published {self.name}"))

    async def _mark_published(self, published: asyncio.Event) -> None:
        await published.wait()
        self.published.set()

    # --- health and hot-plug ------------------------------------------------------------------------

    async def _follow(self, report: BackendReport) -> None:
        """Apply one backend's health stream until the backend ends it; a failing stream is followed again."""
        backend = report.plugin.backend
        while True:
            try:
                async for event in backend.health():
                    if isinstance(event, HealthEvent):
                        self._on_health(report.name, event)
                    elif isinstance(event, DevicesChanged):
                        self._log.info("devices changed; discovering again", backend=report.name,
                                       reason=event.reason)
                        self._stale.add(report.name)
                        self._stale_event.set()
                    else:
                        self._log.warning("unknown health event ignored", backend=report.name,
                                          event=type(event).__name__)
                return  # the backend ended its stream: it is stopping
            except Exception as e:  # a third-party bug must not take the agent down, nor leave devices "healthy"
                self._log.exception("health monitoring failed; retrying", backend=report.name,
                                    retry_in=RETRY_SECONDS)
                for device, owner in list(self._owners.items()):
                    if owner.name == report.name:
                        self._on_health(report.name, HealthEvent(
                            device, Health.UNKNOWN, f"health monitoring of backend {report.name} failed: {e}",
                            "unmonitored"))
                await asyncio.sleep(RETRY_SECONDS * random.uniform(0.8, 1.2))

    def _on_health(self, backend: str, event: HealthEvent) -> None:
        owner = self._owners.get(event.device)
        if owner is None or owner.name != backend:
            self._log.debug("health event for a device the backend does not own", backend=backend,
                            device=event.device)
            return
        before = self.board.state(event.device)
        state = self.board.apply(event)
        if state is None:
            return
        if self._setup.events is not None:
            self._setup.events.health_changed(self.name, event.device, before, state, self._policy)
        log = self._log.info if state.health is Health.HEALTHY else self._log.warning
        log("device health changed", device=event.device, health=state.health.value, reason=state.reason,
            cause=state.cause or None, value=state.value or None)
        metrics = self._setup.metrics
        metrics.set_health(self.name, event.device, state.health.value)
        metrics.health_changes.labels(self.name, state.health.value, state.cause or "").inc()
        if self.active:
            self._publish()

    async def _rediscover_loop(self) -> None:
        while True:
            await self._stale_event.wait()
            await asyncio.sleep(SETTLE_SECONDS)
            self._stale_event.clear()
            names, self._stale = sorted(self._stale), set()
            settings = self._setup.settings
            for report in await discover_all([self._reports[n].plugin for n in names], settings.driver_name):
                if report.error or report.inventory is None:
                    self._log.warning("discovery failed; keeping the devices found before", backend=report.name,
                                      reason=report.error)
                    continue
                for warning in report.inventory.warnings:
                    self._log.warning("device problem", backend=report.name, problem=warning)
                before = self._reports[report.name].inventory
                if (before.unserved if before else ()) != report.inventory.unserved:
                    log_unserved(self._log, report)
                    if not report.inventory.unserved:
                        self._log.info("every device can be served again", backend=report.name)
                self._reports[report.name] = report
                self._count_unserved(report)
            await self._refresh_pool()

    async def _refresh_pool(self) -> None:
        before = {d.name for d in self.pool.devices}
        self.pool = _merged(self.name, self._reports.values())
        self._index_owners()
        after = {d.name for d in self.pool.devices}
        if before == after:
            # Same names, maybe new attributes (a driver rebound): publish what discovery says now.
            if self.active:
                self._publish()
            return
        self._log.info("devices changed", added=sorted(after - before), removed=sorted(before - after))
        self.board.set_devices(after)
        for device in before - after:
            self._setup.metrics.forget_device(self.name, device)
        for device in after - before:
            self._setup.metrics.set_health(self.name, device, self.board.state(device).health.value)
        if not self.active:
            if after:
                try:
                    await self._activate()
                except CheckpointError as e:  # the agent goes on serving its other drivers
                    self.preparer = None
                    self._log.error("driver not started: its checkpoint cannot be used", error=str(e))
                    if self._setup.events is not None:
                        self._setup.events.checkpoint_refused(self.checkpoint_path, str(e))
        else:
            self._publish()

    # --- helpers ------------------------------------------------------------------------------------

    @property
    def _state_dir(self) -> Path:
        return self._setup.settings.state_dir / self.name

    @property
    def checkpoint_path(self) -> Path:
        """The driver's checkpoint journal."""
        return self._state_dir / "checkpoint.journal"

    def _index_owners(self) -> None:
        """Device → owning backend, kept in one dict the preparer reads (hot-plug updates it in place)."""
        owners: dict[str, Owner] = {}
        for report in sorted(self._reports.values(), key=lambda r: r.name):
            backend = report.plugin.backend
            types = tuple(backend.config_types) if isinstance(backend, HasConfigTypes) else ()
            for device in report.inventory.devices if report.inventory else ():
                owners.setdefault(device.name, Owner(report.name, backend, types, device))
        self._owners.clear()
        self._owners.update(owners)

    def _preparer(self) -> Preparer:
        settings = self._setup.settings
        plugin_dir = settings.plugins_dir / self.name
        plugin_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
        events = self._setup.events
        if settings.claim_status and self.claim_status is None:
            self.claim_status = ClaimStatusWriter(self._setup.kube, self.name, self._setup.node,
                                                  metrics=self._setup.metrics)
        writer = self.claim_status
        return Preparer(
            DriverDevices(self.name, self._setup.node, {r.name: r.plugin.backend for r in self._reports.values()},
                          self._owners.get, self._unusable, frozenset(settings.allowed_configs)),
            ClaimMemory(Checkpoint(self.checkpoint_path, self._setup.boot_id, driver=self.name,
                                   owner=self._setup.instances.id),
                        SpecStore(settings.cdi_dir, vendor(self.name), CLASS,
                                  runtime_root=str(settings.cdi_host_root))),
            ClaimSource(self._setup.kube),
            instances=InstanceGuard(FileLock(plugin_dir / "serialize.lock"), serialize=settings.pod_uid is not None,
                                    owner_alive=self._setup.instances.alive),
            reporting=Reporting(get_logger("preparer"), self._setup.metrics,
                                None if events is None else partial(events.prepare_failed, self.name),
                                on_prepared=None if writer is None else writer.prepared,
                                on_released=None if writer is None else writer.released),
            metadata=MetadataFiles(self.name, self._setup.node, plugin_dir, settings.cdi_dir,
                                   enabled=settings.device_metadata),
        )

    def _reaped(self, record: ClaimRecord, why: str) -> None:
        if self._setup.events is not None:
            self._setup.events.claim_reaped(self.name, f"{record.namespace}/{record.name} ({record.uid})",
                                            [d.device for d in record.devices], why)

    def _unusable(self, device: str) -> str | None:
        state = self.board.state(device)
        return (state.reason or "unhealthy") if state.health is Health.UNHEALTHY else None


def _merged(driver: str, reports: Iterable[BackendReport]) -> Pool:
    pools = merge_pools(list(reports))
    return pools[0] if pools else Pool(driver)


def _has_state(folder: Path) -> bool:
    """A journal of claims this driver prepared: it must be read (even an empty file, which is a damaged one)."""
    return (folder / "checkpoint.journal").exists()

