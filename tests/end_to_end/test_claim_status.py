"""A claim's status.devices through `dra-agent run`: a prepared device gets a Ready entry, another driver's entry on
the same claim survives ours coming and going, unprepare removes ours, an API server failing the writes neither
fails nor holds up a prepare (the entry comes once it recovers), a restarted agent applies the status again, and
`--no-claim-status` writes nothing."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from simulator.apiserver.resources import RESOURCE_CLAIMS
from tests.support.agent_env import (
    NODE,
    AgentProcess,
    ServedNode,
    allocate,
    plugin_after_restart,
    served_node,
    wait_until,
)
from tests.support.timing import scaled

GPU, OTHER = "gpu.nvidia.com", "net.example.com"
STATUS = "/apis/resource.k8s.io/v1/namespaces/*/resourceclaims/*/status"
WAIT = scaled(30.0)
"""Seconds an outcome may take on a loaded machine (an agent process starts, a retry comes round)."""


def entries(node: ServedNode, claim: str) -> list[dict[str, Any]]:
    """The claim's `status.devices` entries, as the test API server stores them."""
    obj = node.server.get_object("resourceclaims", claim) or {}
    found: list[dict[str, Any]] = (obj.get("status") or {}).get("devices") or []
    return found


def drivers(node: ServedNode, claim: str) -> list[str]:
    return [e["driver"] for e in entries(node, claim)]


def other_driver_applies(node: ServedNode, claim: str, entries: list[dict[str, Any]]) -> None:
    """Another DRA driver's server-side apply of its entries on the claim."""
    obj = node.server.get_object("resourceclaims", claim)
    assert obj is not None
    node.server.store.apply_status(RESOURCE_CLAIMS, "default", claim, {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": claim},
        "status": {"devices": entries}}, OTHER, force=True)


def ready(entry: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in entry.get("conditions") or ())


async def until(predicate: Callable[[], object]) -> None:
    await wait_until(predicate, timeout=WAIT)


async def test_prepare_writes_our_entry_beside_another_drivers_and_unprepare_removes_it(scratch: Path) -> None:
    async with served_node(scratch, wait=WAIT) as node:
        gpu = node.gpu()
        claim = allocate(node.server, "mixed", [("gpu", GPU, gpu), ("nic", OTHER, "eth-1")])
        theirs = {"driver": OTHER, "pool": NODE, "device": "eth-1", "networkData": {"interfaceName": "eth1"},
                  "conditions": [{"type": "Ready", "status": "True", "reason": "NetworkReady", "message": "",
                                  "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
        other_driver_applies(node, "mixed", [theirs])

        assert (await node.plugin.prepare_or_raise([claim]))[claim.uid].devices
        await until(lambda: drivers(node, "mixed") == [OTHER, GPU])
        ours = entries(node, "mixed")[1]
        assert (ours["pool"], ours["device"]) == (NODE, gpu) and ready(ours)
        assert ours["conditions"][0]["reason"] == "DevicePrepared"
        assert isinstance(ours.get("data", {}), dict), "the device's facts, when its backend gives any"
        assert entries(node, "mixed")[0] == theirs
        stored = node.server.get_object("resourceclaims", "mixed") or {}
        assert {m["manager"] for m in stored["metadata"]["managedFields"]} == {OTHER, GPU}

        await node.plugin.unprepare_or_raise([claim])
        await until(lambda: drivers(node, "mixed") == [OTHER])
        assert entries(node, "mixed") == [theirs]
        assert node.metric(f'dra_agent_claim_status_writes_total{{driver="{GPU}",outcome="ok"}}') >= 2


async def test_failing_status_writes_neither_fail_nor_hold_up_prepares(scratch: Path) -> None:
    async with served_node(scratch, wait=WAIT) as node:
        gpu = node.gpu()
        hang = node.server.delay("PATCH", STATUS, 3600.0)
        slow = allocate(node.server, "slow", [("gpu", GPU, gpu)])
        assert (await node.plugin.prepare_or_raise([slow]))[slow.uid].devices
        await until(lambda: node.server.find_requests("PATCH", STATUS))
        (hanging,) = node.server.find_requests("PATCH", STATUS)
        await node.plugin.unprepare_or_raise([slow])
        assert (await node.plugin.prepare_or_raise([slow]))[slow.uid].devices
        assert hanging.duration is None, "prepare and unprepare were answered while the status write still hung"
        hang.times = hang.hits  # no more hanging

        node.server.clear_requests()
        fault = node.server.fail("PATCH", STATUS, 500, times=3)
        claim = allocate(node.server, "failing", [("gpu", GPU, gpu)])
        await node.plugin.unprepare_or_raise([slow])
        assert (await node.plugin.prepare_or_raise([claim]))[claim.uid].devices
        await until(lambda: fault.exhausted)
        await until(lambda: drivers(node, "failing") == [GPU] and ready(entries(node, "failing")[0]))
        assert node.metric(f'dra_agent_claim_status_writes_total{{driver="{GPU}",outcome="error"}}') >= 3
        await until(lambda: "cannot write the claim's status; trying again" in node.agent.output())


async def test_a_restarted_agent_applies_the_status_again(scratch: Path) -> None:
    async with served_node(scratch, wait=WAIT) as node:
        claim = allocate(node.server, "kept", [("gpu", GPU, node.gpu())])
        assert (await node.plugin.prepare_or_raise([claim]))[claim.uid].devices
        await until(lambda: drivers(node, "kept") == [GPU])
        since = entries(node, "kept")[0]["conditions"][0]["lastTransitionTime"]
        await node.agent.stop()
        node.server.clear_requests()
        second = AgentProcess(node.agent.settings)
        try:
            await second.start()
            await plugin_after_restart(node.kubelet, node.plugin)
            await until(lambda: node.server.find_requests("PATCH", STATUS, status=200))
            assert entries(node, "kept")[0]["conditions"][0]["lastTransitionTime"] == since
            # An entry lost meanwhile comes back at the next start.
            obj = node.server.get_object("resourceclaims", "kept")
            assert obj is not None
            del obj["status"]["devices"]
            del obj["metadata"]["managedFields"]
            node.server.put_claim(obj)
            await second.stop()
            third = AgentProcess(node.agent.settings)
            await third.start()
            try:
                await until(lambda: drivers(node, "kept") == [GPU])
            finally:
                await third.stop()
        finally:
            await second.stop()


async def test_no_claim_status_writes_nothing(scratch: Path) -> None:
    async with served_node(scratch, wait=WAIT, claim_status=False) as node:
        claim = allocate(node.server, "quiet", [("gpu", GPU, node.gpu())])
        assert (await node.plugin.prepare_or_raise([claim]))[claim.uid].devices
        await node.plugin.unprepare_or_raise([claim])
        assert (await node.plugin.prepare_or_raise([claim]))[claim.uid].devices
        assert node.server.find_requests("PATCH", STATUS) == [] and entries(node, "quiet") == []


async def test_an_unprepare_just_before_a_stop_still_removes_the_entry(scratch: Path) -> None:
    async with served_node(scratch, wait=WAIT) as node:
        claim = allocate(node.server, "last", [("gpu", GPU, node.gpu())])
        assert (await node.plugin.prepare_or_raise([claim]))[claim.uid].devices
        await until(lambda: drivers(node, "last") == [GPU])
        node.server.fail("PATCH", STATUS, 503, times=1)  # the removal's first try fails: the retry is the stop's
        await node.plugin.unprepare_or_raise([claim])
        await node.agent.signal(signal.SIGTERM)
        assert await node.agent.wait(timeout=WAIT) == 0
        assert entries(node, "last") == []
