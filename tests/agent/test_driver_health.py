"""A driver following its backend's health: the kubelet's stream, the slices' taints, refused prepares,
hot-plug and recovery. A scripted backend stands in for the hardware; everything else is the real agent
(publisher against the test API server, kubelet sockets, checkpoint, CDI)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agent.claims.checkpoint import read_boot_id
from agent.claims.instances import Instances
from agent.driver import Driver, DriverSetup
from agent.kube.client import KubeClient
from agent.kubelet.services import HealthStatus
from agent.logs import get_logger
from agent.metrics import Metrics, MetricsServer
from agent.node.inventory import BackendReport
from agent.node.plugins import FoundPlugin, LoadedPlugin
from agent.slices.publisher import Publisher
from backends.contract import (
    Allocated,
    BackendContext,
    ClaimRef,
    Device,
    DevicesChanged,
    Health,
    HealthEvent,
    Inventory,
    Prepared,
    Unserved,
)
from cdi.spec import ContainerEdits, DeviceNode
from simulator.apiserver.server import TestApiServer
from simulator.kubelet import KubeletSimulator
from simulator.kubelet_connection import Plugin
from tests.support.agent_env import NODE, allocate, settings_for, wait_until
from tests.support.timing import scaled

DRIVER = "accel.example.com"


class ScriptedBackend:
    """A backend whose devices and health events the test decides."""

    name = "scripted"
    driver = DRIVER

    def __init__(self, devices: Sequence[str]) -> None:
        self.devices = list(devices)
        self.unserved: list[Unserved] = []
        self.events: asyncio.Queue[HealthEvent | DevicesChanged | Exception] = asyncio.Queue()
        self.streams = 0

    async def start(self, ctx: BackendContext) -> None:
        pass

    async def discover(self) -> Inventory:
        return Inventory(tuple(Device(d, attributes={"index": i}) for i, d in enumerate(self.devices)),
                         unserved=tuple(self.unserved))

    async def health(self) -> AsyncIterator[HealthEvent | DevicesChanged]:
        self.streams += 1
        while True:
            event = await self.events.get()
            if isinstance(event, Exception):
                raise event
            yield event

    async def prepare(self, claim: ClaimRef, devices: Sequence[Allocated]) -> Sequence[Prepared]:
        return [Prepared(a.device, ContainerEdits(device_nodes=(DeviceNode(f"/dev/accel-{a.device}"),)))
                for a in devices]

    async def unprepare(self, claim: ClaimRef, prepared: Sequence[Prepared]) -> None:
        pass

    async def stop(self) -> None:
        pass


@dataclass
class Env:
    server: TestApiServer
    backend: ScriptedBackend
    driver: Driver
    kubelet: KubeletSimulator
    metrics: Metrics

    def slices(self) -> list[dict[str, Any]]:
        return sorted((s for s in self.server.objects("resourceslices") if s["spec"]["driver"] == DRIVER),
                      key=lambda s: s["metadata"]["name"])

    def taints(self) -> dict[str, list[dict[str, Any]]]:
        return {d["name"]: [{k: v for k, v in t.items() if k != "timeAdded"} for t in d["taints"]]
                for s in self.slices() for d in s["spec"].get("devices", ()) if d.get("taints")}

    def published(self) -> list[str]:
        return sorted(d["name"] for s in self.slices() for d in s["spec"].get("devices", ()))

    async def plugin(self) -> Plugin:
        return await self.kubelet.wait_for_plugin(DRIVER)


async def report(backend: ScriptedBackend) -> BackendReport:
    found = FoundPlugin("scripted", "tests", "0", EntryPoint("scripted", "tests:ScriptedBackend", "dra_agent.backends"))
    return BackendReport(LoadedPlugin(found, backend), DRIVER, await backend.discover())


@pytest.fixture
async def make_env(scratch: Path) -> AsyncIterator[Callable[..., Any]]:
    async with AsyncExitStack() as stack:

        async def make(devices: Sequence[str] = ("dev-0", "dev-1", "dev-2"), unserved: Sequence[Unserved] = (),
                       **settings: Any) -> Env:
            server = await stack.enter_async_context(TestApiServer())
            server.add_node(NODE)
            config = settings_for(scratch, server.write_kubeconfig(scratch / "kubeconfig"), "gke-g2-l4",
                                  health_timeout=4, **settings)
            kube = await KubeClient.connect(config.kubeconfig)
            stack.push_async_callback(kube.close)
            metrics = Metrics()
            publisher = Publisher(kube, NODE, get_logger("publisher"), metrics)
            stack.push_async_callback(publisher.stop)
            backend = ScriptedBackend(devices)
            backend.unserved = list(unserved)
            instances = Instances(config.state_dir).register(config.pod_uid)
            stack.callback(instances.close)
            setup = DriverSetup(config, NODE, kube, publisher, metrics, read_boot_id(Path("/proc")), instances)
            driver = Driver(setup, DRIVER, [await report(backend)])
            await driver.start()
            stack.push_async_callback(driver.stop, 1.0)
            kubelet = await stack.enter_async_context(KubeletSimulator(config.registry_dir))
            return Env(server, backend, driver, kubelet, metrics)

        yield make


async def next_health(plugin: Plugin, stream: AsyncIterator[list[Any]], want: Callable[[dict[str, Any]], bool],
                      timeout: float = scaled(3)) -> dict[str, Any]:
    """The first message (device → report) of the stream that satisfies `want`."""
    async with asyncio.timeout(timeout):
        async for reports in stream:
            by_device = {r.device: r for r in reports}
            if want(by_device):
                return by_device
    raise AssertionError("stream ended")


async def test_unhealthy_device_is_streamed_tainted_and_refused_until_it_recovers(make_env: Callable[..., Any]) -> None:
    env: Env = await make_env()
    await asyncio.wait_for(env.driver.published.wait(), scaled(5))
    plugin = await env.plugin()
    stream = aiter(plugin.health())
    first = await next_health(plugin, stream, lambda m: True)
    assert {d: r.health for d, r in first.items()} == dict.fromkeys(["dev-0", "dev-1", "dev-2"], HealthStatus.HEALTHY)

    before = env.server.writes()
    env.backend.events.put_nowait(HealthEvent("dev-1", Health.UNHEALTHY, "Xid 79: GPU has fallen off the bus",
                                              "xid", "79"))
    message = await next_health(plugin, stream, lambda m: m["dev-1"].health == HealthStatus.UNHEALTHY)
    assert message["dev-1"].message == "Xid 79: GPU has fallen off the bus"
    assert message["dev-0"].health == HealthStatus.HEALTHY
    await wait_until(lambda: env.taints() == {"dev-1": [{"key": f"{DRIVER}/xid", "value": "79",
                                                         "effect": "NoSchedule"}]}, scaled(3))
    assert env.server.writes() - before == 1, "one slice rewritten, nothing else"
    assert env.slices()[0]["spec"]["pool"]["generation"] == 0

    claim = allocate(env.server, "train", [("accel", DRIVER, "dev-1")])
    result = (await plugin.prepare([claim]))[claim.uid]
    assert result.error == "not prepared, unhealthy device(s): dev-1: Xid 79: GPU has fallen off the bus"
    healthy_claim = allocate(env.server, "other", [("accel", DRIVER, "dev-0")])
    assert (await plugin.prepare([healthy_claim]))[healthy_claim.uid].error == ""

    env.backend.events.put_nowait(HealthEvent("dev-1", Health.HEALTHY, "GPU reset"))
    await next_health(plugin, stream, lambda m: m["dev-1"].health == HealthStatus.HEALTHY)
    await wait_until(lambda: env.taints() == {}, scaled(3))
    assert (await plugin.prepare([claim]))[claim.uid].error == ""
    samples = {(s.labels["device"], s.labels["health"]): s.value
               for s in env.metrics.device_health.collect()[0].samples}
    assert samples[("dev-1", "Healthy")] == 1 and samples[("dev-1", "Unhealthy")] == 0


async def test_a_claim_prepared_before_the_device_failed_keeps_its_answer(make_env: Callable[..., Any]) -> None:
    env: Env = await make_env()
    plugin = await env.plugin()
    claim = allocate(env.server, "train", [("accel", DRIVER, "dev-0")])
    first = await plugin.prepare_or_raise([claim])
    env.backend.events.put_nowait(HealthEvent("dev-0", Health.UNHEALTHY, "double-bit ECC error", "ecc"))
    await wait_until(lambda: env.driver.board.state("dev-0").health is Health.UNHEALTHY, scaled(3))
    assert await plugin.prepare_or_raise([claim]) == first, "the kubelet's retry of a running pod's claim"
    assert await plugin.unprepare([claim]) == {claim.uid: ""}


async def test_effects_unknown_and_no_execute(make_env: Callable[..., Any]) -> None:
    env: Env = await make_env(no_execute=("gpu-lost",))
    await asyncio.wait_for(env.driver.published.wait(), scaled(5))
    for event in (HealthEvent("dev-0", Health.UNHEALTHY, "GPU lost", "gpu-lost"),
                  HealthEvent("dev-1", Health.UNKNOWN, "NVML does not answer", "unmonitored"),
                  HealthEvent("dev-2", Health.UNHEALTHY, "odd", "Not A Label!", "x" * 70)):
        env.backend.events.put_nowait(event)
    await wait_until(lambda: len(env.taints()) == 3, scaled(3))
    assert env.taints() == {
        "dev-0": [{"key": f"{DRIVER}/gpu-lost", "effect": "NoExecute"}],
        "dev-1": [{"key": f"{DRIVER}/unmonitored", "effect": "None"}],
        "dev-2": [{"key": f"{DRIVER}/unhealthy", "effect": "NoSchedule"}],  # what the API would refuse, left out
    }
    plugin = await env.plugin()
    unknown = allocate(env.server, "unknown", [("accel", DRIVER, "dev-1")])
    assert (await plugin.prepare([unknown]))[unknown.uid].error == "", "unknown health does not block a prepare"


async def test_hot_plug_removes_and_restores_devices(make_env: Callable[..., Any]) -> None:
    env: Env = await make_env()
    plugin = await env.plugin()
    claim = allocate(env.server, "train", [("accel", DRIVER, "dev-2")])
    await plugin.prepare_or_raise([claim])
    stream = aiter(plugin.health())

    env.backend.devices.remove("dev-2")
    env.backend.events.put_nowait(DevicesChanged("PCI remove of 0000:3b:00.0"))
    await wait_until(lambda: env.published() == ["dev-0", "dev-1"], scaled(5))
    message = await next_health(plugin, stream, lambda m: "dev-2" in m and m["dev-2"].health == HealthStatus.UNHEALTHY)
    assert message["dev-2"].message == "the device is no longer on the node", "its pods see it gone"
    fresh = allocate(env.server, "fresh", [("accel", DRIVER, "dev-2")])
    assert "not a device of driver" in (await plugin.prepare([fresh]))[fresh.uid].error

    assert await plugin.unprepare([claim]) == {claim.uid: ""}, "unprepare works from the checkpoint alone"
    env.backend.devices.append("dev-2")
    env.backend.events.put_nowait(DevicesChanged("PCI add of 0000:3b:00.0"))
    await wait_until(lambda: env.published() == ["dev-0", "dev-1", "dev-2"], scaled(5))
    message = await next_health(plugin, stream, lambda m: m.get("dev-2") is not None
                                and m["dev-2"].health == HealthStatus.HEALTHY)
    assert set(message) == {"dev-0", "dev-1", "dev-2"}


async def test_a_dormant_driver_starts_serving_when_devices_appear(make_env: Callable[..., Any]) -> None:
    env: Env = await make_env(devices=())
    registry = env.kubelet.registry_dir
    assert not env.driver.active and not (registry.exists() and list(registry.iterdir())), "no sockets yet"
    env.backend.devices.append("dev-0")
    env.backend.events.put_nowait(DevicesChanged("PCI add"))
    await wait_until(lambda: env.published() == ["dev-0"], scaled(5))
    plugin = await env.plugin()
    claim = allocate(env.server, "train", [("accel", DRIVER, "dev-0")])
    assert (await plugin.prepare([claim]))[claim.uid].error == ""


def unserved_count(env: Env) -> float | None:
    labels = {"driver": DRIVER, "backend": "scripted"}
    return env.metrics.registry.get_sample_value("dra_agent_unserved_devices", labels)


async def test_hardware_a_backend_cannot_serve_is_reported_until_it_can(make_env: Callable[..., Any]) -> None:
    why = Unserved(("0000:3b:00.0", "0000:86:00.0"), "the driver's library cannot be loaded")
    # Said twice (as two backends of one driver may say the same of the same GPUs): one line, every device counted.
    env: Env = await make_env(devices=(), unserved=[why, why])
    line = f"{DRIVER}: 2 device(s) cannot be served (0000:3b:00.0, 0000:86:00.0): the driver's library cannot be loaded"
    assert env.driver.unserved() == [line]
    assert unserved_count(env) == 4
    env.backend.unserved = [why]
    env.backend.events.put_nowait(DevicesChanged("looked again"))
    await wait_until(lambda: unserved_count(env) == 2, scaled(5))
    env.backend.unserved, env.backend.devices = [], ["dev-0"]
    env.backend.events.put_nowait(DevicesChanged("the driver is there"))
    await wait_until(lambda: env.published() == ["dev-0"], scaled(5))
    assert env.driver.unserved() == []
    assert unserved_count(env) == 0

    server = MetricsServer("127.0.0.1:0", env.metrics, lambda: ["starting", line])
    await server.start()
    try:
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{server.port}/readyz") as response:
            assert (response.status, await response.text()) == (503, f"not ready:\n- starting\n- {line}\n")
    finally:
        await server.stop()


async def test_events_for_devices_of_others_are_ignored(make_env: Callable[..., Any]) -> None:
    env: Env = await make_env()
    await asyncio.wait_for(env.driver.published.wait(), scaled(5))
    env.backend.events.put_nowait(HealthEvent("not-mine", Health.UNHEALTHY, "?", "xid"))
    env.backend.events.put_nowait(HealthEvent("dev-0", Health.UNHEALTHY, "marker", "ecc"))
    await wait_until(lambda: env.driver.board.state("dev-0").health is Health.UNHEALTHY, scaled(3))
    assert list(env.driver.board.unhealthy()) == ["dev-0"]
    assert "not-mine" not in env.driver.board.states()


async def test_a_failing_health_stream_marks_devices_unknown_and_is_followed_again(
        make_env: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("agent.driver.RETRY_SECONDS", 0.3)
    env: Env = await make_env()
    await asyncio.wait_for(env.driver.published.wait(), scaled(5))
    env.backend.events.put_nowait(RuntimeError("NVML crashed"))
    await wait_until(lambda: env.driver.board.state("dev-0").health is Health.UNKNOWN, scaled(3))
    assert "health monitoring of backend scripted failed: NVML crashed" in env.driver.board.state("dev-0").reason
    await wait_until(lambda: env.backend.streams == 2, scaled(3))
    for device in ("dev-0", "dev-1", "dev-2"):
        env.backend.events.put_nowait(HealthEvent(device, Health.HEALTHY))
    await wait_until(lambda: not env.driver.board.unhealthy(), scaled(3))
    await wait_until(lambda: env.taints() == {}, scaled(3))
