"""What the test API server serves: the resource types, their discovery documents and its ``Status`` errors.

Paths, kinds, field-selector labels and error wording follow the real kube-apiserver (1.36).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

JsonObject = dict[str, Any]

VERSION_INFO: JsonObject = {
    "major": "1",
    "minor": "36",
    "emulationMajor": "1",
    "emulationMinor": "36",
    "minCompatibilityMajor": "1",
    "minCompatibilityMinor": "35",
    "gitVersion": "v1.36.3",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-05-01T00:00:00Z",
    "goVersion": "go1.25.5",
    "compiler": "gc",
    "platform": "linux/amd64",
}

VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
STATUS_VERBS = ("get", "patch", "update")
_DEFAULT_FIELDS = ("metadata.name", "metadata.namespace")


@dataclass(frozen=True)
class ResourceType:
    """One served resource, e.g. ``resourceslices.resource.k8s.io``."""

    plural: str
    singular: str
    kind: str
    group: str
    namespaced: bool
    field_labels: tuple[str, ...] = _DEFAULT_FIELDS
    field_error: str = '"{label}" is not a known field selector: only "metadata.name", "metadata.namespace"'
    returns_deleted: bool = False  # DELETE answers with the object rather than a Status
    tracks_generation: bool = False  # metadata.generation starts at 1 and counts spec changes
    has_status: bool = False  # a /status subresource; the main resource ignores status on update
    version: str = "v1"

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def prefix(self) -> str:
        return f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"

    @property
    def qualified(self) -> str:
        """``resourceslices.resource.k8s.io``, or just ``nodes`` for the core group, as in error messages."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def qualified_kind(self) -> str:
        return f"{self.kind}.{self.group}" if self.group else self.kind

    def field_value(self, obj: Mapping[str, Any], label: str) -> str:
        """The value a field selector compares: missing fields read as the empty string."""
        value: Any = obj
        for part in label.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        if isinstance(value, bool):
            return "true" if value else "false"
        return "" if value is None else str(value)


RESOURCE_SLICES = ResourceType(
    "resourceslices", "resourceslice", "ResourceSlice", "resource.k8s.io", namespaced=False,
    field_labels=("metadata.name", "spec.nodeName", "spec.driver"),
    field_error="field label not supported for resource.k8s.io/v1, Kind=ResourceSlice: {label}",
    returns_deleted=True, tracks_generation=True,
)  # fmt: skip
RESOURCE_CLAIMS = ResourceType(
    "resourceclaims", "resourceclaim", "ResourceClaim", "resource.k8s.io", namespaced=True,
    returns_deleted=True, has_status=True,
)  # fmt: skip
DEVICE_CLASSES = ResourceType(
    "deviceclasses", "deviceclass", "DeviceClass", "resource.k8s.io", namespaced=False,
    returns_deleted=True, tracks_generation=True,
)  # fmt: skip
NODES = ResourceType(
    "nodes", "node", "Node", "", namespaced=False, has_status=True,
    field_labels=("metadata.name", "spec.unschedulable"), field_error="field label not supported: {label}",
)  # fmt: skip
EVENTS = ResourceType(
    "events", "event", "Event", "", namespaced=True,
    field_labels=(
        *_DEFAULT_FIELDS, "involvedObject.kind", "involvedObject.namespace", "involvedObject.name",
        "involvedObject.uid", "involvedObject.apiVersion", "involvedObject.resourceVersion",
        "involvedObject.fieldPath", "reason", "reportingComponent", "source", "type",
    ),
    field_error="field label not supported: {label}",
)  # fmt: skip
EVENTS_V1 = ResourceType("events", "event", "Event", "events.k8s.io", namespaced=True)

RESOURCES: tuple[ResourceType, ...] = (RESOURCE_SLICES, RESOURCE_CLAIMS, DEVICE_CLASSES, NODES, EVENTS, EVENTS_V1)
_BY_PATH = {(r.group, r.version, r.plural): r for r in RESOURCES}


def resource_at(group: str, version: str, plural: str) -> ResourceType | None:
    return _BY_PATH.get((group, version, plural))


def resource_named(name: str) -> ResourceType:
    """Look a type up by plural (``resourceslices``; core group first), ``plural.group`` or kind."""
    for rt in RESOURCES:
        if name in (rt.plural, rt.qualified, rt.kind):
            return rt
    raise KeyError(f"not served by the test API server: {name!r}")


# --- discovery -------------------------------------------------------------------------------------


def _group_versions() -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for rt in RESOURCES:
        if rt.group and rt.version not in groups.setdefault(rt.group, []):
            groups[rt.group].append(rt.version)
    return groups


def _api_group(name: str, versions: Sequence[str]) -> JsonObject:
    entries = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
    return {"name": name, "versions": entries, "preferredVersion": entries[0]}


def discovery(path: str, address: str) -> JsonObject | None:
    """The discovery document at ``path`` (``/api``, ``/apis/resource.k8s.io/v1``...), or None if none is."""
    groups = _group_versions()
    if path == "/api":
        return {"kind": "APIVersions", "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": address}]}  # fmt: skip
    if path == "/apis":
        return {"kind": "APIGroupList", "apiVersion": "v1",
                "groups": [_api_group(name, versions) for name, versions in groups.items()]}  # fmt: skip
    parts = path.strip("/").split("/")
    if len(parts) == 2 and parts[0] == "apis" and parts[1] in groups:
        return {"kind": "APIGroup", "apiVersion": "v1", **_api_group(parts[1], groups[parts[1]])}
    if parts == ["api", "v1"]:
        group_version = "v1"
    elif len(parts) == 3 and parts[0] == "apis" and parts[2] in groups.get(parts[1], ()):
        group_version = f"{parts[1]}/{parts[2]}"
    else:
        return None
    resources: list[JsonObject] = []
    for rt in RESOURCES:
        if rt.api_version != group_version:
            continue
        resources.append({"name": rt.plural, "singularName": rt.singular, "namespaced": rt.namespaced,
                          "kind": rt.kind, "verbs": list(VERBS)})  # fmt: skip
        if rt.has_status:
            resources.append({"name": f"{rt.plural}/status", "singularName": "", "namespaced": rt.namespaced,
                              "kind": rt.kind, "verbs": list(STATUS_VERBS)})  # fmt: skip
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": resources}


# --- errors ----------------------------------------------------------------------------------------

_REASONS = {
    400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed",
    406: "NotAcceptable", 409: "Conflict", 410: "Expired", 413: "RequestEntityTooLarge",
    415: "UnsupportedMediaType", 422: "Invalid", 429: "TooManyRequests", 500: "InternalError",
    503: "ServiceUnavailable", 504: "Timeout",
}  # fmt: skip
_MESSAGES = {
    401: "Unauthorized",
    404: "the server could not find the requested resource",
    405: "the server does not allow this method on the requested resource",
    429: "Too many requests, please try again later.",
    500: "Internal error occurred: injected fault",
    503: "the server is currently unable to handle the request",
    504: "the server was unable to return a response in the time allotted, but may still be processing the request",
}


class ApiError(Exception):
    """A request answered with a ``Status`` body, as the real server answers every failure."""

    def __init__(
        self, code: int, message: str | None = None, *, reason: str | None = None,
        details: JsonObject | None = None, retry_after: int | None = None,
    ) -> None:  # fmt: skip
        self.code = code
        self.reason = reason or _REASONS.get(code, "Unknown" if code < 500 else "InternalError")
        self.message = message if message is not None else _MESSAGES.get(code, self.reason)
        self.details = dict(details or {})
        self.retry_after = retry_after
        if retry_after is not None:
            self.details["retryAfterSeconds"] = retry_after
        super().__init__(f"{code} {self.reason}: {self.message}")

    def status(self) -> JsonObject:
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": self.message,
                "reason": self.reason, "details": self.details, "code": self.code}  # fmt: skip


def _details(rt: ResourceType, name: str, *, kind: str | None = None) -> JsonObject:
    details: JsonObject = {"name": name, "kind": kind or rt.plural}
    if rt.group:
        details["group"] = rt.group
    return details


def not_found(rt: ResourceType, name: str) -> ApiError:
    return ApiError(404, f'{rt.qualified} "{name}" not found', details=_details(rt, name))


def already_exists(rt: ResourceType, name: str) -> ApiError:
    return ApiError(409, f'{rt.qualified} "{name}" already exists', reason="AlreadyExists",
                    details=_details(rt, name))  # fmt: skip


def conflict(rt: ResourceType, name: str, why: str) -> ApiError:
    return ApiError(409, f'Operation cannot be fulfilled on {rt.qualified} "{name}": {why}', details=_details(rt, name))


STALE = "the object has been modified; please apply your changes to the latest version and try again"


def invalid(rt: ResourceType, name: str, errors: Sequence[str]) -> ApiError:
    """422 from ``"<field path>: <message>"`` strings, with one cause per error as the real server gives."""
    causes = [_cause(error) for error in errors]
    summary = errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"
    details = {**_details(rt, name, kind=rt.kind), "causes": causes}
    return ApiError(422, f'{rt.qualified_kind} "{name}" is invalid: {summary}', details=details)


_CAUSE_PREFIXES = (
    ("Required value", "FieldValueRequired"), ("Duplicate value", "FieldValueDuplicate"),
    ("Too long", "FieldValueTooLong"), ("Too many", "FieldValueTooMany"),
    ("Unsupported value", "FieldValueNotSupported"),
    ("Invalid value", "FieldValueInvalid"),
)


def _cause(error: str) -> JsonObject:
    field, message = _split_field(error)
    lowered = message.lower()
    for prefix, reason in _CAUSE_PREFIXES:  # the wording of Go's field.Error
        if message.startswith(prefix):
            return {"reason": reason, "message": message, "field": field}
    if "required" in lowered:
        reason = "FieldValueRequired"
    elif "duplicate" in lowered:
        reason = "FieldValueDuplicate"
    elif "at most" in lowered and ("entries" in lowered or "allowed" in lowered or "counters" in lowered):
        reason = "FieldValueTooMany"
    elif "must not be set" in lowered or "may only be set" in lowered:
        reason = "FieldValueForbidden"
    elif "must be one of" in lowered:
        reason = "FieldValueNotSupported"
    else:
        reason = "FieldValueInvalid"
    return {"reason": reason, "message": message, "field": field}


def _split_field(error: str) -> tuple[str, str]:
    """Split at the first ``": "`` outside brackets and quotes; map keys in paths may contain one."""
    depth, quoted = 0, False
    for i, char in enumerate(error):
        if char == '"' and depth:
            quoted = not quoted
        elif not quoted and char == "[":
            depth += 1
        elif not quoted and char == "]":
            depth -= 1
        elif not quoted and depth == 0 and error.startswith(": ", i):
            return error[:i], error[i + 2 :]
    return "", error
