"""Reading a ResourceClaim for prepare: which devices are this driver's, for which requests, with which opaque
configuration, and whether the kubelet's reference to it is sound.

Pure: works on the claim as the API server returned it (a JSON mapping) and raises ClaimError with a message
meant for the pod's events when the claim cannot be prepared.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.kube.names import claim_reference_problem, is_uid
from agent.kube.quantity import read_amount
from backends.contract import ClaimRef

__all__ = [
    "POD_CLAIM_NAME",
    "ClaimAllocation",
    "ClaimError",
    "DeviceAllocation",
    "OpaqueEntry",
    "check_reference",
    "configs_for",
    "read_allocation",
]

POD_CLAIM_NAME = "resource.kubernetes.io/pod-claim-name"
"""The annotation a claim made from a template carries: the name the pod gave the claim (pod.spec.resourceClaims)."""
FROM_CLASS, FROM_CLAIM = "FromClass", "FromClaim"


class ClaimError(Exception):
    """This claim cannot be prepared; the message says why."""


@dataclass(frozen=True)
class DeviceAllocation:
    """One allocation result of this driver."""

    request: str  # as allocated: "<request>" or "<request>/<subrequest>"
    driver: str
    pool: str
    device: str
    admin_access: bool = False
    share_id: str | None = None
    consumed: Mapping[str, int] = field(default_factory=dict)  # consumedCapacity of a share, in whole units
    written: Mapping[str, str] = field(default_factory=dict)  # the same as the claim writes it, for messages
    index: int = 0  # its place in status.allocation.devices.results

    @property
    def path(self) -> str:
        """The result's field in the claim, for messages."""
        return f"status.allocation.devices.results[{self.index}]"

    @property
    def request_name(self) -> str:
        """The request name the kubelet matches against containers (the subrequest stripped)."""
        return self.request.split("/", 1)[0]


@dataclass(frozen=True)
class OpaqueEntry:
    """One opaque configuration of this driver from status.allocation.devices.config."""

    index: int
    source: str
    requests: tuple[str, ...]
    parameters: Any

    def applies_to(self, request: str) -> bool:
        return not self.requests or request in self.requests or request.split("/", 1)[0] in self.requests

    def describe(self) -> str:
        scope = f"requests {', '.join(self.requests)}" if self.requests else "all requests"
        origin = "device class" if self.source == FROM_CLASS else "claim"
        return f"opaque config #{self.index} (from the {origin}, {scope})"


@dataclass(frozen=True)
class ClaimAllocation:
    """What this driver has to prepare for a claim. `pod_claim_name`: the claim was made from a template for the
    pod that calls it this (its `resource.kubernetes.io/pod-claim-name` annotation), unchecked."""

    ref: ClaimRef
    devices: tuple[DeviceAllocation, ...]
    configs: tuple[OpaqueEntry, ...]
    pod_claim_name: str | None = None


def check_reference(ref: ClaimRef) -> None:
    """Refuse claim references that no API server would produce; they must never reach a file name."""
    problem = claim_reference_problem(ref.uid, ref.namespace, ref.name)
    if problem:
        raise ClaimError(problem)


def read_allocation(claim: Mapping[str, Any], ref: ClaimRef, driver: str) -> ClaimAllocation:
    """This driver's part of an allocated claim; ClaimError when the claim does not fit the reference."""
    where = f"claim {ref.namespace}/{ref.name}"
    uid = _field(claim, "metadata", "uid")
    if uid != ref.uid:
        raise ClaimError(f"{where} has UID {uid}, not {ref.uid}: it was deleted and created again")
    devices = _field(claim, "status", "allocation", "devices")
    if not isinstance(devices, Mapping):
        raise ClaimError(f"{where} is not allocated")
    results = [_result(r, i, where, driver) for i, r in enumerate(_list(devices.get("results"), f"{where} results"))]
    ours = tuple(r for r in results if r.driver == driver)
    if not ours:
        drivers = ", ".join(sorted({r.driver for r in results})) or "none"
        raise ClaimError(f"{where} has no device allocated by driver {driver} (allocated by: {drivers})")
    _check_shares_distinct(ours, where)
    configs = tuple(
        entry
        for i, raw in enumerate(_list(devices.get("config"), f"{where} config"))
        if (entry := _config(raw, i, driver, where)) is not None
    )
    annotation = _field(claim, "metadata", "annotations", POD_CLAIM_NAME)
    return ClaimAllocation(ref, ours, configs, annotation if isinstance(annotation, str) else None)


def configs_for(allocation: ClaimAllocation, device: DeviceAllocation) -> list[OpaqueEntry]:
    """The configurations that apply to a device, weakest first: class before claim, general before specific.

    The last one is the effective configuration; all of them are validated, so a broken one is never hidden.
    """
    applicable = [c for c in allocation.configs if c.applies_to(device.request)]
    return sorted(applicable, key=lambda c: (c.source == FROM_CLAIM, bool(c.requests), c.index))


def _field(obj: Any, *path: str) -> Any:
    for key in path:
        obj = obj.get(key) if isinstance(obj, Mapping) else None
    return obj


def _list(value: Any, what: str) -> Sequence[Any]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ClaimError(f"{what} is malformed: expected a list")
    return value


def _result(raw: Any, index: int, where: str, driver: str) -> DeviceAllocation:
    fields = {key: _field(raw, key) for key in ("request", "driver", "pool", "device")}
    missing = [key for key, value in fields.items() if not isinstance(value, str) or not value]
    if missing:
        raise ClaimError(f"{where}: allocation result #{index} lacks {', '.join(missing)}")
    share = _field(raw, "shareID")
    if share is not None and not is_uid(share):
        raise ClaimError(f"{where}: allocation result #{index} has shareID {str(share)[:80]!r}, not a UID")
    # Another driver's amounts are its own business.
    ours = fields["driver"] == driver
    written, consumed = _consumed(_field(raw, "consumedCapacity"), index, where) if ours else ({}, {})
    return DeviceAllocation(
        request=fields["request"],
        driver=fields["driver"],
        pool=fields["pool"],
        device=fields["device"],
        admin_access=_field(raw, "adminAccess") is True,
        share_id=share,
        consumed=consumed,
        written=written,
        index=index,
    )


def _consumed(raw: Any, index: int, where: str) -> tuple[dict[str, str], dict[str, int]]:
    """A share's consumedCapacity as the claim writes it, and in whole units (rounded up, as the scheduler rounds
    a request up: the amounts of every capacity the agent publishes are whole unless written by hand).

    Each amount must be as the API server serves it: a quantity in the server's own form (the server checks no
    more, and writes every value back in its form), neither negative nor beyond what Kubernetes computes with.
    Whether the amount suits the device is checked with the plan (agent/claims/share_amounts.py)."""
    if raw is None:
        return {}, {}
    if not isinstance(raw, Mapping):
        raise ClaimError(f"{where}: allocation result #{index} consumedCapacity is malformed: expected a map")
    written: dict[str, str] = {}
    consumed: dict[str, int] = {}
    for name, value in raw.items():
        field_path = f"status.allocation.devices.results[{index}].consumedCapacity.{str(name)[:80]}"
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # a JSON number, which the server would have stored as this string
        if not isinstance(value, str):
            raise ClaimError(f'{where}: {field_path}: must be a quantity such as "40Gi", not '
                             f"{json.dumps(value)[:80]}")
        try:
            consumed[str(name)] = math.ceil(read_amount(value))
        except ValueError as e:
            raise ClaimError(f"{where}: {field_path}: {e}") from None
        written[str(name)] = value
    return written, consumed


def _check_shares_distinct(results: Sequence[DeviceAllocation], where: str) -> None:
    """One shareID per share: the scheduler gives every share a new one, so one met twice was written by hand,
    and the two would be counted as one."""
    first: dict[str, int] = {}
    for result in results:
        if result.share_id is None:
            continue
        if result.share_id in first:
            raise ClaimError(f"{where}: {result.path}.shareID: {result.share_id} is the shareID of "
                             f"results[{first[result.share_id]}] too: the scheduler gives every share its own")
        first[result.share_id] = result.index


def _config(raw: Any, index: int, driver: str, where: str) -> OpaqueEntry | None:
    opaque = _field(raw, "opaque")
    if not isinstance(opaque, Mapping) or opaque.get("driver") != driver:
        return None  # another driver's configuration
    source = _field(raw, "source")
    if source not in (FROM_CLASS, FROM_CLAIM):
        raise ClaimError(f"{where}: config #{index} has source {source!r}, expected FromClass or FromClaim")
    requests = _list(_field(raw, "requests"), f"{where} config #{index} requests")
    if not all(isinstance(r, str) for r in requests):
        raise ClaimError(f"{where}: config #{index} requests must be names")
    return OpaqueEntry(index, source, tuple(requests), opaque.get("parameters"))
