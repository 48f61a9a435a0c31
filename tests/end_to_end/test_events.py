"""Events through `dra-agent run`: a claim that cannot be prepared gets a Warning Event (one per failure, counted
in its series), a refused checkpoint leaves an Event on the Node before the process exits, and an API server that
fails or hangs on Event writes neither fails nor holds up a prepare."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.claims import checkpoint
from agent.events.recorder import CONTROLLER
from simulator.apiserver.server import TestApiServer
from tests.support.agent_env import (
    NODE,
    AgentProcess,
    ServedNode,
    allocate,
    served_node,
    settings_for,
    wait_until,
)
from tests.support.timing import scaled

GPU = "gpu.nvidia.com"
EVENTS = "/apis/events.k8s.io/v1/namespaces/*/events"
MISSING = "gpu-0000-ff-00-0"
NOT_OURS = f"device {MISSING} is not a device of driver {GPU} on this node"
WAIT = scaled(30.0)
"""Seconds an outcome may take on a loaded machine (an agent process starts, a retry comes round)."""


@pytest.fixture
async def node(scratch: Path) -> AsyncIterator[ServedNode]:
    async with served_node(scratch, wait=WAIT) as served:
        yield served




async def prepare_error(node: ServedNode, name: str, device: str = MISSING) -> str:
    claim = allocate(node.server, name, [("gpu", GPU, device)])
    return (await node.plugin.prepare([claim]))[claim.uid].error


async def test_a_failed_prepare_is_an_event_on_the_claim_and_repeats_are_its_series(node: ServedNode) -> None:
    claim = allocate(node.server, "broken", [("gpu", GPU, MISSING)])
    assert (await node.plugin.prepare([claim]))[claim.uid].error == NOT_OURS
    await wait_until(lambda: node.claim_events("broken"), timeout=WAIT)
    (event,) = node.claim_events("broken")
    assert event["regarding"] == {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "name": "broken",
                                  "namespace": "default", "uid": claim.uid}
    assert (event["type"], event["reason"], event["action"]) == ("Warning", "PrepareFailed", "Prepare")
    assert event["note"] == f"Driver {GPU} could not prepare the claim on node {NODE}: {NOT_OURS}"
    assert (event["reportingController"], event["reportingInstance"]) == (CONTROLLER, NODE)

    assert (await node.plugin.prepare([claim]))[claim.uid].error == NOT_OURS
    await wait_until(lambda: node.claim_events("broken")[0].get("series", {}).get("count") == 2, timeout=WAIT)
    # A third failure within the heartbeat is counted, and written when the agent stops at the latest.
    assert (await node.plugin.prepare([claim]))[claim.uid].error == NOT_OURS
    await node.agent.signal(signal.SIGTERM)
    assert await node.agent.wait(timeout=WAIT) == 0
    (event,) = node.claim_events("broken")
    assert event["series"]["count"] == 3
    assert node.server.count_requests("POST", EVENTS) == 1


async def test_failing_event_writes_leave_prepares_as_they_are(node: ServedNode) -> None:
    fault = node.server.fail("POST", EVENTS, 500, times=None)
    assert await prepare_error(node, "broken") == NOT_OURS
    assert await prepare_error(node, "fine", node.gpu()) == ""
    assert await prepare_error(node, "broken-too") == NOT_OURS
    await wait_until(lambda: fault.hits >= 3, timeout=WAIT)
    assert node.metric('dra_agent_api_errors_total{operation="create event"}') >= 3
    told = [line for line in node.agent.output().splitlines() if "cannot write events" in line]
    assert len(told) == 1, "one log line for the whole outage"
    node.server.clear_faults()
    await wait_until(lambda: node.claim_events("broken") and node.claim_events("broken-too"), timeout=WAIT)
    assert not node.claim_events("fine")
    await wait_until(lambda: "events are written again" in node.agent.output(), timeout=WAIT)


async def test_a_hanging_event_write_does_not_hold_up_prepares(node: ServedNode) -> None:
    node.server.delay("POST", EVENTS, 3600.0)
    assert await prepare_error(node, "broken") == NOT_OURS
    await wait_until(lambda: node.server.find_requests("POST", EVENTS), timeout=WAIT)
    (hanging,) = node.server.find_requests("POST", EVENTS)
    assert await prepare_error(node, "broken-too") == NOT_OURS
    assert await prepare_error(node, "fine", node.gpu()) == ""
    assert hanging.duration is None, "both prepares were answered while the Event write still hung"
    assert node.server.events() == []


async def test_a_refused_checkpoint_is_an_event_on_the_node(scratch: Path) -> None:
    async with TestApiServer() as server:
        server.add_node(NODE)
        settings = settings_for(scratch, server.write_kubeconfig(scratch / "kubeconfig"), "gke-g2-l4")
        journal = settings.state_dir / GPU / "checkpoint.journal"
        journal.parent.mkdir(parents=True)
        journal.write_bytes(checkpoint._line({"format": checkpoint.FORMAT + 1, "op": "removed", "uid": "u"}))
        agent = AgentProcess(settings)
        try:
            await agent.start()
            assert await agent.wait(timeout=WAIT) == 1
        finally:
            await agent.stop()
        (event,) = server.events()
        assert event["metadata"]["namespace"] == "default"
        assert event["regarding"] == {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE}
        assert (event["type"], event["reason"], event["action"]) == ("Warning", "CheckpointRefused", "ReadCheckpoint")
        assert event["note"].startswith(f"Checkpoint {journal} refused: checkpoint {journal} was written by a newer "
                                        f"dra-agent (format {checkpoint.FORMAT + 1}")
