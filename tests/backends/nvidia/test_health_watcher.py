"""GPU health end to end inside the NVIDIA backends: simulated NVML events in, health events out.

The backends run on a simulated node with the real watcher thread and pynvml; udev is a fake that records
the backends' handlers, so a test plays the kernel's part by calling them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import structlog
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

import backends.nvidia.health_watcher as watcher_module
from backends.contract import BackendContext, DevicesChanged, Health, HealthEvent
from backends.nvidia.gpu import NvidiaGpuBackend
from backends.nvidia.mig import NvidiaMigBackend
from backends.topology import TopologyReader, device_name
from simulator.node.node import SimulatedNode
from simulator.nvml.events import SUPPORTED_EVENTS
from tests.support.timing import scaled

Item = HealthEvent | DevicesChanged
Nvidia = NvidiaGpuBackend | NvidiaMigBackend


class FakeUdev:
    """Records the handlers backends subscribe; `fire` delivers an event the way the core's monitor would."""

    def __init__(self) -> None:
        self.handlers: dict[str, list[Callable[[Any], None]]] = {}

    def subscribe(self, subsystem: str, handler: Callable[[Any], None]) -> Callable[[], None]:
        self.handlers.setdefault(subsystem, []).append(handler)
        return lambda: self.handlers[subsystem].remove(handler)

    def fire(self, action: str, bus_id: str) -> None:
        for handler in list(self.handlers.get("pci", [])):
            handler(SimpleNamespace(action=action, sys_name=bus_id, subsystem="pci"))


@dataclass
class Watching:
    """Started backends whose health streams are being read."""

    node: SimulatedNode
    backends: list[Nvidia]
    udev: FakeUdev
    registry: CollectorRegistry
    queue: asyncio.Queue[tuple[str, Item]] = field(default_factory=asyncio.Queue)
    devices: dict[str, list[str]] = field(default_factory=dict)

    async def next(self, timeout: float = scaled(5.0)) -> tuple[str, Item]:
        return await asyncio.wait_for(self.queue.get(), timeout)

    async def collect(self, count: int, timeout: float = scaled(5.0)) -> dict[str, Item]:
        """The next `count` items, by device name (DevicesChanged under its reason)."""
        found: dict[str, Item] = {}
        for _ in range(count):
            _, item = await self.next(timeout)
            found[item.device if isinstance(item, HealthEvent) else item.reason] = item
        return found

    async def quiet(self, seconds: float) -> None:
        """Nothing comes for `seconds` (a window that is the point: stretched by the time factor)."""
        await asyncio.sleep(scaled(seconds))
        assert self.queue.empty(), self.queue.get_nowait()

    def xids(self, code: int) -> float:
        return self.registry.get_sample_value("dra_agent_nvidia_xids_total", {"code": str(code)}) or 0.0

    def gpu(self, index: int) -> str:
        return device_name("gpu", self.node.nvml.gpus[index].bus_id)


async def until(predicate: Callable[[], bool], timeout: float = scaled(5.0)) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():  # noqa: ASYNC110 - the condition lives in another thread's NVML state
            await asyncio.sleep(0.01)


@pytest.fixture
def fast_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watcher_module, "WAIT_MS", 100)


@asynccontextmanager
async def watching(node: SimulatedNode, *kinds: type[Nvidia], **config: Any) -> AsyncIterator[Watching]:
    udev, registry = FakeUdev(), CollectorRegistry()
    topology = TopologyReader(node.sysfs)
    backends: list[Nvidia] = [kind() for kind in kinds]
    w = Watching(node, backends, udev, registry)
    for backend in backends:
        ctx = BackendContext(node.sysfs, node.dev, node.root, topology, config, structlog.get_logger(backend.name),
                             udev, registry, driver_root=node.driver_root)
        await backend.start(ctx)
        w.devices[backend.name] = [d.name for d in (await backend.discover()).devices]

    async def pump(backend: Nvidia) -> None:
        async for item in backend.health():
            w.queue.put_nowait((backend.name, item))

    tasks = [asyncio.create_task(pump(b)) for b in backends]
    try:
        # Watching has begun once every GPU that can be is registered for its events.
        await until(lambda: all(node.nvml.registrations(i) or gpu.faults or gpu.lost
                                for i, gpu in enumerate(node.nvml.gpus)))
        yield w
    finally:
        for backend in backends:
            await backend.stop()
        await asyncio.wait_for(asyncio.gather(*tasks), scaled(5))


@pytest.fixture
def t4x2(sim_node: Callable[[str], SimulatedNode], fast_waits: None) -> SimulatedNode:
    return sim_node("gke-n1-t4x2")


# -- Xids ------------------------------------------------------------------------------------------------


async def test_xid_79_makes_the_gpu_unhealthy_until_it_is_reset(t4x2: SimulatedNode) -> None:
    async with watching(t4x2, NvidiaGpuBackend, recheckSeconds=3600) as w:
        t4x2.nvml.inject_xid(1, 79)
        backend, event = await w.next()
        assert (backend, event) == ("nvidia-gpu", HealthEvent(w.gpu(1), Health.UNHEALTHY,
                                                              "Xid 79: GPU has fallen off the bus", "xid", "79"))
        assert w.xids(79) == 1
        w.udev.fire("change", t4x2.nvml.gpus[1].bus_id)  # not reset yet: still lost
        await w.quiet(0.4)
        t4x2.nvml.reset_gpu(1)
        w.udev.fire("change", t4x2.nvml.gpus[1].bus_id)
        _, event = await w.next()
        assert event == HealthEvent(w.gpu(1), Health.HEALTHY, "NVML answers normally for the GPU again")
        # Watched again: the next Xid arrives.
        await until(lambda: t4x2.nvml.registrations(1) != 0)
        t4x2.nvml.inject_xid(1, 48)
        _, event = await w.next()
        assert isinstance(event, HealthEvent) and (event.cause, event.value) == ("xid", "48")


async def test_a_reset_gpu_comes_back_on_the_timer(t4x2: SimulatedNode) -> None:
    async with watching(t4x2, NvidiaGpuBackend, recheckSeconds=0.2) as w:
        t4x2.nvml.inject_xid(0, 79)
        _, event = await w.next()
        assert isinstance(event, HealthEvent) and event.health is Health.UNHEALTHY
        await w.quiet(0.5)  # probed on the timer, still lost
        t4x2.nvml.reset_gpu(0)
        _, event = await w.next(timeout=scaled(3))
        assert event == HealthEvent(w.gpu(0), Health.HEALTHY, "NVML answers normally for the GPU again")


async def test_ignored_xids_are_logged_and_counted_only(t4x2: SimulatedNode) -> None:
    async with watching(t4x2, NvidiaGpuBackend) as w:
        with capture_logs() as logs:
            t4x2.nvml.inject_xid(0, 13)
            await until(lambda: w.xids(13) == 1)
            await w.quiet(0.3)
        [entry] = [e for e in logs if e["event"] == "GPU event changes no health"]
        assert entry["log_level"] == "info"
        assert entry["detail"] == "Xid 13: graphics engine exception (ignored: caused by an application)"


async def test_the_ignore_list_is_configurable(t4x2: SimulatedNode) -> None:
    async with watching(t4x2, NvidiaGpuBackend, ignoredXids=[48]) as w:
        t4x2.nvml.inject_xid(0, 48)
        t4x2.nvml.inject_xid(0, 13)
        _, event = await w.next()
        assert isinstance(event, HealthEvent) and event.reason == "Xid 13: graphics engine exception"
        assert w.xids(48) == 1


async def test_a_double_bit_ecc_error_lasts_until_the_gpu_is_seen_again(t4x2: SimulatedNode) -> None:
    async with watching(t4x2, NvidiaGpuBackend, recheckSeconds=0.2) as w:
        t4x2.nvml.inject_ecc(0)
        _, event = await w.next()
        assert event == HealthEvent(w.gpu(0), Health.UNHEALTHY, "double-bit (uncorrectable) ECC error", "ecc")
        await w.quiet(0.6)  # the GPU still answers NVML: the timer is for GPUs that do not
        t4x2.nvml.reset_gpu(0)
        w.udev.fire("bind", t4x2.nvml.gpus[0].bus_id)
        items = await w.collect(2)
        assert items[w.gpu(0)] == HealthEvent(w.gpu(0), Health.HEALTHY, "NVML answers normally for the GPU again")
        assert items[f"PCI bind {t4x2.nvml.gpus[0].bus_id}"] == DevicesChanged(f"PCI bind {t4x2.nvml.gpus[0].bus_id}")


# -- lost and unmonitored GPUs ----------------------------------------------------------------------------


async def test_a_lost_gpu(t4x2: SimulatedNode) -> None:
    async with watching(t4x2, NvidiaGpuBackend, recheckSeconds=0.2) as w:
        t4x2.nvml.set_lost(1)
        _, event = await w.next()
        assert event == HealthEvent(w.gpu(1), Health.UNHEALTHY, "GPU has fallen off the bus: NVML reports it lost",
                                    "gpu-lost")
        await w.quiet(0.3)  # the other GPU is still watched, and nothing spins on the lost one
        t4x2.nvml.inject_xid(0, 48)
        _, event = await w.next()
        assert isinstance(event, HealthEvent) and event.device == w.gpu(0)
        t4x2.nvml.reset_gpu(1)
        _, event = await w.next()
        assert event == HealthEvent(w.gpu(1), Health.HEALTHY, "NVML answers normally for the GPU again")


async def test_a_gpu_that_cannot_report_events_is_unmonitored_from_the_start(
    t4x2: SimulatedNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    t4x2.nvml.gpus[0].faults["nvmlDeviceRegisterEvents"] = 3  # NOT_SUPPORTED: a driver too old for events
    async with watching(t4x2, NvidiaGpuBackend, recheckSeconds=0.1) as w:
        _, event = await w.next()
        assert event == HealthEvent(w.gpu(0), Health.UNKNOWN,
                                    "health not monitored: the driver cannot report its events", "unmonitored")
        probes = t4x2.nvml.call_count("nvmlDeviceGetHandleByUUID")
        await w.quiet(0.5)
        assert t4x2.nvml.call_count("nvmlDeviceGetHandleByUUID") == probes  # nothing to re-check


async def test_a_gpu_lost_before_watching_begins_is_reported_at_once(t4x2: SimulatedNode) -> None:
    backend = NvidiaGpuBackend()
    ctx = BackendContext(t4x2.sysfs, t4x2.dev, t4x2.root, TopologyReader(t4x2.sysfs), {}, structlog.get_logger(),
                         driver_root=t4x2.driver_root)
    await backend.start(ctx)
    assert len((await backend.discover()).devices) == 2
    t4x2.nvml.set_lost(0)  # after discovery published it
    stream = backend.health()
    assert isinstance(stream, AsyncGenerator)  # the backend's health() is an async generator function
    try:
        event = await asyncio.wait_for(anext(stream), scaled(5))
        assert event == HealthEvent(device_name("gpu", t4x2.nvml.gpus[0].bus_id), Health.UNHEALTHY,
                                    "GPU has fallen off the bus: NVML reports it lost", "gpu-lost")
    finally:
        await backend.stop()
        await stream.aclose()


async def test_a_lost_gpu_stays_published_through_a_rediscovery_until_its_reset(
        sim_node: Callable[[str], SimulatedNode], fast_waits: None) -> None:
    # Another device's hot-plug makes the backends discover again while a GPU is off the bus: the GPU must not
    # leave the slices (its reset sends no hot-plug event to bring it back), whole or in MIG devices.
    node = sim_node("mixed")  # GPU 0 whole, GPU 1 in MIG mode with three instances
    async with watching(node, NvidiaGpuBackend, NvidiaMigBackend, recheckSeconds=3600) as w:
        gpu_backend = w.backends[0]
        before = {b.name: await b.discover() for b in w.backends}
        node.nvml.inject_xid(0, 79)
        node.nvml.inject_xid(1, 79)
        await w.collect(4)
        during = {b.name: await b.discover() for b in w.backends}
        for name in ("nvidia-gpu", "nvidia-mig"):
            assert during[name].devices == before[name].devices, f"{name} keeps the lost GPU's devices as they were"
        assert [x for x in during["nvidia-gpu"].warnings if "lost" in x] == [
            "GPU 0: nvmlDeviceGetHandleByIndex failed: GPU is lost; its devices stay published as last seen until "
            "it answers NVML again"]
        assert any("GPU 1: " in x and "stay published" in x for x in during["nvidia-mig"].warnings)
        assert isinstance(gpu_backend, NvidiaGpuBackend)
        assert [m for m in gpu_backend._minors] == [w.gpu(0)], "prepare still knows the device node"
        node.nvml.reset_gpu(0)
        node.nvml.reset_gpu(1)
        after = {b.name: await b.discover() for b in w.backends}
        assert after["nvidia-gpu"].devices == before["nvidia-gpu"].devices
        assert after["nvidia-mig"].devices == before["nvidia-mig"].devices
        assert not [x for x in after["nvidia-gpu"].warnings + after["nvidia-mig"].warnings if "lost" in x]


async def test_a_gpu_lost_before_the_first_discovery_is_left_out_with_the_reason(t4x2: SimulatedNode) -> None:
    t4x2.nvml.set_lost(0)
    backend = NvidiaGpuBackend()
    ctx = BackendContext(t4x2.sysfs, t4x2.dev, t4x2.root, TopologyReader(t4x2.sysfs), {}, structlog.get_logger(),
                         driver_root=t4x2.driver_root)
    await backend.start(ctx)
    try:
        inventory = await backend.discover()
        assert [d.name for d in inventory.devices] == [device_name("gpu", t4x2.nvml.gpus[1].bus_id)]
        assert "GPU 0: nvmlDeviceGetHandleByIndex failed: GPU is lost; left out" in inventory.warnings
    finally:
        await backend.stop()


async def test_nvml_failing_makes_every_gpu_unknown_until_it_works(t4x2: SimulatedNode) -> None:
    async with watching(t4x2, NvidiaGpuBackend, recheckSeconds=0.2) as w:
        t4x2.nvml.gpus[1].faults["nvmlEventSetWait_v2"] = 999
        items = await w.collect(2)
        assert set(items) == {w.gpu(0), w.gpu(1)}
        for event in items.values():
            assert isinstance(event, HealthEvent) and (event.health, event.cause) == (Health.UNKNOWN, "unmonitored")
            assert "NVML failed: nvmlEventSetWait_v2 failed" in event.reason
        del t4x2.nvml.gpus[1].faults["nvmlEventSetWait_v2"]
        items = await w.collect(2)
        assert {e.health for e in items.values() if isinstance(e, HealthEvent)} == {Health.HEALTHY}


# -- MIG --------------------------------------------------------------------------------------------------


async def test_mig_devices_follow_their_gpu_or_their_instance(sim_node: Callable[[str], SimulatedNode],
                                                             fast_waits: None) -> None:
    node = sim_node("mixed")  # GPU 0 whole, GPU 1 in MIG mode with three instances
    async with watching(node, NvidiaGpuBackend, NvidiaMigBackend, recheckSeconds=3600) as w:
        migs = w.devices["nvidia-mig"]
        assert len(migs) == 3 and w.devices["nvidia-gpu"] == [w.gpu(0)]
        [three_g] = [v for v in node.nvml.instances(1) if v.profile == "3g.40gb"]
        node.nvml.inject_xid(1, 94, gi=three_g.gi, ci=three_g.cis[0])
        backend, event = await w.next()
        assert backend == "nvidia-mig" and isinstance(event, HealthEvent)
        assert "-mig-3g40gb-" in event.device and event.reason == "Xid 94: contained ECC error"
        node.nvml.inject_xid(1, 79)
        items = await w.collect(3)  # the whole GPU's condition outweighs the 3g instance's own
        assert set(items) == set(migs)
        assert all(isinstance(e, HealthEvent) and e.value == "79" for e in items.values())
        await w.quiet(0.3)  # nvidia-gpu owns nothing on that GPU
        node.nvml.reset_gpu(1)
        w.udev.fire("change", node.nvml.gpus[1].bus_id)
        items = await w.collect(3)
        assert set(items) == set(migs)
        assert {e.health for e in items.values() if isinstance(e, HealthEvent)} == {Health.HEALTHY}
        node.nvml.inject_xid(0, 79)
        backend, event = await w.next()
        assert backend == "nvidia-gpu" and isinstance(event, HealthEvent) and event.device == w.gpu(0)
        assert w.xids(79) == 2 and w.xids(94) == 1  # counted once, though two backends watch


# -- hot-plug ---------------------------------------------------------------------------------------------


async def test_pci_add_and_remove_of_nvidia_gpus_change_the_device_set(t4x2: SimulatedNode) -> None:
    nic = t4x2.plan.nics[0].bus_id
    async with watching(t4x2, NvidiaGpuBackend) as w:
        w.udev.fire("add", nic)  # not NVIDIA
        w.udev.fire("change", t4x2.nvml.gpus[0].bus_id)  # not a change of the device set
        await w.quiet(0.3)
        gpu = t4x2.nvml.gpus[1].bus_id
        w.udev.fire("remove", gpu)
        w.udev.fire("add", gpu)  # in the same batch: one rediscovery
        [item] = (await w.collect(1)).values()
        assert item == DevicesChanged(f"PCI remove {gpu}; PCI add {gpu}")
        await w.quiet(0.3)


# -- the thread ---------------------------------------------------------------------------------------------


def _watcher_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "nvml-health"]


async def test_one_thread_for_both_backends_and_it_stops_promptly(sim_node: Callable[[str], SimulatedNode]) -> None:
    node = sim_node("mixed")
    await until(lambda: not _watcher_threads())  # an earlier test's watcher may still be finishing its last wait
    async with watching(node, NvidiaGpuBackend, NvidiaMigBackend) as w:
        assert len(_watcher_threads()) == 1
        assert w.registry.get_sample_value("dra_agent_nvidia_xids_total", {"code": "79"}) is None
        started = time.monotonic()
        for backend in w.backends:
            await backend.stop()
        # Within one NVML wait, with room for a loaded machine.
        assert time.monotonic() - started < watcher_module.WAIT_MS / 1000 + scaled(1.5)
        assert not _watcher_threads()
        assert watcher_module._shared is None
        assert node.nvml.registrations(0) == 0  # the event set is freed
    # The metric goes with the watcher; a new one registers again.
    async with watching(node, NvidiaGpuBackend) as w:
        node.nvml.inject_xid(0, 31)
        await until(lambda: w.xids(31) == 1)


async def test_no_nvml_work_but_waiting_while_all_is_healthy(t4x2: SimulatedNode) -> None:
    async with watching(t4x2, NvidiaGpuBackend) as w:
        await until(lambda: t4x2.nvml.call_count("nvmlEventSetWait_v2") >= 2)  # the watcher is in its loop
        before = {s: t4x2.nvml.call_count(s) for s in ("nvmlEventSetWait_v2", "nvmlDeviceGetHandleByUUID",
                                                       "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetHandleByIndex_v2")}
        window = scaled(1.0)  # the window is the point of the test: kept, and stretched
        await asyncio.sleep(window)
        after = {s: t4x2.nvml.call_count(s) for s in before}
        waits = after["nvmlEventSetWait_v2"] - before["nvmlEventSetWait_v2"]
        assert 7 * window <= waits <= 12 * window  # one per 100 ms wait
        assert {s: after[s] - before[s] for s in before if s != "nvmlEventSetWait_v2"} == {
            "nvmlDeviceGetHandleByUUID": 0, "nvmlDeviceGetMemoryInfo": 0, "nvmlDeviceGetHandleByIndex_v2": 0}
        assert w.queue.empty()
        assert t4x2.nvml.registrations(0) == SUPPORTED_EVENTS


async def test_health_ends_when_the_backend_stops_even_unread(t4x2: SimulatedNode) -> None:
    backend = NvidiaGpuBackend()
    ctx = BackendContext(t4x2.sysfs, t4x2.dev, t4x2.root, TopologyReader(t4x2.sysfs), {}, structlog.get_logger(),
                         driver_root=t4x2.driver_root)
    await backend.start(ctx)
    await backend.discover()
    stream = backend.health()
    reader = asyncio.create_task(anext(stream, None))
    await until(lambda: t4x2.nvml.registrations(0) != 0)
    await backend.stop()
    assert await asyncio.wait_for(reader, scaled(2)) is None
    assert not _watcher_threads()


@pytest.fixture(autouse=True)
def _no_watcher_left() -> Iterator[None]:
    yield
    assert not _watcher_threads()
