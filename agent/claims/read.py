"""Reading a ResourceClaim for prepare: which devices are this driver's, for which requests, with which opaque
configuration, and whether the kubelet's reference to it is sound.

Pure: works on the claim as the API server returned it (a JSON mapping) and raises ClaimError with a message
meant for the pod's events when the claim cannot be prepared.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.kube.names import is_dns_label, is_dns_subdomain
from agent.kube.quantity import parse_quantity
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
_UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
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
    if not _UID.fullmatch(ref.uid):
        raise ClaimError(f"claim UID {ref.uid[:80]!r} is not a Kubernetes UID")
    if not is_dns_label(ref.namespace):
        raise ClaimError(f"claim namespace {ref.namespace[:80]!r} is not a valid namespace name")
    if not is_dns_subdomain(ref.name):
        raise ClaimError(f"claim name {ref.name[:80]!r} is not a valid object name")


def read_allocation(claim: Mapping[str, Any], ref: ClaimRef, driver: str) -> ClaimAllocation:
    """This driver's part of an allocated claim; ClaimError when the claim does not fit the reference."""
    where = f"claim {ref.namespace}/{ref.name}"
    uid = _field(claim, "metadata", "uid")
    if uid != ref.uid:
        raise ClaimError(f"{where} has UID {uid}, not {ref.uid}: it was deleted and created again")
    devices = _field(claim, "status", "allocation", "devices")
    if not isinstance(devices, Mapping):
        raise ClaimError(f"{where} is not allocated")
    results = [_result(r, i, where) for i, r in enumerate(_list(devices.get("results"), f"{where} results"))]
    ours = tuple(r for r in results if r.driver == driver)
    if not ours:
        drivers = ", ".join(sorted({r.driver for r in results})) or "none"
        raise ClaimError(f"{where} has no device allocated by driver {driver} (allocated by: {drivers})")
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


def _result(raw: Any, index: int, where: str) -> DeviceAllocation:
    fields = {key: _field(raw, key) for key in ("request", "driver", "pool", "device")}
    missing = [key for key, value in fields.items() if not isinstance(value, str) or not value]
    if missing:
        raise ClaimError(f"{where}: allocation result #{index} lacks {', '.join(missing)}")
    share = _field(raw, "shareID")
    if share is not None and (not isinstance(share, str) or not _UID.fullmatch(share)):
        raise ClaimError(f"{where}: allocation result #{index} has shareID {str(share)[:80]!r}, not a UID")
    return DeviceAllocation(
        request=fields["request"],
        driver=fields["driver"],
        pool=fields["pool"],
        device=fields["device"],
        admin_access=_field(raw, "adminAccess") is True,
        share_id=share,
        consumed=_consumed(_field(raw, "consumedCapacity"), index, where),
    )


def _consumed(raw: Any, index: int, where: str) -> dict[str, int]:
    """A share's consumedCapacity in whole units (rounded up, as the allocator rounds a request up)."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ClaimError(f"{where}: allocation result #{index} consumedCapacity is malformed: expected a map")
    consumed: dict[str, int] = {}
    for name, value in raw.items():
        try:
            consumed[str(name)] = math.ceil(parse_quantity(value if isinstance(value, str) else json.dumps(value)))
        except ValueError as e:
            raise ClaimError(f"{where}: allocation result #{index} consumedCapacity {name}: {e}") from None
    return consumed


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
