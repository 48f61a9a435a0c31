"""What a driver tells about its prepared devices in their ResourceClaim's `status.devices` (KEP-4817): the body of
the server-side apply that writes them, built from the claim's checkpoint record alone.

One entry per device of the record (every device of a record belongs to its driver): `driver`, `pool`, `device`,
`shareID` for a share, a `Ready` condition, `data` (the device's facts as a JSON object of plain values) and
`networkData` when the backend gave network data. An entry the API server would refuse (a fact that does not
fit, an address not in canonical form) is left out and the reason told, rather than refusing the whole write:
the other entries and the claim's preparation stand.

The condition's `lastTransitionTime` is passed in (`ready_since`): the writer keeps the time of the first write of
a claim, so applying the same claim again changes nothing on the server.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from agent.claims.records import ClaimRecord, DeviceRecord
from agent.claims.status_rules import DATA_MAX_BYTES, device_status_errors, json_size
from backends.attributes import AttributeValue, Version
from backends.contract import ClaimRef

__all__ = ["API_VERSION", "DATA_BUDGET", "READY", "REASON", "TRUNCATED", "StatusApply", "device_data",
           "released_status", "rfc3339", "status_apply"]

API_VERSION = "resource.k8s.io/v1"
READY = "Ready"
REASON = "DevicePrepared"
DATA_BUDGET = 4 * 1024
"""Bytes of `data` the agent writes at most (the server takes 10 KiB): facts past it are left out, and the marker
says how many."""
TRUNCATED = "(truncated)"
"""Key of `data` that counts the facts left out; not a valid attribute name, so it never hides a fact."""


@dataclass(frozen=True)
class StatusApply:
    """The server-side apply body for one claim's status, and why entries were left out of it (one line each)."""

    body: dict[str, Any]
    omitted: tuple[str, ...] = ()

    @property
    def devices(self) -> list[dict[str, Any]]:
        devices: list[dict[str, Any]] = self.body["status"]["devices"]
        return devices


def rfc3339(seconds: float) -> str:
    """A Unix time as a metav1.Time: RFC 3339 in UTC, whole seconds."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_apply(record: ClaimRecord, driver: str, pool: str, ready_since: str) -> StatusApply:
    """The apply body that makes the claim's `status.devices` entries of `driver` those of `record`'s devices."""
    devices: list[dict[str, Any]] = []
    omitted: list[str] = []
    for device in record.devices:
        entry = device_entry(device, driver, pool, ready_since)
        errors = device_status_errors(entry, f"device {device.device}")
        if errors:
            omitted.append("; ".join(errors))
        else:
            devices.append(entry)
    return StatusApply(_body(ClaimRef(record.uid, record.namespace, record.name), devices), tuple(omitted))


def released_status(ref: ClaimRef) -> StatusApply:
    """The apply body that removes every `status.devices` entry this driver wrote on the claim: an apply without
    them (the server drops what the field manager owned and no longer applies; other drivers' entries stay)."""
    return StatusApply(_body(ref, []))


def device_entry(device: DeviceRecord, driver: str, pool: str, ready_since: str) -> dict[str, Any]:
    entry: dict[str, Any] = {"driver": driver, "pool": pool, "device": device.device}
    if device.share_id is not None:
        entry["shareID"] = device.share_id
    requests = ", ".join(device.requests) or "the claim"
    access = " with admin access" if device.admin_access else ""
    entry["conditions"] = [{
        "type": READY, "status": "True", "reason": REASON, "lastTransitionTime": ready_since,
        "message": f"Prepared{access} for {requests} by backend {device.backend}",
    }]
    if device.facts:
        entry["data"] = device_data(device.facts)
    network = device.network
    if network is not None:
        data: dict[str, Any] = {}
        if network.interface_name:
            data["interfaceName"] = network.interface_name
        if network.hardware_address:
            data["hardwareAddress"] = network.hardware_address
        if network.ips:
            data["ips"] = list(network.ips)
        if data:
            entry["networkData"] = data
    return entry


def device_data(facts: Mapping[str, AttributeValue], budget: int = DATA_BUDGET) -> dict[str, Any]:
    """The facts as a JSON object of plain values (a version as its text), in name order, cut to `budget` bytes:
    facts past it are left out and counted under `TRUNCATED`."""
    assert budget < DATA_MAX_BYTES
    data: dict[str, Any] = {}
    names = sorted(facts)
    size = 2  # "{}"
    for i, name in enumerate(names):
        value = facts[name]
        plain = value.text if isinstance(value, Version) else value
        # Each member costs its key, its value, a colon and a comma; the marker may be needed after it.
        cost = json_size(name) + json_size(plain) + 2
        marker = json_size(TRUNCATED) + json_size(len(names)) + 2
        if size + cost + (marker if i < len(names) - 1 else 0) > budget:
            data[TRUNCATED] = len(names) - i
            return data
        data[name] = plain
        size += cost
    return data


def _body(ref: ClaimRef, devices: list[dict[str, Any]]) -> dict[str, Any]:
    # The UID makes the write fail on a claim of the same name created since, rather than land on it.
    return {"apiVersion": API_VERSION, "kind": "ResourceClaim",
            "metadata": {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid},
            "status": {"devices": devices}}
