"""The rules of events.k8s.io/v1 Events: how the agent builds one, and what the API server accepts.

The agent's recorder and the test API server share these rules, taken from the real server's validation of
Events created or updated through events.k8s.io/v1 (pkg/apis/core/validation/events.go): required
`eventTime` (a MicroTime: exactly six fractional digits), `type` Normal or Warning, `reportingController` a
qualified name, `reportingInstance`, `action` and `reason` required and at most 128 bytes, `note` at most 1 KiB,
the deprecated core fields unset, a `series` with a count of at least 2 and a `lastObservedTime`; an Event about
a cluster-scoped object (a Node) lives in the namespace `default` (or `kube-system`). On update every field but
the series and the metadata is immutable. Error paths name the core/v1 fields, as the server's messages do
(`message` for the note, `involvedObject` for `regarding`).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from agent.kube.names import SUBDOMAIN_MSG, is_dns_subdomain, is_label_key

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
_MICRO_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}(Z|[+-]\d\d:\d\d)")
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


def is_micro_time(value: object) -> bool:
    """What the server's MicroTime decoder accepts (Go's layout "2006-01-02T15:04:05.000000Z07:00")."""
    return isinstance(value, str) and _MICRO_TIME.fullmatch(value) is not None


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


def validate_event(event: Mapping[str, Any]) -> list[str]:
    """The server's errors for an Event created through events.k8s.io/v1, as `"<field>: <message>"`."""
    errors = _legacy_errors(event)
    meta = event.get("metadata") or {}
    name = meta.get("name")
    if not name:
        errors.append("metadata.name: Required value: name or generateName is required")
    elif not is_dns_subdomain(name):
        errors.append(f"metadata.name: Invalid value: {json.dumps(name)}: {SUBDOMAIN_MSG}")
    errors += _series_errors(event)
    if not event.get("eventTime"):
        errors.append("eventTime: Required value")
    if event.get("type") not in (NORMAL, WARNING):
        errors.append(f'type: Invalid value: "": has invalid value: {event.get("type") or ""}')
    for field, core in (("deprecatedFirstTimestamp", "firstTimestamp"), ("deprecatedLastTimestamp", "lastTimestamp"),
                        ("deprecatedCount", "count")):
        if event.get(field):
            errors.append(f'{core}: Invalid value: "": needs to be unset')
    source = event.get("deprecatedSource") or {}
    if isinstance(source, Mapping) and (source.get("component") or source.get("host")):
        errors.append('source: Invalid value: "": needs to be unset')
    return errors


def validate_event_update(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """The server's errors for an update (or patch) of an Event through events.k8s.io/v1."""
    errors = _legacy_errors(new)
    if new.get("series") != old.get("series"):
        errors += _series_errors(new)
    for field, core in _IMMUTABLE:
        if new.get(field) != old.get(field):
            errors.append(f"{core}: Invalid value: {json.dumps(new.get(field))}: field is immutable")
    return errors


def _series_errors(event: Mapping[str, Any]) -> list[str]:
    series = event.get("series")
    if series is None:
        return []
    if not isinstance(series, Mapping):
        return ["series: Invalid value: must be an object"]
    errors = []
    count = series.get("count")
    if not isinstance(count, int) or isinstance(count, bool) or count < 2:
        errors.append('series.count: Invalid value: "": should be at least 2')
    if not series.get("lastObservedTime"):
        errors.append("series.lastObservedTime: Required value")
    return errors


def _legacy_errors(event: Mapping[str, Any]) -> list[str]:
    """The checks every Event passes whichever API wrote it (those of an Event with an `eventTime`)."""
    errors = []
    namespace = (event.get("metadata") or {}).get("namespace") or ""
    regarding = event.get("regarding") or {}
    regarding_namespace = regarding.get("namespace") if isinstance(regarding, Mapping) else None
    if event.get("eventTime"):
        if not regarding_namespace and namespace not in _CLUSTER_EVENT_NAMESPACES:
            errors.append('involvedObject.namespace: Invalid value: "": does not match event.namespace')
        controller = event.get("reportingController") or ""
        if not controller:
            errors.append("reportingController: Required value")
        elif not is_label_key(controller):
            errors.append(f"reportingController: Invalid value: {json.dumps(controller)}: must be a qualified "
                          "name: [DNS subdomain '/'] name of 1-63 letters, digits, '-', '_', '.'")
        errors += _length_errors(event, "reportingInstance", "reportingInstance", REPORTING_INSTANCE_LIMIT)
        errors += _length_errors(event, "action", "action", ACTION_LIMIT)
        errors += _length_errors(event, "reason", "reason", REASON_LIMIT)
        if len(str(event.get("note") or "").encode()) > NOTE_LIMIT:
            errors.append(f'message: Invalid value: "": can have at most {NOTE_LIMIT} characters')
    elif regarding_namespace and namespace != regarding_namespace:
        errors.append(f"involvedObject.namespace: Invalid value: {json.dumps(regarding_namespace)}: does not "
                      "match event.namespace")
    if not is_dns_subdomain(namespace):
        errors.append(f"namespace: Invalid value: {json.dumps(namespace)}: {SUBDOMAIN_MSG}")
    return errors


def _length_errors(event: Mapping[str, Any], field: str, core: str, limit: int) -> list[str]:
    value = str(event.get(field) or "")
    if not value:
        return [f"{core}: Required value"]
    if len(value.encode()) > limit:
        return [f'{core}: Invalid value: "": can have at most {limit} characters']
    return []
