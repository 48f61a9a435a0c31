"""events.k8s.io/v1 Events chosen to cover each rule of the API server's validation of Events once, accepted and
refused, with the server's verdict: creates (every field's limit, the note in bytes, eventTime's formats, the
namespaces of Events about cluster-scoped objects, the series, the deprecated fields) and updates by merge patch
(the series may change, nothing else). Shared by the fast tier's test of agent/events/rules.py through the test
API server and the real API server's test of the same cases."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tests.support.time_cases import TIMES
from tests.support.verdicts import ACCEPTED, Verdict, refused

__all__ = ["EventCase", "UpdateCase", "create_cases", "event", "update_cases"]

UNREADABLE = Verdict("bad-request")
UNREADABLE_PATCH = refused("patch: Invalid value")
WHEN = "2026-05-01T12:00:00.123456Z"
LATER = "2026-05-01T12:01:00.000000Z"


def event(namespace: str, name: str = "my-claim.17f3a", **changes: Any) -> dict[str, Any]:
    """A valid Event about a claim in `namespace`, with `changes` merged in (None removes a field)."""
    body: dict[str, Any] = {
        "apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": name, "namespace": namespace},
        "eventTime": WHEN, "type": "Warning", "reason": "PrepareFailed", "action": "Prepare",
        "note": "device gpu-9 is not a device of driver gpu.nvidia.com on this node",
        "regarding": {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "name": "my-claim",
                      "namespace": namespace, "uid": "0b6f0c52-9d6f-4d4e-9c1e-2a1f0d1f7e11"},
        "reportingController": "dra-agent.io/agent", "reportingInstance": "node-a",
    }  # fmt: skip
    for key, value in changes.items():
        if value is None:
            body.pop(key, None)
        else:
            body[key] = value
    return body


NODE = {"apiVersion": "v1", "kind": "Node", "name": "node-a", "uid": "node-a"}


@dataclass(frozen=True)
class EventCase:
    id: str
    event: Mapping[str, Any]
    verdict: Verdict


@dataclass(frozen=True)
class UpdateCase:
    """`old` is created, then `patch` is applied to it as a merge patch."""

    id: str
    old: Mapping[str, Any]
    patch: Mapping[str, Any]
    verdict: Verdict


def create_cases(ns: str) -> list[EventCase]:
    """Every chosen create, for Events in the namespace `ns` (any but default and kube-system)."""
    def case(id: str, verdict: Verdict, **changes: Any) -> EventCase:
        return EventCase(id, event(ns, **changes), verdict)

    def meta(namespace: str = ns, **fields: Any) -> dict[str, Any]:
        return {"namespace": namespace, **(fields or {"name": "my-claim.17f3a"})}

    elsewhere = {**event(ns)["regarding"], "namespace": "default"}
    cases = [
        case("valid", ACCEPTED),
        case("node-in-default", ACCEPTED, regarding=NODE, metadata=meta("default")),
        case("node-in-kube-system", ACCEPTED, regarding=NODE, metadata=meta("kube-system")),
        case("node-in-another-namespace", refused("involvedObject.namespace: Invalid value"), regarding=NODE),
        case("regarding-in-another-namespace", ACCEPTED, regarding=elsewhere),
        case("series", ACCEPTED, series={"count": 2, "lastObservedTime": LATER}),
        case("series-count-1", refused("series.count: Invalid value"), series={"count": 1, "lastObservedTime": LATER}),
        case("series-no-time", refused("series.lastObservedTime: Required value"), series={"count": 2}),
        case("series-empty", refused("series.count: Invalid value", "series.lastObservedTime: Required value"),
             series={}),
        case("series-time-unreadable", UNREADABLE, series={"count": 2, "lastObservedTime": "2026-05-01T12:01:00Z"}),
        case("no-event-time", refused("eventTime: Required value"), eventTime=None),
        # Without an eventTime the older rules apply: a cluster-scoped object's Event lives in default only.
        case("no-event-time-node", refused("eventTime: Required value", "involvedObject.namespace: Invalid value"),
             eventTime=None, regarding=NODE),
        case("no-event-time-regarding-elsewhere",
             refused("eventTime: Required value", "involvedObject.namespace: Invalid value"),
             eventTime=None, regarding=elsewhere),
        case("type-error", refused("type: Invalid value"), type="Error"),
        case("no-type", refused("type: Invalid value"), type=None),
        case("no-controller", refused("reportingController: Required value", "reportingController: Invalid value"),
             reportingController=None),
        case("controller-with-space", refused("reportingController: Invalid value"), reportingController="dra agent"),
        case("controller-name-64", refused("reportingController: Invalid value"),
             reportingController="dra-agent.io/" + "a" * 64),
        case("controller-prefix-upper-case", refused("reportingController: Invalid value"),
             reportingController="Dra-Agent.io/agent"),
        case("controller-without-prefix", ACCEPTED, reportingController="Agent_1.x"),
        case("no-instance", refused("reportingInstance: Required value"), reportingInstance=None),
        case("instance-128", ACCEPTED, reportingInstance="i" * 128),
        case("instance-129", refused("reportingInstance: Invalid value"), reportingInstance="i" * 129),
        case("instance-64-two-byte", ACCEPTED, reportingInstance="é" * 64),
        case("instance-65-two-byte", refused("reportingInstance: Invalid value"), reportingInstance="é" * 65),
        case("no-action", refused("action: Required value"), action=None),
        case("action-129", refused("action: Invalid value"), action="a" * 129),
        case("action-65-two-byte", refused("action: Invalid value"), action="ü" * 65),
        case("no-reason", refused("reason: Required value"), reason=None),
        case("reason-128", ACCEPTED, reason="R" * 128),
        case("reason-129", refused("reason: Invalid value"), reason="R" * 129),
        case("no-note", ACCEPTED, note=None),
        case("note-1024", ACCEPTED, note="x" * 1024),
        case("note-1025", refused("message: Invalid value"), note="x" * 1025),
        # The limit is in bytes of UTF-8, though the message says characters.
        case("note-512-two-byte", ACCEPTED, note="é" * 512),
        case("note-513-two-byte", refused("message: Invalid value"), note="é" * 513),
        case("note-341-three-byte", ACCEPTED, note="€" * 341),
        case("note-342-three-byte", refused("message: Invalid value"), note="€" * 342),
        case("deprecated-count", refused("count: Invalid value"), deprecatedCount=3),
        case("deprecated-source-component", refused("source: Invalid value"), deprecatedSource={"component": "k"}),
        case("deprecated-source-host", refused("source: Invalid value"), deprecatedSource={"host": "node-a"}),
        case("deprecated-first-timestamp", refused("firstTimestamp: Invalid value"),
             deprecatedFirstTimestamp="2026-05-01T12:00:00Z"),
        case("deprecated-last-timestamp", refused("lastTimestamp: Invalid value"),
             deprecatedLastTimestamp="2026-05-01T12:00:00Z"),
        case("deprecated-first-timestamp-unreadable", UNREADABLE, deprecatedFirstTimestamp="2026-05-01T12:00:00z"),
        case("name-not-a-subdomain", refused("metadata.name: Invalid value"), metadata=meta(name="My_Event")),
        case("no-name", refused("metadata.name: Required value"), metadata=meta(generateName="")),
        case("generated-name", ACCEPTED, metadata=meta(generateName="my-claim-")),
        # A generateName must make a name with any suffix: a trailing dash is fine, a trailing dot is not.
        case("generated-name-ending-in-dot", refused("metadata.generateName: Invalid value"),
             metadata=meta(generateName="my-claim.")),
    ]
    cases += [case(f"event-time-{value or 'empty'}", ACCEPTED if micro else UNREADABLE, eventTime=value)
              for value, _, micro in TIMES]
    return cases


def update_cases(ns: str) -> list[UpdateCase]:
    """Every chosen update, for Events in the namespace `ns`; each case's Event has its own name."""
    cases: list[UpdateCase] = []

    def case(id: str, verdict: Verdict, patch: Mapping[str, Any], **old: Any) -> None:
        cases.append(UpdateCase(id, event(ns, f"update-{len(cases)}", **old), patch, verdict))

    series = {"count": 2, "lastObservedTime": LATER}
    regarding = copy.deepcopy(event(ns)["regarding"])
    case("series-added", ACCEPTED, {"series": series})
    case("series-added-count-1", refused("series.count: Invalid value"), {"series": {**series, "count": 1}})
    case("series-added-no-time", refused("series.lastObservedTime: Required value"), {"series": {"count": 2}})
    # A patch that makes an Event the server cannot read is refused as the patch's fault.
    case("series-time-unreadable", UNREADABLE_PATCH,
         {"series": {"count": 3, "lastObservedTime": "2026-05-01T12:02:00Z"}}, series=series)
    case("series-grown", ACCEPTED, {"series": {"count": 3, "lastObservedTime": "2026-05-01T12:02:00.000000Z"}},
         series=series)
    case("series-removed", ACCEPTED, {"series": None}, series=series)
    case("note-changed", refused("message: Invalid value"), {"note": "another error"})
    case("note-changed-too-long", refused("message: Invalid value"), {"note": "x" * 1025})
    case("reason-changed", refused("reason: Invalid value"), {"reason": "Other"})
    case("type-changed", refused("type: Invalid value"), {"type": "Normal"})
    case("action-changed", refused("action: Invalid value"), {"action": "Other"})
    case("controller-changed", refused("reportingController: Invalid value"), {"reportingController": "x.io/y"})
    case("controller-changed-invalid", refused("reportingController: Invalid value"),
         {"reportingController": "dra agent"})
    case("instance-changed", refused("reportingInstance: Invalid value"), {"reportingInstance": "node-b"})
    case("regarding-changed", refused("involvedObject: Invalid value"), {"regarding": {"name": "other"}})
    # An empty string is Go's zero value: the reference is the same.
    case("regarding-empty-field-added", ACCEPTED, {"regarding": {"fieldPath": ""}})
    case("related-added", refused("related: Invalid value"), {"related": regarding})
    case("event-time-changed", refused("eventTime: Invalid value"), {"eventTime": "2026-05-01T13:00:00.000000Z"})
    # The same moment in another offset is the same eventTime.
    case("event-time-same-moment", ACCEPTED, {"eventTime": "2026-05-01T14:00:00.123456+02:00"})
    case("event-time-removed", refused("eventTime: Invalid value"), {"eventTime": None})
    case("event-time-unreadable", UNREADABLE_PATCH, {"eventTime": "2026-05-01T12:00:00Z"})
    case("deprecated-count-set", refused("count: Invalid value"), {"deprecatedCount": 3})
    case("deprecated-source-set", refused("source: Invalid value"), {"deprecatedSource": {"component": "k"}})
    case("labels-added", ACCEPTED, {"metadata": {"labels": {"a": "b"}}})
    return cases
