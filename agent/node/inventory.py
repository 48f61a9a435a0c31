"""The node's inventory: runs the loaded backends and merges what they own into one pool per DRA driver.

Several backends may publish under one driver name (nvidia-gpu and nvidia-mig share gpu.nvidia.com); their
devices and counter sets form a single pool. A backend that fails is reported and the others still count.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.logs import get_logger
from agent.node.host import Host
from agent.node.plugins import FoundPlugin, LoadedPlugin, PluginFailure, find_plugins, load_plugins
from agent.settings import Settings
from agent.unexpected import unexpected
from backends.contract import (
    Backend,
    BackendContext,
    BackendError,
    CounterSet,
    Device,
    DeviceEvents,
    Inventory,
    LinkEvents,
)
from backends.topology import TopologyReader

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from structlog.typing import FilteringBoundLogger

__all__ = ["BackendReport", "NotRunning", "Pool", "Survey", "discover_all", "log_unserved", "merge_pools", "start_all",
           "stop_all", "survey"]

_START_TIMEOUT = 30.0
_DISCOVER_TIMEOUT = 60.0


@dataclass(frozen=True)
class BackendReport:
    """The outcome of one backend's discovery."""

    plugin: LoadedPlugin
    driver: str
    inventory: Inventory | None
    error: str | None = None

    @property
    def name(self) -> str:
        return self.plugin.found.name


@dataclass(frozen=True)
class Pool:
    """The devices and counter sets of one driver on this node."""

    driver: str
    devices: tuple[Device, ...] = ()
    counter_sets: tuple[CounterSet, ...] = ()
    backends: tuple[str, ...] = ()
    problems: tuple[str, ...] = field(default=())


async def start_all(
    plugins: Sequence[LoadedPlugin],
    host: Host,
    config_for: Callable[[str], Mapping[str, Any]],
    udev: DeviceEvents | None = None,
    registry: CollectorRegistry | None = None,
    links: LinkEvents | None = None,
    state_root: Path | None = None,
) -> tuple[list[LoadedPlugin], dict[str, str]]:
    """Start every backend; returns the started ones and an error message per backend that failed to start."""
    topology = TopologyReader(host.sysfs_root)

    async def start(plugin: LoadedPlugin) -> str | None:
        name = plugin.found.name
        ctx = BackendContext(host.sysfs_root, host.dev_root, host.host_root, topology, config_for(name),
                             get_logger(name), udev, registry, links,
                             state_root / name if state_root is not None else None,
                             driver_root=host.driver_root)
        try:
            async with asyncio.timeout(_START_TIMEOUT):
                await plugin.backend.start(ctx)
        except BackendError as e:
            return str(e)
        except TimeoutError:
            return f"did not start within {_START_TIMEOUT:.0f} s"
        except Exception as e:  # a third-party bug must not take the agent down
            get_logger(name).exception("start failed")
            return f"start failed: {unexpected(e)}"
        return None

    outcomes = await asyncio.gather(*(start(p) for p in plugins))
    errors = {p.found.name: err for p, err in zip(plugins, outcomes, strict=True) if err is not None}
    return [p for p in plugins if p.found.name not in errors], errors


async def discover_all(plugins: Sequence[LoadedPlugin], driver_for: Callable[[str], str]) -> list[BackendReport]:
    """Ask every started backend for its inventory, concurrently."""

    async def discover(plugin: LoadedPlugin) -> BackendReport:
        driver = driver_for(plugin.backend.driver)
        try:
            async with asyncio.timeout(_DISCOVER_TIMEOUT):
                inventory = await plugin.backend.discover()
        except TimeoutError:
            return BackendReport(plugin, driver, None, f"discovery took longer than {_DISCOVER_TIMEOUT:.0f} s")
        except Exception as e:
            if not isinstance(e, BackendError):
                get_logger(plugin.found.name).exception("discovery failed")
            return BackendReport(plugin, driver, None, f"discovery failed: {unexpected(e)}")
        if not isinstance(inventory, Inventory):
            return BackendReport(plugin, driver, None, f"discover() returned {type(inventory).__name__}, "
                                                       "expected an Inventory")
        return BackendReport(plugin, driver, inventory)

    return list(await asyncio.gather(*(discover(p) for p in plugins)))


async def stop_all(plugins: Sequence[LoadedPlugin]) -> None:
    """Stop every backend; a failing stop is logged, never raised."""
    for plugin in plugins:
        try:
            await plugin.backend.stop()
        except Exception as e:
            get_logger("inventory").warning("backend stop failed", backend=plugin.found.name, error=str(e))


def merge_pools(reports: Sequence[BackendReport]) -> list[Pool]:
    """One pool per driver name, sorted by driver; a device or counter set name claimed twice keeps the first."""
    by_driver: dict[str, list[BackendReport]] = {}
    for report in reports:
        if report.inventory is not None:
            by_driver.setdefault(report.driver, []).append(report)
    pools: list[Pool] = []
    for driver in sorted(by_driver):
        devices: dict[str, Device] = {}
        counters: dict[str, CounterSet] = {}
        owner: dict[str, str] = {}
        problems: list[str] = []
        for report in sorted(by_driver[driver], key=lambda r: r.name):
            assert report.inventory is not None
            for device in report.inventory.devices:
                if device.name in devices:
                    problems.append(f"device {device.name} of backend {report.name} is also published by "
                                    f"{owner[device.name]}; left out")
                    continue
                devices[device.name], owner[device.name] = device, report.name
            for counter_set in report.inventory.counter_sets:
                if counter_set.name in counters:
                    problems.append(f"counter set {counter_set.name} of backend {report.name} is defined twice; "
                                    "left out")
                    continue
                counters[counter_set.name] = counter_set
        pools.append(Pool(
            driver=driver,
            devices=tuple(devices[n] for n in sorted(devices)),
            counter_sets=tuple(counters[n] for n in sorted(counters)),
            backends=tuple(sorted(r.name for r in by_driver[driver])),
            problems=tuple(problems),
        ))
    return pools


@dataclass(frozen=True)
class NotRunning:
    """An enabled backend that does not serve: it could not be loaded, started or discovered. `driver` is the one
    it publishes under (None when it never loaded), `backend` the object when there is one."""

    name: str
    driver: str | None
    reason: str
    backend: Backend | None = None


@dataclass(frozen=True)
class Survey:
    """One discovery pass over the node: what is installed, what loaded and started, what each backend found.

    The started backends keep running: stop them with `stop_all(survey.started)`.
    """

    found: list[FoundPlugin]
    loaded: list[LoadedPlugin]
    failures: list[PluginFailure]
    started: list[LoadedPlugin]
    start_errors: dict[str, str]
    reports: list[BackendReport]

    def not_running(self, driver_for: Callable[[str], str]) -> list[NotRunning]:
        """The enabled backends that could not be loaded, started or discovered, by name, with why."""
        loaded = {p.found.name: p for p in self.loaded}
        found: dict[str, NotRunning] = {}
        for failure in self.failures:
            if failure.name not in loaded:  # not the one skipped when two distributions offer one name
                found.setdefault(failure.name, NotRunning(failure.name, None, f"not loaded: {failure.message}"))
        for name, error in self.start_errors.items():
            backend = loaded[name].backend
            found[name] = NotRunning(name, driver_for(backend.driver), f"failed to start: {error}", backend)
        for report in self.reports:
            if report.inventory is None:
                found[report.name] = NotRunning(report.name, report.driver, report.error or "discovery failed",
                                                report.plugin.backend)
        return [found[name] for name in sorted(found)]


async def survey(settings: Settings, host: Host, udev: DeviceEvents | None = None,
                 registry: CollectorRegistry | None = None, links: LinkEvents | None = None,
                 state_root: Path | None = None) -> Survey:
    """Find, load and start the enabled backends and run their discovery; every problem is logged once.

    `udev`, `links` and `registry` are handed to the backends (hot-plug, link and health events; their own
    metrics); each backend's state directory is `state_root/<name>`."""
    log = get_logger("discovery")
    found, failures = find_plugins()
    loaded, load_failures = load_plugins(found, settings.backends)
    failures = failures + load_failures
    for failure in failures:
        log.warning("backend skipped", backend=failure.name, distribution=failure.distribution,
                    reason=failure.message)
    started, start_errors = await start_all(loaded, host, lambda name: settings.backend_config.get(name, {}), udev,
                                            registry, links, state_root)
    for name, error in start_errors.items():
        log.warning("backend failed to start", backend=name, reason=error)
    try:
        reports = await discover_all(started, settings.driver_name)
    except BaseException:
        await stop_all(started)
        raise
    for report in reports:
        if report.error:
            log.warning("backend discovery failed", backend=report.name, reason=report.error)
        for warning in report.inventory.warnings if report.inventory else ():
            log.warning("device problem", backend=report.name, problem=warning)
        log_unserved(log, report)
    return Survey(found, loaded, failures, started, start_errors, reports)


def log_unserved(log: FilteringBoundLogger, report: BackendReport) -> None:
    """An error per group of devices the backend cannot serve: hardware is there, and nothing is published for it."""
    for unserved in report.inventory.unserved if report.inventory else ():
        log.error("devices cannot be served", backend=report.name, driver=report.driver,
                  devices=list(unserved.devices), reason=unserved.reason)
