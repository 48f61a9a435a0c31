"""The test API server, driven through the official ``kubernetes.aio`` client (and raw HTTP where the client
cannot say what a test needs), checked against the real server's behaviour."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from kubernetes.aio import client, config, watch
from kubernetes.aio.client.exceptions import ApiException

from simulator.apiserver.server import TestApiServer
from tests.support.kube_models import as_sent, list_meta, meta, name_of, spec_of, version_of
from tests.support.timing import scaled

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
DRIVER = "gpu.example.com"


def slice_body(
    name: str | None = None, *, node: str = "node-a", driver: str = DRIVER, devices: int = 1, **meta: Any
) -> client.V1ResourceSlice:
    metadata = client.V1ObjectMeta(name=name, **meta)
    return client.V1ResourceSlice(
        api_version="resource.k8s.io/v1",
        kind="ResourceSlice",
        metadata=metadata,
        spec=client.V1ResourceSliceSpec(
            driver=driver,
            node_name=node,
            pool=client.V1ResourcePool(name=node, generation=1, resource_slice_count=1),
            devices=[client.V1Device(name=f"gpu-{i}") for i in range(devices)],
        ),
    )


def wire(model: Any) -> dict[str, Any]:
    """A client model as the JSON it sends (``to_dict`` would give snake_case names)."""
    body = json.loads(model.to_json())
    assert isinstance(body, dict)
    return body


def status_of(error: ApiException) -> dict[str, Any]:
    assert error.body is not None, "an error response without a Status"
    body = json.loads(error.body)
    assert isinstance(body, dict)
    return body


@pytest.fixture
async def server() -> AsyncIterator[TestApiServer]:
    async with TestApiServer(bookmark_interval=0.3) as running:
        yield running


@pytest.fixture
async def api(server: TestApiServer, scratch: Path) -> AsyncIterator[client.ApiClient]:
    """A client configured the way the agent configures one: from a kubeconfig."""
    kubeconfig = server.write_kubeconfig(scratch / "kubeconfig")
    api_client = await config.new_client_from_config(config_file=str(kubeconfig))
    async with api_client:
        yield api_client


@pytest.fixture
def resources(api: client.ApiClient) -> client.ResourceV1Api:
    return client.ResourceV1Api(api)


@pytest.fixture
def core(api: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api)


@pytest.fixture
async def http(server: TestApiServer) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(server.url, headers=server.auth_headers) as raw:
        yield raw


def allocated(claim: client.ResourceV1ResourceClaim) -> list[client.V1DeviceRequestAllocationResult]:
    """The claim's allocated devices."""
    status = claim.status
    assert status and status.allocation and status.allocation.devices and status.allocation.devices.results
    return status.allocation.devices.results


async def next_events(stream: watch.Watch, count: int) -> list[tuple[str, str]]:
    """The next ``count`` events of a watch stream as (type, name); BOOKMARKs are skipped."""
    seen: list[tuple[str, str]] = []
    while len(seen) < count:
        event = await asyncio.wait_for(stream.__anext__(), scaled(5))
        if event["type"] != "BOOKMARK":
            seen.append((event["type"], event["raw_object"]["metadata"]["name"]))
    return seen


# --- discovery, auth ---------------------------------------------------------------------------


async def test_discovery_documents(api: client.ApiClient) -> None:
    assert (await client.VersionApi(api).get_code()).git_version.startswith("v1.")
    groups = await client.ApisApi(api).get_api_versions()
    assert "resource.k8s.io/v1" in {v.group_version for g in groups.groups for v in g.versions}
    listed = {r.name: r for r in (await client.ResourceV1Api(api).get_api_resources()).resources}
    assert {"resourceslices", "resourceclaims", "resourceclaims/status", "deviceclasses"} <= set(listed)
    assert not listed["resourceslices"].namespaced and listed["resourceclaims"].namespaced
    assert {"create", "get", "list", "watch", "update", "patch", "delete", "deletecollection"} <= set(
        listed["resourceslices"].verbs
    )
    core_names = {r.name for r in (await client.CoreV1Api(api).get_api_resources()).resources}
    assert {"nodes", "events"} <= core_names
    events_names = {r.name for r in (await client.EventsV1Api(api).get_api_resources()).resources}
    assert events_names == {"events"}


async def test_requests_without_the_token_are_unauthorized(server: TestApiServer) -> None:
    async with aiohttp.ClientSession(server.url) as anonymous:
        async with anonymous.get("/version") as response:
            assert response.status == 200  # public, as on a real cluster
        async with anonymous.get(SLICES) as response:
            assert response.status == 401
            assert (await response.json())["reason"] == "Unauthorized"


# --- ResourceSlices ----------------------------------------------------------------------------


async def test_slice_create_get_list_replace_patch_delete(resources: client.ResourceV1Api) -> None:
    created = await resources.create_resource_slice(slice_body("a-1", labels={"tier": "gold"}))
    await resources.create_resource_slice(slice_body("a-2", driver="nic.example.com"))
    await resources.create_resource_slice(slice_body("b-1", node="node-b"))
    assert meta(created).generation == 1 and meta(created).uid and meta(created).creation_timestamp

    fetched = await resources.read_resource_slice("a-1")
    assert spec_of(fetched).node_name == "node-a" and version_of(fetched) == version_of(created)

    async def names(*, field_selector: str | None = None, label_selector: str | None = None) -> list[str]:
        listed = await resources.list_resource_slice(field_selector=field_selector, label_selector=label_selector)
        assert int(version_of(listed)) >= int(version_of(created))
        return [name_of(s) for s in listed.items]

    assert await names(field_selector="spec.nodeName=node-a") == ["a-1", "a-2"]
    assert await names(field_selector=f"spec.nodeName==node-a,spec.driver={DRIVER}") == ["a-1"]
    assert await names(field_selector="spec.driver!=nic.example.com") == ["a-1", "b-1"]
    assert await names(field_selector="metadata.name=b-1") == ["b-1"]
    assert await names(label_selector="tier in (gold,silver)") == ["a-1"]
    assert await names(label_selector="!tier") == ["a-2", "b-1"]
    assert await names(label_selector="tier!=gold") == ["a-2", "b-1"]

    devices = spec_of(fetched).devices
    assert devices is not None
    devices.append(client.V1Device(name="gpu-9"))
    replaced = await resources.replace_resource_slice("a-1", fetched)
    assert meta(replaced).generation == 2
    assert int(version_of(replaced)) > int(version_of(fetched))
    unchanged = await resources.replace_resource_slice("a-1", replaced)
    assert version_of(unchanged) == version_of(replaced)  # a no-op is not written

    patched = await resources.patch_resource_slice("a-1", {"metadata": {"labels": {"tier": None, "x": "y"}}})
    assert meta(patched).labels == {"x": "y"} and meta(patched).generation == 2  # no spec change

    deleted = await resources.delete_resource_slice("a-1")
    assert name_of(deleted) == "a-1"
    with pytest.raises(ApiException) as missing:
        await resources.read_resource_slice("a-1")
    assert missing.value.status == 404


async def test_merge_patch_content_type(http: aiohttp.ClientSession, resources: client.ResourceV1Api) -> None:
    await resources.create_resource_slice(slice_body("m"))
    headers = {"Content-Type": "application/merge-patch+json"}
    async with http.patch(f"{SLICES}/m", data=json.dumps({"spec": {"devices": None}}), headers=headers) as response:
        assert response.status == 200
        assert "devices" not in (await response.json())["spec"]
        assert (await response.json())["metadata"]["generation"] == 2
    async with http.patch(f"{SLICES}/m", data="[]", headers={"Content-Type": "application/json-patch+json"}) as r:
        assert r.status == 415


async def test_generate_name_cuts_the_prefix_and_appends_five_characters(resources: client.ResourceV1Api) -> None:
    prefix = "00000-gpu.example.com-" + "n" * 60 + "-"
    created = await resources.create_resource_slice(slice_body(generate_name=prefix))
    name = name_of(created)
    assert len(name) == 63 and name.startswith(prefix[:58])
    assert re.fullmatch(r"[a-z0-9]{5}", name[58:])


async def test_invalid_slice_is_422_with_causes(resources: client.ResourceV1Api) -> None:
    with pytest.raises(ApiException) as error:
        await resources.create_resource_slice(slice_body("big", devices=129))
    status = status_of(error.value)
    assert error.value.status == 422 and status["reason"] == "Invalid"
    assert status["message"].startswith('ResourceSlice.resource.k8s.io "big" is invalid: spec.devices: ')
    assert "at most 128" in status["message"]
    assert status["details"]["causes"] == [
        {"reason": "FieldValueTooMany", "field": "spec.devices", "message": "must have at most 128 entries, got 129"}
    ]
    assert status["details"]["kind"] == "ResourceSlice" and status["details"]["group"] == "resource.k8s.io"

    current = await resources.create_resource_slice(slice_body("s"))
    spec_of(current).driver = "other.example.com"
    with pytest.raises(ApiException) as immutable:
        await resources.replace_resource_slice("s", current)
    assert immutable.value.status == 422
    assert {c["field"] for c in status_of(immutable.value)["details"]["causes"]} == {"spec.driver"}


async def test_fields_of_alpha_gates_are_dropped_as_by_a_1_37_server(http: aiohttp.ClientSession) -> None:
    """Their gates are off by default: the server drops the fields before validating, so bad values pass too."""
    body = wire(slice_body("lists"))
    body["spec"].update(partitionTypeAttribute="x", skipNodeOperations=["NodePrepareResources"])
    body["spec"]["devices"][0].update(
        attributes={"x": {"int": 1, "ints": [1, 2]}}, nodeAllocatableResources={"cpu": {}},
        consumesCounters=[{"counterSet": "s", "counters": {"c": {"value": "1"}}, "compatibilityGroups": ["-"]}])
    async with http.post(SLICES, json=body) as response:
        assert response.status == 201
        stored = (await response.json())["spec"]
    assert "partitionTypeAttribute" not in stored and "skipNodeOperations" not in stored
    assert stored["devices"][0] == {"name": "gpu-0", "attributes": {"x": {"int": 1}},
                                    "consumesCounters": [{"counterSet": "s", "counters": {"c": {"value": "1"}}}]}
    body["metadata"]["name"] = "list-only"
    body["spec"]["devices"][0]["attributes"] = {"x": {"ints": [1, 2]}}
    async with http.post(SLICES, json=body) as response:
        assert response.status == 422
        causes = (await response.json())["details"]["causes"]
        assert [c["field"] for c in causes] == ["spec.devices[0].attributes[x]"]


async def test_taint_time_added_is_defaulted(resources: client.ResourceV1Api) -> None:
    body = slice_body("t")
    sent = spec_of(body).devices
    assert sent
    sent[0].taints = [client.V1DeviceTaint(key="gpu.example.com/xid", effect="NoSchedule")]
    before = time.time()
    created = await resources.create_resource_slice(body)
    stored = spec_of(created).devices
    assert stored and stored[0].taints
    added = stored[0].taints[0].time_added
    assert added is not None and added.microsecond == 0 and before - 1 <= added.timestamp() <= time.time()


async def test_conflicts_and_not_found(resources: client.ResourceV1Api) -> None:
    first = await resources.create_resource_slice(slice_body("c"))
    with pytest.raises(ApiException) as exists:
        await resources.create_resource_slice(slice_body("c"))
    assert exists.value.status == 409 and status_of(exists.value)["reason"] == "AlreadyExists"

    await resources.patch_resource_slice("c", {"metadata": {"labels": {"bump": "1"}}})
    with pytest.raises(ApiException) as stale:
        await resources.replace_resource_slice("c", first)  # carries the old resourceVersion
    status = status_of(stale.value)
    assert stale.value.status == 409 and status["reason"] == "Conflict"
    assert status["message"] == (
        'Operation cannot be fulfilled on resourceslices.resource.k8s.io "c": the object has been modified; '
        "please apply your changes to the latest version and try again"
    )

    with pytest.raises(ApiException) as missing:
        await resources.read_resource_slice("nope")
    assert status_of(missing.value) == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": 'resourceslices.resource.k8s.io "nope" not found',
        "reason": "NotFound",
        "details": {"name": "nope", "group": "resource.k8s.io", "kind": "resourceslices"},
        "code": 404,
    }


async def test_delete_honours_preconditions(resources: client.ResourceV1Api) -> None:
    created = await resources.create_resource_slice(slice_body("p"))
    wrong = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid="not-the-uid"))
    with pytest.raises(ApiException) as error:
        await resources.delete_resource_slice("p", body=wrong)
    assert error.value.status == 409 and "Precondition failed: UID in precondition" in status_of(error.value)["message"]
    await resources.patch_resource_slice("p", {"metadata": {"labels": {"v": "2"}}})
    old_version = client.V1Preconditions(resource_version=version_of(created))
    with pytest.raises(ApiException) as stale:
        await resources.delete_resource_slice("p", body=client.V1DeleteOptions(preconditions=old_version))
    assert stale.value.status == 409
    right = client.V1Preconditions(uid=meta(created).uid)
    await resources.delete_resource_slice("p", body=client.V1DeleteOptions(preconditions=right))
    assert (await resources.list_resource_slice()).items == []


async def test_delete_collection_by_field_selector(server: TestApiServer, resources: client.ResourceV1Api) -> None:
    for name, node in (("a", "node-a"), ("b", "node-a"), ("c", "node-b")):
        await resources.create_resource_slice(slice_body(name, node=node))
    await resources.delete_collection_resource_slice(field_selector="spec.nodeName=node-a")
    assert [s["metadata"]["name"] for s in server.objects("resourceslices")] == ["c"]


async def test_unknown_field_selector_is_400(resources: client.ResourceV1Api) -> None:
    with pytest.raises(ApiException) as error:
        await resources.list_resource_slice(field_selector="spec.pool.name=x")
    assert error.value.status == 400
    assert status_of(error.value)["message"] == (
        "field label not supported for resource.k8s.io/v1, Kind=ResourceSlice: spec.pool.name"
    )


async def test_list_pages_with_limit_and_continue(resources: client.ResourceV1Api) -> None:
    for i in range(5):
        await resources.create_resource_slice(slice_body(f"s-{i}"))
    first = await resources.list_resource_slice(limit=2)
    assert [name_of(s) for s in first.items] == ["s-0", "s-1"] and list_meta(first).remaining_item_count == 3
    rest = await resources.list_resource_slice(limit=10, _continue=list_meta(first).var_continue)
    assert [name_of(s) for s in rest.items] == ["s-2", "s-3", "s-4"] and not list_meta(rest).var_continue


# --- watches -----------------------------------------------------------------------------------


async def test_watch_reports_matching_slices_only(resources: client.ResourceV1Api) -> None:
    start = version_of(await resources.list_resource_slice())
    async with watch.Watch() as w:
        stream = w.stream(resources.list_resource_slice, field_selector="spec.nodeName=node-a",
                          resource_version=start, timeout_seconds=10)  # fmt: skip
        await resources.create_resource_slice(slice_body("other", node="node-b"))
        mine = await resources.create_resource_slice(slice_body("mine"))
        await resources.patch_resource_slice("other", {"metadata": {"labels": {"x": "1"}}})
        await resources.patch_resource_slice("mine", {"metadata": {"labels": {"x": "1"}}})
        await resources.delete_resource_slice("other")
        await resources.delete_resource_slice("mine")
        events = await next_events(stream, 3)
    assert events == [("ADDED", "mine"), ("MODIFIED", "mine"), ("DELETED", "mine")]
    assert meta(mine).resource_version is not None


async def test_watch_sends_current_objects_then_selector_exits_as_deleted(resources: client.ResourceV1Api) -> None:
    await resources.create_resource_slice(slice_body("gold", labels={"tier": "gold"}))
    async with watch.Watch() as w:
        stream = w.stream(resources.list_resource_slice, label_selector="tier=gold", timeout_seconds=10)
        assert await next_events(stream, 1) == [("ADDED", "gold")]  # no resourceVersion: the current state first
        await resources.patch_resource_slice("gold", {"metadata": {"labels": {"tier": "tin"}}})
        assert await next_events(stream, 1) == [("DELETED", "gold")]  # it left the selector


async def test_watch_from_an_expired_resource_version_gets_410(
    server: TestApiServer, resources: client.ResourceV1Api, http: aiohttp.ClientSession
) -> None:
    old = version_of(await resources.create_resource_slice(slice_body("x")))
    await resources.patch_resource_slice("x", {"metadata": {"labels": {"y": "1"}}})
    server.compact()
    with pytest.raises(ApiException) as gone:
        async with watch.Watch() as w:
            async for _ in w.stream(resources.list_resource_slice, resource_version=old, timeout_seconds=5):
                pass
    assert gone.value.status == 410
    async with http.get(SLICES, params={"watch": "1", "resourceVersion": old}) as response:
        assert response.status == 200  # the error arrives as an event, as from the real server
        event = json.loads(await response.content.readline())
    assert event["type"] == "ERROR"
    assert {k: event["object"][k] for k in ("kind", "code", "reason")} == {"kind": "Status", "code": 410,
                                                                           "reason": "Expired"}  # fmt: skip
    assert event["object"]["message"].startswith(f"too old resource version: {old} (")


async def test_history_is_bounded() -> None:
    async with TestApiServer(history_size=2) as small:
        small.add_node("n1")
        first = small.resource_version
        for node in ("n2", "n3", "n4"):
            small.add_node(node)
        async with aiohttp.ClientSession(small.url, headers=small.auth_headers) as raw:
            params = {"watch": "true", "resourceVersion": first, "timeoutSeconds": "1"}
            async with raw.get("/api/v1/nodes", params=params) as response:
                assert json.loads(await response.content.readline())["object"]["code"] == 410
            params["resourceVersion"] = str(int(small.resource_version) - 2)
            async with raw.get("/api/v1/nodes", params=params) as response:
                replayed = [json.loads(line)["object"]["metadata"]["name"] async for line in response.content]
    assert replayed == ["n3", "n4"]


async def test_bookmarks_only_when_allowed(server: TestApiServer, http: aiohttp.ClientSession) -> None:
    server.add_node("n1")
    params = {"watch": "true", "resourceVersion": server.resource_version, "timeoutSeconds": "1"}
    async with http.get("/api/v1/nodes", params={**params, "allowWatchBookmarks": "true"}) as response:
        events = [json.loads(line) async for line in response.content]
    assert len(events) >= 2 and {e["type"] for e in events} == {"BOOKMARK"}  # every 0.3 s in this server
    assert events[-1]["object"]["metadata"]["resourceVersion"] == server.resource_version
    async with http.get("/api/v1/nodes", params=params) as response:
        assert [line async for line in response.content] == []


async def test_initial_events_end_with_a_marked_bookmark(server: TestApiServer, http: aiohttp.ClientSession) -> None:
    server.add_node("n1")
    params = {"watch": "true", "sendInitialEvents": "true", "resourceVersionMatch": "NotOlderThan",
              "allowWatchBookmarks": "true", "timeoutSeconds": "5"}  # fmt: skip
    async with http.get("/api/v1/nodes", params=params) as response:
        added, bookmark = [json.loads(await response.content.readline()) for _ in range(2)]
    assert (added["type"], added["object"]["metadata"]["name"]) == ("ADDED", "n1")
    assert bookmark["type"] == "BOOKMARK"
    assert bookmark["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}


async def test_store_helpers_notify_watchers(server: TestApiServer, resources: client.ResourceV1Api) -> None:
    # The client calls the resource.k8s.io/v1 claim model ResourceV1ResourceClaim (core/v1 has a ResourceClaim
    # too), so Watch cannot derive it from V1ResourceClaimList and must be told.
    async with watch.Watch(return_type="ResourceV1ResourceClaim") as w:
        stream = w.stream(resources.list_namespaced_resource_claim, "default", resource_version=server.resource_version,
                          timeout_seconds=10)  # fmt: skip
        server.put_claim({"metadata": {"name": "c1"}, "spec": {}})
        server.put_claim({"metadata": {"name": "c2", "namespace": "elsewhere"}, "spec": {}})
        server.put_claim({"metadata": {"name": "c1"}, "spec": {}, "status": {"reservedFor": []}})
        assert server.delete_object("resourceclaims", "c1", "default")
        assert not server.delete_object("resourceclaims", "c1", "default")
        events = await next_events(stream, 3)
    assert events == [("ADDED", "c1"), ("MODIFIED", "c1"), ("DELETED", "c1")]


async def test_bookmark_on_demand_through_the_client(server: TestApiServer, core: client.CoreV1Api) -> None:
    server.bookmark_interval = 3600
    server.add_node("n1")
    async with watch.Watch() as w:
        stream = w.stream(core.list_node, allow_watch_bookmarks=True, timeout_seconds=10)
        assert await next_events(stream, 1) == [("ADDED", "n1")]  # the watch is open
        assert server.send_bookmarks() == 1
        event = await asyncio.wait_for(stream.__anext__(), scaled(5))
    assert event["type"] == "BOOKMARK" and w.resource_version == server.resource_version


async def test_watch_ends_at_timeout_seconds(server: TestApiServer, core: client.CoreV1Api) -> None:
    started = time.monotonic()
    async with watch.Watch() as w:
        stream = w.stream(core.list_node, resource_version=server.resource_version, timeout_seconds=1)
        events = [event async for event in stream]
    assert events == [] and 0.9 <= time.monotonic() - started < 1 + scaled(2)


# --- other resources ---------------------------------------------------------------------------


async def test_nodes(server: TestApiServer, core: client.CoreV1Api) -> None:
    uid = server.add_node("node-a")
    server.add_node("node-b")
    assert meta(await core.read_node("node-a")).uid == uid
    assert [name_of(n) for n in (await core.list_node(field_selector="metadata.name=node-b")).items] == ["node-b"]
    with pytest.raises(ApiException) as missing:
        await core.read_node("node-c")
    assert status_of(missing.value)["message"] == 'nodes "node-c" not found'


async def test_claims(server: TestApiServer, resources: client.ResourceV1Api) -> None:
    allocation = {"devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-0"}]}}
    given_claim = {"metadata": {"name": "given", "namespace": "ns1"}, "spec": {}, "status": {"allocation": allocation}}
    server.put_claim(given_claim)
    given = await resources.read_namespaced_resource_claim("given", "ns1")
    assert allocated(given)[0].device == "gpu-0"

    body = {"metadata": {"name": "made"}, "spec": {}, "status": {"allocation": allocation}}
    made = await resources.create_namespaced_resource_claim("ns2", as_sent(client.ResourceV1ResourceClaim, body))
    assert made.status is None  # status is only written through /status
    updated = await resources.replace_namespaced_resource_claim_status(
        "made", "ns2", as_sent(client.ResourceV1ResourceClaim, {**wire(made), "status": {"allocation": allocation}})
    )
    assert allocated(updated)[0].pool == "node-a"
    everywhere = await resources.list_resource_claim_for_all_namespaces()
    assert [(meta(c).namespace, meta(c).name) for c in everywhere.items] == [("ns1", "given"), ("ns2", "made")]
    await resources.delete_namespaced_resource_claim("made", "ns2")
    assert [c["metadata"]["name"] for c in server.objects("resourceclaims")] == ["given"]
    stored = server.get_object("resourceclaims", "given", "ns1")
    assert stored is not None and stored["status"]["allocation"] == allocation
    assert server.get_object("resourceclaims", "made", "ns2") is None


async def test_device_classes(resources: client.ResourceV1Api) -> None:
    gpu_class = {"metadata": {"name": "gpu.example.com"}, "spec": {}}
    await resources.create_device_class(as_sent(client.V1DeviceClass, gpu_class))
    assert meta(await resources.read_device_class("gpu.example.com")).generation == 1
    assert [name_of(c) for c in (await resources.list_device_class()).items] == ["gpu.example.com"]
    await resources.delete_device_class("gpu.example.com")
    assert (await resources.list_device_class()).items == []


async def test_events_are_recorded(server: TestApiServer, api: client.ApiClient) -> None:
    core_event = {"metadata": {"generateName": "node-a."}, "involvedObject": {"kind": "Node", "name": "node-a"},
                  "reason": "DevicesPublished", "message": "8 GPUs", "type": "Normal"}  # fmt: skip
    await client.CoreV1Api(api).create_namespaced_event("default", as_sent(client.CoreV1Event, core_event))
    # Not a whole second: the client writes a datetime with no microseconds without the fraction, which the
    # server's MicroTime decoder refuses.
    new_event = {"metadata": {"name": "slice-sync"}, "eventTime": "2026-01-01T00:00:00.250000Z",
                 "regarding": {"kind": "Node", "name": "node-a"}, "reason": "SyncFailed", "action": "Publish",
                 "reportingController": "dra-agent", "reportingInstance": "node-a", "type": "Warning"}  # fmt: skip
    await client.EventsV1Api(api).create_namespaced_event("default", as_sent(client.EventsV1Event, new_event))
    assert [e.get("reason") for e in server.events()] == ["DevicesPublished", "SyncFailed"]
    listed = await client.CoreV1Api(api).list_namespaced_event("default", field_selector="reason=DevicesPublished")
    assert [e.message for e in listed.items] == ["8 GPUs"]


async def test_events_v1_are_validated_as_the_real_server_does(http: aiohttp.ClientSession) -> None:
    events = "/apis/events.k8s.io/v1/namespaces/default/events"
    good = {"metadata": {"name": "node-a.17f3"}, "eventTime": "2026-05-01T12:00:00.123456Z", "type": "Warning",
            "regarding": {"apiVersion": "v1", "kind": "Node", "name": "node-a", "uid": "node-a"},
            "reason": "DeviceUnhealthy", "action": "Taint", "note": "gpu-0 fell off the bus",
            "reportingController": "dra-agent.io/agent", "reportingInstance": "node-a"}  # fmt: skip

    async def create(**changes: Any) -> tuple[int, dict[str, Any]]:
        async with http.post(events, json={**good, **changes}) as response:
            return response.status, await response.json()

    status, body = await create(note="n" * 1025, metadata={"name": "too-long"})
    assert status == 422 and body["reason"] == "Invalid"
    assert body["details"]["causes"] == [{"reason": "FieldValueInvalid", "field": "message",
                                          "message": 'Invalid value: "": can have at most 1024 characters'}]
    status, body = await create(eventTime="2026-05-01T12:00:00Z", metadata={"name": "whole-seconds"})
    assert status == 400
    assert 'parsing time "2026-05-01T12:00:00Z" as "2006-01-02T15:04:05.000000Z07:00"' in body["message"]
    status, body = await create(metadata={"name": "elsewhere", "namespace": "team-a"})
    assert status == 400, "the namespace of the body must be the one of the path"
    async with http.post("/apis/events.k8s.io/v1/namespaces/team-a/events", json=good) as response:
        assert response.status == 422, "an Event about a Node lives in default"
        assert "involvedObject.namespace" in (await response.json())["message"]
    assert (await create())[0] == 201

    async def patch(change: dict[str, Any]) -> int:
        async with http.patch(f"{events}/node-a.17f3", json=change,
                              headers={"Content-Type": "application/merge-patch+json"}) as response:
            return response.status

    assert await patch({"series": {"count": 1, "lastObservedTime": "2026-05-01T12:01:00.000000Z"}}) == 422
    assert await patch({"series": {"count": 3}}) == 422, "lastObservedTime is required"
    assert await patch({"note": "another note"}) == 422, "immutable"
    # A patched Event the server cannot read is the patch's fault: 422 naming `patch`, not 400.
    assert await patch({"series": {"count": 3, "lastObservedTime": "2026-05-01T12:01:00"}}) == 422
    assert await patch({"series": {"count": 3, "lastObservedTime": "2026-05-01T12:01:00.000000Z"}}) == 200


# --- faults and the request log ------------------------------------------------------------------


async def test_failure_burst_then_success(server: TestApiServer, core: client.CoreV1Api) -> None:
    server.add_node("node-a")
    server.fail("GET", "/api/v1/nodes/*", 500, times=3)
    for _ in range(3):
        with pytest.raises(ApiException) as error:
            await core.read_node("node-a")
        assert error.value.status == 500 and status_of(error.value)["reason"] == "InternalError"
    assert name_of(await core.read_node("node-a")) == "node-a"
    assert [r.status for r in server.find_requests("GET", "/api/v1/nodes/node-a")] == [500, 500, 500, 200]


async def test_throttling_with_retry_after(server: TestApiServer, http: aiohttp.ClientSession) -> None:
    server.fail(("POST", "PUT"), f"{SLICES}*", 429, retry_after=2, query=lambda q: "dryRun" not in q)
    async with http.post(SLICES, params={"dryRun": "All"}, json=wire(slice_body("d"))) as response:
        assert response.status == 201  # the query predicate lets this one through
    async with http.post(SLICES, json=wire(slice_body("d"))) as response:
        assert response.status == 429 and response.headers["Retry-After"] == "2"
        assert (await response.json())["details"]["retryAfterSeconds"] == 2
    assert server.objects("resourceslices") == [] and server.count("resourceslices") == 0
    async with http.post(SLICES, json=wire(slice_body("d"))) as response:
        assert response.status == 201
    assert server.count("resourceslices") == 1


async def test_delay(server: TestApiServer, core: client.CoreV1Api) -> None:
    server.add_node("node-a")
    delay = scaled(0.3)  # longer than an undelayed request takes, on a busy machine too
    server.delay("GET", "/api/v1/nodes/node-a", delay, times=1)
    started = time.monotonic()
    await core.read_node("node-a")
    assert time.monotonic() - started >= delay
    started = time.monotonic()
    await core.read_node("node-a")
    assert time.monotonic() - started < delay


async def test_dropped_watch_ends_the_client_stream(server: TestApiServer, core: client.CoreV1Api) -> None:
    server.add_node("node-a")
    async with watch.Watch() as w:
        stream = w.stream(core.list_node, timeout_seconds=30)
        assert await next_events(stream, 1) == [("ADDED", "node-a")]
        assert server.drop_watches() == 1
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(stream.__anext__(), scaled(5))
    async with watch.Watch() as w:
        stream = w.stream(core.list_node, timeout_seconds=30)
        assert await next_events(stream, 1) == [("ADDED", "node-a")]
        server.drop_watches(reset=True)
        with pytest.raises(aiohttp.ClientPayloadError):
            await asyncio.wait_for(stream.__anext__(), scaled(5))


async def test_refused_connections_recover_on_the_same_port(server: TestApiServer, core: client.CoreV1Api) -> None:
    server.add_node("node-a")
    await core.read_node("node-a")
    port = server.port
    started = time.monotonic()
    await server.refuse_connections(0.5)
    with pytest.raises(aiohttp.ClientConnectionError):
        await core.read_node("node-a")
    while True:
        try:
            await core.read_node("node-a")
            break
        except aiohttp.ClientConnectionError:
            assert time.monotonic() - started < scaled(5)
            await asyncio.sleep(0.05)
    assert time.monotonic() - started >= 0.45 and server.port == port and server.listening


async def test_request_log_counts_writes(server: TestApiServer, resources: client.ResourceV1Api) -> None:
    await resources.create_resource_slice(slice_body("before"))
    since = time.monotonic()
    await resources.create_resource_slice(slice_body("w"))
    await resources.patch_resource_slice("w", {"metadata": {"labels": {"a": "b"}}})
    await resources.list_resource_slice()
    await resources.delete_resource_slice("w")
    assert server.writes("resourceslices", since=since) == 3
    assert server.writes("resourceslices") == 4
    assert server.count_requests("GET", SLICES, since=since) == 1


# --- transport and standalone ------------------------------------------------------------------


async def test_keep_alive_gets_are_not_held_back_by_nagle(server: TestApiServer, core: client.CoreV1Api) -> None:
    server.add_node("node-a")
    await core.read_node("node-a")
    timings = []
    for _ in range(50):
        started = time.perf_counter()
        await core.read_node("node-a")
        timings.append(time.perf_counter() - started)
    # Nagle plus delayed ACK would make it ~0.044: a busy machine may stretch the bound, but not that far.
    assert statistics.median(timings) < min(scaled(0.010), 0.030)
    states = server.connection_nodelay()
    assert states and all(states)


async def test_standalone_module_serves_until_sigterm(scratch: Path) -> None:
    kubeconfig = scratch / "standalone.kubeconfig"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "simulator.apiserver.server", "--port", "0", "--kubeconfig", str(kubeconfig),
        "--node", "node-a", stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        url = (await asyncio.wait_for(process.stdout.readline(), scaled(20))).decode().strip()
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url)
        assert yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"] == url
        async with aiohttp.ClientSession() as raw, raw.get(f"{url}/version") as response:
            assert (await response.json())["major"] == "1"
        api_client = await config.new_client_from_config(config_file=str(kubeconfig))
        async with api_client:
            assert name_of(await client.CoreV1Api(api_client).read_node("node-a")) == "node-a"
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), scaled(10)) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
