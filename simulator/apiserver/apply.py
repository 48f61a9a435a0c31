"""Server-side apply of a ResourceClaim's `status.devices`, as the real server does it on `resourceclaims/status`,
kept as small as its semantics allow.

`status.devices` is a list-map keyed by (driver, device, pool, shareID). Each field manager owns the entries it
applied, recorded in `metadata.managedFields` (operation Apply, subresource status, `fieldsV1` with `k:{...}` keys
as the real server writes them). An apply with a manager's new set adds or replaces its entries and removes those
it owned and no longer lists, unless another manager owns them too; entries of other managers stay. Applying an
entry another manager owns with other content is a conflict (409) unless `force=true`, which takes the entry over.

Simplifications: ownership is tracked per entry, not per field inside it (`data` is atomic in both); only
`status.devices` may be applied (other status fields are the scheduler's, written with PUT); writes by PUT and
merge patch are not recorded as Update managers, though entries they remove leave the owners' sets.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from agent.claims.status_rules import DeviceKey, device_key
from simulator.apiserver.objects import drop_deallocated_status_devices
from simulator.apiserver.resources import RESOURCE_CLAIMS, ApiError, JsonObject

__all__ = ["APPLY_PATCH", "apply_status_devices", "claim_status_written", "owned_keys", "prune_managed_fields"]

APPLY_PATCH = "application/apply-patch+yaml"
_STATUS = "status"


def apply_status_devices(old: Mapping[str, Any], applied: Mapping[str, Any], manager: str, *, force: bool,
                         time: str) -> tuple[JsonObject, list[JsonObject]]:
    """The claim's status and managedFields after `manager` applied `applied` (a ResourceClaim apply body)."""
    name = str((old.get("metadata") or {}).get("name") or "")
    if not manager:
        raise ApiError(422, 'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required value: is required for '
                       "apply patch")
    status = applied.get("status") or {}
    if not isinstance(status, Mapping) or set(status) - {"devices"}:
        raise ApiError(400, "the test API server applies status.devices only")
    entries = status.get("devices") or []
    if not isinstance(entries, list) or not all(isinstance(e, Mapping) for e in entries):
        raise ApiError(400, "status.devices must be a list of objects")
    wanted: dict[DeviceKey, JsonObject] = {}
    for entry in entries:
        key = device_key(entry)
        if key in wanted:
            raise _duplicate(old, ".status.devices", _key_fields(key))
        wanted[key] = dict(entry)
        types = [c.get("type") for c in entry.get("conditions") or () if isinstance(c, Mapping)]
        if (twice := next((t for i, t in enumerate(types) if t in types[:i]), None)) is not None:
            raise _duplicate(old, f".status.devices{_key_fields(key)}.conditions", f"[type={json.dumps(twice)}]")
    old_status: JsonObject = dict(old.get("status") or {})
    live: list[JsonObject] = list(old_status.get("devices") or [])
    managed: list[JsonObject] = list((old.get("metadata") or {}).get("managedFields") or [])
    owners = {i: owned_keys(m) for i, m in enumerate(managed)}
    mine = next((i for i, m in enumerate(managed) if _is_apply(m, manager)), None)
    owned = owners.get(mine, set()) if mine is not None else set()
    by_key = {device_key(e): e for e in live}

    conflicts = [(key, managed[i]["manager"]) for i, keys in owners.items() if i != mine
                 for key in keys & wanted.keys() if by_key.get(key) != wanted[key]]
    if conflicts and not force:
        raise _conflict(name, conflicts)
    for i in owners:
        if i != mine:
            owners[i] -= {key for key, _ in conflicts}  # forced: the entries change hands
    shared = set().union(*(keys for i, keys in owners.items() if i != mine))

    devices: list[JsonObject] = []
    for entry in live:
        key = device_key(entry)
        if key in wanted:
            devices.append(wanted.pop(key))
        elif key not in owned or key in shared:
            devices.append(entry)
    devices.extend(wanted.values())
    applied_keys = {device_key(e) for e in entries}

    new_status = {**old_status, "devices": devices}
    if not devices:
        del new_status["devices"]
    if devices == live and applied_keys == owned and not conflicts:
        return new_status, managed  # nothing changes hands: the stored managedFields stay as they are
    result: list[JsonObject] = []
    for i, entry in enumerate(managed):
        if i == mine:
            continue
        if owners[i] != owned_keys(entry):
            entry = _with_keys(entry, owners[i], devices)
        if owned_keys(entry) or not _is_status(entry):
            result.append(entry)
    if applied_keys:
        mine_entry = {"manager": manager, "operation": "Apply", "apiVersion": RESOURCE_CLAIMS.api_version,
                      "time": time, "fieldsType": "FieldsV1", "fieldsV1": {}, "subresource": _STATUS}
        position = mine if mine is not None else len(result)
        result.insert(min(position, len(result)), _with_keys(mine_entry, applied_keys, devices))
    return new_status, result


def claim_status_written(claim: JsonObject, old: Mapping[str, Any],
                         managed_fields: Sequence[JsonObject] | None) -> None:
    """What every status write of a ResourceClaim does besides: entries of deallocated devices dropped, and its
    managedFields those of an apply (`managed_fields`), else the stored ones less the entries that are gone."""
    drop_deallocated_status_devices(claim, old)
    meta = claim["metadata"]
    managed = list(managed_fields) if managed_fields is not None else prune_managed_fields(
        (old.get("metadata") or {}).get("managedFields") or [], (claim.get("status") or {}).get("devices") or [])
    meta.pop("managedFields", None)
    if managed:
        meta["managedFields"] = managed


def prune_managed_fields(managed: Sequence[Mapping[str, Any]], devices: Sequence[Mapping[str, Any]]
                         ) -> list[JsonObject]:
    """managedFields after a write other than an apply (PUT, merge patch, entries of a deallocated device
    dropped): the owners lose the entries that are gone; a manager left owning nothing is dropped."""
    present = {device_key(e) for e in devices}
    result: list[JsonObject] = []
    for entry in managed:
        keys = owned_keys(entry)
        if keys <= present:
            result.append(dict(entry))
        elif keys & present:
            result.append(_with_keys(entry, keys & present, devices))
    return result


def owned_keys(entry: Mapping[str, Any]) -> set[DeviceKey]:
    """The `status.devices` keys a managedFields entry owns."""
    if not _is_status(entry):
        return set()
    fields = ((entry.get("fieldsV1") or {}).get("f:status") or {}).get("f:devices") or {}
    keys: set[DeviceKey] = set()
    for name in fields:
        if name.startswith("k:"):
            keys.add(device_key(json.loads(name[2:])))
    return keys


def _is_status(entry: Mapping[str, Any]) -> bool:
    return entry.get("subresource") == _STATUS


def _is_apply(entry: Mapping[str, Any], manager: str) -> bool:
    return entry.get("manager") == manager and entry.get("operation") == "Apply" and _is_status(entry)


def _with_keys(entry: Mapping[str, Any], keys: set[DeviceKey], devices: Sequence[Mapping[str, Any]]) -> JsonObject:
    """`entry` owning exactly the entries of `devices` with these keys."""
    owned = {_key_field(device_key(d)): _fields(d) for d in devices if device_key(d) in keys}
    return {**entry, "fieldsV1": {"f:status": {"f:devices": owned}}}


def _key_field(key: DeviceKey) -> str:
    driver, pool, device, share = key
    fields = {"device": device, "driver": driver, "pool": pool}
    if share is not None:
        fields["shareID"] = share
    return "k:" + json.dumps(fields, separators=(",", ":"), sort_keys=True)


def _fields(value: Mapping[str, Any]) -> JsonObject:
    """The fieldsV1 set of an entry: its fields, conditions as a list-map keyed by type, `data` atomic."""
    fields: JsonObject = {".": {}}
    for name, item in sorted(value.items()):
        if name == "conditions" and isinstance(item, list):
            fields["f:conditions"] = {
                "k:" + json.dumps({"type": c.get("type")}, separators=(",", ":")): {
                    ".": {}, **{f"f:{k}": {} for k in sorted(c)}}
                for c in item if isinstance(c, Mapping)}
        elif name == "networkData" and isinstance(item, Mapping):
            fields["f:networkData"] = {".": {}, **{f"f:{k}": {} for k in sorted(item)}}
        else:
            fields[f"f:{name}"] = {}
    return fields


def _key_fields(key: DeviceKey) -> str:
    """An entry's key as server-side apply prints it: `[device="...",driver="...",pool="..."(,shareID="...")]`."""
    driver, pool, device, share = key
    parts = [f'device="{device}"', f'driver="{driver}"', f'pool="{pool}"']
    if share is not None:
        parts.append(f'shareID="{share}"')
    return "[" + ",".join(parts) + "]"


def _duplicate(claim: Mapping[str, Any], path: str, key: str) -> ApiError:
    """What the real server answers an apply listing one key of a list-map twice: it cannot build the typed
    patch, and says so as an internal error, before any validation."""
    meta = claim.get("metadata") or {}
    return ApiError(500, f"failed to create typed patch object ({meta.get('namespace')}/{meta.get('name')}; "
                    f"{RESOURCE_CLAIMS.api_version}, Kind={RESOURCE_CLAIMS.kind}): {path}: duplicate entries for key "
                    f"{key}")


def _conflict(name: str, conflicts: Sequence[tuple[DeviceKey, str]]) -> ApiError:
    def path(key: DeviceKey) -> str:
        return ".status.devices" + _key_fields(key)

    lines = [f'conflict with "{manager}" with subresource "status" using {RESOURCE_CLAIMS.api_version}: '
             f"{path(key)}" for key, manager in conflicts]
    count = f"{len(lines)} conflict{'s' if len(lines) > 1 else ''}"
    message = f"Apply failed with {count}: " + ("\n".join(lines) if len(lines) > 1 else lines[0])
    causes = [{"reason": "FieldManagerConflict", "message": line.split(":")[0], "field": path(key)}
              for line, (key, _) in zip(lines, conflicts, strict=True)]
    return ApiError(409, message, reason="Conflict", details={"name": name, "group": RESOURCE_CLAIMS.group,
                                                                "kind": RESOURCE_CLAIMS.plural, "causes": causes})
