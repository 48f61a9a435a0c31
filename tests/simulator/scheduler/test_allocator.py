"""The allocator against the test API server, over HTTP with the real client: allocate, see other claims,
retry conflicting writes, release."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.kube.client import KubeClient
from simulator.apiserver.server import TestApiServer
from simulator.scheduler.allocation import Unallocatable
from simulator.scheduler.allocator import Allocator
from tests.support.agent_env import wait_until
from tests.support.allocation_env import claim, device_classes, discovered, exactly, example_claim
from tests.support.timing import scaled

NODE = "dgx-h100"


@pytest.fixture(scope="module")
def dgx() -> list[dict[str, Any]]:
    return discovered(NODE)


@pytest.fixture
async def server(dgx: list[dict[str, Any]]) -> AsyncIterator[TestApiServer]:
    async with TestApiServer() as running:
        for obj in dgx:
            running.put_object("resourceslices", obj)
        for obj in device_classes():
            running.put_object("deviceclasses", obj)
        running.add_node(NODE)
        yield running


@pytest.fixture
async def allocator(server: TestApiServer, scratch: Path) -> AsyncIterator[Allocator]:
    allocator = await Allocator.connect(server.write_kubeconfig(scratch / "kubeconfig"))
    yield allocator
    await allocator.close()


def gpu_claim(name: str, count: int = 1) -> dict[str, Any]:
    return claim(name, exactly("gpus", "gpu.nvidia.com", count=count))


def stored_allocation(server: TestApiServer, name: str) -> Any:
    stored = server.get_object("resourceclaims", name)
    assert stored is not None
    return (stored.get("status") or {}).get("allocation")


async def test_allocate_writes_the_status_and_the_next_claim_sees_it(server: TestApiServer,
                                                                      allocator: Allocator) -> None:  # fmt: skip
    server.put_claim(gpu_claim("first", 3))
    server.put_claim(gpu_claim("second", 5))
    first = await allocator.allocate("default", "first", node=NODE)
    assert stored_allocation(server, "first") == first.status
    second = await allocator.allocate("default", "second", node=NODE)
    assert {r.device for r in first.results}.isdisjoint(r.device for r in second.results)
    assert len(second.results) == 5
    assert server.count_requests("PUT", "*/resourceclaims/*/status") == 2
    server.put_claim(gpu_claim("third"))
    with pytest.raises(Unallocatable) as caught:
        await allocator.allocate("default", "third", node=NODE)
    assert caught.value.reasons[0].startswith("request gpus: needs 1 device(s); 8 match its class and selectors, "
                                              "0 available (8 in use by default/first, default/second)")
    assert stored_allocation(server, "third") is None
    await allocator.deallocate("default", "first")
    assert stored_allocation(server, "first") is None
    third = await allocator.allocate("default", "third", node=NODE)
    assert [r.device for r in third.results] == [first.results[0].device]


async def test_an_example_claim_round_trip(server: TestApiServer, allocator: Allocator) -> None:
    server.put_claim(example_claim("all-gpus"))
    allocation = await allocator.allocate("default", "all-gpus", node=NODE)
    assert len(allocation.results) == 8
    assert stored_allocation(server, "all-gpus")["devices"]["results"][0] == {
        "request": "gpus", "driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-0000-18-00-0"}


async def test_a_conflicting_write_is_redone_from_fresh_reads(server: TestApiServer, allocator: Allocator) -> None:
    server.put_claim(gpu_claim("mine"))
    server.fail("PUT", "*/resourceclaims/mine/status", 409, times=2)
    allocation = await allocator.allocate("default", "mine", node=NODE)
    assert stored_allocation(server, "mine") == allocation.status
    assert server.count_requests("PUT", "*/resourceclaims/mine/status") == 3
    assert server.count_requests("GET", "*/resourceclaims/mine") == 3


async def test_a_claim_changed_under_the_allocator_is_not_overwritten(server: TestApiServer, scratch: Path) -> None:
    server.put_claim(gpu_claim("mine"))
    kube = await KubeClient.connect(server.write_kubeconfig(scratch / "kubeconfig"))
    try:
        allocator = Allocator(kube)
        # The claim changes between the allocator's read and its write: the stale write gets 409.
        classes = "/apis/resource.k8s.io/v1/deviceclasses"
        server.delay("GET", classes, scaled(0.2), times=1)  # held while the claim changes
        changed = gpu_claim("mine")
        changed["metadata"]["labels"] = {"changed": "yes"}

        async def change() -> None:
            await wait_until(lambda: server.find_requests("GET", classes))  # the claim has been read
            server.put_claim(changed)

        allocation, _ = await asyncio.gather(allocator.allocate("default", "mine", node=NODE), change())
        stored = server.get_object("resourceclaims", "mine")
        assert stored is not None and stored["metadata"]["labels"] == {"changed": "yes"}
        assert stored["status"]["allocation"] == allocation.status
        assert server.count_requests("PUT", "*/resourceclaims/mine/status", status=409) == 1
        await allocator.close()  # the connection was handed in: it stays open
        assert await kube.get_claim("default", "mine") is not None
    finally:
        await kube.close()


async def test_an_allocated_claim_is_kept_and_a_missing_one_is_refused(server: TestApiServer,
                                                                       allocator: Allocator) -> None:  # fmt: skip
    server.put_claim(gpu_claim("mine"))
    first = await allocator.allocate("default", "mine", node=NODE)
    again = await allocator.allocate("default", "mine", node=NODE)
    assert again.status == first.status
    assert again.results == first.results
    assert server.count_requests("PUT", "*/status") == 1
    with pytest.raises(Unallocatable, match="resourceclaim default/absent does not exist"):
        await allocator.allocate("default", "absent", node=NODE)
    await allocator.deallocate("default", "absent")  # nothing to release: no error
    await allocator.deallocate("default", "mine")
    await allocator.deallocate("default", "mine")
    assert server.count_requests("PUT", "*/status") == 2


async def test_node_labels_from_the_api_server_decide_node_selectors(server: TestApiServer,
                                                                     allocator: Allocator) -> None:  # fmt: skip
    shared = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "rack-a"},
              "spec": {"driver": "gpu.nvidia.com", "pool": {"name": "rack-a", "generation": 0, "resourceSliceCount": 1},
                       "nodeSelector": {"nodeSelectorTerms": [{"matchExpressions": [
                           {"key": "rack", "operator": "In", "values": ["a"]}]}]},
                       "devices": [{"name": "remote", "attributes": {"type": {"string": "gpu"}}}]}}  # fmt: skip
    server.put_object("resourceslices", shared)
    selector = 'device.attributes["gpu.nvidia.com"].type == "gpu" && !("uuid" in device.attributes["gpu.nvidia.com"])'
    server.put_claim(claim("remote", exactly("gpu", "gpu.nvidia.com", selector)))
    with pytest.raises(Unallocatable):
        await allocator.allocate("default", "remote", node=NODE)
    server.add_node(NODE, labels={"rack": "a"})
    allocation = await allocator.allocate("default", "remote", node=NODE)
    assert [r.device for r in allocation.results] == ["remote"]
    assert allocation.status["nodeSelector"]["nodeSelectorTerms"][0]["matchExpressions"][0]["key"] == "rack"
