"""The test API server's storage: objects, the global resourceVersion, the change history and open watches.

Writes follow the real registry: generated names, system metadata, strategy effects (ResourceSlice generation
and taint ``timeAdded``, ResourceClaim status only through ``/status``, its ``status.devices`` entries of
deallocated devices dropped), times the real server cannot read (400 for a body, 422 naming ``patch`` for a
merge patch, 500 for a server-side apply), validation (422: ResourceSlices and events.k8s.io/v1 Events in full, a
ResourceClaim's ``status.devices`` and allocation results' shareIDs on status writes, other kinds their names),
the authorization of the drivers whose ``status.devices`` entries a write changes (422, before the validation's
errors; simulator/apiserver/authorization.py), optimistic concurrency (409), no-op updates that neither bump the
resourceVersion nor notify watchers, and server-side apply of a claim's ``status.devices``. A DeviceClass's
extendedResourceName is checked (simulator/apiserver/deviceclasses.py). Stored objects are never mutated once
committed, so they can be shared with watchers and serialised without copying.
"""

from __future__ import annotations

import base64
import binascii
import json
import secrets
import uuid
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from agent.claims.status_rules import claim_status_errors
from agent.events.rules import validate_event, validate_event_update
from agent.slices.rules import validate_resource_slice, validate_resource_slice_update
from simulator.apiserver.apply import apply_status_devices, claim_status_written
from simulator.apiserver.authorization import ANYONE, Caller, device_status_forbidden
from simulator.apiserver.deviceclasses import drop_disabled_class_fields, validate_device_class
from simulator.apiserver.objects import (
    OFF_BY_DEFAULT,
    Key,
    allocation_errors,
    default_taint_times,
    drop_disabled_fields,
    json_copy,
    merge_patch,
    name_errors,
    now,
    object_key,
    refuse_unreadable,
    with_version,
    without_type,
)
from simulator.apiserver.resources import (
    DEVICE_CLASSES,
    EVENTS_V1,
    RESOURCE_CLAIMS,
    RESOURCE_SLICES,
    RESOURCES,
    STALE,
    ApiError,
    JsonObject,
    ResourceType,
    already_exists,
    conflict,
    invalid,
    not_found,
)
from simulator.apiserver.selectors import Selector
from simulator.apiserver.watches import ADDED, BOOKMARK, DELETED, ERROR, MODIFIED, Change, Watch

INITIAL_EVENTS_END = "k8s.io/initial-events-end"
_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # the real server's generateName alphabet: no vowels, no 0/1/3
_SYSTEM_FIELDS = ("uid", "creationTimestamp", "generation", "deletionTimestamp", "deletionGracePeriodSeconds")


class Store:
    """All objects of all served types under one resourceVersion counter, with a bounded change history."""

    def __init__(self, history_size: int = 10_000, disabled_gates: Iterable[str] = (), caller: Caller = ANYONE
                 ) -> None:
        self._objects: dict[ResourceType, dict[Key, JsonObject]] = {rt: {} for rt in RESOURCES}
        # Feature gates off, those given and 1.37's alpha ones: their ResourceSlice fields are dropped.
        self.disabled_gates = set(disabled_gates) | OFF_BY_DEFAULT
        self.caller = caller  # who writes: what the authorization of claim status writes decides on
        self._rv = 1
        self._history: deque[Change] = deque()
        self._history_size = history_size
        self._compacted = 0  # changes up to this resourceVersion are no longer in the history
        self._watches: set[Watch] = set()

    @property
    def resource_version(self) -> int:
        return self._rv

    # --- reads ---------------------------------------------------------------------------------

    def get(self, rt: ResourceType, namespace: str, name: str) -> JsonObject:
        obj = self._objects[rt].get((namespace, name))
        if obj is None:
            raise not_found(rt, name)
        return obj

    def count(self, rt: ResourceType) -> int:
        return len(self._objects[rt])

    def objects(self, rt: ResourceType) -> list[JsonObject]:
        return [json_copy(obj) for _, obj in sorted(self._objects[rt].items())]

    def list(self, selector: Selector, *, limit: int = 0, continue_token: str = "") -> JsonObject:
        """A ``<Kind>List`` of matching objects in key order; ``limit`` and ``continue`` page through it."""
        rt = selector.rt
        items = [obj for key, obj in sorted(self._objects[rt].items()) if selector.matches(obj)]
        if continue_token:
            start = self._continue_key(continue_token)
            items = [obj for obj in items if object_key(obj) > start]
        meta: JsonObject = {"resourceVersion": str(self._rv)}
        if 0 < limit < len(items):
            last = object_key(items[limit - 1])
            token = json.dumps({"rv": self._rv, "start": list(last)}).encode()
            meta["continue"] = base64.urlsafe_b64encode(token).decode()
            meta["remainingItemCount"] = len(items) - limit
            items = items[:limit]
        return {"kind": f"{rt.kind}List", "apiVersion": rt.api_version, "metadata": meta,
                "items": [without_type(obj) for obj in items]}  # fmt: skip

    @staticmethod
    def _continue_key(token: str) -> Key:
        try:
            start = json.loads(base64.urlsafe_b64decode(token.encode()))["start"]
            return str(start[0]), str(start[1])
        except (ValueError, KeyError, IndexError, TypeError, binascii.Error):
            raise ApiError(400, f"continue key is not valid: {token}") from None

    # --- writes --------------------------------------------------------------------------------

    def _accept(self, rt: ResourceType, namespace: str, body: Any) -> JsonObject:
        """The request body as an object of type ``rt`` in ``namespace``, or 400 as the real decoder gives."""
        if not isinstance(body, dict):
            raise ApiError(400, f"the body of the request is not a {rt.kind} object")
        api_version, kind = body.get("apiVersion"), body.get("kind")
        if api_version and api_version != rt.api_version:
            raise ApiError(400, f"the API version in the data ({api_version}) does not match the expected API "
                           f"version ({rt.api_version})")  # fmt: skip
        if kind and kind != rt.kind:
            raise ApiError(400, f"the kind in the data ({kind}) does not match the expected kind ({rt.kind})")
        if not isinstance(body.get("metadata") or {}, dict):
            raise ApiError(400, "metadata must be an object")
        obj: JsonObject = {"apiVersion": rt.api_version, "kind": rt.kind, **body}
        obj["apiVersion"], obj["kind"] = rt.api_version, rt.kind
        meta = obj["metadata"] = dict(obj.get("metadata") or {})
        if rt.namespaced:
            if meta.get("namespace") and meta["namespace"] != namespace:
                raise ApiError(400, "the namespace of the provided object does not match the namespace sent on "
                               "the request")  # fmt: skip
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)  # the real server clears it for cluster-scoped types
        return obj

    def create(self, rt: ResourceType, namespace: str, body: Any, *, dry_run: bool = False) -> JsonObject:
        obj = self._accept(rt, namespace, body)
        meta = obj["metadata"]
        if meta.get("resourceVersion"):
            raise ApiError(500, "Internal error occurred: resourceVersion should not be set on objects to be created")
        for field in _SYSTEM_FIELDS:
            meta.pop(field, None)
        prefix = meta.get("generateName")
        if not meta.get("name") and isinstance(prefix, str) and prefix:
            meta["name"] = self._generate_name(rt, namespace, prefix)
        meta["uid"], meta["creationTimestamp"] = str(uuid.uuid4()), now()
        if rt.tracks_generation:
            meta["generation"] = 1
        if rt is RESOURCE_CLAIMS:
            obj.pop("status", None)  # status is written through /status only
        if rt is RESOURCE_SLICES:
            drop_disabled_fields(obj, None, self.disabled_gates)
            default_taint_times(obj)
            errors = validate_resource_slice(obj)
        elif rt is EVENTS_V1:
            refuse_unreadable(rt, obj)
            errors = validate_event(obj)
        else:
            errors = name_errors(meta)
            if rt is DEVICE_CLASSES:
                drop_disabled_class_fields(obj, None, self.disabled_gates)
                errors += validate_device_class(obj)
        if errors:
            raise invalid(rt, str(meta.get("name") or ""), errors)
        if (namespace if rt.namespaced else "", meta["name"]) in self._objects[rt]:
            raise already_exists(rt, meta["name"])
        return obj if dry_run else self._commit(rt, ADDED, obj, None)

    def _generate_name(self, rt: ResourceType, namespace: str, prefix: str) -> str:
        while True:  # the real server also retries a generated name that is taken
            name = prefix[:58] + "".join(secrets.choice(_NAME_CHARS) for _ in range(5))
            if (namespace if rt.namespaced else "", name) not in self._objects[rt]:
                return name

    def update(
        self, rt: ResourceType, namespace: str, name: str, body: Any, *, status: bool = False, dry_run: bool = False,
        managed_fields: Sequence[JsonObject] | None = None, verb: str = "update",
    ) -> JsonObject:
        """PUT (or ``/status`` PUT): optimistic concurrency on ``metadata.resourceVersion`` when it is set.
        ``managed_fields``: the object's managedFields after a server-side apply (else they are kept, less the
        ``status.devices`` entries the write removed); ``verb``: the request's, as authorization sees it (a patch
        or an apply is stored as an update)."""
        obj = self._accept(rt, namespace, body)
        meta = obj["metadata"]
        if meta.get("name") != name:
            raise ApiError(400, f"the name of the object ({meta.get('name') or ''}) does not match the name on the "
                           f"URL ({name})")  # fmt: skip
        refuse_unreadable(rt, obj)
        old = self.get(rt, namespace if rt.namespaced else "", name)
        old_meta = old["metadata"]
        if meta.get("uid") and meta["uid"] != old_meta["uid"]:
            raise conflict(rt, name, f"Precondition failed: UID in precondition: {meta['uid']}, UID in object "
                           f"meta: {old_meta['uid']}")  # fmt: skip
        if meta.get("resourceVersion") and meta["resourceVersion"] != old_meta["resourceVersion"]:
            raise conflict(rt, name, STALE)
        if status:  # only the status changes; metadata and spec stay as stored
            obj = {**json_copy(old), "status": obj.get("status")}
            meta = obj["metadata"]
            if obj["status"] is None:
                del obj["status"]
        else:
            for field in (*_SYSTEM_FIELDS, "managedFields"):
                meta.pop(field, None)
                if field in old_meta:
                    meta[field] = old_meta[field]
            if rt.has_status:
                obj.pop("status", None)
                if "status" in old:
                    obj["status"] = old["status"]
        if rt is RESOURCE_SLICES:
            drop_disabled_fields(obj, old, self.disabled_gates)
            default_taint_times(obj)  # defaulting comes first, so a defaulted time counts as a spec change
        elif rt is DEVICE_CLASSES:
            drop_disabled_class_fields(obj, old, self.disabled_gates)
        if rt.tracks_generation and obj.get("spec") != old.get("spec"):
            meta["generation"] = int(old_meta.get("generation") or 0) + 1
        if rt is RESOURCE_CLAIMS and status:
            claim_status_written(obj, old, managed_fields)
        errors: list[str] = []
        if rt is RESOURCE_SLICES:
            errors = validate_resource_slice_update(old, obj)
        elif rt is RESOURCE_CLAIMS and obj.get("spec") != old.get("spec"):
            errors = ["spec: field is immutable"]
        elif rt is RESOURCE_CLAIMS and status:
            new_status, old_status = obj.get("status") or {}, old.get("status") or {}
            errors = device_status_forbidden(self.caller, verb, namespace, new_status, old_status)
            errors += allocation_errors(obj) + claim_status_errors(new_status)
        elif rt is EVENTS_V1:
            errors = validate_event_update(old, obj)
        elif rt is DEVICE_CLASSES:
            errors = validate_device_class(obj)
        if errors:
            raise invalid(rt, name, errors)
        meta["resourceVersion"] = old_meta["resourceVersion"]
        if obj == old or dry_run:  # an unchanged object is not written: same resourceVersion, no event
            return old if obj == old else obj
        return self._commit(rt, MODIFIED, obj, old)

    def patch(
        self, rt: ResourceType, namespace: str, name: str, patch: Any, *, status: bool = False, dry_run: bool = False
    ) -> JsonObject:
        """A merge patch applied to the stored object, then stored as an update of it."""
        if not isinstance(patch, dict):
            raise ApiError(400, "the patch must be a JSON object")
        old = self.get(rt, namespace if rt.namespaced else "", name)
        patched = json_copy(merge_patch(old, patch))
        refuse_unreadable(rt, patched, "patch")
        return self.update(rt, namespace, name, patched, status=status, dry_run=dry_run, verb="patch")

    def apply_status(
        self, rt: ResourceType, namespace: str, name: str, body: Any, manager: str, *, force: bool = False,
        dry_run: bool = False,
    ) -> JsonObject:
        """Server-side apply on ``/status`` (ResourceClaims' ``status.devices`` only, simulator/apiserver/apply.py)."""
        if rt is not RESOURCE_CLAIMS:
            raise ApiError(415, "the body of the request was in an unknown format - accepted media types include: "
                           "application/json, application/merge-patch+json, application/strategic-merge-patch+json")
        if not isinstance(body, dict) or not body.get("apiVersion") or not body.get("kind"):
            raise ApiError(400, "invalid object type: /, Kind=: apiVersion and kind must be set in an apply body")
        applied = self._accept(rt, namespace, body)
        old = self.get(rt, namespace, name)
        meta = applied["metadata"]
        if meta.get("name") != name:
            raise ApiError(400, f"the name of the object ({meta.get('name') or ''}) does not match the name on the "
                           f"URL ({name})")  # fmt: skip
        status, managed = apply_status_devices(old, applied, manager, force=force, time=now())
        refuse_unreadable(rt, {"status": status}, "apply", f"{namespace}/{name}")
        preconditions = {k: meta[k] for k in ("name", "uid", "resourceVersion") if meta.get(k)}
        return self.update(rt, namespace, name, {"metadata": preconditions, "status": status}, status=True,
                           dry_run=dry_run, managed_fields=managed, verb="patch")

    def delete(
        self, rt: ResourceType, namespace: str, name: str, options: Any = None, *, dry_run: bool = False
    ) -> JsonObject:
        """Delete now (finalizers are not modelled), honouring ``preconditions``; returns the object as it was."""
        old = self.get(rt, namespace if rt.namespaced else "", name)
        meta = old["metadata"]
        pre = options.get("preconditions") if isinstance(options, dict) else None
        if isinstance(pre, dict):
            if pre.get("uid") and pre["uid"] != meta["uid"]:
                raise conflict(rt, name, f"Precondition failed: UID in precondition: {pre['uid']}, UID in object "
                               f"meta: {meta['uid']}")  # fmt: skip
            rv = pre.get("resourceVersion")
            if rv and rv != meta["resourceVersion"]:
                raise conflict(rt, name, f"Precondition failed: ResourceVersion in precondition: {rv}, "
                               f"ResourceVersion in object meta: {meta['resourceVersion']}")  # fmt: skip
        if not dry_run:
            self._commit(rt, DELETED, old, old)
        return old

    def delete_collection(self, selector: Selector, *, dry_run: bool = False) -> JsonObject:
        doomed = [obj for _, obj in sorted(self._objects[selector.rt].items()) if selector.matches(obj)]
        for obj in doomed if not dry_run else ():
            self._commit(selector.rt, DELETED, obj, obj)
        rt, items = selector.rt, [without_type(obj) for obj in doomed]
        meta = {"resourceVersion": str(self._rv)}
        return {"kind": f"{rt.kind}List", "apiVersion": rt.api_version, "metadata": meta, "items": items}

    def put(self, rt: ResourceType, body: Mapping[str, Any]) -> JsonObject:
        """Store ``body`` as given (status included, no validation), creating or replacing; watchers are told."""
        obj = self._accept(rt, str((body.get("metadata") or {}).get("namespace") or "default"), json_copy(body))
        meta = obj["metadata"]
        if not meta.get("name"):
            raise ValueError("put needs metadata.name")
        old = self._objects[rt].get(object_key(obj))
        meta.setdefault("uid", old["metadata"]["uid"] if old else str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", old["metadata"]["creationTimestamp"] if old else now())
        if rt.tracks_generation:
            meta.setdefault("generation", 1)
        return json_copy(self._commit(rt, MODIFIED if old else ADDED, obj, old))

    def remove(self, rt: ResourceType, namespace: str, name: str) -> bool:
        old = self._objects[rt].get((namespace if rt.namespaced else "", name))
        if old is not None:
            self._commit(rt, DELETED, old, old)
        return old is not None

    def _commit(self, rt: ResourceType, type_: str, obj: JsonObject, old: JsonObject | None) -> JsonObject:
        self._rv += 1
        key = object_key(obj)
        obj = with_version(obj, self._rv)
        if type_ == DELETED:
            del self._objects[rt][key]
        else:
            self._objects[rt][key] = obj
        change = Change(self._rv, type_, rt, obj, old)
        self._history.append(change)
        while len(self._history) > self._history_size:
            self._compacted = self._history.popleft().rv
        for watch in self._watches:
            watch.offer(change)
        return obj

    # --- watches -------------------------------------------------------------------------------

    def watch(self, selector: Selector, resource_version: str, *, initial: bool | None, bookmarks: bool) -> Watch:
        """Open a watch. ``initial`` None means the default of the real server: current objects as ADDED events
        when ``resource_version`` is "" or "0", else the changes after it (410 Gone if it is too old)."""
        if resource_version not in ("", "0") and not resource_version.isdigit():
            raise ApiError(400, f'invalid resource version "{resource_version}"')
        watch = Watch(selector, bookmarks=bookmarks)
        since = int(resource_version or 0)
        send_initial = initial if initial is not None else since == 0
        if send_initial:
            for _, obj in sorted(self._objects[selector.rt].items()):
                if selector.matches(obj):
                    watch.send(ADDED, obj)
            if initial and bookmarks:
                watch.send(BOOKMARK, self.bookmark(selector.rt, initial_end=True))
        elif resource_version in ("", "0"):
            pass  # from now on
        elif since < self._compacted:
            gone = ApiError(410, f"too old resource version: {since} ({self._compacted + 1})", reason="Expired")
            watch.send(ERROR, gone.status())
            watch.end()
            return watch
        else:
            for change in self._history:
                if change.rv > since:
                    watch.offer(change)
        self._watches.add(watch)
        return watch

    def unwatch(self, watch: Watch) -> None:
        self._watches.discard(watch)

    def bookmark(self, rt: ResourceType, *, initial_end: bool = False) -> JsonObject:
        meta: JsonObject = {"resourceVersion": str(self._rv)}
        if initial_end:
            meta["annotations"] = {INITIAL_EVENTS_END: "true"}
        return {"kind": rt.kind, "apiVersion": rt.api_version, "metadata": meta}

    def send_bookmarks(self) -> int:
        """Queue a BOOKMARK on every watch that asked for them; returns how many."""
        chosen = [w for w in self._watches if w.bookmarks]
        for watch in chosen:
            watch.send(BOOKMARK, self.bookmark(watch.selector.rt))
        return len(chosen)

    def end_watches(self, *, reset: bool = False) -> int:
        """End every open watch, cleanly or by resetting its connection; returns how many."""
        watches = list(self._watches)
        for watch in watches:
            watch.end(reset=reset)
        self._watches.clear()
        return len(watches)

    def compact(self) -> None:
        """Forget the change history, as etcd compaction does: older resourceVersions now give 410."""
        self._compacted = self._rv
        self._history.clear()

