"""The rules of events.k8s.io/v1 Events (agent/events/rules.py): how the agent builds one, what the server
accepts."""

from __future__ import annotations

import copy
import re
import uuid
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.events.rules import (
    NOTE_LIMIT,
    Reference,
    check_fields,
    cut_note,
    event_name,
    is_micro_time,
    micro_time,
    reporting_instance,
    validate_event,
    validate_event_update,
)
from agent.kube.names import is_dns_subdomain

POD_UID = "3f8e4c1a-5b2d-4e6f-8a9b-0c1d2e3f4a5b"
CLAIM = Reference("resource.k8s.io/v1", "ResourceClaim", "my-claim", "team-a", "0b6f0c52-9d6f-4d4e-9c1e-2a1f0d1f7e11")
NODE = Reference("v1", "Node", "node-a", uid="node-a")


def event(**changes: Any) -> dict[str, Any]:
    """A valid Event about a claim, with `changes` merged in (None removes a field)."""
    body: dict[str, Any] = {
        "apiVersion": "events.k8s.io/v1", "kind": "Event",
        "metadata": {"name": "my-claim.17f3a", "namespace": "team-a"},
        "eventTime": "2026-05-01T12:00:00.123456Z", "type": "Warning", "reason": "PrepareFailed",
        "action": "Prepare", "note": "device gpu-9 is not a device of driver gpu.nvidia.com on this node",
        "regarding": CLAIM.to_json(), "reportingController": "dra-agent.io/agent", "reportingInstance": "node-a",
    }  # fmt: skip
    for key, value in changes.items():
        if value is None:
            body.pop(key, None)
        else:
            body[key] = value
    return body


# --- building an Event -----------------------------------------------------------------------------


def test_a_short_note_is_kept_whole() -> None:
    assert cut_note("x" * NOTE_LIMIT) == "x" * NOTE_LIMIT


def test_a_long_note_is_cut_to_the_limit_in_bytes_with_an_ellipsis() -> None:
    cut = cut_note("x" * 5000)
    assert len(cut.encode()) == NOTE_LIMIT and cut.endswith("…") and cut.startswith("x" * 1000)
    # Two-byte characters: 600 of them are 1,200 bytes; the cut falls between two characters, never inside one.
    cut = cut_note("é" * 600)
    assert len(cut.encode()) <= NOTE_LIMIT and cut == "é" * (len(cut) - 1) + "…"
    assert len(cut.encode()) > NOTE_LIMIT - 4


@given(st.text(max_size=3000))
def test_any_note_fits_and_keeps_its_beginning(note: str) -> None:
    cut = cut_note(note)
    assert len(cut.encode()) <= NOTE_LIMIT
    assert cut == note or (cut.endswith("…") and note.startswith(cut[:-1]))
    assert not validate_event(event(note=cut))


def test_event_names_follow_client_go() -> None:
    assert event_name("my-claim", 0x17F3A2B4C5D6E7F8) == "my-claim.17f3a2b4c5d6e7f8"
    # A name near the 253-character limit has no room for the suffix: a UUID instead, still a valid name.
    long = "a" * 250
    named = event_name(long, 0x17F3A2B4C5D6E7F8)
    assert uuid.UUID(named) and is_dns_subdomain(named)


def test_micro_times_have_exactly_six_fractional_digits() -> None:
    assert micro_time(1777636800.25) == "2026-05-01T12:00:00.250000Z"
    assert is_micro_time("2026-05-01T12:00:00.250000Z") and is_micro_time("2026-05-01T12:00:00.250000+02:00")
    for bad in ("2026-05-01T12:00:00Z", "2026-05-01T12:00:00.250Z", "2026-05-01T12:00:00.2500001Z", 12, None):
        assert not is_micro_time(bad), bad


def test_reporting_instance_is_the_node_and_the_pod() -> None:
    assert reporting_instance("node-a", None) == "node-a"
    assert reporting_instance("node-a", POD_UID) == f"node-a/{POD_UID}"
    longest = reporting_instance("n" * 253, POD_UID)
    assert len(longest) == 128 and longest.endswith(f"/{POD_UID}")
    assert reporting_instance("n" * 253, None) == "n" * 128


@pytest.mark.parametrize(("type_", "reason", "action", "message"), [
    ("Error", "PrepareFailed", "Prepare", "Normal or Warning"),
    ("Warning", "", "Prepare", "reason must be 1-128 bytes"),
    ("Warning", "R" * 129, "Prepare", "reason must be 1-128 bytes"),
    ("Warning", "PrepareFailed", "", "action must be 1-128 bytes"),
    ("Normal", "DeviceRecovered", "ü" * 65, "action must be 1-128 bytes"),
])  # fmt: skip
def test_fields_the_server_would_refuse_are_refused_at_once(type_: str, reason: str, action: str,
                                                            message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_fields(type_, reason, action)


def test_references() -> None:
    assert CLAIM.event_namespace == "team-a"
    assert NODE.event_namespace == "default"
    assert NODE.to_json() == {"apiVersion": "v1", "kind": "Node", "name": "node-a", "uid": "node-a"}


# --- what the server accepts -----------------------------------------------------------------------


def test_a_valid_event_passes() -> None:
    assert validate_event(event()) == []
    node_event = event(regarding=NODE.to_json(), metadata={"name": "node-a.1", "namespace": "default"})
    assert validate_event(node_event) == []
    assert validate_event(event(series={"count": 2, "lastObservedTime": "2026-05-01T12:01:00.000000Z"})) == []


@pytest.mark.parametrize(("changes", "error"), [
    ({"eventTime": None}, "eventTime: Required value"),
    ({"type": "Error"}, "type: Invalid value"),
    ({"reportingController": None}, "reportingController: Required value"),
    ({"reportingController": "dra agent"}, "reportingController: Invalid value"),
    ({"reportingInstance": None}, "reportingInstance: Required value"),
    ({"reportingInstance": "i" * 129}, "reportingInstance: Invalid value: \"\": can have at most 128 characters"),
    ({"action": None}, "action: Required value"),
    ({"action": "a" * 129}, "action: Invalid value"),
    ({"reason": None}, "reason: Required value"),
    ({"reason": "r" * 129}, "reason: Invalid value"),
    ({"note": "n" * 1025}, "message: Invalid value: \"\": can have at most 1024 characters"),
    ({"note": "é" * 513}, "message: Invalid value"),  # 1,026 bytes in 513 characters
    ({"series": {"count": 1, "lastObservedTime": "2026-05-01T12:01:00.000000Z"}}, "series.count: Invalid value"),
    ({"series": {"count": 2}}, "series.lastObservedTime: Required value"),
    ({"deprecatedCount": 3}, "count: Invalid value: \"\": needs to be unset"),
    ({"deprecatedSource": {"component": "kubelet"}}, "source: Invalid value"),
    ({"deprecatedFirstTimestamp": "2026-05-01T12:00:00Z"}, "firstTimestamp: Invalid value"),
    ({"metadata": {"name": "My_Event", "namespace": "team-a"}}, "metadata.name: Invalid value"),
    ({"metadata": {"namespace": "team-a"}}, "metadata.name: Required value"),
    # An Event about a cluster-scoped object lives in `default` (or kube-system), not anywhere.
    ({"regarding": NODE.to_json()}, "involvedObject.namespace: Invalid value"),
])  # fmt: skip
def test_what_the_server_refuses(changes: dict[str, Any], error: str) -> None:
    errors = validate_event(event(**changes))
    assert any(e.startswith(error) for e in errors), errors


def test_an_update_may_change_the_series_only() -> None:
    old = event()
    grown = event(series={"count": 2, "lastObservedTime": "2026-05-01T12:01:00.000000Z"})
    assert validate_event_update(old, grown) == []
    again = copy.deepcopy(grown)
    again["series"]["count"] = 5
    assert validate_event_update(grown, again) == []
    assert validate_event_update(grown, event(series={"count": 1, "lastObservedTime": "x"})) == [
        'series.count: Invalid value: "": should be at least 2']
    for field, value in (("note", "another error"), ("reason", "Other"), ("type", "Normal"), ("action", "Other"),
                         ("eventTime", "2026-05-01T13:00:00.000000Z"), ("reportingInstance", "node-b"),
                         ("regarding", NODE.to_json())):
        errors = validate_event_update(old, event(**{field: value}))
        assert any(re.search(r": field is immutable$", e) for e in errors), (field, errors)
