"""A kubelet double: plugin watcher, DRA plugin manager and device-health cache, over real gRPC on unix sockets.

It registers plugins as the kubelet does (GetInfo, validation, NotifyRegistrationStatus), calls
NodePrepareResources / NodeUnprepareResources and checks the answers as the kubelet does, and keeps streamed
device health as the kubelet's health cache does (timeouts and messages as in kubelet 1.34-1.36).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import stat
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self, TypeVar

import grpc

from agent.kubelet.services import (
    DRA_PLUGIN_TYPE,
    DeviceHealthReport,
    DraVersion,
    HealthStatus,
    PluginInfo,
    RegistrationClient,
    watch_health,
)
from simulator.kubelet_connection import (
    OWN_CONNECTIONS,
    Identity,
    KubeletError,
    Plugin,
    RegistrationRefused,
)
from simulator.timing import scaled

__all__ = ["DeviceHealthState", "KubeletSimulator"]

# The kubelet's deadlines for a plugin's answers, stretched by the time factor: a busy test machine answers later
# than a node does, and a missed deadline fails the registration into the kubelet's back-off.
DIAL_TIMEOUT = scaled(10.0)
GET_INFO_TIMEOUT = scaled(1.0)
NOTIFY_TIMEOUT = scaled(5.0)
DEFAULT_HEALTH_TIMEOUT = 30.0  # what a report without a timeout means to the health cache, not a wait
MAX_HEALTH_MESSAGE = 1024
_VERSIONS: dict[str, DraVersion] = {"v1.DRAPlugin": "v1", "v1beta1.DRAPlugin": "v1beta1"}
_POLL = 0.02
# Per-socket retry of failed registrations, doubling like the kubelet's operation executor.
_RETRY_FIRST, _RETRY_MAX = 0.5, 122.0


T = TypeVar("T")
HealthView = dict[tuple[str, str], "DeviceHealthState"]


@dataclass(frozen=True)
class DeviceHealthState:
    """The health cache's view of one device; `received` is the simulator clock at the last report naming it."""

    health: HealthStatus
    message: str
    received: float
    timeout: float


class KubeletSimulator:
    """The kubelet as DRA plugins see it. Watching the registry starts with `start()` or `wait_for_plugin`."""

    def __init__(
        self,
        registry_dir: Path,
        *,
        dra_versions: Sequence[str] = ("v1.DRAPlugin", "v1beta1.DRAPlugin"),
        health: bool = True,
        health_retry: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        unknown = set(dra_versions) - _VERSIONS.keys()
        if unknown:
            raise ValueError(f"cannot speak {sorted(unknown)}; known: {sorted(_VERSIONS)}")
        self.registry_dir = Path(registry_dir)
        self.dra_versions = tuple(dra_versions)
        self.failures: dict[str, str] = {}
        """Registration socket → why its last registration attempt failed."""
        self._health_enabled = health
        self._health_retry = health_retry
        self._clock = clock
        self._plugins: dict[str, list[Plugin]] = {}
        self._by_socket: dict[Path, Plugin] = {}
        self._in_flight: set[Path] = set()
        self._retrying: dict[Path, tuple[Identity, asyncio.Task[None]]] = {}
        self._health: dict[str, HealthView] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # watcher, registration retries, closing connections
        self._watcher: asyncio.Task[None] | None = None
        self._event = asyncio.Event()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # --- registration ------------------------------------------------------------------------------------

    async def register(self, socket_path: Path | str) -> Plugin:
        """One registration attempt of the plugin watcher plus the DRA handler."""
        path = Path(socket_path)
        identity = _socket_identity(path)
        if identity is None:
            raise KubeletError(f"cannot register {path}: not a unix socket")
        self._in_flight.add(path)
        channel = grpc.aio.insecure_channel(f"unix:{path}", options=OWN_CONNECTIONS)
        try:
            client = RegistrationClient(channel)
            try:
                await asyncio.wait_for(channel.channel_ready(), DIAL_TIMEOUT)
                info = await client.get_info(timeout=GET_INFO_TIMEOUT)
            except (TimeoutError, grpc.aio.AioRpcError) as e:
                raise KubeletError(f"failed to get plugin info from {path}: {e!r}") from e
            try:
                endpoint, version = self._validate(info, path)
            except RegistrationRefused as refused:
                # The upstream plugin helper answers a refusal with an error status; the kubelet ignores that.
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await client.notify(False, str(refused), timeout=NOTIFY_TIMEOUT)
                raise
            plugin = self._add(Plugin(info, endpoint, version, path, identity))
            try:
                await client.notify(True, "", timeout=NOTIFY_TIMEOUT)
            except grpc.aio.AioRpcError as e:
                # Like the kubelet: the attempt is reported failed, but the plugin stays registered.
                raise KubeletError(f"failed to send registration status to {path}: {e.details()}", e.code()) from e
            finally:
                plugin._settled = True
                self._changed()
            return plugin
        finally:
            self._in_flight.discard(path)
            await channel.close()

    def _validate(self, info: PluginInfo, path: Path) -> tuple[str, DraVersion]:
        if info.type != DRA_PLUGIN_TYPE:
            raise RegistrationRefused(f"no handler registered for plugin type: {info.type} at socket {path}")
        if not info.name:
            raise RegistrationRefused(f"plugin at socket {path} gave no DRA driver name")
        endpoint = info.endpoint or str(path)
        if _socket_identity(Path(endpoint)) is None:
            raise RegistrationRefused(f"DRA plugin {info.name}: endpoint {endpoint} is not a unix socket")
        # The plugin's order decides, among the versions this kubelet speaks.
        chosen = next((v for v in info.supported_versions if v in self.dra_versions), None)
        if chosen is None:
            raise RegistrationRefused(
                f"DRA plugin {info.name}: none of the versions {list(info.supported_versions)} is supported "
                f"by this kubelet ({', '.join(self.dra_versions)})"
            )
        if any(p.endpoint == endpoint for p in self._plugins.get(info.name, ())):
            raise RegistrationRefused(f"DRA plugin {info.name}: endpoint {endpoint} already registered")
        return endpoint, _VERSIONS[chosen]

    def _add(self, plugin: Plugin) -> Plugin:
        self._plugins.setdefault(plugin.driver, []).append(plugin)
        self._by_socket[plugin.socket_path] = plugin
        if self._health_enabled and plugin.health_service is not None:
            plugin._health_task = asyncio.create_task(self._watch_health(plugin))
        self.failures.pop(str(plugin.socket_path), None)
        self._changed()
        return plugin

    def _forget(self, plugin: Plugin) -> None:
        """The DRA handler's DeRegisterPlugin: gone from the table now, connection closed soon after."""
        instances = self._plugins.get(plugin.driver, [])
        if plugin in instances:
            instances.remove(plugin)
        if not instances:
            self._plugins.pop(plugin.driver, None)
        if self._by_socket.get(plugin.socket_path) is plugin:
            del self._by_socket[plugin.socket_path]
        self._spawn(plugin._close())
        self._changed()

    def plugins(self, driver: str) -> list[Plugin]:
        """Registered instances of a driver, oldest first."""
        return list(self._plugins.get(driver, ()))

    def plugin(self, driver: str) -> Plugin:
        """The instance calls go to: the newest connected one, else the newest."""
        instances = self._plugins.get(driver)
        if not instances:
            raise KubeletError(f"DRA driver {driver} is not registered")
        return next((p for p in reversed(instances) if p.connected), instances[-1])

    # --- the plugin watcher ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start watching the registry directory (created if missing); existing sockets count as new."""
        if self._watcher is None:
            self.registry_dir.mkdir(parents=True, exist_ok=True)
            self._watcher = self._spawn(self._watch_registry())

    async def wait_for_plugin(
        self, driver: str, *, timeout: float = scaled(10.0), endpoint: str | None = None
    ) -> Plugin:
        """Watch the registry until an instance of `driver` (at `endpoint`, if given) has been registered and told."""
        self.start()

        def found() -> Plugin | None:
            matching = [p for p in self._plugins.get(driver, ()) if p._settled and endpoint in (None, p.endpoint)]
            return matching[-1] if matching else None

        return await self._wait(found, timeout, lambda: f"DRA driver {driver} did not register")

    async def deregistered(self, driver: str, *, timeout: float = scaled(10.0)) -> None:
        """Wait until no instance of `driver` is registered."""
        await self._wait(
            lambda: None if driver in self._plugins else True, timeout, lambda: f"DRA driver {driver} still registered"
        )

    async def _watch_registry(self) -> None:
        while True:
            self._scan()
            await asyncio.sleep(_POLL)  # polling stands in for inotify

    def _scan(self) -> None:
        present = dict(_sockets(self.registry_dir))
        for path, plugin in list(self._by_socket.items()):
            watched = path.is_relative_to(self.registry_dir) and path not in self._in_flight
            if watched and present.get(path) != plugin.identity:
                self._forget(plugin)  # removed, or re-created: deregister before registering anew
        for path, (identity, task) in list(self._retrying.items()):
            if present.get(path) != identity:
                task.cancel()
                del self._retrying[path]
        for path, identity in present.items():
            if path in self._by_socket or path in self._in_flight or path in self._retrying:
                continue
            self._retrying[path] = (identity, self._spawn(self._register_until_done(path)))

    async def _register_until_done(self, path: Path) -> None:
        delay = _RETRY_FIRST
        try:
            while path not in self._by_socket:
                try:
                    await self.register(path)
                except KubeletError as e:
                    self.failures[str(path)] = str(e)
                    self._changed()
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, _RETRY_MAX)
        finally:
            if self._retrying.get(path, (None, None))[1] is asyncio.current_task():
                del self._retrying[path]

    # --- health ------------------------------------------------------------------------------------------

    async def _watch_health(self, plugin: Plugin) -> None:
        while True:
            try:
                assert plugin.health_service is not None
                async with contextlib.aclosing(watch_health(plugin._channel, plugin.health_service)) as stream:
                    async for reports in stream:
                        self._record(plugin.driver, reports)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return  # as the newest kubelet: a plugin without the service is not asked again
            finally:
                # Any end of the stream, cancellation included, drops what this driver reported.
                if self._health.pop(plugin.driver, None) is not None:
                    self._changed()
            await asyncio.sleep(self._health_retry)

    def _record(self, driver: str, reports: Sequence[DeviceHealthReport]) -> None:
        now = self._clock()  # the time of receipt; the driver's last_updated is ignored like the kubelet does
        cache = self._health.setdefault(driver, {})
        for report in reports:
            message = report.message
            if len(message) > MAX_HEALTH_MESSAGE:
                message = message[: MAX_HEALTH_MESSAGE - 3] + "..."
            timeout = float(report.timeout_seconds) if report.timeout_seconds > 0 else DEFAULT_HEALTH_TIMEOUT
            cache[(report.pool, report.device)] = DeviceHealthState(report.health, message, now, timeout)
        self._changed()

    def health_state(self, driver: str) -> HealthView:
        """(pool, device) → cached health; UNKNOWN once a device went unreported longer than its timeout."""
        now = self._clock()
        return {
            key: dataclasses.replace(state, health=HealthStatus.UNKNOWN)
            if now - state.received > state.timeout
            else state
            for key, state in self._health.get(driver, {}).items()
        }

    async def wait_for_health(
        self, driver: str, check: Callable[[HealthView], bool], *, timeout: float = scaled(5.0)
    ) -> HealthView:
        """Wait until `check(health_state(driver))` holds; re-checked on every report and clearing."""

        def ready() -> HealthView | None:
            state = self.health_state(driver)
            return state if check(state) else None

        return await self._wait(ready, timeout, lambda: f"health of {driver}: {self.health_state(driver)}")

    # --- plumbing ----------------------------------------------------------------------------------------

    def _spawn(self, work: Coroutine[None, None, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _changed(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def _wait(self, probe: Callable[[], T | None], timeout: float, describe: Callable[[], str]) -> T:
        try:
            async with asyncio.timeout(timeout):
                while (result := probe()) is None:
                    await self._event.wait()
                return result
        except TimeoutError:
            failures = "; ".join(f"{k}: {v}" for k, v in self.failures.items()) or "none"
            raise TimeoutError(f"{describe()} within {timeout} s (registration failures: {failures})") from None

    async def close(self) -> None:
        """Stop watching, cancel retries and health streams, close every connection."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        for _, retry in self._retrying.values():
            retry.cancel()  # connections of deregistered plugins, though, close to the end
        await asyncio.gather(*self._tasks, return_exceptions=True)
        plugins = list(self._by_socket.values())
        self._plugins.clear()
        self._by_socket.clear()
        self._retrying.clear()
        await asyncio.gather(*(p._close() for p in plugins))
        self._changed()


def _socket_identity(path: Path) -> Identity | None:
    """The identity of the socket at `path` (not following links); None if there is none."""
    try:
        info = path.lstat()
    except OSError:
        return None
    return (info.st_ino, info.st_ctime_ns) if stat.S_ISSOCK(info.st_mode) else None


def _sockets(directory: Path) -> Iterator[tuple[Path, Identity]]:
    """Sockets under `directory`, recursively, not following links; names starting with "." are skipped."""
    try:
        entries = list(directory.iterdir())
    except OSError:
        return  # removed while scanning
    for path in entries:
        if path.name.startswith("."):
            continue
        if path.is_dir() and not path.is_symlink():
            yield from _sockets(path)
        elif (identity := _socket_identity(path)) is not None:
            yield path, identity
