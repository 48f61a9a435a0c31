"""The claim's `status.devices` written by a driver: the apply body built from a checkpoint record (entries, facts
as `data`, network data, entries the server would refuse left out), and the background writer (latest state
wins, retries with backoff, gives up on a gone or refused claim, counts every attempt, keeps the Ready time)."""

from __future__ import annotations

import asyncio
import re
import string
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.claims.records import ClaimRecord, DeviceRecord
from agent.claims.status import (
    DATA_BUDGET,
    TRUNCATED,
    device_data,
    released_status,
    rfc3339,
    status_apply,
)
from agent.claims.status_rules import DATA_MAX_BYTES, json_size
from agent.claims.status_writer import Backoff, ClaimStatusWriter
from agent.commands.cli import build_parser
from agent.kube.client import KubeError
from agent.metrics import Metrics
from agent.settings import SettingsError, load_settings
from backends.attributes import AttributeValue, Version
from backends.contract import ClaimRef, NetworkData
from simulator.apiserver.resources import RESOURCE_CLAIMS, ApiError
from simulator.apiserver.store import Store
from tests.support.timing import scaled

DRIVER, POOL = "gpu.nvidia.com", "node-a"
SINCE = "2026-11-26T10:00:00Z"
SHARE = "2f1c7a52-8e0b-4c59-9d1f-6a4b3c2d1e0f"
UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def record(*devices: DeviceRecord, uid: str = "0b6f0c52-9d6f-4d4e-9c1e-2a1f0d1f7e11") -> ClaimRecord:
    return ClaimRecord(uid, "team-a", "my-claim", "completed", "boot", devices)


def test_one_entry_per_device_with_its_facts_share_and_network() -> None:
    apply = status_apply(record(
        DeviceRecord("gpu-0", "nvidia-gpu", ("gpu",), facts={"uuid": "GPU-1", "memory": 80, "mig": False,
                                                             "driverVersion": Version("550.54.15")}),
        DeviceRecord("vf-1", "sriov", ("nic",), share_id=SHARE, admin_access=True,
                     network=NetworkData("net1", "aa:bb:cc:dd:ee:ff", ("192.0.2.5/24", "2001:db8::5/64"))),
    ), DRIVER, POOL, SINCE)
    assert apply.omitted == ()
    assert apply.body["metadata"] == {"name": "my-claim", "namespace": "team-a",
                                      "uid": "0b6f0c52-9d6f-4d4e-9c1e-2a1f0d1f7e11"}
    assert (apply.body["apiVersion"], apply.body["kind"]) == ("resource.k8s.io/v1", "ResourceClaim")
    assert apply.devices == [
        {"driver": DRIVER, "pool": POOL, "device": "gpu-0",
         "conditions": [{"type": "Ready", "status": "True", "reason": "DevicePrepared", "lastTransitionTime": SINCE,
                         "message": "Prepared for gpu by backend nvidia-gpu"}],
         "data": {"driverVersion": "550.54.15", "memory": 80, "mig": False, "uuid": "GPU-1"}},
        {"driver": DRIVER, "pool": POOL, "device": "vf-1", "shareID": SHARE,
         "conditions": [{"type": "Ready", "status": "True", "reason": "DevicePrepared", "lastTransitionTime": SINCE,
                         "message": "Prepared with admin access for nic by backend sriov"}],
         "networkData": {"interfaceName": "net1", "hardwareAddress": "aa:bb:cc:dd:ee:ff",
                         "ips": ["192.0.2.5/24", "2001:db8::5/64"]}},
    ]


def test_an_entry_the_server_would_refuse_is_left_out_and_told() -> None:
    apply = status_apply(record(
        DeviceRecord("gpu-0", "nvidia-gpu"),
        DeviceRecord("vf-1", "sriov", network=NetworkData("net1", "", ("192.0.2.05/24",))),
        DeviceRecord("Bad_Name", "sriov"),
    ), DRIVER, POOL, SINCE)
    assert [d["device"] for d in apply.devices] == ["gpu-0"]
    assert len(apply.omitted) == 2
    assert "device vf-1.networkData.ips[0]" in apply.omitted[0] and "CIDR" in apply.omitted[0]
    assert "device Bad_Name.device: Invalid value" in apply.omitted[1]


def test_data_is_cut_under_its_budget_with_a_marker() -> None:
    facts: dict[str, AttributeValue] = {f"fact{i:03}": "x" * 60 for i in range(300)}
    data = device_data(facts)
    assert json_size(data) <= DATA_BUDGET < DATA_MAX_BYTES
    kept = [k for k in data if k != TRUNCATED]
    assert kept == sorted(facts)[:len(kept)] and len(kept) > 10
    assert data[TRUNCATED] == 300 - len(kept)
    assert TRUNCATED not in device_data({"a": 1})


def test_releasing_applies_no_entries() -> None:
    body = released_status(ClaimRef("u", "ns", "n")).body
    assert body["status"] == {"devices": []} and body["metadata"] == {"name": "n", "namespace": "ns", "uid": "u"}


def test_rfc3339_is_whole_seconds_in_utc() -> None:
    assert rfc3339(1_764_151_200.75) == "2025-11-26T10:00:00Z"


# --- whatever the records hold, what is applied passes the test API server ------------------------------------

_names = st.one_of(st.from_regex(r"[a-z0-9]([-a-z0-9]{0,8}[a-z0-9])?", fullmatch=True),
                   st.text(string.ascii_letters + string.digits + "-_.", min_size=0, max_size=70))
_values: st.SearchStrategy[AttributeValue] = st.one_of(
    st.booleans(), st.integers(), st.text(max_size=200),
    st.builds(Version, st.sampled_from(["1.2.3", "550.54.15", "0.0.1-rc.1"])))
_ips = st.one_of(st.ip_addresses().map(lambda ip: f"{ip}/{24 if ip.version == 4 else 64}"),
                 st.text(string.hexdigits + ".:/", max_size=40))
_network = st.builds(NetworkData, st.text(max_size=300), st.text(max_size=140),
                     st.lists(_ips, max_size=18).map(tuple))
_devices = st.builds(
    DeviceRecord, device=_names, backend=st.just("b"), requests=st.just(("r",)),
    share_id=st.one_of(st.none(), st.uuids().map(str), st.text(max_size=40)),
    facts=st.dictionaries(st.text(min_size=1, max_size=40), _values, max_size=40),
    network=st.one_of(st.none(), _network), admin_access=st.booleans())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_devices, max_size=5, unique_by=lambda d: (d.device, d.share_id)))
def test_an_applied_body_always_passes_the_servers_validation(devices: list[DeviceRecord]) -> None:
    store = Store()
    uid = str(uuid.uuid4())
    claim = record(*devices, uid=uid)
    # The allocation comes from the server, whose shareIDs are valid; a record may hold anything.
    results = [{"request": "r", "driver": DRIVER, "pool": POOL, "device": d.device,
                **({"shareID": d.share_id} if d.share_id is not None and UID.fullmatch(d.share_id) else {})}
               for d in devices]
    store.put(RESOURCE_CLAIMS, {"metadata": {"name": claim.name, "namespace": claim.namespace, "uid": uid},
                                "spec": {}, "status": {"allocation": {"devices": {"results": results}}}})
    apply = status_apply(claim, DRIVER, POOL, SINCE)
    try:
        stored = store.apply_status(RESOURCE_CLAIMS, claim.namespace, claim.name, apply.body, DRIVER, force=True)
    except ApiError as e:
        raise AssertionError(f"refused: {e}") from None
    assert len(stored["status"].get("devices", [])) + len(apply.omitted) == len(devices)


# --- the writer -----------------------------------------------------------------------------------------------


class FakeApi:
    """Records applies; `failures` are raised first, one per call; `gate` holds a call until set."""

    def __init__(self) -> None:
        self.applied: list[tuple[str, Mapping[str, Any]]] = []
        self.failures: list[KubeError] = []
        self.gate: asyncio.Event | None = None
        self.claims: dict[str, Mapping[str, Any]] = {}

    async def apply_claim_status(self, namespace: str, name: str, body: Mapping[str, Any], field_manager: str,
                                 timeout: float) -> None:
        if self.gate is not None:
            await self.gate.wait()
        if self.failures:
            raise self.failures.pop(0)
        self.applied.append((field_manager, body))

    async def get_claim(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        return self.claims.get(name)


FAST = Backoff(first=0.001, limit=0.002, attempts=4, timeout=scaled(1.0))
REF = ClaimRef("0b6f0c52-9d6f-4d4e-9c1e-2a1f0d1f7e11", "team-a", "my-claim")
ONE = record(DeviceRecord("gpu-0", "nvidia-gpu"))


def writes(metrics: Metrics, outcome: str) -> float:
    return metrics.registry.get_sample_value("dra_agent_claim_status_writes_total",
                                             {"driver": DRIVER, "outcome": outcome}) or 0.0


async def settled(writer: ClaimStatusWriter) -> None:
    async with asyncio.timeout(scaled(5)):
        while writer.pending:  # noqa: ASYNC110 - the writer's tasks end on their own
            await asyncio.sleep(0.001)


def devices_of(body: Mapping[str, Any]) -> list[str]:
    return [d["device"] for d in body["status"]["devices"]]


async def test_the_latest_wanted_state_wins() -> None:
    api, metrics = FakeApi(), Metrics()
    api.gate = asyncio.Event()
    writer = ClaimStatusWriter(api, DRIVER, POOL, metrics=metrics, backoff=FAST, settle=0.0)
    writer.prepared(REF, ONE)
    await asyncio.sleep(0.01)  # the first write is under way, held
    writer.released(REF, ONE)
    writer.prepared(REF, record(DeviceRecord("gpu-0", "g"), DeviceRecord("gpu-1", "g")))
    writer.released(REF, ONE)
    api.gate.set()
    await settled(writer)
    assert [devices_of(body) for _, body in api.applied] == [["gpu-0"], []]
    assert {manager for manager, _ in api.applied} == {DRIVER}
    assert writes(metrics, "ok") == 2


async def test_a_state_replaced_at_once_is_not_written() -> None:
    api = FakeApi()
    writer = ClaimStatusWriter(api, DRIVER, POOL, backoff=FAST, settle=0.05)
    writer.prepared(REF, ONE)
    writer.released(REF, ONE)
    await settled(writer)
    assert [devices_of(body) for _, body in api.applied] == [[]]


async def test_failures_are_tried_again_then_given_up() -> None:
    api, metrics = FakeApi(), Metrics()
    writer = ClaimStatusWriter(api, DRIVER, POOL, metrics=metrics, backoff=FAST)
    api.failures = [KubeError("down", 0), KubeError("busy", 503), KubeError("conflict", 409)]
    writer.prepared(REF, ONE)
    await settled(writer)
    assert [devices_of(body) for _, body in api.applied] == [["gpu-0"]]
    assert (writes(metrics, "error"), writes(metrics, "ok")) == (3, 1)
    api.failures = [KubeError("down", 500)] * 4
    writer.prepared(REF, ONE)
    await settled(writer)
    assert writes(metrics, "gave-up") == 1 and len(api.applied) == 1


async def test_a_gone_or_refused_claim_is_not_tried_again() -> None:
    api, metrics = FakeApi(), Metrics()
    writer = ClaimStatusWriter(api, DRIVER, POOL, metrics=metrics, backoff=FAST)
    api.failures = [KubeError("not found", 404)]
    writer.prepared(REF, ONE)
    await settled(writer)
    api.failures = [KubeError("Precondition failed: UID in precondition", 409)]
    writer.prepared(REF, ONE)
    await settled(writer)
    api.failures = [KubeError("invalid", 422)]
    writer.prepared(REF, ONE)
    await settled(writer)
    assert (writes(metrics, "gone"), writes(metrics, "refused"), writes(metrics, "error")) == (2, 1, 0)
    assert api.applied == []


async def test_the_ready_time_stays_across_prepares_and_restarts() -> None:
    api, clock = FakeApi(), iter(range(1_764_151_200, 1_764_151_300, 10))
    writer = ClaimStatusWriter(api, DRIVER, POOL, backoff=FAST, clock=lambda: float(next(clock)))
    for _ in range(3):
        writer.prepared(REF, ONE)
        await settled(writer)
    times = {body["status"]["devices"][0]["conditions"][0]["lastTransitionTime"] for _, body in api.applied}
    assert times == {"2025-11-26T10:00:00Z"}
    writer.released(REF, ONE)
    writer.prepared(REF, ONE)
    await settled(writer)
    assert api.applied[-1][1]["status"]["devices"][0]["conditions"][0]["lastTransitionTime"] == "2025-11-26T10:00:10Z"
    # After a restart the time the server holds is kept.
    api.claims["my-claim"] = {"metadata": {"uid": REF.uid}, "status": {"devices": [
        {**api.applied[0][1]["status"]["devices"][0], "driver": DRIVER}]}}
    restarted = ClaimStatusWriter(api, DRIVER, POOL, backoff=FAST, clock=lambda: 1_800_000_000.0)
    restarted.resume(REF, ONE)
    await settled(restarted)
    assert api.applied[-1][1]["status"]["devices"][0]["conditions"][0]["lastTransitionTime"] == "2025-11-26T10:00:00Z"


async def test_a_claim_known_only_from_its_cdi_spec_is_not_resumed() -> None:
    """Taken back from a spec, a claim has a UID but no namespace or name: there is no status to write to."""
    api, metrics = FakeApi(), Metrics()
    writer = ClaimStatusWriter(api, DRIVER, POOL, metrics=metrics, backoff=FAST, settle=0.0)
    writer.resume(ClaimRef(REF.uid, "", ""), ONE)
    await settled(writer)
    assert api.applied == [] and writes(metrics, "refused") == 0 and writes(metrics, "ok") == 0


async def test_close_writes_what_is_wanted_then_gives_up_on_a_hanging_write() -> None:
    api = FakeApi()
    writer = ClaimStatusWriter(api, DRIVER, POOL, backoff=FAST)
    writer.prepared(REF, ONE)
    writer.released(REF, ONE)
    await writer.close(timeout=scaled(5))
    assert [devices_of(body) for _, body in api.applied] == [[]]
    api.gate = asyncio.Event()
    writer.prepared(REF, ONE)
    await writer.close(timeout=scaled(0.1))
    assert writer.pending == 0 and len(api.applied) == 1


async def test_a_malformed_claim_read_at_restart_leaves_a_fresh_ready_time() -> None:
    api = FakeApi()
    api.claims["my-claim"] = {"metadata": {"uid": REF.uid}, "status": {"devices": [
        "not an entry", {"driver": DRIVER, "conditions": ["nor a condition", {"type": "Ready", "status": "True",
                                                                             "lastTransitionTime": "yesterday"}]}]}}
    writer = ClaimStatusWriter(api, DRIVER, POOL, backoff=FAST, clock=lambda: 1_764_151_200.0)
    writer.resume(REF, ONE)
    await settled(writer)
    (written,) = api.applied
    assert written[1]["status"]["devices"][0]["conditions"][0]["lastTransitionTime"] == "2025-11-26T10:00:00Z"


def test_the_setting_is_on_by_default_and_turned_off_from_each_source(tmp_path: Path) -> None:
    assert load_settings({}, {}).claim_status is True
    assert load_settings({}, {"DRA_AGENT_CLAIM_STATUS": "false"}).claim_status is False
    config = tmp_path / "agent.yaml"
    config.write_text("claim-status: false\n")
    assert load_settings({}, {}, config).claim_status is False
    args = build_parser().parse_args(["run", "--no-claim-status"])
    assert load_settings({"claim_status": args.claim_status}, {"DRA_AGENT_CLAIM_STATUS": "true"}).claim_status is False
    assert build_parser().parse_args(["run"]).claim_status is None, "unset: the environment or file decides"
    with pytest.raises(SettingsError, match="claim_status"):
        load_settings({}, {"DRA_AGENT_CLAIM_STATUS": "maybe"})
