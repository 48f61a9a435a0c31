"""The rules of events.k8s.io/v1 Events (agent/events/rules.py): how the agent builds one, and what the server
accepts, case by case from the table the real API server's test checks too (tests/support/event_cases.py), both on the
rules and through the test API server."""

from __future__ import annotations

import copy
import uuid

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
    unreadable_time,
    validate_event,
    validate_event_update,
)
from agent.kube.names import is_dns_subdomain
from simulator.apiserver.resources import EVENTS_V1
from simulator.apiserver.store import Store
from tests.support.event_cases import EventCase, UpdateCase, create_cases, event, update_cases
from tests.support.verdicts import ACCEPTED, field_errors, of_store

POD_UID = "3f8e4c1a-5b2d-4e6f-8a9b-0c1d2e3f4a5b"
CLAIM = Reference("resource.k8s.io/v1", "ResourceClaim", "my-claim", "team-a", "0b6f0c52-9d6f-4d4e-9c1e-2a1f0d1f7e11")
NODE = Reference("v1", "Node", "node-a", uid="node-a")


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
    assert not validate_event(event("team-a", note=cut))


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

NAMESPACE = "team-a"


@pytest.mark.parametrize("case", create_cases(NAMESPACE), ids=lambda case: case.id)
def test_each_create_gets_the_servers_verdict(case: EventCase) -> None:
    named = copy.deepcopy(dict(case.event))  # as the server validates it: a name generated first
    meta = named["metadata"]
    if meta.get("generateName") and not meta.get("name"):
        meta["name"] = meta["generateName"] + "x2b4z"
    unreadable, errors = unreadable_time(named), validate_event(named)
    if case.verdict.outcome == "bad-request":
        assert unreadable is not None
    else:
        assert unreadable is None and field_errors(errors) == case.verdict.fields, errors
    store = Store()
    namespace = case.event["metadata"]["namespace"]
    assert of_store(lambda: store.create(EVENTS_V1, namespace, copy.deepcopy(case.event))) == case.verdict
    assert store.count(EVENTS_V1) == (case.verdict == ACCEPTED)


@pytest.mark.parametrize("case", update_cases(NAMESPACE), ids=lambda case: case.id)
def test_each_update_gets_the_servers_verdict(case: UpdateCase) -> None:
    store = Store()
    old = store.create(EVENTS_V1, NAMESPACE, copy.deepcopy(case.old))
    name = old["metadata"]["name"]
    assert of_store(lambda: store.patch(EVENTS_V1, NAMESPACE, name, copy.deepcopy(case.patch))) == case.verdict
    if case.verdict != ACCEPTED:
        assert store.get(EVENTS_V1, NAMESPACE, name) == old, "a refused update changes nothing"


def test_a_series_is_checked_only_when_it_changes() -> None:
    stored = event(NAMESPACE, series={"count": 1, "lastObservedTime": "2026-05-01T12:01:00.000000Z"})
    assert validate_event_update(stored, copy.deepcopy(stored)) == []
    same_moment = copy.deepcopy(stored)
    same_moment["series"]["lastObservedTime"] = "2026-05-01T14:01:00.000000+02:00"
    assert validate_event_update(stored, same_moment) == []
    later = copy.deepcopy(stored)
    later["series"]["lastObservedTime"] = "2026-05-01T12:02:00.000000Z"
    assert field_errors(validate_event_update(stored, later)) == {"series.count: Invalid value"}
