"""Hostile claim references through `dra-agent run`: the kubelet's prepare and unprepare calls carry namespaces,
names and UIDs made to steer a URL (`..` segments, slashes, escapes, a fragment, NUL, look-alike characters, 300
characters). Each such claim gets its own error, no Event is written about it, and every request the agent makes in
the whole run (slices, node, claims, Events) goes to a well-formed path of its own object, read from the test API
server's log of the paths as they came on the wire."""

from __future__ import annotations

import re
import signal
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import quote, unquote

import pytest

from agent.kube.names import is_dns_label, is_dns_subdomain, is_driver_name
from backends.contract import ClaimRef
from simulator.apiserver.faults import RequestRecord
from tests.support.agent_env import (
    NODE,
    ServedNode,
    allocate,
    metrics_of,
    served_node,
    wait_until,
)
from tests.support.timing import scaled

GPU = "gpu.nvidia.com"
MISSING = "gpu-0000-ff-00-0"
WAIT = scaled(30.0)

HOSTILE = [
    "../../../../tmp/x-ns",
    "default/resourceclaims/x/../../../../../api/v1/nodes/x-node#",
    "/etc/x",
    "../../x",
    "%2F",
    "%2e%2e",
    "..",
    ".",
    "",
    "default\x00x",
    "a" * 300,
    "def\u0430ult",  # Cyrillic small a
    "default\uff0fx",  # fullwidth solidus
    "default\u2215x",  # division slash
    "x?watch=true",
    "x;y",
    "Default",
]
"""Namespaces, names and UIDs a claim reference must not carry into a request."""

CLAIMS = "resourceclaims"
SLICE_NAME = re.compile(r"[0-9a-f]{5,}-.*")


@pytest.fixture
async def node(scratch: Path) -> AsyncIterator[ServedNode]:
    async with served_node(scratch, wait=WAIT) as served:
        yield served


def hostile_references() -> list[tuple[ClaimRef, str]]:
    """Each hostile value as a namespace, as a name and as a UID (the other two sound), with the field the
    claim's error must name."""
    refs = []
    for value in HOSTILE:
        refs.append((ClaimRef(str(uuid.uuid4()), value, "claim"), "claim namespace"))
        refs.append((ClaimRef(str(uuid.uuid4()), "default", value), "claim name"))
        refs.append((ClaimRef(value, "default", "claim"), "claim UID"))
    return refs


def request_object(record: RequestRecord, drivers: set[str]) -> tuple[str, ...]:
    """The object a logged request is about, as (kind, namespace, name, subresource) parts; fails the test when its
    path is not one of the API paths the agent uses, a part is escaped other than in full, or names no valid
    object of its kind."""
    raw = record.raw_path
    where = f"{record.method} {raw}"
    assert raw.startswith("/"), where
    parts = raw[1:].split("/")
    segments = [unquote(p) for p in parts]
    assert all(p == quote(s, safe="") for p, s in zip(parts, segments, strict=True)), f"{where}: not fully escaped"
    match segments:
        case ["api", "v1", "nodes", name] if record.method == "GET":
            assert name == NODE, where
            return ("GET nodes",)
        case ["apis", "resource.k8s.io", "v1", "resourceslices"] if record.method in ("GET", "POST"):
            if record.method == "GET":
                node, _, driver = record.query.get("fieldSelector", "").partition(",spec.driver=")
                assert node == f"spec.nodeName={NODE}" and driver in drivers and is_driver_name(driver), record.query
            return (f"{record.method} resourceslices",)
        case ["apis", "resource.k8s.io", "v1", "resourceslices", name] if record.method in ("PUT", "DELETE"):
            assert is_dns_subdomain(name) and SLICE_NAME.fullmatch(name), f"{where}: not a slice name"
            return (f"{record.method} resourceslices", name)
        case ["apis", "resource.k8s.io", "v1", "namespaces", namespace, "resourceclaims", name, *status] \
                if (record.method, status) in (("GET", []), ("PATCH", ["status"])):
            assert is_dns_label(namespace) and is_dns_subdomain(name), f"{where}: not a claim's namespace and name"
            return (f"{record.method} resourceclaims" + "/status" * bool(status), namespace, name)
        case ["apis", "events.k8s.io", "v1", "namespaces", namespace, "events", *name] \
                if (record.method, len(name)) in (("POST", 0), ("PATCH", 1)):
            assert is_dns_label(namespace) and all(is_dns_subdomain(n) for n in name), f"{where}: not an Event's"
            return (f"{record.method} events", namespace, *name)
    raise AssertionError(f"{where}: not a path of an object the agent reads or writes")


async def test_hostile_claim_references_steer_no_request(node: ServedNode) -> None:
    gpu = next(s for s in node.server.objects("resourceslices") if s["spec"]["driver"] == GPU)["spec"]["devices"][0]
    fine = allocate(node.server, "fine", [("gpu", GPU, gpu["name"])])
    broken = allocate(node.server, "broken", [("gpu", GPU, MISSING)])
    hostile = hostile_references()
    refs = [ref for ref, _ in hostile]

    answers = await node.plugin.prepare(refs)  # one call with all of them, as a kubelet may batch claims
    for ref, field in hostile:
        assert answers[ref.uid].error.startswith(field), (ref, answers[ref.uid].error)
        assert not answers[ref.uid].devices
    for ref, field in hostile[:6]:  # the kubelet's usual call: one claim at a time
        assert (await node.plugin.prepare([ref]))[ref.uid].error.startswith(field)
    assert (await node.plugin.prepare([fine]))[fine.uid].error == ""
    assert (await node.plugin.prepare([broken]))[broken.uid].error.startswith(f"device {MISSING}")
    assert set(await node.plugin.unprepare(refs)) == {ref.uid for ref in refs}
    assert (await node.plugin.unprepare([fine]))[fine.uid] == ""

    # The Event about the sound claim is written after any about the hostile ones would have been (oldest first).
    await wait_until(lambda: node.server.events(), timeout=WAIT)
    metrics = metrics_of(node.metrics_address)
    print({k: v for k, v in metrics.items() if "events" in k})
    await node.agent.signal(signal.SIGTERM)
    assert await node.agent.wait(timeout=WAIT) == 0

    drivers = {s["spec"]["driver"] for s in node.server.objects("resourceslices")}
    objects, bad = [], []
    for record in node.server.requests:
        try:
            objects.append(request_object(record, drivers))
        except AssertionError as e:
            bad.append(str(e).splitlines()[0])
    assert not bad, "requests to paths not of their object:\n" + "\n".join(bad)
    claims = {o[1:] for o in objects if o[0].split()[1].startswith(CLAIMS)}
    assert claims == {("default", "fine"), ("default", "broken")}, claims
    events = {e["metadata"]["name"] for e in node.server.events()}
    assert all(o[2] in events for o in objects if o[0] == "PATCH events")
    by_kind = Counter(o[0] for o in objects)
    print("requests by kind:", ", ".join(f"{kind}: {n}" for kind, n in sorted(by_kind.items())))
    assert by_kind["GET resourceclaims"] == 2 and by_kind["POST events"] == 1

    assert [(e["metadata"]["namespace"], e["regarding"]["name"]) for e in node.server.events()] == \
        [("default", "broken")]
    reported = len(hostile) + 6 + 1  # the batch, the single calls, the sound claim
    assert metrics['dra_agent_events_total{reason="PrepareFailed",type="Warning"}'] == reported
    assert metrics['dra_agent_events_dropped_total{cause="invalid-claim"}'] == reported - 1
    assert "no Event about it" in node.agent.output()
