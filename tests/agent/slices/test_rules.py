"""Tests for agent.slices.rules and agent.slices.device_rules, one table row per rule of reference/resourceslice.md
section 2.

The rows live in tests/support/slice_cases.py, shared with the real-cluster tier, which checks them against
kube-apiserver itself. Each row mutates a valid baseline so that exactly one rule breaks, and states the exact
set of error paths expected; the baseline itself yields no error.
"""

from __future__ import annotations

import copy
import string
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.kube.names import (
    is_c_identifier,
    is_dns_label,
    is_dns_subdomain,
    is_driver_name,
    is_label_key,
    is_label_value,
    is_node_name,
    is_qualified_name,
    is_semver,
)
from agent.slices import device_rules, rules
from agent.slices.device_rules import validate_device
from agent.slices.rules import validate_pool, validate_resource_slice, validate_resource_slice_update
from tests.support.slice_cases import (
    COUNTER_CASES,
    DEV,
    POOL_CASES,
    RAW_CASES,
    SELECTOR,
    SLICE_CASES,
    UPDATE_CASES,
    VALID_CASES,
    Mutation,
    Obj,
    baseline,
    counter_slice,
    counters_baseline,
    device,
    numbered_devices,
    paths,
    pool_slice,
)
from tests.support.slice_strategies import built_slices, mutated_slices


def test_baselines_are_valid() -> None:
    assert validate_resource_slice(baseline()) == []
    assert validate_resource_slice(counters_baseline()) == []


def test_error_format_matches_documented_example() -> None:
    obj = baseline()
    device(obj)["attributes"]["bad-key"] = {"string": "x"}
    assert validate_resource_slice(obj) == [
        'spec.devices[0].attributes: key "bad-key" must be a C identifier of at most 32 characters, '
        "optionally prefixed by a DNS subdomain and '/'"
    ]


@pytest.mark.parametrize(("mutate", "expected"), SLICE_CASES.values(), ids=SLICE_CASES.keys())
def test_slice_rule_violations(mutate: Mutation, expected: set[str]) -> None:
    obj = baseline()
    assert validate_resource_slice(obj) == []
    mutate(obj)
    assert paths(validate_resource_slice(obj)) == expected


@pytest.mark.parametrize(("mutate", "expected"), RAW_CASES.values(), ids=RAW_CASES.keys())
def test_whole_numbers_written_as_floats_are_refused(mutate: Mutation, expected: set[str]) -> None:
    obj = baseline()
    mutate(obj)
    assert paths(validate_resource_slice(obj)) == expected


@pytest.mark.parametrize(("mutate", "expected"), COUNTER_CASES.values(), ids=COUNTER_CASES.keys())
def test_counter_slice_rule_violations(mutate: Mutation, expected: set[str]) -> None:
    obj = counters_baseline()
    assert validate_resource_slice(obj) == []
    mutate(obj)
    assert paths(validate_resource_slice(obj)) == expected


@pytest.mark.parametrize("mutate", VALID_CASES.values(), ids=VALID_CASES.keys())
def test_valid_variants(mutate: Mutation) -> None:
    obj = baseline()
    mutate(obj)
    assert validate_resource_slice(obj) == []


def test_limit_constants() -> None:
    assert rules.MAX_DEVICES_PER_SLICE == 128
    assert rules.MAX_DEVICES_WITH_TAINTS_OR_COUNTERS == 64
    assert device_rules.MAX_ATTRIBUTES_AND_CAPACITIES == 32
    assert device_rules.MAX_TAINTS == 16
    assert rules.MAX_COUNTER_SETS == 8
    assert device_rules.MAX_COUNTERS == 32
    assert device_rules.MAX_CONSUMES_COUNTERS == 2
    assert device_rules.MAX_STRING_ATTRIBUTE_BYTES == 64


def test_oversized_device_list_is_not_validated_item_by_item() -> None:
    obj = baseline()
    obj["spec"]["devices"] = [{"name": "BAD"}] * 129
    assert paths(validate_resource_slice(obj)) == {"spec.devices"}


def test_malformed_types_are_reported_not_raised() -> None:
    obj = baseline()
    obj["spec"]["devices"] = "gpu-0"
    obj["metadata"]["labels"] = ["x"]
    assert paths(validate_resource_slice(obj)) == {"spec.devices", "metadata.labels"}
    assert paths(validate_resource_slice([])) == {"<root>"}  # type: ignore[arg-type]
    obj = baseline()
    device(obj)["attributes"] = {"x": "plain"}
    device(obj)["capacity"] = {"memory": {"value": {"nested": 1}}}
    assert paths(validate_resource_slice(obj)) == {
        f"{DEV}.attributes[x]",
        f"{DEV}.capacity[memory].value",
    }


def test_validate_device_alone() -> None:
    assert validate_device(baseline()["spec"]["devices"][0]) == []
    assert paths(validate_device({"name": "Bad"})) == {"device.name"}
    assert paths(validate_device({"name": "a", "nodeName": "n"}, path="d")) == {"d"}
    assert validate_device({"name": "a", "nodeName": "n"}, per_device_node_selection=True) == []
    assert paths(validate_device({"name": "a"}, per_device_node_selection=True)) == {"device"}


@pytest.mark.parametrize(("mutate", "expected"), UPDATE_CASES.values(), ids=UPDATE_CASES.keys())
def test_update_rule_violations(mutate: Mutation, expected: set[str]) -> None:
    old, new = baseline(), baseline()
    mutate(new)
    assert paths(validate_resource_slice_update(old, new)) == expected


def test_update_may_change_devices_generation_and_node_selector() -> None:
    old = baseline()
    old["spec"].update(nodeName=None, allNodes=True)
    new = copy.deepcopy(old)
    new["spec"].update(allNodes=None, nodeSelector=SELECTOR)
    new["spec"]["pool"]["generation"] = 2
    new["spec"]["devices"] = numbered_devices(3)
    assert validate_resource_slice_update(old, new) == []
    assert validate_resource_slice_update(baseline(), baseline()) == []


def test_complete_pools_are_valid() -> None:
    assert validate_pool([pool_slice(0, 1)]) == []
    assert validate_pool([pool_slice(0, 2), pool_slice(1, 2)]) == []
    consumer = pool_slice(
        0,
        2,
        devices=[
            {
                "name": "mig-0",
                "consumesCounters": [{"counterSet": "gpu-0-cs", "counters": {"memory": {"value": "5Gi"}}}],
            }
        ],
    )
    assert validate_pool([consumer, counter_slice(2)]) == []
    for rs in (consumer, counter_slice(2)):
        assert validate_resource_slice(rs) == []


def test_older_generations_are_ignored() -> None:
    stale = pool_slice(0, 3, generation=1)
    stale["spec"]["devices"] = [{"name": "dev-0-1"}]  # would clash with the current slice
    assert validate_pool([stale, pool_slice(1, 1, generation=2)]) == []


@pytest.mark.parametrize(("slices", "expected", "message"), POOL_CASES.values(), ids=POOL_CASES.keys())
def test_pool_rule_violations(slices: list[Obj], expected: set[str], message: str) -> None:
    errors = validate_pool(slices)
    assert paths(errors) == expected
    assert any(message in error for error in errors), errors


def test_empty_pool_is_an_error() -> None:
    assert validate_pool([]) != []


# --- format predicates -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("predicate", "good", "bad"),
    [
        (
            is_dns_label,
            ["a", "gpu-0", "0", "a" * 63],
            ["", "A", "-a", "a-", "a.b", "a_b", "a" * 64, "a\n", "é"],
        ),
        (
            is_dns_subdomain,
            ["a", "a.b", "gpu.example.com", "a" * 253, ("a" * 63 + ".") * 3 + "a" * 61],
            ["", ".a", "a.", "a..b", "A.b", "a_b", "a" * 254, "a.-b"],
        ),
        (is_c_identifier, ["a", "_", "A_9", "a" * 100], ["", "9a", "a-b", "a.b", "a b", "é"]),
        (
            is_label_key,
            ["a", "A.b_c-d", "example.com/Name", "a" * 63, "a" * 253 + "/" + "b" * 63],
            ["", "/a", "a/", "a/b/c", "-a", "a-", "a" * 64, "Example.com/a", "a b"],
        ),
        (is_label_value, ["", "a", "A.b_c-d", "a" * 63], ["-a", "a-", "a" * 64, "a/b", "a b"]),
        (
            is_driver_name,
            ["gpu.example.com", "GPU.Example.com", "a", "a" * 63, "\u0130o.example.com"],
            ["", "a" * 64, "gpu_example.com", "-gpu.com", "gpu.com.", "é.com"],
        ),
        (
            is_qualified_name,
            ["a", "memory", "_x", "a" * 32, "example.com/x", "Example.COM/x", "a" * 63 + "/" + "b" * 32],
            ["", "bad-key", "a.b", "a" * 33, "a/b/c", "/x", "x/", "a" * 64 + "/x", "ex_ample.com/x", "x/9"],
        ),
        (
            is_semver,
            ["0.0.0", "1.2.3", "12.4.0", "1.2.3-rc.1+build.5", "1.2.3-0", "1.2.3-0a", "1.2.3+01", "1.2.3--x"],
            [
                "",
                "12.4",
                "01.2.3",
                "1.02.3",
                "v1.2.3",
                "1.2.3-01",
                "1.2.3-",
                "1.2.3+",
                "1.2.3-a..b",
                "1.2.3.4",
                " 1.2.3",
                "1.2.3\n",
                "\u0661.2.3",
            ],
        ),
        (is_node_name, ["node-1", "ip-10-0-0-1.ec2.internal"], ["", "Node-1", "node_1"]),
    ],
)
def test_format_predicates(predicate: Callable[[str], bool], good: list[str], bad: list[str]) -> None:
    for text in good:
        assert predicate(text), text
    for text in bad:
        assert not predicate(text), text


def test_predicates_reject_non_strings() -> None:
    for predicate in (
        is_dns_label,
        is_dns_subdomain,
        is_c_identifier,
        is_label_key,
        is_label_value,
        is_driver_name,
        is_qualified_name,
        is_semver,
        is_node_name,
    ):
        assert not predicate(None)
        assert not predicate(5)


_dns_like = st.from_regex(r"[a-z0-9][-a-z0-9.]{0,70}", fullmatch=True)
_identifier_like = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,40}", fullmatch=True)


@settings(database=None)
@given(st.text(alphabet=string.printable, max_size=80) | _dns_like)
def test_dns_label_implies_dns_subdomain(s: str) -> None:
    if is_dns_label(s):
        assert is_dns_subdomain(s)
        assert is_node_name(s)
        assert is_driver_name(s)


@settings(database=None)
@given(st.text(alphabet=string.printable, max_size=40) | _identifier_like)
def test_short_c_identifiers_are_qualified_names(s: str) -> None:
    if is_c_identifier(s) and len(s) <= 32:
        assert is_qualified_name(s)
        assert is_qualified_name(f"example.com/{s}")
    elif "/" not in s:
        assert not is_qualified_name(s)


@settings(max_examples=150, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(built_slices())
def test_every_slice_the_builder_makes_passes_the_rules(obj: Obj) -> None:
    assert validate_resource_slice(obj) == []


@settings(max_examples=300, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_slices())
def test_mutated_slices_get_errors_that_name_a_field(obj: Obj) -> None:
    for path in paths(validate_resource_slice(obj)):
        assert path and " " not in path.split("[", 1)[0], path
