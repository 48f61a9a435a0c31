"""A ResourceClaim's `status.devices` entries chosen to cover each rule of the API server's validation once (KEP-4817:
the entry's key fields, that it names a device of the allocation, conditions, data and its size, network data),
accepted and refused, with the server's verdict on a server-side apply of them by a driver on `/status`; a few
also written by merge patch, where the server's answer differs. Shared by the fast tier's test of
agent/claims/status_rules.py through the test API server and the real API server's test of the same cases.

The claim is allocated three devices of the driver DRIVER in the pool POOL: dev-0, dev-1 and a share of dev-2."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tests.support.time_cases import TIMES
from tests.support.verdicts import ACCEPTED, Verdict, refused

__all__ = ["ALLOCATION", "APPLY_CASES", "DRIVER", "MERGE_CASES", "POOL", "SHARE", "StatusCase", "condition", "entry"]

DRIVER = "status-rules.example.com"
POOL = "127.0.0.1"
SHARE = "2f1c7a52-8e0b-4c59-9d1f-6a4b3c2d1e0f"
WHEN = "2026-05-01T12:00:00Z"
INTERNAL = Verdict("internal")

ALLOCATION: dict[str, Any] = {
    "devices": {"results": [
        {"request": "r", "driver": DRIVER, "pool": POOL, "device": "dev-0"},
        {"request": "r", "driver": DRIVER, "pool": POOL, "device": "dev-1"},
        {"request": "r", "driver": DRIVER, "pool": POOL, "device": "dev-2", "shareID": SHARE},
    ]},
    "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
        {"key": "metadata.name", "operator": "In", "values": [POOL]}]}]},
}  # fmt: skip
"""The claim's `status.allocation`: on the node named like the pool."""


def entry(device: str = "dev-0", **fields: Any) -> dict[str, Any]:
    """An entry of `status.devices` for one of DRIVER's devices (None removes a field)."""
    body = {"driver": DRIVER, "pool": POOL, "device": device, **fields}
    return {k: v for k, v in body.items() if v is not None}


def condition(**changes: Any) -> dict[str, Any]:
    """A valid Ready condition, with `changes` (None removes a field)."""
    body = {"type": "Ready", "status": "True", "reason": "DevicePrepared", "message": "", "lastTransitionTime": WHEN,
            **changes}
    return {k: v for k, v in body.items() if v is not None}


@dataclass(frozen=True)
class StatusCase:
    id: str
    devices: Sequence[Mapping[str, Any]]
    verdict: Verdict


def _data_of_size(size: int, char: str = "a") -> dict[str, Any]:
    """A `data` object of `size` bytes as compact JSON with `char` (one byte) repeated."""
    return {"x": char * (size - len('{"x":""}'))}


FIRST = "status.devices[0]"
NOT_ALLOCATED = f"{FIRST}: Invalid value"
FLOAT_DATA = '{"f":100000000000000000000,"s":""}'  # how Go writes the float 1e20: in full, 21 digits

APPLY_CASES: list[StatusCase] = [
    StatusCase("one-entry", [entry()], ACCEPTED),
    StatusCase("every-device", [entry(), entry("dev-1"), entry("dev-2", shareID=SHARE)], ACCEPTED),
    StatusCase("everything", [entry(conditions=[condition()], data={"uuid": "GPU-1", "n": [1, 2.5, None]},
                                    networkData={"interfaceName": "net1", "hardwareAddress": "aa:bb:cc:dd:ee:ff",
                                                 "ips": ["192.0.2.5/24", "2001:db8::5/64"]})], ACCEPTED),
    StatusCase("not-allocated", [entry("dev-9")], refused(NOT_ALLOCATED)),
    StatusCase("share-of-an-unshared-device", [entry(shareID=SHARE)], refused(NOT_ALLOCATED)),
    StatusCase("shared-device-without-its-share", [entry("dev-2")], refused(NOT_ALLOCATED)),
    StatusCase("share-upper-case", [entry("dev-2", shareID=SHARE.upper())],
               refused(f"{FIRST}.shareID: Invalid value", NOT_ALLOCATED)),
    StatusCase("share-not-a-uuid", [entry("dev-2", shareID="share-1")],
               refused(f"{FIRST}.shareID: Invalid value", NOT_ALLOCATED)),
    # A driver name is checked lower-cased: upper case is a valid name, of no allocated device here.
    StatusCase("driver-upper-case", [entry(driver="Status-Rules.example.com")], refused(NOT_ALLOCATED)),
    StatusCase("driver-64", [entry(driver="d" * 64)], refused(f"{FIRST}.driver: Too long", NOT_ALLOCATED)),
    StatusCase("driver-underscore", [entry(driver="bad_driver.example.com")],
               refused(f"{FIRST}.driver: Invalid value", NOT_ALLOCATED)),
    StatusCase("pool-part-upper-case", [entry(pool=f"{POOL}/Bad")],
               refused(f"{FIRST}.pool: Invalid value", NOT_ALLOCATED)),
    StatusCase("pool-254", [entry(pool="p" * 254)],
               refused(f"{FIRST}.pool: Too long", f"{FIRST}.pool: Invalid value", NOT_ALLOCATED)),
    StatusCase("device-underscore", [entry("dev_0")], refused(f"{FIRST}.device: Invalid value", NOT_ALLOCATED)),
    StatusCase("device-64", [entry("d" * 64)], refused(f"{FIRST}.device: Invalid value", NOT_ALLOCATED)),
    # Server-side apply refuses duplicate keys of a list-map before validation, as an internal error.
    StatusCase("duplicate-entries", [entry(), entry()], INTERNAL),
    StatusCase("second-entry-not-allocated", [entry(), entry("dev-9")], refused("status.devices[1]: Invalid value")),
    StatusCase("8-conditions", [entry(conditions=[condition(type=f"T{i}") for i in range(8)])], ACCEPTED),
    StatusCase("9-conditions", [entry(conditions=[condition(type=f"T{i}") for i in range(9)])],
               refused(f"{FIRST}.conditions: Too many")),
    StatusCase("9-conditions-one-bad", [entry(conditions=[condition(type=f"T{i}", status="Yes" if i == 8 else "True")
                                                          for i in range(9)])],
               refused(f"{FIRST}.conditions: Too many", f"{FIRST}.conditions[8].status: Unsupported value")),
    StatusCase("duplicate-condition-types", [entry(conditions=[condition(), condition()])], INTERNAL),
    StatusCase("condition-type-empty", [entry(conditions=[condition(type="")])],
               refused(f"{FIRST}.conditions[0].type: Required value")),
    StatusCase("condition-type-invalid", [entry(conditions=[condition(type="Ready!")])],
               refused(f"{FIRST}.conditions[0].type: Invalid value")),
    StatusCase("condition-type-prefixed", [entry(conditions=[condition(type="example.com/Ready")])], ACCEPTED),
    StatusCase("condition-status-yes", [entry(conditions=[condition(status="Yes")])],
               refused(f"{FIRST}.conditions[0].status: Unsupported value")),
    StatusCase("condition-status-empty", [entry(conditions=[condition(status="")])],
               refused(f"{FIRST}.conditions[0].status: Required value")),
    StatusCase("condition-generation-negative", [entry(conditions=[condition(observedGeneration=-1)])],
               refused(f"{FIRST}.conditions[0].observedGeneration: Invalid value")),
    StatusCase("condition-no-time", [entry(conditions=[condition(lastTransitionTime=None)])],
               refused(f"{FIRST}.conditions[0].lastTransitionTime: Required value")),
    StatusCase("condition-reason-empty", [entry(conditions=[condition(reason="")])],
               refused(f"{FIRST}.conditions[0].reason: Required value")),
    StatusCase("condition-reason-invalid", [entry(conditions=[condition(reason="1bad")])],
               refused(f"{FIRST}.conditions[0].reason: Invalid value")),
    StatusCase("condition-reason-1025", [entry(conditions=[condition(reason="R" * 1025)])],
               refused(f"{FIRST}.conditions[0].reason: Too long")),
    StatusCase("condition-reason-1025-invalid", [entry(conditions=[condition(reason="R" * 1024 + ".")])],
               refused(f"{FIRST}.conditions[0].reason: Invalid value", f"{FIRST}.conditions[0].reason: Too long")),
    StatusCase("condition-message-32768", [entry(conditions=[condition(message="m" * 32768)])], ACCEPTED),
    StatusCase("condition-message-32769", [entry(conditions=[condition(message="m" * 32769)])],
               refused(f"{FIRST}.conditions[0].message: Too long")),
    StatusCase("condition-message-two-byte", [entry(conditions=[condition(message="é" * 16385)])],
               refused(f"{FIRST}.conditions[0].message: Too long")),
    StatusCase("data-10240", [entry(data=_data_of_size(10240))], ACCEPTED),
    StatusCase("data-10241", [entry(data=_data_of_size(10241))], refused(f"{FIRST}.data: Too long")),
    # The server measures `data` as Go writes JSON: '<', '>' and '&' escaped in six bytes each.
    StatusCase("data-html-characters", [entry(data={"x": "<" * 2000})], refused(f"{FIRST}.data: Too long")),
    StatusCase("data-two-byte-10240", [entry(data={"x": "é" * 5116})], ACCEPTED),
    StatusCase("data-two-byte-10242", [entry(data={"x": "é" * 5117})], refused(f"{FIRST}.data: Too long")),
    StatusCase("data-float-10240", [entry(data={"f": 1e20, "s": "a" * (10240 - len(FLOAT_DATA))})], ACCEPTED),
    StatusCase("data-float-10241", [entry(data={"f": 1e20, "s": "a" * (10241 - len(FLOAT_DATA))})],
               refused(f"{FIRST}.data: Too long")),
    StatusCase("data-list", [entry(data=[1, 2])], refused(f"{FIRST}.data: Invalid value")),
    StatusCase("data-string", [entry(data="text")], refused(f"{FIRST}.data: Invalid value")),
    StatusCase("data-empty-object", [entry(data={})], ACCEPTED),
    StatusCase("interface-name-256", [entry(networkData={"interfaceName": "n" * 256})], ACCEPTED),
    StatusCase("interface-name-257", [entry(networkData={"interfaceName": "n" * 257})],
               refused(f"{FIRST}.networkData.interfaceName: Too long")),
    StatusCase("interface-name-two-byte", [entry(networkData={"interfaceName": "é" * 129})],
               refused(f"{FIRST}.networkData.interfaceName: Too long")),
    StatusCase("hardware-address-129", [entry(networkData={"hardwareAddress": "a" * 129})],
               refused(f"{FIRST}.networkData.hardwareAddress: Too long")),
    StatusCase("ip-leading-zero", [entry(networkData={"ips": ["192.0.2.05/24"]})],
               refused(f"{FIRST}.networkData.ips[0]: Invalid value")),
    StatusCase("ip-upper-case", [entry(networkData={"ips": ["2001:DB8::1/64"]})],
               refused(f"{FIRST}.networkData.ips[0]: Invalid value")),
    StatusCase("ip-mapped-v4", [entry(networkData={"ips": ["::ffff:192.0.2.5/120"]})],
               refused(f"{FIRST}.networkData.ips[0]: Invalid value")),
    StatusCase("ip-without-prefix", [entry(networkData={"ips": ["192.0.2.5"]})],
               refused(f"{FIRST}.networkData.ips[0]: Invalid value")),
    StatusCase("ip-with-zone", [entry(networkData={"ips": ["fe80::1%eth0/64"]})],
               refused(f"{FIRST}.networkData.ips[0]: Invalid value")),
    StatusCase("ip-host-bits", [entry(networkData={"ips": ["10.1.2.3/8"]})], ACCEPTED),
    StatusCase("ips-16", [entry(networkData={"ips": [f"10.0.0.{i}/8" for i in range(16)]})], ACCEPTED),
    StatusCase("ips-17", [entry(networkData={"ips": [f"10.0.0.{i}/8" for i in range(17)]})],
               refused(f"{FIRST}.networkData.ips: Too many")),
    # Too many addresses: the server says so and checks none of them.
    StatusCase("ips-17-one-bad", [entry(networkData={"ips": [f"10.0.0.{i}/8" for i in range(16)] + ["x"]})],
               refused(f"{FIRST}.networkData.ips: Too many")),
    StatusCase("ips-duplicate", [entry(networkData={"ips": ["10.0.0.1/8", "10.0.0.1/8"]})],
               refused(f"{FIRST}.networkData.ips[1]: Duplicate value")),
]
APPLY_CASES += [
    StatusCase(f"condition-time-{value or 'empty'}", [entry(conditions=[condition(lastTransitionTime=value)])],
               ACCEPTED if time else INTERNAL)
    for value, time, _ in TIMES
]
"""Applied by the driver, server-side, on `/status`."""

MERGE_CASES: list[StatusCase] = [
    StatusCase("one-entry", [entry()], ACCEPTED),
    StatusCase("duplicate-entries", [entry(), entry()], refused("status.devices[1]: Duplicate value")),
    StatusCase("duplicate-condition-types", [entry(conditions=[condition(), condition()])],
               refused(f"{FIRST}.conditions[1]: Duplicate value")),
    StatusCase("time-unreadable", [entry(conditions=[condition(lastTransitionTime="2026-05-01T12:00:00z")])],
               refused("patch: Invalid value")),
    StatusCase("not-allocated", [entry("dev-9")], refused(NOT_ALLOCATED)),
]
"""Written by a merge patch of `status.devices` on `/status`."""
