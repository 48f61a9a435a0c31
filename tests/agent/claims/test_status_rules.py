"""The API server's rules for a claim's `status.devices` (agent/claims/status_rules.py), case by case from
the table the real API server's test checks too (tests/support/claim_status_cases.py): on the rules, and through the
test API server's server-side apply and merge patch on `/status`; and the size of `data` as the server measures it."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from agent.claims.status_rules import claim_status_errors, device_status_errors, json_size, unreadable_time
from simulator.apiserver.resources import RESOURCE_CLAIMS
from simulator.apiserver.store import Store
from tests.support.claim_status_cases import ALLOCATION, APPLY_CASES, DRIVER, MERGE_CASES, StatusCase, condition, entry
from tests.support.verdicts import ACCEPTED, field_errors, of_store

NAMESPACE, NAME = "team-a", "c"


def allocated() -> Store:
    store = Store()
    store.put(RESOURCE_CLAIMS, {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": "c"}}]}},
        "status": {"allocation": copy.deepcopy(ALLOCATION)},
    })  # fmt: skip
    return store


def apply_body(case: StatusCase) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": NAME},
            "status": {"devices": copy.deepcopy(list(case.devices))}}


@pytest.mark.parametrize("case", APPLY_CASES, ids=lambda case: case.id)
def test_each_apply_gets_the_servers_verdict(case: StatusCase) -> None:
    status = {"allocation": ALLOCATION, "devices": list(case.devices)}
    if case.verdict.outcome == "invalid":
        assert unreadable_time(status) is None
        assert field_errors(claim_status_errors(status)) == case.verdict.fields
    elif case.verdict == ACCEPTED:
        assert unreadable_time(status) is None and claim_status_errors(status) == []
    store = allocated()
    before = store.get(RESOURCE_CLAIMS, NAMESPACE, NAME)
    assert of_store(lambda: store.apply_status(RESOURCE_CLAIMS, NAMESPACE, NAME, apply_body(case), DRIVER)) \
        == case.verdict
    if case.verdict != ACCEPTED:
        assert store.get(RESOURCE_CLAIMS, NAMESPACE, NAME) == before, "a refused write changes nothing"


@pytest.mark.parametrize("case", MERGE_CASES, ids=lambda case: case.id)
def test_each_merge_patch_gets_the_servers_verdict(case: StatusCase) -> None:
    store = allocated()
    patch = {"status": {"devices": copy.deepcopy(list(case.devices))}}
    assert of_store(lambda: store.patch(RESOURCE_CLAIMS, NAMESPACE, NAME, patch, status=True)) == case.verdict


def test_the_agents_check_of_an_entry_counts_a_time_the_server_cannot_read() -> None:
    bad = entry(conditions=[condition(), condition(type="Other", lastTransitionTime="2026-05-01t12:00:00Z")])
    assert field_errors(device_status_errors(bad)) == {"status.devices[0].conditions[1].lastTransitionTime: "
                                                       "Invalid value"}
    assert device_status_errors(entry(conditions=[condition(lastTransitionTime="2026-05-01T1:00:00,5+24:00")])) == []
    assert unreadable_time({"devices": [bad]}) == ('"2026-05-01t12:00:00Z"', "2006-01-02T15:04:05Z07:00")


@pytest.mark.parametrize(("value", "go"), [
    ({"x": "<<<"}, '{"x":"\\u003c\\u003c\\u003c"}'),
    (1e20, "100000000000000000000"), (1e21, "1e+21"), (1e-7, "1e-7"), (1e-6, "0.000001"), (2.0, "2"),
    (-0.0, "-0"), (0.1, "0.1"), (123456789.125, "123456789.125"), (10**20, "100000000000000000000"),
    ("é", '"é"'), ("\u2028", '"\\u2028"'), ("\x01\n", '"\\u0001\\n"'), ('a"b\\', r'"a\"b\\"'),
    ([], "[]"), ({}, "{}"), ([1, None, True, False], "[1,null,true,false]"),
    ({"a": {"b": [1.5]}}, '{"a":{"b":[1.5]}}'),
])  # fmt: skip
def test_json_is_measured_as_go_writes_it(value: Any, go: str) -> None:
    """`go`: what Go's encoding/json writes for the value once the server has decoded it."""
    assert json_size(value) == len(go.encode())
