"""The kubelet simulator against a small in-test DRA plugin served over real gRPC on unix sockets."""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack
from pathlib import Path

import grpc
import pytest

from agent.claims.results import ClaimResult, PreparedDeviceResult
from agent.kubelet.services import (
    DRA_PLUGIN_TYPE,
    SUPPORTED_VERSIONS,
    DeviceHealthReport,
    HealthStatus,
    PluginInfo,
    add_dra_services,
    add_registration_service,
)
from backends.contract import ClaimRef
from simulator.kubelet import KubeletSimulator
from simulator.kubelet_connection import KubeletError, Plugin, RegistrationRefused
from tests.support.timing import scaled

DRIVER = "gpu.example.com"
CLAIM_A = ClaimRef(uid="uid-a", namespace="ns", name="claim-a")
CLAIM_B = ClaimRef(uid="uid-b", namespace="ns", name="claim-b")
V1BETA1_ONLY = ("v1beta1.DRAPlugin",)

Answer = Callable[[Sequence[ClaimRef]], Mapping[str, ClaimResult]]


class FakeDriver:
    """Handler, health source and registration listener of one in-test plugin."""

    def __init__(self) -> None:
        self.statuses: list[tuple[bool, str]] = []
        self.status_times: list[float] = []
        self.prepared: list[list[ClaimRef]] = []
        self.answer: Answer = lambda claims: {c.uid: ClaimResult() for c in claims}
        self.unprepare_answer: Callable[[Sequence[ClaimRef]], Mapping[str, str]] = lambda cs: {c.uid: "" for c in cs}
        self.reports: asyncio.Queue[list[DeviceHealthReport] | None] = asyncio.Queue()
        self.stream_opened: list[float] = []

    async def prepare(self, claims: Sequence[ClaimRef], api_version: str = "v1") -> Mapping[str, ClaimResult]:
        self.prepared.append(list(claims))
        return self.answer(claims)

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        return self.unprepare_answer(claims)

    def registration_status(self, registered: bool, error: str) -> None:
        self.statuses.append((registered, error))
        self.status_times.append(time.monotonic())

    async def watch(self) -> AsyncIterator[Sequence[DeviceHealthReport]]:
        self.stream_opened.append(asyncio.get_running_loop().time())
        while (reports := await self.reports.get()) is not None:
            yield reports


async def until(condition: Callable[[], bool]) -> None:
    """Wait for a condition of the channels or the plugin's sockets (nothing to await: poll)."""
    async with asyncio.timeout(scaled(5)):
        while not condition():  # noqa: ASYNC110 - gRPC channel states and socket scans have no event here
            await asyncio.sleep(0.02)


@pytest.fixture
def base() -> Iterator[Path]:
    """A short directory: unix socket paths must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="k", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else "/tmp"))
    (path / "reg").mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def servers() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as stack:
        yield stack


async def serve(
    stack: AsyncExitStack,
    reg_socket: Path,
    *,
    name: str = DRIVER,
    kind: str = DRA_PLUGIN_TYPE,
    versions: Sequence[str] = SUPPORTED_VERSIONS,
    endpoint: str | None = None,
) -> tuple[FakeDriver, str]:
    """Serve registration on `reg_socket` and DRA on a socket outside the registry; returns the endpoint too."""
    driver = FakeDriver()
    registry = next(p for p in reg_socket.parents if p.name == "reg")
    dra_socket = registry.parent / "dra" / "-".join(reg_socket.relative_to(registry).parts)
    dra_socket.parent.mkdir(exist_ok=True)
    endpoint = str(dra_socket) if endpoint is None else endpoint
    server = grpc.aio.server()
    add_registration_service(server, PluginInfo(kind, name, endpoint, tuple(versions)), driver)
    add_dra_services(server, driver, driver)
    server.add_insecure_port(f"unix:{dra_socket}")
    reg_socket.parent.mkdir(parents=True, exist_ok=True)
    server.add_insecure_port(f"unix:{reg_socket}")
    await server.start()
    stack.push_async_callback(server.stop, None)
    return driver, endpoint


# --- registration -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("advertised", "kubelet", "expected"),
    [
        (SUPPORTED_VERSIONS, ("v1.DRAPlugin", "v1beta1.DRAPlugin"), "v1"),
        (SUPPORTED_VERSIONS, V1BETA1_ONLY, "v1beta1"),
        # The plugin's order decides, not the kubelet's.
        (("v1beta1.DRAPlugin", "v1.DRAPlugin"), ("v1.DRAPlugin", "v1beta1.DRAPlugin"), "v1beta1"),
    ],
)
async def test_registration_picks_the_plugins_first_supported_version(
    base: Path, servers: AsyncExitStack, advertised: tuple[str, ...], kubelet: tuple[str, ...], expected: str
) -> None:
    driver, endpoint = await serve(servers, base / "reg" / "gpu-reg.sock", versions=advertised)
    async with KubeletSimulator(base / "reg", dra_versions=kubelet) as sim:
        plugin = await sim.register(base / "reg" / "gpu-reg.sock")
        assert (plugin.driver, plugin.endpoint, plugin.version) == (DRIVER, endpoint, expected)
        assert driver.statuses == [(True, "")]
        assert sim.plugins(DRIVER) == [plugin]
        assert sim.plugin(DRIVER) is plugin


async def test_no_common_version_is_refused_and_the_plugin_told_why(base: Path, servers: AsyncExitStack) -> None:
    driver, _ = await serve(servers, base / "reg" / "gpu-reg.sock", versions=("v1.DRAPlugin",))
    async with KubeletSimulator(base / "reg", dra_versions=V1BETA1_ONLY) as sim:
        with pytest.raises(RegistrationRefused, match="none of the versions") as refused:
            await sim.register(base / "reg" / "gpu-reg.sock")
        assert driver.statuses == [(False, str(refused.value))]
        assert sim.plugins(DRIVER) == []
        with pytest.raises(KubeletError, match="not registered"):
            sim.plugin(DRIVER)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"kind": "CSIPlugin"}, "no handler registered for plugin type: CSIPlugin"),
        ({"name": ""}, "gave no DRA driver name"),
        ({"endpoint": "/nonexistent/dra.sock"}, "is not a unix socket"),
    ],
)
async def test_invalid_plugin_info_is_refused(
    base: Path, servers: AsyncExitStack, overrides: dict[str, str], reason: str
) -> None:
    driver, _ = await serve(servers, base / "reg" / "gpu-reg.sock", **overrides)
    async with KubeletSimulator(base / "reg") as sim:
        with pytest.raises(RegistrationRefused, match=reason):
            await sim.register(base / "reg" / "gpu-reg.sock")
        assert len(driver.statuses) == 1
        assert driver.statuses[0][0] is False
        assert reason in driver.statuses[0][1]


async def test_empty_endpoint_means_the_registration_socket(base: Path, servers: AsyncExitStack) -> None:
    driver, _ = await serve(servers, base / "reg" / "gpu-reg.sock", endpoint="")
    async with KubeletSimulator(base / "reg") as sim:
        plugin = await sim.register(base / "reg" / "gpu-reg.sock")
        assert plugin.endpoint == str(base / "reg" / "gpu-reg.sock")
        assert await plugin.prepare([CLAIM_A]) == {CLAIM_A.uid: ClaimResult()}
        assert driver.prepared == [[CLAIM_A]]


async def test_same_endpoint_twice_is_refused(base: Path, servers: AsyncExitStack) -> None:
    driver, endpoint = await serve(servers, base / "reg" / "gpu-reg.sock")
    async with KubeletSimulator(base / "reg") as sim:
        first = await sim.register(base / "reg" / "gpu-reg.sock")
        with pytest.raises(RegistrationRefused, match=f"endpoint {endpoint} already registered"):
            await sim.register(base / "reg" / "gpu-reg.sock")
        assert [s[0] for s in driver.statuses] == [True, False]
        assert sim.plugins(DRIVER) == [first]


async def test_newest_connected_instance_takes_the_calls(base: Path) -> None:
    async with AsyncExitStack() as old_server, AsyncExitStack() as new_server:
        await serve(old_server, base / "reg" / "gpu-old-reg.sock")
        await serve(new_server, base / "reg" / "gpu-new-reg.sock")
        async with KubeletSimulator(base / "reg") as sim:
            old = await sim.register(base / "reg" / "gpu-old-reg.sock")
            new = await sim.register(base / "reg" / "gpu-new-reg.sock")
            assert sim.plugins(DRIVER) == [old, new]
            await until(lambda: old.connected and new.connected)  # both connect as they register, not at once
            assert sim.plugin(DRIVER) is new
            await new_server.aclose()
            await until(lambda: old.connected and not new.connected)  # the channels notice it within milliseconds
            assert sim.plugin(DRIVER) is old


# --- the registry watcher -----------------------------------------------------------------------------------


async def test_wait_for_plugin_finds_a_socket_created_later_and_ignores_dot_files(
    base: Path, servers: AsyncExitStack
) -> None:
    async with KubeletSimulator(base / "reg") as sim:
        waiting = asyncio.create_task(sim.wait_for_plugin(DRIVER, timeout=scaled(5)))
        await asyncio.sleep(scaled(0.1))  # the registry scanned a few times before any socket is there
        assert not waiting.done()
        hidden, _ = await serve(servers, base / "reg" / ".hidden-reg.sock", name="hidden.example.com")
        await asyncio.sleep(scaled(0.1))  # scans that see the hidden socket
        # In a sub-directory created after watching started.
        driver, endpoint = await serve(servers, base / "reg" / "sub" / "gpu-reg.sock")
        plugin = await waiting
        assert (plugin.endpoint, plugin.version) == (endpoint, "v1")
        assert driver.statuses == [(True, "")]
        await asyncio.sleep(scaled(0.1))  # a window in which the hidden socket must not be registered
        assert hidden.statuses == []
        assert sim.plugins("hidden.example.com") == []


async def test_removing_the_registration_socket_deregisters(base: Path, servers: AsyncExitStack) -> None:
    await serve(servers, base / "reg" / "gpu-reg.sock")
    async with KubeletSimulator(base / "reg") as sim:
        plugin = await sim.wait_for_plugin(DRIVER, timeout=scaled(5))
        assert sim.plugins(DRIVER) == [plugin]
        (base / "reg" / "gpu-reg.sock").unlink()
        await sim.deregistered(DRIVER, timeout=scaled(5))
        assert sim.plugins(DRIVER) == []
        with pytest.raises(KubeletError, match="not registered"):
            sim.plugin(DRIVER)


async def test_a_socket_re_created_at_the_same_path_registers_anew(base: Path) -> None:
    async with AsyncExitStack() as first, AsyncExitStack() as second, KubeletSimulator(base / "reg") as sim:
        await serve(first, base / "reg" / "gpu-reg.sock")
        old = await sim.wait_for_plugin(DRIVER, timeout=scaled(5))
        await first.aclose()
        (base / "reg" / "gpu-reg.sock").unlink(missing_ok=True)
        driver, endpoint = await serve(second, base / "reg" / "gpu-reg.sock")  # same paths, new files
        await until(lambda: bool(driver.statuses))
        assert driver.statuses == [(True, "")]  # not refused as "already registered"
        (new,) = sim.plugins(DRIVER)
        assert new is not old and new.endpoint == old.endpoint == endpoint


async def test_a_plugin_restarted_at_the_same_socket_takes_calls_at_once(base: Path) -> None:
    # The dead instance's connection is in reconnect backoff, and may not be closed yet when the new instance
    # registers; the new instance's connection must not inherit that backoff.
    async with AsyncExitStack() as first, AsyncExitStack() as second, KubeletSimulator(base / "reg") as sim:
        await serve(first, base / "reg" / "gpu-reg.sock")
        old = await sim.register(base / "reg" / "gpu-reg.sock")
        await first.aclose()
        for _ in range(3):
            with pytest.raises(KubeletError, match="UNAVAILABLE"):
                await old.prepare([CLAIM_A])
        (base / "reg" / "gpu-reg.sock").unlink(missing_ok=True)
        driver, _ = await serve(second, base / "reg" / "gpu-reg.sock")
        driver.answer = lambda claims: {CLAIM_A.uid: ClaimResult()}
        new = Plugin(old.info, old.endpoint, old.version, old.socket_path, old.identity)  # as registration makes it
        try:
            assert await new.prepare([CLAIM_A]) == {CLAIM_A.uid: ClaimResult()}
        finally:
            await new._close()


async def test_refusals_are_retried_and_reported_on_timeout(base: Path, servers: AsyncExitStack) -> None:
    driver, _ = await serve(servers, base / "reg" / "gpu-reg.sock", versions=("v1.DRAPlugin",))
    async with KubeletSimulator(base / "reg", dra_versions=V1BETA1_ONLY) as sim:
        with pytest.raises(TimeoutError, match="none of the versions"):
            await sim.wait_for_plugin(DRIVER, timeout=scaled(0.8))
        assert len(driver.statuses) >= 2 and not any(registered for registered, _ in driver.statuses)
        # At once, then 0.5 s later, then twice as long each time.
        gaps = [later - earlier for earlier, later in itertools.pairwise(driver.status_times)]
        assert all(gap >= 0.5 * 2**i for i, gap in enumerate(gaps)), gaps


# --- prepare and unprepare ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("kubelet", "share_id"), [(("v1.DRAPlugin",), "share-1"), (V1BETA1_ONLY, None)])
async def test_prepare_and_unprepare_round_trip(
    base: Path, servers: AsyncExitStack, kubelet: tuple[str, ...], share_id: str | None
) -> None:
    driver, _ = await serve(servers, base / "reg" / "gpu-reg.sock")
    device = PreparedDeviceResult(
        pool="node-1", device="gpu-0", cdi_device_ids=("example.com/gpu=gpu-0",),
        request_names=("gpu/big",), share_id="share-1",
    )
    driver.answer = lambda claims: {CLAIM_A.uid: ClaimResult(devices=(device,)), CLAIM_B.uid: ClaimResult()}
    async with KubeletSimulator(base / "reg", dra_versions=kubelet) as sim:
        plugin = await sim.register(base / "reg" / "gpu-reg.sock")
        results = await plugin.prepare_or_raise([CLAIM_A, CLAIM_B])
        assert driver.prepared == [[CLAIM_A, CLAIM_B]]
        (got,) = results[CLAIM_A.uid].devices
        assert got == PreparedDeviceResult("node-1", "gpu-0", ("example.com/gpu=gpu-0",), ("gpu/big",), share_id)
        assert results[CLAIM_B.uid] == ClaimResult()
        assert await plugin.unprepare_or_raise([CLAIM_A, CLAIM_B]) == {CLAIM_A.uid: "", CLAIM_B.uid: ""}


@pytest.mark.parametrize("call", ["prepare", "unprepare"])
async def test_unknown_uid_and_missing_entries_fail_like_the_kubelet(
    base: Path, servers: AsyncExitStack, call: str
) -> None:
    driver, _ = await serve(servers, base / "reg" / "gpu-reg.sock")
    method = "NodePrepareResources" if call == "prepare" else "NodeUnprepareResources"
    async with KubeletSimulator(base / "reg") as sim:
        plugin = await sim.register(base / "reg" / "gpu-reg.sock")
        run = plugin.prepare if call == "prepare" else plugin.unprepare

        driver.answer = lambda claims: {"stranger": ClaimResult()}
        driver.unprepare_answer = lambda claims: {"stranger": ""}
        with pytest.raises(KubeletError, match=f"^{method} returned result for unknown claim UID stranger$"):
            await run([CLAIM_A])

        driver.answer = lambda claims: {CLAIM_A.uid: ClaimResult()}
        driver.unprepare_answer = lambda claims: {CLAIM_A.uid: ""}
        with pytest.raises(KubeletError, match=f"^{method} skipped 1 ResourceClaims$"):
            await run([CLAIM_A, CLAIM_B])
        await run([CLAIM_A])  # the same answer is fine when it covers every claim


async def test_per_claim_errors_are_returned_or_raised(base: Path, servers: AsyncExitStack) -> None:
    driver, _ = await serve(servers, base / "reg" / "gpu-reg.sock")
    driver.answer = lambda claims: {CLAIM_A.uid: ClaimResult(), CLAIM_B.uid: ClaimResult(error="no such GPU")}
    driver.unprepare_answer = lambda claims: {CLAIM_A.uid: "", CLAIM_B.uid: "busy"}
    async with KubeletSimulator(base / "reg") as sim:
        plugin = await sim.register(base / "reg" / "gpu-reg.sock")
        assert (await plugin.prepare([CLAIM_A, CLAIM_B]))[CLAIM_B.uid].error == "no such GPU"
        with pytest.raises(KubeletError, match="failed for ResourceClaim claim-b: no such GPU"):
            await plugin.prepare_or_raise([CLAIM_A, CLAIM_B])
        assert (await plugin.unprepare([CLAIM_A, CLAIM_B]))[CLAIM_B.uid] == "busy"
        with pytest.raises(KubeletError, match="failed for ResourceClaim claim-b: busy"):
            await plugin.unprepare_or_raise([CLAIM_A, CLAIM_B])


# --- health -------------------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_health_reports_are_cached_and_go_unknown_after_their_timeout(
    base: Path, servers: AsyncExitStack
) -> None:
    driver, _ = await serve(servers, base / "reg" / "gpu-reg.sock")
    clock = FakeClock()
    async with KubeletSimulator(base / "reg", clock=clock) as sim:
        await sim.register(base / "reg" / "gpu-reg.sock")
        driver.reports.put_nowait([
            DeviceHealthReport("p", "gpu-0", HealthStatus.HEALTHY, last_updated=5, timeout_seconds=2),
            DeviceHealthReport("p", "gpu-1", HealthStatus.UNHEALTHY, message="x" * 2000),
        ])
        state = await sim.wait_for_health(DRIVER, lambda s: len(s) == 2)
        assert state[("p", "gpu-0")].health is HealthStatus.HEALTHY
        assert state[("p", "gpu-0")].received == 1000.0  # the time of receipt, not the driver's last_updated
        assert (state[("p", "gpu-0")].timeout, state[("p", "gpu-1")].timeout) == (2.0, 30.0)
        assert state[("p", "gpu-1")].message == "x" * 1021 + "..."

        clock.now += 2.5
        state = sim.health_state(DRIVER)
        assert state[("p", "gpu-0")].health is HealthStatus.UNKNOWN
        assert state[("p", "gpu-1")].health is HealthStatus.UNHEALTHY

        driver.reports.put_nowait([DeviceHealthReport("p", "gpu-0", HealthStatus.HEALTHY, timeout_seconds=2)])
        state = await sim.wait_for_health(DRIVER, lambda s: s[("p", "gpu-0")].health is HealthStatus.HEALTHY)
        assert state[("p", "gpu-0")].received == 1002.5

        clock.now += 28  # gpu-1, unreported since 1000, passes the 30 s default
        assert sim.health_state(DRIVER)[("p", "gpu-1")].health is HealthStatus.UNKNOWN


async def test_health_stream_end_clears_and_reconnects_after_the_delay(base: Path, servers: AsyncExitStack) -> None:
    driver, _ = await serve(servers, base / "reg" / "gpu-reg.sock")
    async with KubeletSimulator(base / "reg", health_retry=0.3) as sim:
        await sim.register(base / "reg" / "gpu-reg.sock")
        driver.reports.put_nowait([DeviceHealthReport("p", "gpu-0", HealthStatus.UNHEALTHY)])
        await sim.wait_for_health(DRIVER, lambda s: ("p", "gpu-0") in s)
        driver.reports.put_nowait(None)  # the plugin ends the stream
        await sim.wait_for_health(DRIVER, lambda s: not s)
        cleared = asyncio.get_running_loop().time()
        assert len(driver.stream_opened) == 1

        driver.reports.put_nowait([DeviceHealthReport("p", "gpu-1", HealthStatus.HEALTHY)])
        state = await sim.wait_for_health(DRIVER, lambda s: bool(s), timeout=scaled(3))
        assert list(state) == [("p", "gpu-1")]
        assert len(driver.stream_opened) == 2
        assert driver.stream_opened[1] - cleared >= 0.25


@pytest.mark.parametrize(
    ("health", "versions"),
    [(False, SUPPORTED_VERSIONS), (True, ("v1.DRAPlugin", "v1beta1.DRAPlugin"))],
)
async def test_no_health_stream_unless_advertised_and_enabled(
    base: Path, servers: AsyncExitStack, health: bool, versions: tuple[str, ...]
) -> None:
    driver, _ = await serve(servers, base / "reg" / "gpu-reg.sock", versions=versions)
    async with KubeletSimulator(base / "reg", health=health) as sim:
        await sim.register(base / "reg" / "gpu-reg.sock")
        await asyncio.sleep(scaled(0.2))  # a window in which no stream may be opened
        assert driver.stream_opened == []


async def test_raw_health_stream(base: Path, servers: AsyncExitStack) -> None:
    driver, _ = await serve(servers, base / "reg" / "gpu-reg.sock")
    report = DeviceHealthReport("p", "gpu-0", HealthStatus.HEALTHY, last_updated=7, timeout_seconds=9, message="ok")
    driver.reports.put_nowait([report])
    driver.reports.put_nowait(None)
    async with KubeletSimulator(base / "reg", health=False) as sim:
        plugin = await sim.register(base / "reg" / "gpu-reg.sock")
        async with asyncio.timeout(scaled(5)):
            assert [reports async for reports in plugin.health()] == [[report]]
