"""What the test API server does to an object's JSON on its way in and out, as the real registry does: timestamps,
copies, JSON merge patches, fields of disabled feature gates dropped, defaults, and the checks of names and of
times that come before validation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, TypeVar, cast

from agent.claims.status_rules import allocated_keys, device_key
from agent.claims.status_rules import unreadable_time as unreadable_status_time
from agent.events.rules import unreadable_time as unreadable_event_time
from agent.kube.field_errors import FieldErrors
from agent.kube.names import SERVER_SUBDOMAIN_MSG, is_dns_subdomain, is_uid
from simulator.apiserver.resources import EVENTS_V1, RESOURCE_CLAIMS, ApiError, JsonObject, ResourceType

__all__ = ["Key", "allocation_errors", "default_taint_times", "drop_deallocated_status_devices", "drop_disabled_fields",
           "json_copy", "merge_patch", "name_errors", "now", "object_key", "refuse_unreadable", "unreadable_time",
           "with_version", "without_type"]

Key = tuple[str, str]  # (namespace or "", name)


_T = TypeVar("_T")


def now() -> str:
    """The current time as the API server writes timestamps: RFC 3339, UTC, whole seconds."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def json_copy(value: _T) -> _T:
    """A deep copy of JSON-shaped data (faster than copy.deepcopy for it)."""
    return cast(_T, json.loads(json.dumps(value)))


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch; returns new containers and leaves ``target`` untouched."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def object_key(obj: Mapping[str, Any]) -> Key:
    meta = obj.get("metadata") or {}
    return meta.get("namespace") or "", meta.get("name") or ""


def without_type(obj: JsonObject) -> JsonObject:
    """List items carry no apiVersion and kind in real list responses."""
    return {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}


def with_version(obj: JsonObject, rv: int) -> JsonObject:
    return {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(rv)}}


_GATED_DEVICE_FIELDS = {
    "DRADeviceTaints": ("taints",),
    "DRAPartitionableDevices": ("consumesCounters", "nodeName", "nodeSelector", "allNodes"),
    "DRAConsumableCapacity": ("allowMultipleAllocations",),
    "DRANodeAllocatableResources": ("nodeAllocatableResources",),
}

# Fields of the entries of a device's maps and lists (capacities, attributes, counter uses) dropped with a gate off.
_GATED_ENTRY_FIELDS = {
    "DRAConsumableCapacity": ("capacity", ("requestPolicy",)),
    "DRAListTypeAttributes": ("attributes", ("ints", "bools", "strings", "versions")),
    "DRADeviceCompatibilityGroups": ("consumesCounters", ("compatibilityGroups",)),
}

_GATED_SPEC_FIELDS = {
    "DRAPartitionableDevices": ("sharedCounters", "perDeviceNodeSelection"),
    "DRAPartitionableDevicesType": ("partitionTypeAttribute",),
    "DRAOptionalNodeOperations": ("skipNodeOperations",),
}

OFF_BY_DEFAULT = frozenset({
    "DRAListTypeAttributes", "DRANodeAllocatableResources", "DRADeviceCompatibilityGroups",
    "DRAPartitionableDevicesType", "DRAOptionalNodeOperations",
})  # fmt: skip
"""The alpha gates of 1.37 with ResourceSlice fields: off unless a cluster turns them on, so their fields are
dropped (agent.slices.rules models the same server)."""


def drop_disabled_fields(obj: JsonObject, old: JsonObject | None, disabled: set[str]) -> None:
    """What the real server does with the fields of a feature gate that is off: drop them silently, unless the
    stored object already used them (then an update keeps them)."""
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return
    old_spec = (old or {}).get("spec") or {}

    def entries(device: Any, field: str) -> list[Any]:
        """The entries of one of a device's maps or lists, those that are objects."""
        value = device.get(field) if isinstance(device, dict) else None
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        return [item for item in items if isinstance(item, dict)]

    def used(spec_fields: tuple[str, ...], device_fields: tuple[str, ...], entry_fields: tuple[str, ...],
             of: str) -> bool:  # fmt: skip
        return any(old_spec.get(f) is not None for f in spec_fields) or any(
            isinstance(d, dict) and (any(d.get(f) is not None for f in device_fields) or any(
                e.get(f) is not None for e in entries(d, of) for f in entry_fields))
            for d in old_spec.get("devices") or ())

    for gate in disabled:
        spec_fields, device_fields = _GATED_SPEC_FIELDS.get(gate, ()), _GATED_DEVICE_FIELDS.get(gate, ())
        of, entry_fields = _GATED_ENTRY_FIELDS.get(gate, ("", ()))
        if used(spec_fields, device_fields, entry_fields, of):
            continue
        for name in spec_fields:
            spec.pop(name, None)
        for device in spec.get("devices") or ():
            for name in device_fields:
                if isinstance(device, dict):
                    device.pop(name, None)
            for entry in entries(device, of) if of else ():
                for name in entry_fields:
                    entry.pop(name, None)


def drop_deallocated_status_devices(claim: JsonObject, old: Mapping[str, Any]) -> None:
    """The ResourceClaim status strategy: entries of ``status.devices`` whose device (or share of one) left the
    allocation go, matched on driver, pool, device and shareID, as since Kubernetes 1.34."""
    gone = allocated_keys(old.get("status") or {}) - allocated_keys(claim.get("status") or {})
    status = claim.get("status")
    if not gone or not isinstance(status, dict) or not isinstance(status.get("devices"), list):
        return
    kept = [d for d in status["devices"] if not isinstance(d, dict) or device_key(d) not in gone]
    if kept:
        status["devices"] = kept
    else:
        del status["devices"]


def default_taint_times(obj: JsonObject) -> None:
    """Defaulting of ResourceSlice taints: a missing ``timeAdded`` becomes now, cut to seconds (T4)."""
    devices = (obj.get("spec") or {}).get("devices") if isinstance(obj.get("spec"), dict) else None
    for device in devices if isinstance(devices, list) else ():
        taints = device.get("taints") if isinstance(device, dict) else None
        for taint in taints if isinstance(taints, list) else ():
            if isinstance(taint, dict) and not taint.get("timeAdded"):
                taint["timeAdded"] = now()


def unreadable_time(rt: ResourceType, obj: Mapping[str, Any]) -> str | None:
    """Go's error for the first time of the object the real server cannot read (an Event's times, the condition
    times of a claim's `status.devices`): it fails the request before validation. None when it reads them all."""
    if rt is EVENTS_V1:
        found = unreadable_event_time(obj)
    elif rt is RESOURCE_CLAIMS and isinstance(obj.get("status"), Mapping):
        found = unreadable_status_time(obj["status"])
    else:
        found = None
    return None if found is None else f'parsing time {found[0]} as "{found[1]}": cannot parse'


def refuse_unreadable(rt: ResourceType, obj: Mapping[str, Any], write: str = "body", where: str = "") -> None:
    """Refuse an object with a time the real server cannot read, as it refuses it: 400 for a request's `body`,
    422 naming `patch` for the result of a merge patch (the patch's fault), 500 for the result of an `apply` to
    the object at `where` (namespace/name)."""
    why = unreadable_time(rt, obj)
    if why is None:
        return
    if write == "patch":
        error = f"Invalid value: {json.dumps(json.dumps(obj))}: {why}"
        cause = {"reason": "FieldValueInvalid", "message": error, "field": "patch"}
        raise ApiError(422, f' "" is invalid: patch: {error}', details={"name": "", "kind": "", "causes": [cause]})
    if write == "apply":
        raise ApiError(500, f"failed to convert new object ({where}; {rt.api_version}, Kind={rt.kind}) to proper "
                       f"version: unable to convert unstructured object to {rt.api_version}, Kind={rt.kind}: {why}")
    raise ApiError(400, f'{rt.kind} in version "{rt.version}" cannot be handled as a {rt.kind}: {why}')


def name_errors(meta: Mapping[str, Any]) -> list[str]:
    """The server's errors for an object's name, in its words."""
    errors = FieldErrors()
    name = meta.get("name")
    if not name:
        errors.required("metadata.name", "name or generateName is required")
    elif not is_dns_subdomain(name):
        errors.invalid("metadata.name", name, SERVER_SUBDOMAIN_MSG)
    return errors


def allocation_errors(claim: JsonObject) -> list[str]:
    """The server's checks of a ResourceClaim's allocation results that the agent relies on: a result's
    ``shareID`` is a lowercase 36-character UUID."""
    allocation = (claim.get("status") or {}).get("allocation") if isinstance(claim.get("status"), dict) else None
    devices = allocation.get("devices") if isinstance(allocation, dict) else None
    results = devices.get("results") if isinstance(devices, dict) else None
    errors = FieldErrors()
    for index, result in enumerate(results if isinstance(results, list) else ()):
        share = result.get("shareID") if isinstance(result, dict) else None
        if share is not None and not is_uid(share):
            errors.invalid(f"status.allocation.devices.results[{index}].shareID", share,
                           "must be a lowercase UUID in 8-4-4-4-12 format")
    return errors
