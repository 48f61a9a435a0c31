"""The project's ResourceSlice rules (agent/slices/rules.py: the agent checks every slice it publishes with them, and
the test API server validates with them) against kube-apiserver itself. Every case of tests/support/slice_cases.py goes
to the real server as a dry run, and so do slices the agent's builder makes of generated devices, mutated at random
(tests/support/slice_strategies.py): the server must refuse exactly the objects the rules refuse, and name exactly the
fields the rules name.

kubectl asks for the server's default field validation, as the agent's own requests do: a field the server does
not know is dropped with a warning, not refused (kubectl's own default would refuse it)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from agent.slices.rules import validate_resource_slice, validate_resource_slice_update
from cluster.kubectl import KubectlError
from tests.real_cluster.cluster_env import RealCluster
from tests.support.slice_cases import (
    COUNTER_CASES,
    DECODING,
    RAW_CASES,
    REFUSED_BEFORE_VALIDATION,
    SLICE_CASES,
    UPDATE_CASES,
    VALID_CASES,
    Mutation,
    Obj,
    baseline,
    counters_baseline,
    paths,
)
from tests.support.slice_strategies import mutated_slices

pytestmark = pytest.mark.xdist_group("real-cluster")

# How a field.Error begins after its path (k8s.io/apimachinery, field.ErrorType.String()).
_ERROR_TYPES = ("Invalid value", "Required value", "Duplicate value", "Unsupported value", "Forbidden", "Too long",
                "Too many", "Too few", "Too short", "Not found", "Internal error")
# A field path: names joined by dots, list indices and map keys in brackets (keys are printed as they are).
_CAUSE = re.compile(r"((?:[A-Za-z_<][\w<>]*)(?:\.[A-Za-z_]\w*|\[[^\]]*\])*): (?:" + "|".join(_ERROR_TYPES) + ")")
_INVALID = re.compile(r'The ResourceSlice "[^"]*" is invalid: ?(.*)')
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
_WARNING = re.compile(r"Warning: |[IWE]\d{4} ")
# How kubectl words a refusal of an object that the server (or kubectl, reading it first) cannot read.
_UNREADABLE = ("cannot be handled as a ResourceSlice", "unable to decode", "error validating data")


@dataclass(frozen=True)
class Verdict:
    """What the server said about one object: accepted, refused as invalid (with the fields it named), or refused
    otherwise (the object could not be read, the kind is not served, ...), with kubectl's message."""

    refused: bool
    fields: frozenset[str] | None = None
    message: str = ""


def invalid_fields(message: str) -> frozenset[str] | None:
    """The field paths of an "is invalid" refusal as kubectl prints it: one error on the same line, or several,
    each on a line of its own after "* " (after warnings, the server's or kubectl's own log lines); None for any
    other refusal."""
    lines = [line for line in message.strip().splitlines() if not _WARNING.match(line)]
    head = _INVALID.match(lines[0]) if lines else None
    if head is None:
        return None
    causes = [head[1]] if head[1] else [line[2:] for line in lines[1:] if line.startswith("* ")]
    fields = set()
    for cause in causes:
        match = _CAUSE.match(cause)
        assert match, f"not a field error: {cause!r}"
        fields.add(match[1])
    assert fields, message
    return frozenset(fields)


def server_verdict(cluster: RealCluster, obj: Obj, verb: str = "create") -> Verdict:
    try:
        cluster.kubectl.run(verb, "--dry-run=server", "--validate=warn", "-f", "-", input=json.dumps(obj))
    except KubectlError as e:
        return Verdict(True, invalid_fields(e.stderr), e.stderr.strip())
    return Verdict(False)


def assert_same_verdict(name: str, ours: set[str], expected: set[str], server: Verdict) -> None:
    """Ours and the table agree (the fast tier's claim), and the server agrees with both."""
    assert ours == expected, f"the rules name {sorted(ours)}, the table {sorted(expected)}"
    if name in REFUSED_BEFORE_VALIDATION:
        assert server.refused and server.fields is None, server
        assert REFUSED_BEFORE_VALIDATION[name] in server.message, server.message
        assert expected, "a refused object needs an error from the rules too"
    elif expected:
        assert server.refused, f"the server accepted what the rules refuse at {sorted(expected)}"
        assert server.fields is not None, server.message
        assert set(server.fields) == expected, server.message
    else:
        assert not server.refused, server.message


def _mutated(base: Obj, mutate: Mutation) -> Obj:
    mutate(base)
    return base


def rows(table: dict[str, Any]) -> list[Any]:
    """A table's cases as parameters, each with its name first."""
    return [pytest.param(name, *(case if isinstance(case, tuple) else (case,)), id=name)
            for name, case in table.items()]


@pytest.mark.parametrize(("name", "mutate", "expected"), rows(SLICE_CASES))
def test_the_server_refuses_each_slice_case_at_the_same_fields(real_cluster: RealCluster, name: str,
                                                               mutate: Mutation, expected: set[str]) -> None:
    obj = _mutated(baseline(), mutate)
    assert_same_verdict(name, paths(validate_resource_slice(obj)), expected, server_verdict(real_cluster, obj))


@pytest.mark.parametrize(("name", "mutate", "expected"), rows(COUNTER_CASES))
def test_the_server_refuses_each_counter_case_at_the_same_fields(real_cluster: RealCluster, name: str,
                                                                 mutate: Mutation, expected: set[str]) -> None:
    obj = _mutated(counters_baseline(), mutate)
    assert_same_verdict(name, paths(validate_resource_slice(obj)), expected, server_verdict(real_cluster, obj))


@pytest.mark.parametrize(("name", "mutate"), rows(VALID_CASES))
def test_the_server_accepts_each_valid_variant(real_cluster: RealCluster, name: str, mutate: Mutation) -> None:
    obj = _mutated(baseline(), mutate)
    assert_same_verdict(name, paths(validate_resource_slice(obj)), set(),
                        server_verdict(real_cluster, obj))


@pytest.mark.parametrize(("name", "mutate", "expected"), rows(RAW_CASES))
def test_the_server_refuses_whole_numbers_written_as_floats(real_cluster: RealCluster, name: str, mutate: Mutation,
                                                           expected: set[str]) -> None:
    """Sent as the agent sends JSON, byte for byte: kubectl create would write 2.0 as 2 first."""
    obj = _mutated(baseline(), mutate)
    assert paths(validate_resource_slice(obj)) == expected
    with pytest.raises(KubectlError) as refused:
        real_cluster.kubectl.run("create", "--raw", f"{SLICES}?dryRun=All", "-f", "-", input=json.dumps(obj))
    assert DECODING in refused.value.stderr, refused.value.stderr


def unowned_baseline() -> Obj:
    """The baseline without its owner: the garbage collector deletes a slice whose owner Node does not exist."""
    obj = baseline()
    del obj["metadata"]["ownerReferences"]
    return obj


@pytest.fixture(scope="module")
def stored_baseline(real_cluster: RealCluster) -> Iterator[Obj]:
    """The baseline stored for real, for the update cases to replace (as dry runs: it stays as it is)."""
    obj = unowned_baseline()
    real_cluster.kubectl.create(obj)
    yield obj
    real_cluster.kubectl.run("delete", "resourceslice", obj["metadata"]["name"], "--ignore-not-found")


@pytest.mark.parametrize(("name", "mutate", "expected"), rows(UPDATE_CASES))
def test_the_server_refuses_each_update_case_at_the_same_fields(real_cluster: RealCluster, stored_baseline: Obj,
                                                                name: str, mutate: Mutation,
                                                                expected: set[str]) -> None:
    new = _mutated(unowned_baseline(), mutate)
    ours = paths(validate_resource_slice_update(stored_baseline, new))
    assert_same_verdict(name, ours, expected, server_verdict(real_cluster, new, "replace"))


def test_the_server_accepts_an_update_of_devices_generation_and_node_selection(real_cluster: RealCluster,
                                                                              stored_baseline: Obj) -> None:
    new: dict[str, Any] = unowned_baseline()
    new["spec"]["pool"]["generation"] = 2
    new["spec"]["devices"] = [{"name": "gpu-7"}]
    assert validate_resource_slice_update(stored_baseline, new) == []
    assert server_verdict(real_cluster, new, "replace") == Verdict(False)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(obj=mutated_slices())
def test_generated_slices_get_the_rules_verdict_from_the_server(real_cluster: RealCluster, obj: Obj) -> None:
    ours = paths(validate_resource_slice(obj))
    server = server_verdict(real_cluster, obj)
    if server.refused and server.fields is None:  # refused before validation: no fields to compare
        assert any(words in server.message for words in _UNREADABLE), server.message
        assert ours, server.message
    else:
        assert set(server.fields or ()) == ours, server.message or "accepted"


@pytest.mark.parametrize(("message", "fields"), [
    ('The ResourceSlice "x" is invalid: spec.driver: Required value', {"spec.driver"}),
    ('W1128 00:19:53.196633  746 schema.go:145] cannot perform warn validation\nWarning: unknown field '
     '"spec.devices[0].attributes.x.float"\nThe ResourceSlice "x" is invalid: '
     'spec.devices[0].attributes[x]: Invalid value: "": must specify one of: `int`', {"spec.devices[0].attributes[x]"}),
    ('The ResourceSlice "x" is invalid: \n* spec.devices[0].attributes[a, b: Invalid value]: Invalid value: "": '
     'must specify one of: `int`\n* spec: Invalid value: "": only one of `sharedCounters` or `devices` is allowed\n',
     {"spec.devices[0].attributes[a, b: Invalid value]", "spec"}),
    ('Error from server (BadRequest): error when creating "STDIN": ResourceSlice in version "v1" cannot be handled '
     'as a ResourceSlice: quantities must match the regular expression', None),
])
def test_kubectl_messages_are_read_field_by_field(message: str, fields: set[str] | None) -> None:
    assert invalid_fields(message) == (None if fields is None else frozenset(fields))
