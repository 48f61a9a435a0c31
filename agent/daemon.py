"""`dra-agent run`: the node agent's lifecycle, from start-up to a graceful stop.

Start: open the host (or the simulated node), connect to the API server, load and start the backends,
discover, and start each driver (agent/driver.py: checkpoint, slices, sockets, health); tell systemd READY=1
once every serving driver's slices are published.
Stop (SIGTERM or SIGINT): deregister, let in-flight calls finish, stop the backends, write the Events still
queued, all within 10 s; a second signal exits at once. A checkpoint the agent refuses stops the start with an
Event on the Node, written before the process exits.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path

from agent import __version__
from agent.claims.checkpoint import CheckpointError, read_boot_id
from agent.claims.instances import InstanceError, Instances
from agent.driver import Driver, DriverSetup
from agent.events.recorder import EventRecorder
from agent.kube.client import KubeClient, KubeconfigError, KubeError
from agent.kubelet.grpc_server import SocketError
from agent.logs import get_logger
from agent.metrics import Metrics, MetricsServer
from agent.node.host import Host, HostError, open_host, resolve_node_name
from agent.node.host_netns import resolve_host_netns, sysfs_netdevs_problem
from agent.node.inventory import BackendReport, NotRunning, Survey, stop_all, survey
from agent.node.link_monitor import LinkMonitor, open_link_monitor
from agent.node.plugins import LoadedPlugin
from agent.node.udev import UdevMonitor, open_udev_monitor
from agent.notify import Notifier
from agent.settings import Settings
from agent.slices.publisher import Publisher
from agent.unexpected import unexpected
from backends.capabilities import ListsHardware

__all__ = ["Agent", "log_start", "open_kernel_events", "run"]

STOP_GRACE = 6.0
"""Seconds in-flight kubelet calls get to finish at shutdown; the whole stop stays within 10 s."""


class Agent:
    """A running agent on one host; `start` then `stop`."""

    def __init__(self, settings: Settings, host: Host, kube: KubeClient, notifier: Notifier | None = None) -> None:
        self.settings = settings
        self.host = host
        self.kube = kube
        self.notifier = notifier or Notifier({})
        self.metrics = Metrics()
        self.node = resolve_node_name(settings, host)
        self.drivers: dict[str, Driver] = {}
        self.publisher = Publisher(kube, self.node, get_logger("publisher"), self.metrics)
        self.events = EventRecorder(kube, self.node, pod_uid=settings.pod_uid, metrics=self.metrics)
        self._plugins: list[LoadedPlugin] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._metrics_server: MetricsServer | None = None
        self._udev: UdevMonitor | None = None
        self._links: LinkMonitor | None = None
        self.instances = Instances(settings.state_dir)
        self._not_running: list[tuple[NotRunning, int]] = []  # with how much of its hardware is known
        self._started = False
        self._announced = False
        self._log = get_logger("agent").bind(node=self.node)

    @property
    def ready(self) -> bool:
        """Started, every serving driver's sockets up and its slices published (trivially so without any): what
        systemd is told with READY=1."""
        return self._started and all(d.published.is_set() for d in self.drivers.values() if d.active)

    def not_ready(self) -> list[str]:
        """Why /readyz fails, one reason each: start-up not done, hardware a backend cannot serve, or a backend that
        does not run at all (which an operator must see: the node has devices and the agent publishes none of
        them)."""
        reasons: list[str] = []
        if not self._started:
            reasons.append("starting")
        reasons.extend(f"{d.name}: slices not published yet" for d in self.drivers.values()
                       if d.active and not d.published.is_set())
        for driver in self.drivers.values():
            reasons.extend(driver.unserved())
        for item, count in self._not_running:
            reasons.append(f"backend {item.name}{f' ({item.driver})' if item.driver else ''} is not running, "
                           f"{count} device(s) of it not served: {item.reason}")
        return reasons

    async def start(self) -> None:
        self.instances.register(self.settings.pod_uid)
        self.events.start()
        # Opened before the backends start, so no hot-plug between their discovery and their subscription is lost:
        # events queue in the netlink socket until read.
        self._udev, self._links = open_kernel_events(self.settings, self.host)
        for monitor in (self._udev, self._links):
            if monitor is not None:
                monitor.start()
        if self.host.profile is None:
            problem = sysfs_netdevs_problem(self.host.sysfs_root, self.host.host_root)
            if problem is not None:
                self._log.warning(problem)
        found = await survey(self.settings, self.host, udev=self._udev, registry=self.metrics.registry,
                             links=self._links, state_root=self.settings.state_dir / "backends")
        self._plugins = found.started
        await self._count_not_running(found)
        setup = DriverSetup(self.settings, self.node, self.kube, self.publisher, self.metrics,
                            read_boot_id(_proc(self.host)), self.instances, self.events)
        by_driver: dict[str, list[BackendReport]] = {}
        for report in found.reports:
            by_driver.setdefault(report.driver, []).append(report)
        for name in sorted(by_driver):
            driver = self.drivers[name] = Driver(setup, name, by_driver[name])
            try:
                await driver.start()
            except CheckpointError as e:  # the start fails; `stop` writes the Event before the process exits
                self.events.checkpoint_refused(driver.checkpoint_path, str(e))
                raise
            self._tasks.append(asyncio.create_task(self._announce_when_published(driver), name=f"announce {name}"))
        if self.settings.metrics_address:
            self._metrics_server = MetricsServer(self.settings.metrics_address, self.metrics, self.not_ready)
            await self._metrics_server.start()
        self._tasks.append(asyncio.create_task(self.notifier.keep_alive(), name="watchdog"))
        self._started = True
        if not any(d.active for d in self.drivers.values()):
            self._log.warning("no devices to serve on this node")
        self._announce_if_ready()

    async def _count_not_running(self, found: Survey) -> None:
        """Every driver's published-devices series from the start (0 until its slices say otherwise), so that "a
        node publishing nothing" can be asked; and, for each backend that cannot run, the hardware it would serve
        counted as unserved."""
        for plugin in found.loaded:
            driver = self.settings.driver_name(plugin.backend.driver)
            self.metrics.published_devices.labels(driver).set(0)
            self.metrics.published_slices.labels(driver).set(0)
        for item in found.not_running(self.settings.driver_name):
            hardware: Sequence[str] = ()
            if isinstance(item.backend, ListsHardware):
                try:
                    hardware = await asyncio.to_thread(item.backend.hardware, self.host.sysfs_root)
                except Exception as e:  # a third-party bug: the backend is reported all the same
                    self._log.warning("cannot list a backend's hardware", backend=item.name, error=unexpected(e))
            self._not_running.append((item, len(hardware)))
            self._log.error("backend not running: its hardware is not served", backend=item.name,
                            driver=item.driver, devices=list(hardware), reason=item.reason)
            if item.driver is not None:
                self.metrics.unserved_devices.labels(item.driver, item.name).set(len(hardware))

    async def _announce_when_published(self, driver: Driver) -> None:
        await driver.published.wait()
        self._announce_if_ready()

    def _announce_if_ready(self) -> None:
        """READY=1 for systemd, once: when started and every driver is published (whichever comes last)."""
        if self.ready and not self._announced:
            self._announced = True
            serving = sorted(d.name for d in self.drivers.values() if d.active)
            self.notifier.ready(f"serving {len(serving)} driver(s) on node {self.node}")
            self._log.info("ready", drivers=serving)

    async def stop(self, grace: float = STOP_GRACE) -> None:
        self.notifier.stopping()
        await self.publisher.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(d.stop(grace) for d in self.drivers.values()))
        await stop_all(self._plugins)
        for monitor in (self._udev, self._links):
            if monitor is not None:
                monitor.close()
        if self._metrics_server is not None:
            await self._metrics_server.stop()
        self.instances.close()
        await self.events.stop()  # last: the drivers' final Events are queued by now


def open_kernel_events(settings: Settings, host: Host) -> tuple[UdevMonitor | None, LinkMonitor | None]:
    """The uevent and link monitors, opened in the host's network namespace wherever the agent runs (see
    agent/node/host_netns.py), receiving already but not yet read; each None where it cannot be opened."""
    netns = resolve_host_netns(settings.host_netns, host.host_root, simulated=host.profile is not None)
    return open_udev_monitor(host, netns=netns), open_link_monitor(netns)


def log_start(settings: Settings, host: Host, node: str) -> None:
    """One line at start-up that says which agent runs where and with what: the version, the node, the backends,
    the roots it reads the hardware from, the directories it writes to and the settings that change behaviour."""
    get_logger("agent").info(
        "starting", version=__version__, node=node,
        backends=",".join(settings.backends) if settings.backends else "all installed",
        simulate=settings.simulate, host_root=str(host.host_root), sysfs_root=str(host.sysfs_root),
        dev_root=str(host.dev_root), driver_root=str(host.driver_root), state_dir=str(settings.state_dir),
        cdi_dir=str(settings.cdi_dir), plugins_dir=str(settings.plugins_dir),
        registry_dir=str(settings.registry_dir), kubeconfig=str(settings.kubeconfig or "default"),
        metrics_address=settings.metrics_address, pod_uid=settings.pod_uid, host_netns=settings.host_netns,
        health_timeout=settings.health_timeout, no_execute=",".join(settings.no_execute),
        claim_status=settings.claim_status, device_metadata=settings.device_metadata,
        reap_interval=settings.reap_interval, reap_grace=settings.reap_grace,
        driver_names=settings.driver_names or None, backend_config=sorted(settings.backend_config) or None,
        allowed_configs=",".join(settings.allowed_configs) or "none",
    )


def _collect_from_now_on() -> None:
    """Turn the cyclic garbage collector back on once the agent serves, when its start-up had it off (`dra-agent
    run`): what start-up made is frozen first, so no later collection walks it again."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


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
            # The credentials first: a wrong kubeconfig is found before a simulated node is built.
            kube = await KubeClient.connect(settings.kubeconfig)
            stack.push_async_callback(kube.close)
            host = stack.enter_context(open_host(settings))
            agent = Agent(settings, host, kube, notifier)
            log_start(settings, host, agent.node)
            stack.push_async_callback(agent.stop)
            await agent.start()
            _collect_from_now_on()
            await stop.wait()
    except (HostError, KubeconfigError) as e:  # the configuration's fault: the documented exit status 2
        log.error("cannot start", error=str(e))
        return 2
    except (KubeError, CheckpointError, InstanceError, SocketError, OSError) as e:
        log.error("cannot start", error=str(e))
        return 1
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
    return 0

