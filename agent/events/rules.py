"""The rules of events.k8s.io/v1 Events: how the agent builds one, and what the API server accepts.

The agent's recorder and the test API server share these rules, taken from the real server's validation of
Events created or updated through events.k8s.io/v1 (pkg/apis/core/validation/events.go): required
`eventTime` (a MicroTime: exactly six fractional digits), `type` Normal or Warning, `reportingController` a
qualified name, `reportingInstance`, `action` and `reason` required and at most 128 bytes, `note` at most 1 KiB,
the deprecated core fields unset, a `series` with a count of at least 2 and a `lastObservedTime`; an Event about
a cluster-scoped object (a Node) lives in the namespace `default` (or `kube-system`). On update every field but
the series and the metadata is immutable, compared as the server compares decoded objects (the same moment in
another offset is the same eventTime). Error paths name the core/v1 fields, as the server's messages do
(`message` for the note, `involvedObject` for `regarding`). A time the server cannot read
(agent/kube/times.py) fails the request before validation: :func:`unreadable_time` finds it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from agent.kube.field_errors import FieldErrors
from agent.kube.names import (
    SERVER_DNS_LABEL_MSG,
    SERVER_NAME_PART_MSG,
    SERVER_SUBDOMAIN_MSG,
    is_dns_label,
    is_dns_subdomain,
    is_label_key,
)
from agent.kube.times import MICRO_TIME_LAYOUT, TIME_LAYOUT, instant, is_micro_time, is_rfc3339

__all__ = [
    "ACTION_LIMIT",
    "EVENTS_API_VERSION",
    "NORMAL",
    "NOTE_LIMIT",
    "REASON_LIMIT",
    "REPORTING_INSTANCE_LIMIT",
    "WARNING",
    "Reference",
    "check_fields",
    "cut_note",
    "event_name",
    "is_micro_time",
    "micro_time",
    "reporting_instance",
    "unreadable_time",
    "validate_event",
    "validate_event_update",
]

EVENTS_API_VERSION = "events.k8s.io/v1"
NORMAL, WARNING = "Normal", "Warning"
REPORTING_INSTANCE_LIMIT = 128
ACTION_LIMIT = 128
REASON_LIMIT = 128
NOTE_LIMIT = 1024
"""Bytes, not characters: the server measures the UTF-8 encoding."""

_ELLIPSIS = "…"
_CLUSTER_EVENT_NAMESPACES = ("default", "kube-system")
# Fields an update may not change (the series and the metadata may change).
_IMMUTABLE = (
    ("regarding", "involvedObject"), ("reason", "reason"), ("note", "message"),
    ("deprecatedSource", "source"), ("deprecatedFirstTimestamp", "firstTimestamp"),
    ("deprecatedLastTimestamp", "lastTimestamp"), ("deprecatedCount", "count"), ("type", "type"),
    ("eventTime", "eventTime"), ("action", "action"), ("related", "related"),
    ("reportingController", "reportingController"), ("reportingInstance", "reportingInstance"),
)  # fmt: skip


@dataclass(frozen=True)
class Reference:
    """The object an Event is about (its `regarding`); hashable, so it can be part of an aggregation key."""

    api_version: str
    kind: str
    name: str
    namespace: str = ""
    uid: str = ""

    def to_json(self) -> dict[str, str]:
        ref = {"apiVersion": self.api_version, "kind": self.kind, "name": self.name}
        if self.namespace:
            ref["namespace"] = self.namespace
        if self.uid:
            ref["uid"] = self.uid
        return ref

    @property
    def event_namespace(self) -> str:
        """Where Events about the object live: its own namespace; `default` for a cluster-scoped object."""
        return self.namespace or "default"


def micro_time(seconds: float) -> str:
    """A MicroTime as the API writes it: UTC, RFC 3339 with exactly six fractional digits."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def event_name(regarding_name: str, unix_nanos: int) -> str:
    """`<object>.<nanoseconds in hex>`, or a random UUID when that is no DNS subdomain (a name near 253)."""
    name = f"{regarding_name}.{unix_nanos:x}"
    return name if is_dns_subdomain(name) else str(uuid.uuid4())


def cut_note(note: str) -> str:
    """The note within the server's 1 KiB, cut on a character boundary and ending in an ellipsis when cut."""
    raw = note.encode()
    if len(raw) <= NOTE_LIMIT:
        return note
    keep = raw[: NOTE_LIMIT - len(_ELLIPSIS.encode())]
    # The original was valid UTF-8, so the only undecodable bytes are the tail of a character cut in two.
    return keep.decode(errors="ignore") + _ELLIPSIS


def reporting_instance(node: str, pod_uid: str | None) -> str:
    """`<node>`, or `<node>/<pod uid>` when the agent runs in a pod (two pods share a node during an update);
    the node name (a DNS subdomain, up to 253 characters) is shortened to keep the whole within 128 bytes."""
    suffix = f"/{pod_uid}" if pod_uid else ""
    return node[: REPORTING_INSTANCE_LIMIT - len(suffix)] + suffix


def check_fields(type_: str, reason: str, action: str) -> None:
    """Refuse, with a ValueError saying why, the caller-given fields the server would refuse."""
    if type_ not in (NORMAL, WARNING):
        raise ValueError(f"event type must be {NORMAL} or {WARNING}, not {type_!r}")
    for field, value, limit in (("reason", reason, REASON_LIMIT), ("action", action, ACTION_LIMIT)):
        if not value or len(value.encode()) > limit:
            raise ValueError(f"event {field} must be 1-{limit} bytes, got {value!r}")


def unreadable_time(event: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first time of the Event the server cannot read (it refuses the request before validating it), and
    the layout it reads that field with; None when it reads every one."""
    series = event.get("series")
    times = [(event.get("eventTime"), True), (event.get("deprecatedFirstTimestamp"), False),
             (event.get("deprecatedLastTimestamp"), False)]
    if isinstance(series, Mapping):
        times.append((series.get("lastObservedTime"), True))
    for value, micro in times:
        if value is not None and not (is_micro_time(value) if micro else is_rfc3339(value)):
            return json.dumps(value), MICRO_TIME_LAYOUT if micro else TIME_LAYOUT
    return None


def validate_event(event: Mapping[str, Any]) -> list[str]:
    """The server's errors for an Event created through events.k8s.io/v1, as `"<field>: <message>"` (one it can
    read: see :func:`unreadable_time`)."""
    errors = FieldErrors()
    _legacy_errors(event, errors)
    meta = event.get("metadata") or {}
    namespace = meta.get("namespace") or ""
    if not namespace:
        errors.required("metadata.namespace")
    elif not is_dns_label(namespace):
        errors.invalid("metadata.namespace", namespace, SERVER_DNS_LABEL_MSG)
    prefix = meta.get("generateName")
    if prefix and not is_dns_subdomain(_mask_trailing_dash(str(prefix))):
        errors.invalid("metadata.generateName", prefix, SERVER_SUBDOMAIN_MSG)
    name = meta.get("name")
    if not name:
        errors.required("metadata.name", "name or generateName is required")
    elif not is_dns_subdomain(name):
        errors.invalid("metadata.name", name, SERVER_SUBDOMAIN_MSG)
    _series_errors(event, errors)
    if event.get("eventTime") is None:
        errors.required("eventTime")
    if event.get("type") not in (NORMAL, WARNING):
        errors.invalid_unshown("type", f"has invalid value: {event.get('type') or ''}")
    for field, core in (("deprecatedFirstTimestamp", "firstTimestamp"), ("deprecatedLastTimestamp", "lastTimestamp"),
                        ("deprecatedCount", "count")):
        if event.get(field):
            errors.invalid_unshown(core, "needs to be unset")
    source = event.get("deprecatedSource") or {}
    if isinstance(source, Mapping) and (source.get("component") or source.get("host")):
        errors.invalid_unshown("source", "needs to be unset")
    return errors


def validate_event_update(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """The server's errors for an update (or patch) of an Event through events.k8s.io/v1. Fields compare as the
    server compares them once decoded: a field set to its zero value ("", 0, an empty object) equals one left
    out, and two times naming the same moment are equal."""
    errors = FieldErrors()
    _legacy_errors(new, errors)
    if _series(new) != _series(old):
        _series_errors(new, errors)
    for field, core in _IMMUTABLE:
        if field == "eventTime":
            changed = instant(new.get(field), micro=True) != instant(old.get(field), micro=True)
        elif field in ("deprecatedFirstTimestamp", "deprecatedLastTimestamp"):
            changed = instant(new.get(field)) != instant(old.get(field))
        else:
            changed = _zero_free(new.get(field)) != _zero_free(old.get(field))
        if changed:
            errors.invalid(core, new.get(field), "field is immutable")
    return errors


def _mask_trailing_dash(prefix: str) -> str:
    """What the server validates of a generateName: a trailing dash (and the character before it) replaced by
    a letter, since a generated suffix follows."""
    return prefix[:-2] + "a" if len(prefix) > 1 and prefix.endswith("-") else prefix


def _zero_free(value: Any) -> Any:
    """`value` without the members Go would decode to their zero values, so that equal objects compare equal."""
    if isinstance(value, Mapping):
        kept = {k: _zero_free(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v not in (None, "", 0, False, {}, [])}
    if isinstance(value, list):
        return [_zero_free(item) for item in value]
    return value


def _series(event: Mapping[str, Any]) -> tuple[Any, int | None] | None:
    series = event.get("series")
    if not isinstance(series, Mapping):
        return None
    return series.get("count"), instant(series.get("lastObservedTime"), micro=True)


def _series_errors(event: Mapping[str, Any], errors: FieldErrors) -> None:
    series = event.get("series")
    if series is None:
        return
    if not isinstance(series, Mapping):
        errors.add("series", "Invalid value: must be an object")
        return
    count = series.get("count")
    if not isinstance(count, int) or isinstance(count, bool) or count < 2:
        errors.invalid_unshown("series.count", "should be at least 2")
    if series.get("lastObservedTime") is None:
        errors.required("series.lastObservedTime")


def _legacy_errors(event: Mapping[str, Any], errors: FieldErrors) -> None:
    """The checks every Event passes whichever API wrote it: those of an Event with an `eventTime` (the agent's),
    or the older ones of an Event without."""
    namespace = (event.get("metadata") or {}).get("namespace") or ""
    regarding = event.get("regarding") or {}
    regarding_namespace = (regarding.get("namespace") if isinstance(regarding, Mapping) else None) or ""
    if event.get("eventTime") is not None:
        if not regarding_namespace and namespace not in _CLUSTER_EVENT_NAMESPACES:
            errors.invalid_unshown("involvedObject.namespace", "does not match event.namespace")
        controller = event.get("reportingController") or ""
        if not controller:
            errors.required("reportingController")
            errors.invalid_unshown("reportingController", "name part must be non-empty")
        elif not is_label_key(controller):
            errors.invalid("reportingController", controller, SERVER_NAME_PART_MSG)
        _length_errors(event, "reportingInstance", REPORTING_INSTANCE_LIMIT, errors)
        _length_errors(event, "action", ACTION_LIMIT, errors)
        _length_errors(event, "reason", REASON_LIMIT, errors)
        if len(str(event.get("note") or "").encode()) > NOTE_LIMIT:
            errors.invalid_unshown("message", f"can have at most {NOTE_LIMIT} characters")
    # An older Event's namespace is its object's, or default for a cluster-scoped object (or none).
    elif namespace != regarding_namespace and (regarding_namespace or namespace != "default"):
        errors.invalid("involvedObject.namespace", regarding_namespace, "does not match event.namespace")


def _length_errors(event: Mapping[str, Any], field: str, limit: int, errors: FieldErrors) -> None:
    value = str(event.get(field) or "")
    if not value:
        errors.required(field)
    elif len(value.encode()) > limit:
        errors.invalid_unshown(field, f"can have at most {limit} characters")
