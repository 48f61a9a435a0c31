"""`dra-agent run`: the node agent's lifecycle, from start-up to a graceful stop.

Start: open the host (or the simulated node), connect to the API server, load and start the backends,
discover, and for each driver recover its checkpoint, start publishing its slices (retrying with backoff
until the API server takes them), serve its DRA socket, then its registration socket; tell systemd READY=1
once every driver's slices are published.
Stop (SIGTERM or SIGINT): deregister, let in-flight calls finish, stop the backends, all within 10 s;
a second signal exits at once.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.checkpoint import Checkpoint, CheckpointError, read_boot_id
from agent.claim_cdi import CLASS, vendor
from agent.health import HealthStream
from agent.host import Host, NodeNameError, open_host, resolve_node_name
from agent.inventory import BackendReport, Pool, merge_pools, stop_all, survey
from agent.kube import KubeClient, KubeError
from agent.kubelet_plugin import KubeletPlugin
from agent.locks import FileLock
from agent.logs import get_logger
from agent.metrics import Metrics, MetricsServer
from agent.notify import Notifier
from agent.plugins import LoadedPlugin
from agent.preparer import Owner, Preparer
from agent.publisher import Features, Publisher
from agent.server import SocketError
from agent.settings import Settings
from agent.slices import pool_slices
from backends.simulation.profile import ProfileError
from cdi.store import SpecStore

__all__ = ["Agent", "run"]

STOP_GRACE = 6.0
"""Seconds in-flight kubelet calls get to finish at shutdown; the whole stop stays within 10 s."""


@dataclass
class _Driver:
    name: str
    preparer: Preparer
    plugin: KubeletPlugin
    pool: Pool
    published: asyncio.Event


class Agent:
    """A running agent on one host; `start` then `stop`."""

    def __init__(self, settings: Settings, host: Host, kube: KubeClient, notifier: Notifier | None = None) -> None:
        self.settings = settings
        self.host = host
        self.kube = kube
        self.notifier = notifier or Notifier({})
        self.metrics = Metrics()
        self.node = resolve_node_name(settings, host)
        self.drivers: dict[str, _Driver] = {}
        self.publisher = Publisher(kube, self.node, get_logger("publisher"), self.metrics)
        self._plugins: list[LoadedPlugin] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._metrics_server: MetricsServer | None = None
        self._started = False
        self._announced = False
        self._log = get_logger("agent").bind(node=self.node)

    @property
    def ready(self) -> bool:
        """Started, every driver's sockets up and its slices published (trivially so without drivers)."""
        return self._started and all(d.published.is_set() for d in self.drivers.values())

    async def start(self) -> None:
        found = await survey(self.settings, self.host)
        self._plugins, reports = found.started, found.reports
        boot_id = read_boot_id(_proc(self.host))
        for pool in merge_pools(reports):
            if not pool.devices and not _has_state(self.settings.state_dir / pool.driver):
                continue  # nothing to offer and nothing to clean up: stay out of the kubelet's way
            preparer = await self._recover(pool, reports, boot_id)
            # Publishing starts before the sockets: its round trips to the API server overlap with them.
            published = self._publish(pool)
            self.drivers[pool.driver] = _Driver(pool.driver, preparer, await self._serve(pool, preparer), pool,
                                                published)
        if self.settings.metrics_address:
            self._metrics_server = MetricsServer(self.settings.metrics_address, self.metrics, lambda: self.ready)
            await self._metrics_server.start()
        self._tasks.append(asyncio.create_task(self.notifier.keep_alive(), name="watchdog"))
        self._started = True
        if not self.drivers:
            self._log.warning("no devices to serve on this node")
        self._announce_if_ready()

    def _announce_if_ready(self) -> None:
        """READY=1 for systemd, once: when started and every driver is published (whichever comes last)."""
        if self.ready and not self._announced:
            self._announced = True
            self.notifier.ready(f"serving {len(self.drivers)} driver(s) on node {self.node}")
            self._log.info("ready", drivers=sorted(self.drivers))

    async def _recover(self, pool: Pool, reports: Sequence[BackendReport], boot_id: str) -> Preparer:
        """The driver's preparer, its checkpoint replayed (claims prepared before a restart stay prepared)."""
        owners: dict[str, Owner] = {}
        backends = {}
        for report in reports:
            if report.driver != pool.driver:
                continue
            backend = report.plugin.backend
            backends[report.name] = backend
            types = tuple(getattr(backend, "config_types", ()))
            for device in report.inventory.devices if report.inventory else ():
                owners[device.name] = Owner(report.name, backend, types)
        plugin_dir = self.settings.plugins_dir / pool.driver
        plugin_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
        preparer = Preparer(
            driver=pool.driver,
            pool=self.node,
            checkpoint=Checkpoint(self.settings.state_dir / pool.driver / "checkpoint.journal", boot_id),
            store=SpecStore(self.settings.cdi_dir, vendor(pool.driver), CLASS),
            claims=self.kube,
            owner_of=owners.get,
            backends=backends,
            log=get_logger("preparer"),
            serialize=FileLock(plugin_dir / "serialize.lock") if self.settings.pod_uid else None,
            metrics=self.metrics,
        )
        await preparer.recover()
        return preparer

    async def _serve(self, pool: Pool, preparer: Preparer) -> KubeletPlugin:
        """The driver's DRA and registration sockets, serving."""
        names = [d.name for d in pool.devices]
        plugin = KubeletPlugin(
            driver=pool.driver,
            plugins_dir=self.settings.plugins_dir,
            registry_dir=self.settings.registry_dir,
            pod_uid=self.settings.pod_uid,
            preparer=preparer,
            health=HealthStream(self.node, lambda: names),
            log=get_logger("kubelet-plugin"),
        )
        await plugin.start()
        return plugin

    def _publish(self, pool: Pool) -> asyncio.Event:
        """Hand the driver's pool to the publisher; set once it is published, and READY once every pool is."""
        built: dict[Features, Sequence[Mapping[str, Any]]] = {}  # the pool is fixed: build once per feature set

        def build(features: Features) -> Sequence[Mapping[str, Any]]:
            if features not in built:
                desired = pool_slices(pool.driver, self.node, pool.devices, pool.counter_sets,
                                      taints_supported=features.taints, counters_supported=features.counters)
                for reason in desired.rejected:
                    self._log.error("device not publishable", driver=pool.driver, reason=reason)
                built[features] = desired.slices
            return built[features]

        published = self.publisher.publish(pool.driver, build)

        async def announce() -> None:
            await published.wait()
            self._announce_if_ready()

        self._tasks.append(asyncio.create_task(announce(), name=f"announce {pool.driver}"))
        return published

    async def stop(self, grace: float = STOP_GRACE) -> None:
        self.notifier.stopping()
        await self.publisher.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(d.plugin.stop(grace) for d in self.drivers.values()))
        for driver in self.drivers.values():
            await asyncio.to_thread(driver.preparer.checkpoint.close)
        await stop_all(self._plugins)
        if self._metrics_server is not None:
            await self._metrics_server.stop()


def _has_state(folder: Path) -> bool:
    journal = folder / "checkpoint.journal"
    return journal.exists() and journal.stat().st_size > 0


def _proc(host: Host) -> Path:
    """The boot id is the kernel's; a simulated node has its own, so its "reboots" can be tested."""
    candidate = host.host_root / "proc"
    return candidate if (candidate / "sys/kernel/random/boot_id").exists() else Path("/proc")


async def run(settings: Settings) -> int:
    """Run until SIGTERM or SIGINT; the exit status for the process."""
    log = get_logger("agent")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = 0

    def on_signal(signum: int) -> None:
        nonlocal signals
        signals += 1
        if signals > 1:
            log.warning("second signal: exiting at once", signal=signal.Signals(signum).name)
            os._exit(128 + signum)
        log.info("stopping", signal=signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    notifier = Notifier()
    try:
        async with AsyncExitStack() as stack:
            host = stack.enter_context(open_host(settings))
            kube = await KubeClient.connect(settings.kubeconfig)
            stack.push_async_callback(kube.close)
            agent = Agent(settings, host, kube, notifier)
            stack.push_async_callback(agent.stop)
            await agent.start()
            await stop.wait()
    except (ProfileError, NodeNameError) as e:
        log.error("cannot start", error=str(e))
        return 2
    except (KubeError, CheckpointError, SocketError, OSError) as e:
        log.error("cannot start", error=str(e))
        return 1
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
    return 0

