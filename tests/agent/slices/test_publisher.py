"""The publisher against the test API server: repair of outside changes, no writes at idle, minimal writes,
faults, and fields the cluster drops."""

from __future__ import annotations

import asyncio
import gc
import time
import warnings
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from agent.kube.client import KubeClient
from agent.logs import get_logger
from agent.slices.build import pool_slices
from agent.slices.publisher import Features, Publisher
from backends.contract import CapacityPolicy, CapacityRange, CounterConsumption, CounterSet, Device
from simulator.apiserver.faults import RequestRecord
from simulator.apiserver.server import TestApiServer
from tests.support.agent_env import wait_until
from tests.support.slice_checks import assert_valid_slices
from tests.support.timing import scaled

NODE, GPU, NIC = "node-a", "gpu.example.com", "nic.example.com"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"


@dataclass
class Inventory:
    """A pool whose devices a test changes, as health events or hot-plug would."""

    driver: str
    devices: list[Device]
    counter_sets: list[CounterSet] = field(default_factory=list)
    taints: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def build(self, features: Features) -> Sequence[dict[str, Any]]:
        return pool_slices(self.driver, NODE, self.devices, self.counter_sets, taints=self.taints,
                           taints_supported=features.taints, counters_supported=features.counters,
                           shares_supported=features.shares).slices


def devices(n: int) -> list[Device]:
    return [Device(name=f"dev-{i:04d}", attributes={"index": i}, capacity={"memory": 80 << 30}) for i in range(n)]


@dataclass
class Env:
    server: TestApiServer
    publisher: Publisher

    def slices(self, driver: str = GPU) -> list[dict[str, Any]]:
        return sorted((s for s in self.server.objects("resourceslices") if s["spec"]["driver"] == driver),
                      key=lambda s: s["metadata"]["name"])

    def names(self, driver: str = GPU) -> list[str]:
        return [d["name"] for s in self.slices(driver) for d in s["spec"].get("devices", [])]

    def writes(self, since: float = 0.0) -> int:
        return self.server.writes("resourceslices", since=since)


@pytest.fixture
async def make_env(scratch: Path) -> AsyncIterator[Callable[..., Any]]:
    made: list[tuple[TestApiServer, KubeClient, Publisher]] = []

    async def make(**server_options: Any) -> Env:
        server = TestApiServer(**server_options)
        await server.start()
        server.add_node(NODE)
        kube = await KubeClient.connect(server.write_kubeconfig(scratch / f"kubeconfig{len(made)}"))
        publisher = Publisher(kube, NODE, get_logger("publisher"))
        made.append((server, kube, publisher))
        return Env(server, publisher)

    yield make
    for server, kube, publisher in made:
        await publisher.stop()
        await kube.close()
        await server.close()


async def published(env: Env, inventory: Inventory) -> None:
    await asyncio.wait_for(env.publisher.publish(inventory.driver, inventory.build).wait(), scaled(10))


def in_sync(env: Env, inventory: Inventory) -> Callable[[], bool]:
    def check() -> bool:
        hidden = {n for n in inventory.taints if not env.publisher.features.taints}
        want = [d.name for d in inventory.devices if d.name not in hidden]
        have = env.slices(inventory.driver)
        generations = {s["spec"]["pool"]["generation"] for s in have}
        return (env.names(inventory.driver) == sorted(want) and len(generations) == 1
                and all(s["spec"]["pool"]["resourceSliceCount"] == len(have) for s in have))
    return check


async def test_pool_with_owner_labels_generation_and_count(make_env: Callable[..., Any]) -> None:
    env = await make_env()
    inventory = Inventory(GPU, devices(300))
    await published(env, inventory)
    slices = env.slices()
    assert_valid_slices(slices)
    assert [len(s["spec"]["devices"]) for s in slices] == [128, 128, 44]
    assert {(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in slices} == {(0, 3)}
    node_uid = env.server.get_object("nodes", NODE)["metadata"]["uid"]
    assert all(s["metadata"]["ownerReferences"][0]["uid"] == node_uid for s in slices)
    assert [s["metadata"]["name"][:6] for s in slices] == ["00000-", "00001-", "00002-"]
    assert all(s["metadata"]["labels"]["dra-agent.io/node"] == NODE for s in slices)


async def test_the_owner_is_added_once_the_node_can_be_read(make_env: Callable[..., Any],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("agent.slices.publisher.OWNER_RETRY", 0.3)
    env = await make_env()
    env.server.fail("GET", f"/api/v1/nodes/{NODE}", 403, times=None)  # until the RBAC rule is fixed
    inventory = Inventory(GPU, devices(3))
    with capture_logs() as logs:
        await published(env, inventory)
        await asyncio.sleep(scaled(0.5))  # a window of owner retries (each 0.3 s) that may not add it or log again
        assert not any(s["metadata"].get("ownerReferences") for s in env.slices()), "published without waiting"
        env.server.clear_faults()
        node_uid = env.server.get_object("nodes", NODE)["metadata"]["uid"]
        await wait_until(lambda: all(s["metadata"].get("ownerReferences", [{}])[0].get("uid") == node_uid
                                     for s in env.slices()), scaled(5))
    assert [e["event"] for e in logs].count("cannot read the Node; slices are published without an owner for now") == 1
    assert {s["spec"]["pool"]["generation"] for s in env.slices()} == {0}, "metadata only: no new generation"


async def test_counters_in_their_own_slices(make_env: Callable[..., Any]) -> None:
    env = await make_env()
    sets = [CounterSet(f"gpu-{i}-counters", {"memory": 80 << 30, "memory-slice-0": 1}) for i in range(10)]
    parts = [Device(name=f"gpu-{i}-part-{j}", consumes_counters=(
        CounterConsumption(f"gpu-{i}-counters", {"memory": 10 << 30, "memory-slice-0": 1}),))
        for i in range(10) for j in range(8)]
    inventory = Inventory(GPU, parts, sets)
    await published(env, inventory)
    slices = env.slices()
    assert_valid_slices(slices)
    counter_slices = [s for s in slices if "sharedCounters" in s["spec"]]
    assert [len(s["spec"]["sharedCounters"]) for s in counter_slices] == [8, 2]
    assert all("devices" not in s["spec"] for s in counter_slices)
    assert all(len(s["spec"]["devices"]) <= 64 for s in slices if "devices" in s["spec"])


async def test_outside_deletes_and_edits_are_repaired_quickly(make_env: Callable[..., Any]) -> None:
    env = await make_env()
    inventory = Inventory(GPU, devices(300))
    await published(env, inventory)
    repaired = in_sync(env, inventory)

    victim = env.slices()[1]["metadata"]["name"]
    started = time.monotonic()
    env.server.delete_object("resourceslices", victim)
    await wait_until(lambda: victim not in [s["metadata"]["name"] for s in env.slices()] and repaired(), scaled(2))
    one = time.monotonic() - started

    started = time.monotonic()
    for obj in env.slices():  # what the kubelet does when it starts
        env.server.delete_object("resourceslices", obj["metadata"]["name"])
    await wait_until(repaired, scaled(2))
    everything = time.monotonic() - started

    edited = env.slices()[0]
    edited["spec"]["devices"][3]["attributes"]["index"] = {"int": -7}
    env.server.put_object("resourceslices", edited)
    started = time.monotonic()
    await wait_until(lambda: env.slices()[0]["spec"]["devices"][3]["attributes"]["index"] == {"int": 3}, scaled(2))
    edit = time.monotonic() - started
    assert max(one, everything, edit) < scaled(2)


async def test_one_changed_device_costs_one_write(make_env: Callable[..., Any]) -> None:
    env = await make_env()
    inventory = Inventory(GPU, devices(300))
    await published(env, inventory)
    await asyncio.sleep(scaled(0.3))  # the publisher's own watch events have come in
    before = time.monotonic()
    inventory.devices[200] = Device(name="dev-0200", attributes={"index": 200, "note": "changed"},
                                    capacity={"memory": 80 << 30})
    env.publisher.publish(GPU, inventory.build)
    await wait_until(lambda: any(d.get("attributes", {}).get("note") for s in env.slices()
                                 for d in s["spec"]["devices"]), scaled(2))
    await asyncio.sleep(scaled(0.5))  # a window in which no other write may follow
    assert env.writes(before) == 1, "one PUT of the one slice that holds the device, no generation bump"
    assert {s["spec"]["pool"]["generation"] for s in env.slices()} == {0}


async def test_a_new_device_bumps_the_generation(make_env: Callable[..., Any]) -> None:
    env = await make_env()
    inventory = Inventory(GPU, devices(128))
    await published(env, inventory)
    inventory.devices.append(Device(name="dev-9999"))
    env.publisher.publish(GPU, inventory.build)
    await wait_until(in_sync(env, inventory), scaled(2))
    assert {s["spec"]["pool"]["generation"] for s in env.slices()} == {1}
    assert_valid_slices(env.slices())


@pytest.mark.slow
async def test_no_writes_at_idle(make_env: Callable[..., Any]) -> None:
    env = await make_env()
    inventories = [Inventory(GPU, devices(300)), Inventory(NIC, devices(64))]
    for inventory in inventories:
        await published(env, inventory)
    await asyncio.sleep(scaled(0.5))  # the publisher's own watch events have come in
    window = time.monotonic()
    await asyncio.sleep(scaled(60))  # the idle minute is the point of the test: kept, and stretched
    requests = env.server.find_requests(since=window)
    assert env.writes(window) == 0
    assert len(requests) == 0, f"at idle the agent only renews its watches (every 5 min or more): {requests}"


async def test_relist_after_an_expired_watch_writes_nothing(make_env: Callable[..., Any]) -> None:
    env = await make_env()
    inventory = Inventory(GPU, devices(10))
    await published(env, inventory)
    await asyncio.sleep(scaled(0.3))  # the publisher's own watch events have come in
    before = time.monotonic()
    # Other changes move the server's resourceVersion on; compacting its history then makes the one our
    # watch resumes from too old: the server answers 410 Gone and the publisher must list again.
    for i in range(3):
        env.server.add_node(f"other-{i}")
    env.server.compact()
    env.server.drop_watches()

    def lists() -> list[RequestRecord]:
        return [r for r in env.server.find_requests("GET", SLICES, since=before) if "watch" not in r.query]

    await wait_until(lambda: len(lists()) >= 1, scaled(5))
    await asyncio.sleep(scaled(0.5))  # a window in which the relist may not lead to a write
    assert env.writes(before) == 0


async def test_faults_converge_and_the_publisher_stays_up(make_env: Callable[..., Any]) -> None:
    env = await make_env()
    inventory = Inventory(GPU, devices(300))
    env.server.fail(["POST", "PUT"], SLICES + "*", 503, times=4)
    await published(env, inventory)
    assert in_sync(env, inventory)()

    env.server.fail("PUT", SLICES + "/*", 409, times=6)  # a storm of conflicts
    inventory.devices[0] = Device(name="dev-0000", attributes={"index": 0, "v": 2}, capacity={"memory": 1})
    env.publisher.publish(GPU, inventory.build)
    await wait_until(lambda: env.slices()[0]["spec"]["devices"][0]["attributes"].get("v") == {"int": 2}, scaled(10))

    env.server.drop_watches(reset=True)
    await asyncio.sleep(scaled(0.2))  # most likely while the publisher watches anew; before is repaired as well
    env.server.delete_object("resourceslices", env.slices()[2]["metadata"]["name"])
    await wait_until(in_sync(env, inventory), scaled(10))


async def test_many_changes_of_our_own_are_never_slowed_down(make_env: Callable[..., Any]) -> None:
    """A device flapping (a link going down and up) is as many desired changes: each is written at once."""
    env = await make_env()
    inventory = Inventory(GPU, devices(3))
    await published(env, inventory)
    with capture_logs() as logs:
        for flap in range(2 * 10 + 2):
            down = flap % 2 == 0
            inventory.taints = {"dev-0001": [{"key": f"{GPU}/link-down", "effect": "NoSchedule"}]} if down else {}
            env.publisher.publish(GPU, inventory.build)
            await wait_until(lambda d=down: bool(env.slices()[0]["spec"]["devices"][1].get("taints")) == d, scaled(2))
    assert not [e for e in logs if e["event"].startswith("slices keep changing")]


@pytest.mark.slow
async def test_a_writer_fighting_over_the_slices_slows_the_publisher_down(make_env: Callable[..., Any]) -> None:
    env = await make_env()
    inventory = Inventory(GPU, devices(3))
    await published(env, inventory)

    async def fight() -> None:  # another controller that keeps rewriting a device attribute
        while True:
            obj = env.slices()[0]
            if obj["spec"]["devices"][0]["attributes"].get("index") != {"int": 99}:
                obj["spec"]["devices"][0]["attributes"]["index"] = {"int": 99}
                env.server.put_object("resourceslices", obj)
            await asyncio.sleep(0.01)

    fighter = asyncio.create_task(fight())
    start = time.monotonic()
    try:
        with capture_logs() as logs:
            await wait_until(lambda: any(e["event"].startswith("slices keep changing") for e in logs), scaled(10))
            slowed_at = time.monotonic()
            await asyncio.sleep(scaled(3))  # the window of the backoff is the point of the test: kept, and stretched
    finally:
        fighter.cancel()
    # Ten repairs in quick succession, then a pause of a full backoff period instead of a hot loop.
    assert env.writes(since=start) <= 11
    assert env.writes(since=slowed_at + scaled(0.1)) == 0  # a write under way when the slowdown was logged
    await wait_until(in_sync(env, inventory), scaled(40))


@pytest.mark.slow
async def test_a_30_second_outage(make_env: Callable[..., Any]) -> None:
    env = await make_env()
    inventory = Inventory(GPU, devices(300))
    await published(env, inventory)
    await env.server.refuse_connections(30)  # listens again 30 s from now
    await asyncio.sleep(scaled(0.5))  # the publisher has most likely seen the outage (either way it recovers)
    inventory.devices.append(Device(name="dev-9999"))
    env.publisher.publish(GPU, inventory.build)
    await wait_until(lambda: env.server.listening, 30 + scaled(1))
    # After the outage, at most one backoff period (30 s, ±20 %) passes before the publisher is back.
    await wait_until(in_sync(env, inventory), 30 * 1.2 + scaled(1))
    assert all(not t.done() for p in env.publisher._pools.values() for t in p.tasks), "still running"


async def test_a_refused_slice_is_logged_and_other_pools_carry_on(make_env: Callable[..., Any]) -> None:
    env = await make_env()
    gpu, nic = Inventory(GPU, devices(3)), Inventory(NIC, devices(3))
    env.server.fail("POST", SLICES, 422, message="spec.devices[1].attributes: refused by policy", times=1)
    with capture_logs() as logs:
        gpu_done = env.publisher.publish(GPU, gpu.build)
        nic_done = env.publisher.publish(NIC, nic.build)
        await asyncio.wait([asyncio.ensure_future(gpu_done.wait()), asyncio.ensure_future(nic_done.wait())],
                           timeout=scaled(5), return_when=asyncio.FIRST_COMPLETED)
        await wait_until(lambda: any(e["event"].startswith("the API server refused a slice") for e in logs), scaled(5))
    refused = next(e for e in logs if e["event"].startswith("the API server refused a slice"))
    assert "refused by policy" in refused["error"]
    assert "(slice 00000-" in refused["error"] and "devices dev-0001)" in refused["error"]
    other = NIC if refused["driver"] == GPU else GPU
    assert env.publisher.published(other).is_set(), "the other pool was published meanwhile"
    assert not env.publisher.published(refused["driver"]).is_set()


async def test_dropped_taints_are_reported_once_and_tainted_devices_left_out(make_env: Callable[..., Any]) -> None:
    env = await make_env(disabled_gates={"DRADeviceTaints"})
    taint = {"key": "gpu.example.com/xid", "value": "79", "effect": "NoSchedule"}
    inventory = Inventory(GPU, devices(5), taints={"dev-0002": [taint]})
    with capture_logs() as logs:
        await published(env, inventory)
        await wait_until(lambda: env.names() == ["dev-0000", "dev-0001", "dev-0003", "dev-0004"], scaled(5))
        before = time.monotonic()
        await asyncio.sleep(scaled(1))  # a window in which no write may be made
    assert env.writes(before) == 0, "no write loop over the dropped field"
    dropped = [e for e in logs if "dropped a ResourceSlice field" in e["event"]]
    assert len(dropped) == 1 and dropped[0]["gate"] == "DRADeviceTaints" and dropped[0]["field"] == "taints"
    assert env.publisher.features == Features(taints=False, counters=True)


async def test_without_consumable_capacity_shareable_devices_are_published_whole(
        make_env: Callable[..., Any]) -> None:
    env = await make_env(disabled_gates={"DRAConsumableCapacity"})
    policy = CapacityPolicy(default=8 << 30, valid_range=CapacityRange(min=1 << 30, step=1 << 30))
    shared = [replace(d, allow_multiple_allocations=True, capacity_policies={"memory": policy}) for d in devices(3)]
    inventory = Inventory(GPU, shared)
    with capture_logs() as logs:
        await published(env, inventory)
        await wait_until(lambda: env.publisher.features.shares is False and all(
            "allowMultipleAllocations" not in d and "requestPolicy" not in d["capacity"]["memory"]
            for s in env.slices() for d in s["spec"]["devices"]), scaled(5))
        before = time.monotonic()
        await asyncio.sleep(scaled(1))  # a window in which no write may be made
    assert env.writes(before) == 0, "no write loop over the dropped fields"
    assert env.names() == ["dev-0000", "dev-0001", "dev-0002"], "published whole, not left out"
    dropped = [e for e in logs if "dropped a ResourceSlice field" in e["event"]]
    assert {(e["gate"], e["field"]) for e in dropped} == {("DRAConsumableCapacity", "allowMultipleAllocations"),
                                                          ("DRAConsumableCapacity", "requestPolicy")}
    assert all(e["fallback"] == "shareable devices are published whole: one claim at a time each" for e in dropped)


async def test_with_consumable_capacity_the_policy_is_stored(make_env: Callable[..., Any]) -> None:
    env = await make_env()
    policy = CapacityPolicy(default=2 << 30, valid_values=(1 << 30, 2 << 30))
    await published(env, Inventory(GPU, [replace(devices(1)[0], allow_multiple_allocations=True,
                                                  capacity_policies={"memory": policy})]))
    (device,) = env.slices()[0]["spec"]["devices"]
    assert device["allowMultipleAllocations"] is True
    assert device["capacity"]["memory"] == {"value": "80Gi",
                                            "requestPolicy": {"default": "2Gi", "validValues": ["1Gi", "2Gi"]}}
    assert env.publisher.features == Features()


async def test_dgx_h100_with_64_vfs_per_pf(scratch: Path) -> None:
    from bench.discover import profile_with_vfs
    from tests.support.agent_env import agent_in_process

    profile = profile_with_vfs(64, scratch)
    async with agent_in_process(scratch, str(profile)) as env:
        for driver in env.agent.drivers.values():
            if driver.active:
                await asyncio.wait_for(driver.published.wait(), scaled(10))
        slices = env.server.objects("resourceslices")
    assert_valid_slices(slices)
    by_driver: dict[str, list[dict[str, Any]]] = {}
    for obj in slices:
        by_driver.setdefault(obj["spec"]["driver"], []).append(obj)
    # 64 devices a slice: a device that turns unhealthy (tainted) then rewrites its own slice only.
    assert {d: len(s) for d, s in by_driver.items()} == {"gpu.nvidia.com": 1, "sriov.dra-agent.io": 8}
    for members in by_driver.values():
        assert {(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in members} == {
            (0, len(members))}
    assert sum(len(s["spec"]["devices"]) for s in by_driver["sriov.dra-agent.io"]) == 512



async def test_stopping_mid_publish_leaves_no_write_unawaited(make_env: Callable[..., Any]) -> None:
    """The agent may stop while slice writes are starting; every write it began is awaited or never made."""
    env = await make_env()
    publisher = Publisher(env.publisher._kube, NODE, get_logger("publisher"))
    stopping: list[asyncio.Task[None]] = []

    async def owner_then_stop() -> list[dict[str, Any]]:
        # The stop runs after the sync has started its create tasks and before their first step.
        stopping.append(asyncio.ensure_future(publisher.stop()))
        return []

    publisher._owner = owner_then_stop  # type: ignore[method-assign]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        publisher.publish(GPU, Inventory(GPU, devices(300)).build)
        await wait_until(lambda: bool(stopping), scaled(10))
        await stopping[0]
        gc.collect()
    assert not [str(w.message) for w in caught if "never awaited" in str(w.message)]
    assert env.slices() == [], "stopped before any write"


async def test_a_slow_first_list_never_makes_a_second_slice_for_one_index(make_env: Callable[..., Any]) -> None:
    """A restarted agent whose first list of its slices is slow (a busy API server) waits for it: publishing
    without knowing what the server holds would create a second slice of the same generation beside the one a
    previous run left, an invalid pool that no scheduler allocates from until one of them goes."""
    env = await make_env()
    inventory = Inventory(GPU, devices(4))
    await published(env, inventory)
    [before] = env.slices()
    await env.publisher.stop()
    restarted = Publisher(env.publisher._kube, NODE, get_logger("publisher"))
    env.server.delay("GET", SLICES, scaled(1.0), times=1, query=lambda q: "watch" not in q)
    since = time.monotonic()
    inventory.devices = devices(5)
    try:
        await asyncio.wait_for(restarted.publish(GPU, inventory.build).wait(), scaled(10))
        [after] = env.slices()
        assert after["metadata"]["name"] == before["metadata"]["name"]
        assert len(after["spec"]["devices"]) == 5
        assert env.server.count_requests("POST", SLICES, since=since) == 0
    finally:
        await restarted.stop()
