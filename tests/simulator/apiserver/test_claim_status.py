"""The test API server's `resourceclaims/<name>/status` as the real server serves it for KEP-4817: server-side
apply of `status.devices` per field manager (two drivers never clobber each other's entries), its managedFields,
the validation of every entry with the real field paths, entries dropped with their device's allocation, and the
per-driver permission a write changing a driver's entries needs (which the agent's writer counts as refused)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import structlog
import yaml

from agent.claims.records import ClaimRecord, DeviceRecord
from agent.claims.status_writer import Backoff, ClaimStatusWriter
from agent.kube.client import KubeClient, KubeError
from agent.kube.paths import ApiPath
from agent.metrics import Metrics
from backends.contract import ClaimRef
from simulator.apiserver.authorization import AGENT_USER, Caller
from simulator.apiserver.objects import drop_deallocated_status_devices
from simulator.apiserver.server import TestApiServer
from tests.support.timing import scaled

NODE = "node-a"
GPU, NIC = "gpu.example.com", "nic.example.com"
SHARE = "2f1c7a52-8e0b-4c59-9d1f-6a4b3c2d1e0f"
# The claim the tests write, and its status, as paths a client sends.
CLAIM = ApiPath("/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/claim")
CLAIM_STATUS = ApiPath(f"{CLAIM}/status")
WHEN = "2026-11-26T10:00:00Z"


def entry(driver: str, device: str, **extra: Any) -> dict[str, Any]:
    return {"driver": driver, "pool": NODE, "device": device,
            "conditions": [{"type": "Ready", "status": "True", "reason": "DevicePrepared", "message": "",
                            "lastTransitionTime": WHEN}], **extra}


def body(uid: str, *entries: dict[str, Any], name: str = "claim") -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default", "uid": uid}, "status": {"devices": list(entries)}}


class Api:
    def __init__(self, server: TestApiServer, kube: KubeClient) -> None:
        self.server, self.kube = server, kube
        self.uid = str(uuid.uuid4())
        server.put_claim({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "claim", "namespace": "default", "uid": self.uid},
            "spec": {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": "x"}}]}},
            "status": {"allocation": {"devices": {"results": [
                {"request": "r", "driver": GPU, "pool": NODE, "device": "gpu-0"},
                {"request": "r", "driver": GPU, "pool": NODE, "device": "gpu-1"},
                {"request": "r", "driver": GPU, "pool": NODE, "device": "gpu-2", "shareID": SHARE},
                {"request": "r", "driver": NIC, "pool": NODE, "device": "vf-0"},
            ]}}},
        })

    async def apply(self, manager: str, *entries: dict[str, Any], force: bool = True) -> dict[str, Any]:
        query = [("fieldManager", manager)] + ([("force", "true")] if force else [])
        result: dict[str, Any] = await self.kube.request(
            "PATCH", CLAIM_STATUS, body=body(self.uid, *entries), query=query,
            content_type="application/apply-patch+yaml")
        return result

    def claim(self) -> dict[str, Any]:
        claim = self.server.get_object("resourceclaims", "claim")
        assert claim is not None
        return claim

    def devices(self) -> list[tuple[str, str]]:
        return [(e["driver"], e["device"]) for e in self.claim()["status"].get("devices", [])]


@pytest.fixture
async def api(scratch: Path) -> AsyncIterator[Api]:
    async with TestApiServer() as server:
        kube = await KubeClient.connect(server.write_kubeconfig(scratch / "kubeconfig"))
        try:
            yield Api(server, kube)
        finally:
            await kube.close()


async def test_two_managers_keep_their_own_entries(api: Api) -> None:
    await api.apply(GPU, entry(GPU, "gpu-0"), entry(GPU, "gpu-1"))
    await api.apply(NIC, entry(NIC, "vf-0", networkData={"interfaceName": "net1", "ips": ["192.0.2.5/24"]}))
    assert api.devices() == [(GPU, "gpu-0"), (GPU, "gpu-1"), (NIC, "vf-0")]
    # GPU's new set drops gpu-1 and changes gpu-0; the NIC's entry is not GPU's to remove.
    await api.apply(GPU, entry(GPU, "gpu-0", data={"uuid": "GPU-1"}))
    assert api.devices() == [(GPU, "gpu-0"), (NIC, "vf-0")]
    assert api.claim()["status"]["devices"][0]["data"] == {"uuid": "GPU-1"}
    await api.apply(GPU)
    assert api.devices() == [(NIC, "vf-0")]
    managers = [(m["manager"], m["operation"], m["subresource"]) for m in api.claim()["metadata"]["managedFields"]]
    assert managers == [(NIC, "Apply", "status")], "a manager that owns nothing is no longer listed"
    await api.apply(NIC)
    assert "devices" not in api.claim()["status"]
    assert "managedFields" not in api.claim()["metadata"]
    assert api.claim()["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-0"


async def test_managed_fields_are_recorded_as_the_real_server_does(api: Api) -> None:
    await api.apply(GPU, entry(GPU, "gpu-2", shareID=SHARE, data={"a": 1},
                               networkData={"interfaceName": "eth1", "hardwareAddress": "aa:bb"}))
    (managed,) = api.claim()["metadata"]["managedFields"]
    assert {k: managed[k] for k in ("manager", "operation", "apiVersion", "fieldsType", "subresource")} == {
        "manager": GPU, "operation": "Apply", "apiVersion": "resource.k8s.io/v1", "fieldsType": "FieldsV1",
        "subresource": "status"}
    key = 'k:{"device":"gpu-2","driver":"gpu.example.com","pool":"node-a","shareID":"' + SHARE + '"}'
    assert managed["fieldsV1"] == {"f:status": {"f:devices": {key: {
        ".": {}, "f:conditions": {'k:{"type":"Ready"}': {
            ".": {}, "f:lastTransitionTime": {}, "f:message": {}, "f:reason": {}, "f:status": {}, "f:type": {}}},
        "f:data": {}, "f:device": {}, "f:driver": {},
        "f:networkData": {".": {}, "f:hardwareAddress": {}, "f:interfaceName": {}}, "f:pool": {},
        "f:shareID": {}}}}}
    before = api.claim()["metadata"]["resourceVersion"]
    await api.apply(GPU, entry(GPU, "gpu-2", shareID=SHARE, data={"a": 1},
                               networkData={"interfaceName": "eth1", "hardwareAddress": "aa:bb"}))
    assert api.claim()["metadata"]["resourceVersion"] == before, "the same apply again changes nothing"


async def test_taking_another_managers_entry_needs_force(api: Api) -> None:
    await api.apply("other", entry(GPU, "gpu-0"))
    with pytest.raises(KubeError) as refused:
        await api.apply(GPU, entry(GPU, "gpu-0", data={"x": 1}), force=False)
    assert refused.value.status == 409
    assert 'Apply failed with 1 conflict: conflict with "other"' in str(refused.value)
    await api.apply(GPU, entry(GPU, "gpu-0", data={"x": 1}))
    assert [m["manager"] for m in api.claim()["metadata"]["managedFields"]] == [GPU]
    # The same entry with the same content is shared, not a conflict; it stays while one owner applies it.
    await api.apply("other", entry(GPU, "gpu-0", data={"x": 1}), force=False)
    await api.apply(GPU)
    assert api.devices() == [(GPU, "gpu-0")]


@pytest.mark.parametrize(("bad", "field", "message"), [
    ({"device": "GPU_0"}, "status.devices[0].device", "Invalid value"),
    ({"device": "gpu-9"}, "status.devices[0]", "must be an allocated device in the claim"),
    ({"shareID": SHARE}, "status.devices[0]", "must be an allocated device in the claim"),
    ({"shareID": SHARE.upper()}, "status.devices[0].shareID", "lowercase UUID"),
    ({"pool": "node-a/Bad"}, "status.devices[0].pool", "Invalid value"),
    ({"driver": "x" * 64}, "status.devices[0].driver", "Too long"),
    ({"data": [1, 2]}, "status.devices[0].data", "must be valid JSON object"),
    ({"data": {"x": "y" * 10240}}, "status.devices[0].data", "Too long: may not be more than 10240 bytes"),
    ({"networkData": {"ips": ["192.0.2.05/24"]}}, "status.devices[0].networkData.ips[0]", "CIDR form"),
    ({"networkData": {"ips": ["2001:DB8::1/64"]}}, "status.devices[0].networkData.ips[0]",
     'must be in canonical form ("2001:db8::1/64")'),
    ({"networkData": {"ips": ["10.0.0.1/8", "10.0.0.1/8"]}}, "status.devices[0].networkData.ips[1]",
     "Duplicate value"),
    ({"networkData": {"ips": [f"10.0.0.{i}/8" for i in range(17)]}}, "status.devices[0].networkData.ips",
     "Too many: 17: must have at most 16 items"),
    ({"networkData": {"interfaceName": "n" * 257}}, "status.devices[0].networkData.interfaceName", "Too long"),
    ({"networkData": {"hardwareAddress": "a" * 129}}, "status.devices[0].networkData.hardwareAddress",
     "Too long"),
    ({"conditions": [{"type": "Ready", "status": "Yes", "reason": "R", "lastTransitionTime": WHEN}]},
     "status.devices[0].conditions[0].status", "Unsupported value"),
    ({"conditions": [{"type": "Ready", "status": "True", "reason": "1bad", "lastTransitionTime": WHEN}]},
     "status.devices[0].conditions[0].reason", "a condition reason must start with alphabetic character"),
    ({"conditions": [{"type": "Ready", "status": "True", "reason": "R"}]},
     "status.devices[0].conditions[0].lastTransitionTime", "Required value"),
    ({"conditions": [{"type": f"T{i}", "status": "True", "reason": "R", "lastTransitionTime": WHEN}
                     for i in range(9)]}, "status.devices[0].conditions", "Too many: 9"),
])
async def test_a_bad_entry_is_refused_with_the_real_field_path(api: Api, bad: dict[str, Any], field: str,
                                                               message: str) -> None:
    with pytest.raises(KubeError) as refused:
        await api.apply(GPU, {**entry(GPU, "gpu-0"), **bad})
    assert refused.value.status == 422
    assert f"{field}: " in str(refused.value) and message in str(refused.value)
    assert api.devices() == [], "nothing of a refused write is kept"


async def test_duplicate_keys_are_refused(api: Api) -> None:
    # An apply cannot even be read as a list-map: the real server says so as an internal error.
    with pytest.raises(KubeError) as refused:
        await api.apply(GPU, entry(GPU, "gpu-0"), entry(GPU, "gpu-0"))
    assert refused.value.status == 500 and ".status.devices: duplicate entries for key [device=\"gpu-0\"," \
        in str(refused.value)
    with pytest.raises(KubeError) as twice:
        await api.apply(GPU, entry(GPU, "gpu-0", conditions=entry(GPU, "gpu-0")["conditions"] * 2))
    assert twice.value.status == 500 and '.conditions: duplicate entries for key [type=\"Ready\"]' in str(twice.value)
    claim = api.claim()
    claim["status"]["devices"] = [entry(GPU, "gpu-0"), entry(GPU, "gpu-0")]
    with pytest.raises(KubeError) as put:
        await api.kube.request("PUT", CLAIM_STATUS, body=claim)
    assert put.value.status == 422 and "status.devices[1]: Duplicate value" in str(put.value)


async def test_status_devices_are_written_through_status_only(api: Api) -> None:
    claim = api.claim()
    claim["status"]["devices"] = [entry(GPU, "gpu-0")]
    await api.kube.request("PUT", CLAIM, body=claim)
    assert api.devices() == []
    with pytest.raises(KubeError) as elsewhere:
        await api.kube.request("PATCH", CLAIM, body=body(api.uid), query=[("fieldManager", GPU)],
                               content_type="application/apply-patch+yaml")
    assert elsewhere.value.status == 415
    with pytest.raises(KubeError) as slices:
        await api.kube.request("PATCH", ApiPath("/apis/resource.k8s.io/v1/resourceslices/x"), body={},
                               query=[("fieldManager", GPU)], content_type="application/apply-patch+yaml")
    assert slices.value.status == 415
    with pytest.raises(KubeError) as manager:
        await api.kube.request("PATCH", CLAIM_STATUS, body=body(api.uid),
                               content_type="application/apply-patch+yaml")
    assert manager.value.status == 422 and "fieldManager: Required value" in str(manager.value)


async def test_an_apply_for_a_replaced_claim_does_not_land(api: Api) -> None:
    api.uid = str(uuid.uuid4())
    with pytest.raises(KubeError) as replaced:
        await api.apply(GPU, entry(GPU, "gpu-0"))
    assert replaced.value.status == 409 and "UID" in str(replaced.value)
    assert api.devices() == []


async def test_entries_of_deallocated_devices_are_dropped(api: Api) -> None:
    await api.apply(GPU, entry(GPU, "gpu-0"), entry(GPU, "gpu-2", shareID=SHARE))
    await api.apply(NIC, entry(NIC, "vf-0"))
    owned = {m["manager"]: list(m["fieldsV1"]["f:status"]["f:devices"]) for m in
             api.claim()["metadata"]["managedFields"]}
    assert owned[NIC] == ['k:{"device":"vf-0","driver":"nic.example.com","pool":"node-a"}']
    claim = api.claim()
    del claim["status"]["allocation"]  # deallocated (an allocation is otherwise immutable)
    await api.kube.request("PUT", CLAIM_STATUS, body=claim)
    assert api.devices() == [] and "managedFields" not in api.claim()["metadata"]


async def test_a_yaml_apply_body_is_read(api: Api) -> None:
    raw = "# YAML, not JSON\n" + yaml.safe_dump(body(api.uid, entry(GPU, "gpu-0")))
    async with aiohttp.ClientSession() as session, session.patch(
        f"{api.server.url}/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/claim/status",
        params={"fieldManager": GPU, "force": "true"}, data=raw,
        headers={**api.server.auth_headers, "Content-Type": "application/apply-patch+yaml"},
    ) as response:
        assert response.status == 200, await response.text()
    assert api.devices() == [(GPU, "gpu-0")]


def test_a_share_leaving_the_allocation_takes_only_its_own_entry() -> None:
    other = "7e0d9a1b-2c3d-4e5f-8a9b-0c1d2e3f4a5b"

    def share(uid: str) -> dict[str, Any]:
        return {"driver": GPU, "pool": NODE, "device": "gpu-2", "shareID": uid}

    old = {"status": {"allocation": {"devices": {"results": [share(SHARE), share(other)]}}}}
    new: dict[str, Any] = {"status": {"allocation": {"devices": {"results": [share(other)]}},
                                      "devices": [share(SHARE), share(other)]}}
    drop_deallocated_status_devices(new, old)
    assert new["status"]["devices"] == [share(other)]


# --- who may change whose entries ---------------------------------------------------------------------------------

ON_NODE = {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}]}
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"


def forbidden(driver: str, verbs: str, user: str = AGENT_USER) -> str:
    """The real server's words for a status write changing `driver`'s entries without the permission."""
    first = verbs.split()[0]
    return (f'status.devices: Forbidden: changing status.devices requires resource="resourceclaims/driver", '
            f'verb="[{verbs}]" permission: resourceclaims.resource.k8s.io "{driver}" is forbidden: User "{user}" '
            f'cannot {first} resource "resourceclaims/driver" in API group "resource.k8s.io" in the namespace '
            f'"default"')


async def test_a_write_changing_a_drivers_entries_needs_that_drivers_permission(api: Api) -> None:
    claim = api.claim()
    claim["status"]["allocation"]["nodeSelector"] = ON_NODE
    api.server.put_claim(claim)
    api.server.caller = Caller(node=NODE, status_drivers=frozenset({NIC}))
    with pytest.raises(KubeError) as refused:
        await api.apply(GPU, entry(GPU, "gpu-0"), entry(GPU, "gpu-9"))
    # The token carries the claim's node: both verbs are tried, associated-node first; then validation's errors.
    assert refused.value.status == 422
    assert (f'"claim" is invalid: [{forbidden(GPU, "associated-node:patch arbitrary-node:patch")}, '
            'status.devices[1]: Invalid value: "gpu.example.com/node-a/gpu-9"') in str(refused.value)
    await api.apply(NIC, entry(NIC, "vf-0"))  # a driver it may write for
    assert api.devices() == [(NIC, "vf-0")]

    # Elsewhere than the token's node, or with no node in it, only arbitrary-node is tried; a PUT is an update.
    api.server.caller = Caller(status_drivers=frozenset({NIC}))
    with pytest.raises(KubeError) as put:
        stored = api.claim()
        stored["status"]["devices"].append(entry(GPU, "gpu-0"))
        await api.kube.request("PUT", CLAIM_STATUS, body=stored)
    assert forbidden(GPU, "arbitrary-node:update") in str(put.value)

    # Taking away another driver's entry is changing it; writing them unchanged is not.
    api.server.caller = Caller(status_drivers=frozenset({GPU}))
    await api.apply(GPU, entry(GPU, "gpu-0"))
    with pytest.raises(KubeError) as removal:
        stored = api.claim()
        stored["status"]["devices"] = [e for e in stored["status"]["devices"] if e["driver"] == GPU]
        await api.kube.request("PUT", CLAIM_STATUS, body=stored)
    assert forbidden(NIC, "arbitrary-node:update") in str(removal.value)
    await api.apply(GPU, entry(GPU, "gpu-0"), entry(GPU, "gpu-1"))
    assert api.devices() == [(NIC, "vf-0"), (GPU, "gpu-0"), (GPU, "gpu-1")]


async def test_the_writer_counts_a_write_without_the_drivers_permission_as_refused(api: Api) -> None:
    claim = api.claim()
    claim["status"]["allocation"]["nodeSelector"] = ON_NODE
    api.server.put_claim(claim)
    api.server.caller = Caller(node=NODE, status_drivers=frozenset({NIC}))
    metrics = Metrics()
    with structlog.testing.capture_logs() as logs:
        writer = ClaimStatusWriter(api.kube, GPU, NODE, metrics=metrics, log=structlog.get_logger(),
                                   backoff=Backoff(first=0.001, limit=0.002, attempts=3, timeout=scaled(5)), settle=0)
        writer.prepared(ClaimRef(api.uid, "default", "claim"), ClaimRecord(
            api.uid, "default", "claim", "completed", "boot", (DeviceRecord("gpu-0", "nvidia-gpu"),)))
        async with asyncio.timeout(scaled(10)):
            while writer.pending:  # noqa: ASYNC110 - the writer's task ends on its own
                await asyncio.sleep(0.01)
    outcomes = {outcome: metrics.registry.get_sample_value(
        "dra_agent_claim_status_writes_total", {"driver": GPU, "outcome": outcome}) or 0.0
        for outcome in ("ok", "refused", "error")}
    assert outcomes == {"ok": 0.0, "refused": 1.0, "error": 0.0}, "refused, and not tried again"
    assert api.server.count_requests("PATCH", f"{CLAIMS}/claim/status", status=422) == 1
    (logged,) = [e for e in logs if e["event"] == "the API server refused the claim's status"]
    assert forbidden(GPU, "associated-node:patch arbitrary-node:patch") in logged["error"]
    assert api.devices() == []
