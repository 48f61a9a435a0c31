"""The event recorder (agent/events/recorder.py) against the test API server: what it writes, how repeats become one
Event's series, and how it behaves when the server fails, hangs or refuses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from agent.events.recorder import CONTROLLER, EventRecorder, Pacing
from agent.events.rules import Reference, is_micro_time
from agent.kube.client import KubeClient
from agent.metrics import Metrics
from agent.node.health_board import HEALTHY, DeviceState
from agent.slices.taints import TaintPolicy
from backends.contract import ClaimRef, Health
from simulator.apiserver.server import TestApiServer
from tests.support.agent_env import wait_until
from tests.support.timing import scaled

NODE, DRIVER, POD_UID = "node-a", "gpu.nvidia.com", "3f8e4c1a-5b2d-4e6f-8a9b-0c1d2e3f4a5b"
CLAIM = ClaimRef("0b6f0c52-9d6f-4d4e-9c1e-2a1f0d1f7e11", "team-a", "my-claim")
EVENTS = "/apis/events.k8s.io/v1/namespaces/*/events"
WAIT = scaled(10.0)
"""Seconds an outcome that needs no real-time wait may take on a loaded machine."""
# Retries without real waits worth the name; a heartbeat of 0 writes every repeat. The tests count requests, so
# a request must never time out: its timeout stretches with the time factor.
FAST = Pacing(heartbeat=0.0, backoff=0.01, backoff_max=0.05, request_timeout=scaled(2.0))


@dataclass
class Env:
    server: TestApiServer
    recorder: EventRecorder
    metrics: Metrics

    def events(self) -> list[dict[str, Any]]:
        return self.server.events()

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def make_env(scratch: Path) -> AsyncIterator[Callable[..., Any]]:
    made: list[tuple[TestApiServer, KubeClient, EventRecorder]] = []

    async def make(pacing: Pacing = FAST, pod_uid: str | None = POD_UID) -> Env:
        server = TestApiServer()
        await server.start()
        kube = await KubeClient.connect(server.write_kubeconfig(scratch / f"kubeconfig{len(made)}"))
        metrics = Metrics()
        recorder = EventRecorder(kube, NODE, pod_uid=pod_uid, metrics=metrics, pacing=pacing)
        recorder.start()
        made.append((server, kube, recorder))
        return Env(server, recorder, metrics)

    yield make
    for server, kube, recorder in made:
        await recorder.stop(timeout=scaled(0.5))
        await kube.close()
        await server.close()


def unhealthy(xid: str = "79") -> DeviceState:
    return DeviceState(Health.UNHEALTHY, "Xid 79: GPU has fallen off the bus", "xid", xid)


async def test_a_failed_prepare_is_a_warning_on_the_claim(make_env: Callable[..., Any]) -> None:
    env: Env = await make_env()
    env.recorder.prepare_failed(DRIVER, CLAIM, "device gpu-9 is not a device of driver gpu.nvidia.com")
    await wait_until(lambda: env.events(), timeout=WAIT)
    (written,) = env.events()
    assert written["metadata"]["namespace"] == "team-a"
    assert written["metadata"]["name"].startswith("my-claim.")
    assert int(written["metadata"]["name"].removeprefix("my-claim."), 16) > 0
    assert written["regarding"] == {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                    "name": "my-claim", "namespace": "team-a", "uid": CLAIM.uid}
    assert (written["type"], written["reason"], written["action"]) == ("Warning", "PrepareFailed", "Prepare")
    assert written["note"] == ("Driver gpu.nvidia.com could not prepare the claim on node node-a: device gpu-9 is "
                               "not a device of driver gpu.nvidia.com")
    assert written["reportingController"] == CONTROLLER
    assert written["reportingInstance"] == f"node-a/{POD_UID}"
    assert is_micro_time(written["eventTime"]) and "series" not in written
    assert env.sample("dra_agent_events_total", type="Warning", reason="PrepareFailed") == 1


async def test_a_long_error_is_cut_to_the_servers_limit(make_env: Callable[..., Any]) -> None:
    env: Env = await make_env()
    env.recorder.prepare_failed(DRIVER, CLAIM, "ü" * 2000)
    await wait_until(lambda: env.events(), timeout=WAIT)
    note = env.events()[0]["note"]
    assert len(note.encode()) <= 1024 and note.endswith("ü…")


async def test_a_repeated_failure_is_one_event_whose_series_grows(make_env: Callable[..., Any]) -> None:
    env: Env = await make_env()
    env.recorder.prepare_failed(DRIVER, CLAIM, "no such device")
    await wait_until(lambda: env.events(), timeout=WAIT)
    for expected in (2, 3, 4):
        env.recorder.prepare_failed(DRIVER, CLAIM, "no such device")
        await wait_until(lambda n=expected: env.events()[0].get("series", {}).get("count") == n, timeout=WAIT)
    (written,) = env.events()
    assert is_micro_time(written["series"]["lastObservedTime"])
    assert written["series"]["lastObservedTime"] >= written["eventTime"]
    assert env.server.count_requests("POST", EVENTS) == 1
    assert env.server.count_requests("PATCH", EVENTS + "/*") == 3
    # Another error on the same claim is another Event, not a repeat of the first.
    env.recorder.prepare_failed(DRIVER, CLAIM, "another error")
    await wait_until(lambda: len(env.events()) == 2, timeout=WAIT)


async def test_between_heartbeats_the_count_waits_and_the_shutdown_writes_it(make_env: Callable[..., Any]) -> None:
    env: Env = await make_env(Pacing(heartbeat=3600.0))
    env.recorder.prepare_failed(DRIVER, CLAIM, "no such device")
    await wait_until(lambda: env.events(), timeout=WAIT)
    env.recorder.prepare_failed(DRIVER, CLAIM, "no such device")  # the series begins: written at once
    await wait_until(lambda: env.events()[0].get("series", {}).get("count") == 2, timeout=WAIT)
    for _ in range(3):
        env.recorder.prepare_failed(DRIVER, CLAIM, "no such device")
    patches = env.server.count_requests("PATCH", EVENTS + "/*")
    await asyncio.sleep(scaled(0.2))  # a window: the writer holds the count back until the heartbeat
    assert env.events()[0]["series"]["count"] == 2 and env.server.count_requests("PATCH", EVENTS + "/*") == patches
    assert env.sample("dra_agent_events_pending") == 1
    await env.recorder.stop()
    assert env.events()[0]["series"]["count"] == 5
    assert env.sample("dra_agent_events_dropped_total", cause="stopped") == 0


async def test_device_health_transitions_are_node_events(make_env: Callable[..., Any]) -> None:
    env: Env = await make_env(pod_uid=None)
    policy = TaintPolicy()
    env.recorder.health_changed(DRIVER, "gpu-0", HEALTHY, unhealthy(), policy)
    env.recorder.health_changed(DRIVER, "gpu-0", unhealthy(), unhealthy("48"), policy)  # still unhealthy: none
    env.recorder.health_changed(DRIVER, "gpu-1", HEALTHY, DeviceState(Health.UNKNOWN, "not watched"), policy)
    env.recorder.health_changed(DRIVER, "gpu-0", unhealthy("48"), HEALTHY, policy)
    await wait_until(lambda: len(env.events()) == 2, timeout=WAIT)
    await env.recorder.stop()
    by_reason = {e["reason"]: e for e in env.events()}
    assert set(by_reason) == {"DeviceUnhealthy", "DeviceRecovered"}
    bad, good = by_reason["DeviceUnhealthy"], by_reason["DeviceRecovered"]
    assert bad["type"] == "Warning" and good["type"] == "Normal"
    assert bad["note"] == ("Device gpu-0 of driver gpu.nvidia.com is unhealthy: Xid 79: GPU has fallen off the "
                           "bus; tainted gpu.nvidia.com/xid=79:NoSchedule")
    assert good["note"] == "Device gpu-0 of driver gpu.nvidia.com is healthy again; taint gpu.nvidia.com/xid=48:" \
                           "NoSchedule removed"
    for written in (bad, good):
        assert written["metadata"]["namespace"] == "default" and written["metadata"]["name"].startswith("node-a.")
        assert written["regarding"] == {"apiVersion": "v1", "kind": "Node", "name": "node-a", "uid": "node-a"}
        assert written["reportingInstance"] == "node-a"


async def test_a_refused_checkpoint_names_the_file(make_env: Callable[..., Any]) -> None:
    env: Env = await make_env()
    path = Path("/var/lib/dra-agent/gpu.nvidia.com/checkpoint.journal")
    env.recorder.checkpoint_refused(path, "written by a newer agent (format 2, this agent reads 1)")
    await env.recorder.stop()
    (written,) = env.events()
    assert (written["type"], written["reason"], written["action"]) == ("Warning", "CheckpointRefused",
                                                                        "ReadCheckpoint")
    assert written["note"] == (f"Checkpoint {path} refused: written by a newer agent (format 2, this agent "
                               "reads 1)")


async def test_bad_fields_are_refused_to_the_caller(make_env: Callable[..., Any]) -> None:
    env: Env = await make_env()
    with pytest.raises(ValueError, match="reason"):
        env.recorder.node_event("Warning", "", "Act", "note")
    with pytest.raises(ValueError, match="Normal or Warning"):
        env.recorder.node_event("Critical", "Reason", "Act", "note")
    await env.recorder.stop()
    assert env.events() == []


# --- when the server does not take the writes ------------------------------------------------------


async def test_failing_writes_are_retried_logged_once_and_counted(make_env: Callable[..., Any]) -> None:
    env: Env = await make_env()
    fault = env.server.fail("POST", EVENTS, 500, times=None)
    with capture_logs() as logs:
        env.recorder.prepare_failed(DRIVER, CLAIM, "no such device")
        env.recorder.node_event("Warning", "CheckpointRefused", "ReadCheckpoint", "bad file")
        await wait_until(lambda: fault.hits >= 4, timeout=WAIT)
        env.server.clear_faults()
        await wait_until(lambda: len(env.events()) == 2, timeout=WAIT)
    (outage,) = [entry for entry in logs if "cannot write events" in entry["event"]]
    assert outage["log_level"] == "warning" and "injected fault" in outage["error"]
    (back,) = [entry for entry in logs if entry["event"] == "events are written again"]
    assert back["failed_attempts"] == fault.hits
    assert env.sample("dra_agent_api_errors_total", operation="create event") == fault.hits
    assert env.sample("dra_agent_events_dropped_total", cause="gave-up") == 0


async def test_a_write_is_given_up_after_its_attempts(make_env: Callable[..., Any]) -> None:
    env: Env = await make_env(Pacing(attempts=3, backoff=0.01, backoff_max=0.02))
    fault = env.server.fail("POST", EVENTS, 503, times=None)
    env.recorder.prepare_failed(DRIVER, CLAIM, "no such device")
    await wait_until(lambda: env.sample("dra_agent_events_dropped_total", cause="gave-up") == 1, timeout=WAIT)
    assert fault.hits == 3
    # A later occurrence tries again (the series counts both).
    env.server.clear_faults()
    env.recorder.prepare_failed(DRIVER, CLAIM, "no such device")
    await wait_until(lambda: env.events(), timeout=WAIT)
    assert env.events()[0]["series"]["count"] == 2


async def test_a_hanging_server_is_a_failure_after_the_request_timeout(make_env: Callable[..., Any]) -> None:
    # Long enough for a request the server answers, on a busy machine too; the held one hangs for an hour.
    env: Env = await make_env(Pacing(request_timeout=scaled(1.0), backoff=0.01, backoff_max=0.02))
    hang = env.server.delay("POST", EVENTS, 3600.0, times=1)
    env.recorder.prepare_failed(DRIVER, CLAIM, "no such device")
    await wait_until(lambda: env.events(), timeout=WAIT)  # the second attempt is not held
    assert hang.hits == 1 and env.sample("dra_agent_api_errors_total", operation="create event") == 1


async def test_refused_writes_are_not_retried(make_env: Callable[..., Any]) -> None:
    env: Env = await make_env()
    fault = env.server.fail("POST", EVENTS, 403, times=None, message='events.events.k8s.io is forbidden')
    with capture_logs() as logs:
        env.recorder.prepare_failed(DRIVER, CLAIM, "one")
        env.recorder.prepare_failed(DRIVER, CLAIM, "two")
        await wait_until(lambda: env.sample("dra_agent_events_dropped_total", cause="refused") == 2, timeout=WAIT)
    assert fault.hits == 2, "one attempt each"
    refused = [entry for entry in logs if entry["event"] == "the API server refused an event"]
    # The second refusal is logged at debug level (which the logging set up by an earlier test may filter out).
    assert [entry["log_level"] for entry in refused if entry["log_level"] != "debug"] == ["error"], \
        "the same refusal is told once"


async def test_no_event_is_written_about_a_claim_whose_reference_is_not_a_claims(make_env: Callable[..., Any]) -> None:
    env: Env = await make_env()
    refs = [ClaimRef(CLAIM.uid, "../../../../tmp/x-ns", "c"), ClaimRef(CLAIM.uid, "default", "/etc/x"),
            ClaimRef("../x", "default", "c")]
    with capture_logs() as logs:
        for ref in refs:
            env.recorder.prepare_failed(DRIVER, ref, "refused")
    env.recorder.prepare_failed(DRIVER, CLAIM, "no such device")  # written after any of the others would be
    await wait_until(lambda: env.events(), timeout=WAIT)
    assert [e["regarding"]["name"] for e in env.events()] == ["my-claim"]
    assert env.server.count_requests() == 1
    assert env.sample("dra_agent_events_dropped_total", cause="invalid-claim") == 3
    assert env.sample("dra_agent_events_total", type="Warning", reason="PrepareFailed") == 4
    told = [e["refused"] for e in logs if e["event"].startswith("claim not prepared; no Event about it")]
    assert told == ['claim namespace "../../../../tmp/x-ns" is not a valid namespace name',
                    'claim name "/etc/x" is not a valid object name', 'claim UID "../x" is not a Kubernetes UID']


async def test_an_event_whose_path_would_leave_its_object_is_not_sent(make_env: Callable[..., Any]) -> None:
    env: Env = await make_env()
    env.recorder.record(Reference("v1", "Node", "x", "../../x"), "Warning", "Test", "Test", "a note")
    await wait_until(lambda: env.sample("dra_agent_events_dropped_total", cause="refused") == 1, timeout=WAIT)
    assert env.server.requests == [], "refused before sending, and not tried again"


async def test_a_series_whose_event_is_gone_creates_it_again(make_env: Callable[..., Any]) -> None:
    env: Env = await make_env()
    env.recorder.prepare_failed(DRIVER, CLAIM, "no such device")
    await wait_until(lambda: env.events(), timeout=WAIT)
    name = env.events()[0]["metadata"]["name"]
    assert env.server.delete_object("events.events.k8s.io", name, "team-a")
    env.recorder.prepare_failed(DRIVER, CLAIM, "no such device")
    await wait_until(lambda: env.events(), timeout=WAIT)
    (again,) = env.events()
    assert again["metadata"]["name"] == name and again["series"]["count"] == 2
    assert env.server.count_requests("PATCH", EVENTS + "/*", status=404) == 1


async def test_a_create_that_got_through_unanswered_is_not_made_twice(make_env: Callable[..., Any]) -> None:
    env: Env = await make_env()
    env.recorder.prepare_failed(DRIVER, CLAIM, "no such device")
    await wait_until(lambda: env.events(), timeout=WAIT)
    # As if the answer to the create had been lost: the recorder does not know the server has the Event. (The
    # test server cannot commit a write and then drop its answer.)
    entry = next(iter(env.recorder._cache._entries.values()))
    entry.mark_written(0, 0.0)
    env.recorder.prepare_failed(DRIVER, CLAIM, "no such device")
    await wait_until(lambda: env.events()[0].get("series", {}).get("count") == 2, timeout=WAIT)
    assert env.server.count_requests("POST", EVENTS, status=409) == 1 and len(env.events()) == 1


async def test_the_queue_drops_its_oldest_beyond_its_bound(make_env: Callable[..., Any]) -> None:
    env: Env = await make_env(Pacing(queue=3, request_timeout=60.0))
    env.server.delay("POST", EVENTS, 3600.0)
    env.recorder.node_event("Warning", "Reason", "Act", "held")
    await wait_until(lambda: env.server.count_requests("POST", EVENTS) == 1, timeout=WAIT)
    for n in range(5):
        env.recorder.node_event("Warning", "Reason", "Act", f"queued {n}")
    assert env.sample("dra_agent_events_dropped_total", cause="queue-full") == 2
    assert [e.body["note"] for e in env.recorder._pending] == ["queued 2", "queued 3", "queued 4"]
    assert env.sample("dra_agent_events_pending") == 3
    async with asyncio.timeout(WAIT):  # the flush gives up at its deadline though the server still hangs
        await env.recorder.stop(timeout=scaled(0.2))
    assert env.sample("dra_agent_events_dropped_total", cause="stopped") == 4  # three queued, one in flight
    env.recorder.node_event("Warning", "Reason", "Act", "after the stop")  # ignored, no error
