"""Tests for agent.slices.rules and agent.slices.device_rules, one table row per rule of reference/resourceslice.md
section 2.

Each row mutates a valid baseline so that exactly one rule breaks, and states the exact set of
error paths expected; the baseline itself yields no error.
"""

from __future__ import annotations

import copy
import string
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
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

Obj = dict[str, Any]
DEV = "spec.devices[0]"


def baseline() -> Obj:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {
            "name": "00000-gpu.example.com-node-1-x7k2p",
            "labels": {"app.kubernetes.io/managed-by": "dra-agent"},
            "annotations": {"example.com/Note": "anything goes here"},
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "name": "node-1",
                    "uid": "2b1c9c3e-0000-4000-8000-000000000001",
                    "controller": True,
                },
            ],
        },
        "spec": {
            "driver": "gpu.example.com",
            "pool": {"name": "node-1", "generation": 1, "resourceSliceCount": 1},
            "nodeName": "node-1",
            "devices": [
                {
                    "name": "gpu-0",
                    "attributes": {
                        "model": {"string": "A100-SXM4-40GB"},
                        "driverVersion": {"version": "550.54.15"},
                        "index": {"int": 0},
                        "mig": {"bool": False},
                        "resource.kubernetes.io/pcieRoot": {"string": "pci0000:00"},
                    },
                    "capacity": {"memory": {"value": "40Gi"}, "multiprocessors": {"value": 108}},
                },
                {"name": "gpu-1"},
            ],
        },
    }


def counters_baseline() -> Obj:
    obj = baseline()
    del obj["spec"]["devices"]
    obj["spec"]["sharedCounters"] = [
        {
            "name": "gpu-0-counter-set",
            "counters": {"memory": {"value": "40Gi"}, "memory-slice-0": {"value": "1"}},
        },
    ]
    return obj


def paths(errors: list[str]) -> set[str]:
    for error in errors:
        assert ": " in error, error
    return {error.split(": ", 1)[0] for error in errors}


def device(obj: Obj, index: int = 0) -> Obj:
    dev: Obj = obj["spec"]["devices"][index]
    return dev


def test_baselines_are_valid() -> None:
    assert validate_resource_slice(baseline()) == []
    assert validate_resource_slice(counters_baseline()) == []


def test_error_format_matches_documented_example() -> None:
    obj = baseline()
    device(obj)["attributes"]["bad-key"] = {"string": "x"}
    assert validate_resource_slice(obj) == [
        'spec.devices[0].attributes["bad-key"]: must be a C identifier of at most 32 characters, '
        "optionally prefixed by a DNS subdomain and '/'"
    ]


# --- one row per rule: (mutation, expected error paths) ----------------------------------------

Mutation = Callable[[Obj], object]


def _set(path: str, value: Any) -> Mutation:
    """Mutation that sets a dotted path (list indices as numbers) to ``value``; None deletes."""

    def mutate(obj: Obj) -> None:
        *parents, last = path.split(".")
        target: Any = obj
        for part in parents:
            target = target[int(part)] if part.isdigit() else target[part]
        if value is None:
            del target[int(last) if last.isdigit() else last]
        else:
            target[int(last) if last.isdigit() else last] = copy.deepcopy(value)

    return mutate


def _attr(key: str, value: Any) -> Mutation:
    return lambda obj: device(obj)["attributes"].__setitem__(key, copy.deepcopy(value))


def _cap(key: str, value: Any) -> Mutation:
    return lambda obj: device(obj)["capacity"].__setitem__(key, copy.deepcopy(value))


def _devices(n: int, **extra: Any) -> list[Obj]:
    return [{"name": f"dev-{i}", **copy.deepcopy(extra)} for i in range(n)]


def _attrs(n: int) -> dict[str, Obj]:
    return {f"a{i}": {"int": i} for i in range(n)}


TAINT = {"key": "gpu.example.com/xid", "value": "79", "effect": "NoSchedule"}
TERM = {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]}
SELECTOR = {"nodeSelectorTerms": [TERM]}
COUNTERS = {"counterSet": "gpu-0-counter-set", "counters": {"memory": {"value": "5Gi"}}}
MULTI: Obj = {"name": "gpu-0", "allowMultipleAllocations": True}
CAP = f'{DEV}.capacity["memory"].requestPolicy'


def _policy(**policy: Any) -> Mutation:
    return _set("spec.devices.0", {**MULTI, "capacity": {"memory": {"value": "40", "requestPolicy": policy}}})


def _selector(*terms: Obj) -> Mutation:
    """Mutation that replaces nodeName by a nodeSelector with ``terms``."""
    return lambda obj: obj["spec"].update(nodeName=None, nodeSelector={"nodeSelectorTerms": list(terms)})


def _per_device(*devices: Obj) -> Mutation:
    def mutate(obj: Obj) -> None:
        del obj["spec"]["nodeName"]
        obj["spec"]["perDeviceNodeSelection"] = True
        obj["spec"]["devices"] = [copy.deepcopy(d) for d in devices]

    return mutate


SLICE_CASES: dict[str, tuple[Mutation, set[str]]] = {
    # metadata, apiVersion, kind
    "M1 no name nor generateName": (_set("metadata.name", None), {"metadata.name"}),
    "M1 name not a DNS subdomain": (_set("metadata.name", "Node_1"), {"metadata.name"}),
    "M1 name too long": (_set("metadata.name", "a" * 254), {"metadata.name"}),
    "M1 generateName invalid": (_set("metadata.generateName", "Node_1-"), {"metadata.generateName"}),
    "M1 generateName cut at 58 ends the label with '-'": (
        _set("metadata", {"generateName": "a" * 56 + ".-"}),
        {"metadata.generateName"},
    ),
    "M2 namespace set": (_set("metadata.namespace", "default"), {"metadata.namespace"}),
    "M2 bad label key": (_set("metadata.labels", {"bad key": "x"}), {'metadata.labels["bad key"]'}),
    "M2 bad label value": (_set("metadata.labels", {"k": "-x"}), {'metadata.labels["k"]'}),
    "M2 bad annotation key": (
        _set("metadata.annotations", {"a/b/c": "x"}),
        {'metadata.annotations["a/b/c"]'},
    ),
    "M2 owner uid missing": (_set("metadata.ownerReferences.0.uid", ""), {"metadata.ownerReferences[0].uid"}),
    "M2 owner kind missing": (
        _set("metadata.ownerReferences.0.kind", None),
        {"metadata.ownerReferences[0].kind"},
    ),
    "M2 two controllers": (
        lambda o: o["metadata"]["ownerReferences"].append(
            {**o["metadata"]["ownerReferences"][0], "name": "other"}
        ),
        {"metadata.ownerReferences"},
    ),
    "apiVersion beta": (_set("apiVersion", "resource.k8s.io/v1beta2"), {"apiVersion"}),
    "kind wrong": (_set("kind", "ResourceClaim"), {"kind"}),
    "spec missing": (_set("spec", None), {"spec"}),
    # S1-S4
    "S1 driver missing": (_set("spec.driver", None), {"spec.driver"}),
    "S1 driver not a subdomain": (_set("spec.driver", "gpu_example.com"), {"spec.driver"}),
    "S1 driver 64 characters": (_set("spec.driver", "a" * 60 + ".com"), {"spec.driver"}),
    "S2 pool name missing": (_set("spec.pool.name", None), {"spec.pool.name"}),
    "S2 pool name upper case": (_set("spec.pool.name", "Node-1"), {"spec.pool.name"}),
    "S2 pool name empty segment": (_set("spec.pool.name", "a//b"), {"spec.pool.name"}),
    "S2 pool name leading slash": (_set("spec.pool.name", "/a"), {"spec.pool.name"}),
    "S2 pool name of 254 characters": (
        _set("spec.pool.name", "/".join(["a" * 63] * 3 + ["a" * 62])),
        {"spec.pool.name"},
    ),
    "S3 resourceSliceCount zero": (_set("spec.pool.resourceSliceCount", 0), {"spec.pool.resourceSliceCount"}),
    "S3 resourceSliceCount missing": (
        _set("spec.pool.resourceSliceCount", None),
        {"spec.pool.resourceSliceCount"},
    ),
    "S4 generation negative": (_set("spec.pool.generation", -1), {"spec.pool.generation"}),
    "S4 generation not an integer": (_set("spec.pool.generation", "1"), {"spec.pool.generation"}),
    # S5-S9
    "S5 no node selection": (_set("spec.nodeName", None), {"spec"}),
    "S5 two node selection fields": (_set("spec.allNodes", True), {"spec"}),
    "S5 nodeName and nodeSelector": (_set("spec.nodeSelector", SELECTOR), {"spec"}),
    "S6 nodeName empty": (_set("spec.nodeName", ""), {"spec.nodeName", "spec"}),
    "S6 nodeName invalid": (_set("spec.nodeName", "Node_1"), {"spec.nodeName"}),
    "S7 nodeSelector with two terms": (_selector(TERM, TERM), {"spec.nodeSelector.nodeSelectorTerms"}),
    "S7 nodeSelector without terms": (_selector(), {"spec.nodeSelector.nodeSelectorTerms"}),
    "S7 nodeSelector bad operator": (
        _selector({"matchExpressions": [{"key": "pool", "operator": "Like", "values": ["a"]}]}),
        {"spec.nodeSelector.nodeSelectorTerms[0].matchExpressions[0].operator"},
    ),
    "S7 nodeSelector In without values": (
        _selector({"matchExpressions": [{"key": "pool", "operator": "In"}]}),
        {"spec.nodeSelector.nodeSelectorTerms[0].matchExpressions[0].values"},
    ),
    "S7 nodeSelector Exists with values": (
        _selector({"matchExpressions": [{"key": "pool", "operator": "Exists", "values": ["a"]}]}),
        {"spec.nodeSelector.nodeSelectorTerms[0].matchExpressions[0].values"},
    ),
    "S7 nodeSelector bad key": (
        _selector({"matchExpressions": [{"key": "a b", "operator": "Exists"}]}),
        {"spec.nodeSelector.nodeSelectorTerms[0].matchExpressions[0].key"},
    ),
    "S7 nodeSelector bad value": (
        _selector({"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a b"]}]}),
        {"spec.nodeSelector.nodeSelectorTerms[0].matchExpressions[0].values[0]"},
    ),
    "S7 nodeSelector matchFields other than metadata.name": (
        _selector({"matchFields": [{"key": "spec.unschedulable", "operator": "In", "values": ["x"]}]}),
        {"spec.nodeSelector.nodeSelectorTerms[0].matchFields[0].key"},
    ),
    "S8 allNodes false": (
        lambda o: o["spec"].update(nodeName=None, allNodes=False),
        {"spec.allNodes", "spec"},
    ),
    "S9 perDeviceNodeSelection false": (
        _set("spec.perDeviceNodeSelection", False),
        {"spec.perDeviceNodeSelection"},
    ),
    # S10-S13
    "S10 devices and sharedCounters": (
        _set("spec.sharedCounters", [{"name": "cs", "counters": {"c": {"value": "1"}}}]),
        {"spec"},
    ),
    "S10 empty devices list counts as set": (
        lambda o: o["spec"].update(
            devices=[], sharedCounters=[{"name": "cs", "counters": {"c": {"value": "1"}}}]
        ),
        {"spec"},
    ),
    "S11 129 devices": (_set("spec.devices", _devices(129)), {"spec.devices"}),
    "S11 65 devices, one tainted": (
        lambda o: o["spec"].update(devices=[{"name": "t", "taints": [TAINT]}, *_devices(64)]),
        {"spec.devices"},
    ),
    "S11 65 devices, one consuming counters": (
        lambda o: o["spec"].update(devices=[{"name": "c", "consumesCounters": [COUNTERS]}, *_devices(64)]),
        {"spec.devices"},
    ),
    "S11 65 devices, one with a list attribute": (
        lambda o: o["spec"].update(
            devices=[{"name": "l", "attributes": {"x": {"ints": [1]}}}, *_devices(64)]
        ),
        {"spec.devices"},
    ),
    "S12 duplicate device name": (_set("spec.devices.1.name", "gpu-0"), {"spec.devices[1].name"}),
    # D1-D4
    "D1 device name missing": (_set("spec.devices.0.name", None), {f"{DEV}.name"}),
    "D1 device name upper case": (_set("spec.devices.0.name", "GPU-0"), {f"{DEV}.name"}),
    "D1 device name with a dot": (_set("spec.devices.0.name", "gpu.0"), {f"{DEV}.name"}),
    "D1 device name 64 characters": (_set("spec.devices.0.name", "g" * 64), {f"{DEV}.name"}),
    "D2 33 attributes and capacities": (
        _set("spec.devices.0", {"name": "d", "attributes": _attrs(32), "capacity": {"c": {"value": "1"}}}),
        {DEV},
    ),
    "D3 49 attribute values": (
        _set("spec.devices.0", {"name": "d", "attributes": {"a": {"ints": list(range(40))}, **_attrs(9)}}),
        {DEV},
    ),
    "D4 attribute key with '-'": (_attr("bad-key", {"int": 1}), {f'{DEV}.attributes["bad-key"]'}),
    "D4 attribute key with two slashes": (_attr("a/b/c", {"int": 1}), {f'{DEV}.attributes["a/b/c"]'}),
    "D4 attribute key with empty domain": (_attr("/x", {"int": 1}), {f'{DEV}.attributes["/x"]'}),
    "D4 attribute key with empty id": (_attr("x/", {"int": 1}), {f'{DEV}.attributes["x/"]'}),
    "D4 attribute id of 33 characters": (_attr("a" * 33, {"int": 1}), {f'{DEV}.attributes["{"a" * 33}"]'}),
    "D4 attribute domain of 64 characters": (
        _attr("a" * 60 + ".com/x", {"int": 1}),
        {f'{DEV}.attributes["{"a" * 60}.com/x"]'},
    ),
    "D4 capacity key invalid": (_cap("mem.size", {"value": "1"}), {f'{DEV}.capacity["mem.size"]'}),
    # D5, T1-T4
    "D5 17 taints": (
        _set("spec.devices.0.taints", [dict(TAINT, value=str(i)) for i in range(17)]),
        {f"{DEV}.taints"},
    ),
    "T1 taint key missing": (
        _set("spec.devices.0.taints", [{"effect": "NoSchedule"}]),
        {f"{DEV}.taints[0].key"},
    ),
    "T1 taint key invalid": (
        _set("spec.devices.0.taints", [dict(TAINT, key="a/b/c")]),
        {f"{DEV}.taints[0].key"},
    ),
    "T2 taint value invalid": (
        _set("spec.devices.0.taints", [dict(TAINT, value="x" * 64)]),
        {f"{DEV}.taints[0].value"},
    ),
    "T3 taint effect PreferNoSchedule": (
        _set("spec.devices.0.taints", [dict(TAINT, effect="PreferNoSchedule")]),
        {f"{DEV}.taints[0].effect"},
    ),
    "T3 taint effect missing": (_set("spec.devices.0.taints", [{"key": "k"}]), {f"{DEV}.taints[0].effect"}),
    "T4 taint timeAdded not RFC 3339": (
        _set("spec.devices.0.taints", [dict(TAINT, timeAdded="yesterday")]),
        {f"{DEV}.taints[0].timeAdded"},
    ),
    "T4 taint timeAdded out of range": (
        _set("spec.devices.0.taints", [dict(TAINT, timeAdded="2026-13-01T00:00:00Z")]),
        {f"{DEV}.taints[0].timeAdded"},
    ),
    # D6, C2
    "D6 three consumesCounters entries": (
        _set("spec.devices.0.consumesCounters", [dict(COUNTERS, counterSet=f"s{i}") for i in range(3)]),
        {f"{DEV}.consumesCounters"},
    ),
    "D6 duplicate counterSet": (
        _set("spec.devices.0.consumesCounters", [COUNTERS, COUNTERS]),
        {f"{DEV}.consumesCounters[1].counterSet"},
    ),
    "C2 counterSet missing": (
        _set("spec.devices.0.consumesCounters", [{"counters": COUNTERS["counters"]}]),
        {f"{DEV}.consumesCounters[0].counterSet"},
    ),
    "C2 counterSet not a DNS label": (
        _set("spec.devices.0.consumesCounters", [dict(COUNTERS, counterSet="gpu.0")]),
        {f"{DEV}.consumesCounters[0].counterSet"},
    ),
    "C2 counters empty": (
        _set("spec.devices.0.consumesCounters", [dict(COUNTERS, counters={})]),
        {f"{DEV}.consumesCounters[0].counters"},
    ),
    "C2 counter key not a DNS label": (
        _set("spec.devices.0.consumesCounters", [dict(COUNTERS, counters={"memorySlice0": {"value": "1"}})]),
        {f'{DEV}.consumesCounters[0].counters["memorySlice0"]'},
    ),
    "C2 33 counters": (
        _set(
            "spec.devices.0.consumesCounters",
            [dict(COUNTERS, counters={f"c{i}": {"value": "1"} for i in range(33)})],
        ),
        {f"{DEV}.consumesCounters[0].counters"},
    ),
    "C2 counter value not a quantity": (
        _set("spec.devices.0.consumesCounters", [dict(COUNTERS, counters={"memory": {"value": "5GB"}})]),
        {f'{DEV}.consumesCounters[0].counters["memory"].value'},
    ),
    # D7, D8
    "D7 device without node selection": (
        _per_device({"name": "a", "nodeName": "node-1"}, {"name": "b"}),
        {"spec.devices[1]"},
    ),
    "D7 device with two node selection fields": (
        _per_device({"name": "a", "nodeName": "node-1", "allNodes": True}),
        {DEV},
    ),
    "D7 device nodeName empty": (_per_device({"name": "a", "nodeName": ""}), {f"{DEV}.nodeName", DEV}),
    "D7 device nodeName invalid": (_per_device({"name": "a", "nodeName": "Node_1"}), {f"{DEV}.nodeName"}),
    "D7 device allNodes false": (_per_device({"name": "a", "allNodes": False}), {f"{DEV}.allNodes", DEV}),
    "D7 device nodeSelector invalid": (
        _per_device({"name": "a", "nodeSelector": {"nodeSelectorTerms": []}}),
        {f"{DEV}.nodeSelector.nodeSelectorTerms"},
    ),
    "D8 device nodeName without perDeviceNodeSelection": (_set("spec.devices.0.nodeName", "node-1"), {DEV}),
    "D8 device allNodes without perDeviceNodeSelection": (_set("spec.devices.0.allNodes", True), {DEV}),
    # D9
    "D9 bindingConditions alone": (
        _set("spec.devices.0.bindingConditions", ["example.com/ready"]),
        {f"{DEV}.bindingFailureConditions"},
    ),
    "D9 bindingFailureConditions alone": (
        _set("spec.devices.0.bindingFailureConditions", ["example.com/failed"]),
        {f"{DEV}.bindingConditions"},
    ),
    "D9 five bindingConditions": (
        lambda o: device(o).update(
            bindingConditions=[f"c{i}" for i in range(5)], bindingFailureConditions=["f"]
        ),
        {f"{DEV}.bindingConditions"},
    ),
    "D9 duplicate bindingCondition": (
        lambda o: device(o).update(bindingConditions=["c", "c"], bindingFailureConditions=["f"]),
        {f"{DEV}.bindingConditions[1]"},
    ),
    "D9 condition in both lists": (
        lambda o: device(o).update(bindingConditions=["c"], bindingFailureConditions=["c"]),
        {f"{DEV}.bindingFailureConditions[0]"},
    ),
    "D9 condition not a label key": (
        lambda o: device(o).update(bindingConditions=["a b"], bindingFailureConditions=["f"]),
        {f"{DEV}.bindingConditions[0]"},
    ),
    # D10, D11
    "D10 requestPolicy without allowMultipleAllocations": (
        _set("spec.devices.0.capacity.memory.requestPolicy", {"default": "1Gi", "validValues": ["1Gi"]}),
        {f'{DEV}.capacity["memory"].requestPolicy'},
    ),
    "D11 validValues and validRange": (
        _policy(default="1", validValues=["1"], validRange={"min": "1"}),
        {CAP},
    ),
    "D11 validValues without default": (_policy(validValues=["1"]), {f"{CAP}.default"}),
    "D11 validRange without default": (_policy(validRange={"min": "1"}), {f"{CAP}.default"}),
    "D11 validValues unsorted": (
        _policy(default="1", validValues=["1", "4", "2"]),
        {f"{CAP}.validValues[2]"},
    ),
    "D11 validValues duplicate": (
        _policy(default="1", validValues=["1", "2", "2000m"]),
        {f"{CAP}.validValues[2]"},
    ),
    "D11 validValues above capacity": (
        _policy(default="1", validValues=["1", "41"]),
        {f"{CAP}.validValues[1]"},
    ),
    "D11 default not among validValues": (_policy(default="3", validValues=["1", "2"]), {f"{CAP}.default"}),
    "D11 11 validValues": (
        _policy(default="1", validValues=[str(i) for i in range(1, 12)]),
        {f"{CAP}.validValues"},
    ),
    "D11 validRange without min": (_policy(default="1", validRange={"max": "4"}), {f"{CAP}.validRange.min"}),
    "D11 min above capacity": (_policy(default="41", validRange={"min": "41"}), {f"{CAP}.validRange.min"}),
    "D11 default below min": (_policy(default="1", validRange={"min": "2"}), {f"{CAP}.validRange.default"}),
    "D11 max below min": (
        _policy(default="4", validRange={"min": "4", "max": "2"}),
        {f"{CAP}.validRange.max", f"{CAP}.validRange.default"},
    ),
    "D11 max above capacity": (
        _policy(default="4", validRange={"min": "1", "max": "41"}),
        {f"{CAP}.validRange.max"},
    ),
    "D11 default above max": (
        _policy(default="8", validRange={"min": "1", "max": "4"}),
        {f"{CAP}.validRange.default"},
    ),
    "D11 step zero": (_policy(default="4", validRange={"min": "4", "step": "0"}), {f"{CAP}.validRange.step"}),
    "D11 one step beyond capacity": (
        _policy(default="4", validRange={"min": "4", "step": "37"}),
        {f"{CAP}.validRange.step"},
    ),
    "D11 default off the step grid": (
        _policy(default="5", validRange={"min": "4", "step": "2"}),
        {f"{CAP}.validRange.step"},
    ),
    "D11 max off the step grid": (
        _policy(default="4", validRange={"min": "4", "max": "9", "step": "2"}),
        {f"{CAP}.validRange.step"},
    ),
    # V1-V6
    "V1 attribute without value": (_attr("x", {}), {f'{DEV}.attributes["x"]'}),
    "V1 attribute with two values": (_attr("x", {"int": 1, "string": "1"}), {f'{DEV}.attributes["x"]'}),
    "V1 attribute with unknown value type": (_attr("x", {"float": 1.5}), {f'{DEV}.attributes["x"]'}),
    "V2 int beyond int64": (_attr("x", {"int": 2**63}), {f'{DEV}.attributes["x"].int'}),
    "V2 int given as bool": (_attr("x", {"int": True}), {f'{DEV}.attributes["x"].int'}),
    "V2 bool given as string": (_attr("x", {"bool": "yes"}), {f'{DEV}.attributes["x"].bool'}),
    "V3 string of 65 bytes": (_attr("x", {"string": "s" * 65}), {f'{DEV}.attributes["x"].string'}),
    "V3 string of 33 characters, 65 bytes": (
        _attr("x", {"string": "é" * 32 + "s"}),
        {f'{DEV}.attributes["x"].string'},
    ),
    "V3 string of 22 euro signs, 66 bytes": (
        _attr("x", {"string": "€" * 22}),
        {f'{DEV}.attributes["x"].string'},
    ),
    "V4 version with two parts": (_attr("x", {"version": "12.4"}), {f'{DEV}.attributes["x"].version'}),
    "V4 version with leading zero": (_attr("x", {"version": "01.2.3"}), {f'{DEV}.attributes["x"].version'}),
    "V4 version with v prefix": (_attr("x", {"version": "v1.2.3"}), {f'{DEV}.attributes["x"].version'}),
    "V4 version with numeric pre-release leading zero": (
        _attr("x", {"version": "1.2.3-01"}),
        {f'{DEV}.attributes["x"].version'},
    ),
    "V4 version of 65 bytes": (
        _attr("x", {"version": "1.2.3-" + "a" * 59}),
        {f'{DEV}.attributes["x"].version'},
    ),
    "V5 empty list": (_attr("x", {"ints": []}), {f'{DEV}.attributes["x"].ints'}),
    "V5 list string too long": (
        _attr("x", {"strings": ["ok", "s" * 65]}),
        {f'{DEV}.attributes["x"].strings[1]'},
    ),
    "V5 list version invalid": (_attr("x", {"versions": ["1.0"]}), {f'{DEV}.attributes["x"].versions[0]'}),
    "V6 capacity value not a quantity": (
        _set("spec.devices.0.capacity.memory.value", "40GB"),
        {f'{DEV}.capacity["memory"].value'},
    ),
    "V6 capacity value missing": (
        _set("spec.devices.0.capacity.memory", {}),
        {f'{DEV}.capacity["memory"].value'},
    ),
}


COUNTER_CASES: dict[str, tuple[Mutation, set[str]]] = {
    "S13 nine counter sets": (
        _set("spec.sharedCounters", [{"name": f"s{i}", "counters": {"c": {"value": "1"}}} for i in range(9)]),
        {"spec.sharedCounters"},
    ),
    "S13 duplicate counter set name": (
        lambda o: o["spec"]["sharedCounters"].append(o["spec"]["sharedCounters"][0]),
        {"spec.sharedCounters[1].name"},
    ),
    "C1 counter set name missing": (
        _set("spec.sharedCounters.0.name", None),
        {"spec.sharedCounters[0].name"},
    ),
    "C1 counter set name not a DNS label": (
        _set("spec.sharedCounters.0.name", "gpu_0"),
        {"spec.sharedCounters[0].name"},
    ),
    "C1 counters missing": (
        _set("spec.sharedCounters.0.counters", None),
        {"spec.sharedCounters[0].counters"},
    ),
    "C1 counters empty": (_set("spec.sharedCounters.0.counters", {}), {"spec.sharedCounters[0].counters"}),
    "C1 33 counters": (
        _set("spec.sharedCounters.0.counters", {f"c{i}": {"value": "1"} for i in range(33)}),
        {"spec.sharedCounters[0].counters"},
    ),
    "C1 counter key not a DNS label": (
        _set("spec.sharedCounters.0.counters.memorySlice0", {"value": "1"}),
        {'spec.sharedCounters[0].counters["memorySlice0"]'},
    ),
    "C1 counter value not a quantity": (
        _set("spec.sharedCounters.0.counters.memory", {"value": "lots"}),
        {'spec.sharedCounters[0].counters["memory"].value'},
    ),
    "S10 sharedCounters and an empty devices list": (_set("spec.devices", []), {"spec"}),
}


@pytest.mark.parametrize(("mutate", "expected"), SLICE_CASES.values(), ids=SLICE_CASES.keys())
def test_slice_rule_violations(mutate: Mutation, expected: set[str]) -> None:
    obj = baseline()
    assert validate_resource_slice(obj) == []
    mutate(obj)
    assert paths(validate_resource_slice(obj)) == expected


@pytest.mark.parametrize(("mutate", "expected"), COUNTER_CASES.values(), ids=COUNTER_CASES.keys())
def test_counter_slice_rule_violations(mutate: Mutation, expected: set[str]) -> None:
    obj = counters_baseline()
    assert validate_resource_slice(obj) == []
    mutate(obj)
    assert paths(validate_resource_slice(obj)) == expected


# --- valid variants and boundaries: each must stay error-free -----------------------------------

VALID_CASES: dict[str, Mutation] = {
    "generateName instead of name": _set("metadata", {"generateName": "00000-gpu.example.com-node-1-"}),
    "generateName longer than 58 characters": _set("metadata", {"generateName": "a" * 58 + "." + "b" * 41}),
    "driver with upper case (only a warning)": _set("spec.driver", "GPU.Example.com"),
    "pool name with slashes": _set("spec.pool.name", "rack-1/node-1"),
    "pool name of 253 characters": _set("spec.pool.name", "/".join(["a" * 63] * 3 + ["a" * 61])),
    "generation zero": _set("spec.pool.generation", 0),
    "allNodes": lambda o: o["spec"].update(nodeName=None, allNodes=True),
    "nodeSelector with one term": lambda o: o["spec"].update(nodeName=None, nodeSelector=SELECTOR),
    "nodeSelector matchFields": lambda o: o["spec"].update(
        nodeName=None,
        nodeSelector={
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-1"]}]}
            ]
        },
    ),
    "128 devices": _set("spec.devices", _devices(128)),
    "64 devices, one tainted": lambda o: o["spec"].update(
        devices=[{"name": "t", "taints": [TAINT]}, *_devices(63)]
    ),
    "64 devices consuming counters": _set("spec.devices", _devices(64, consumesCounters=[COUNTERS])),
    "32 attributes and capacities": _set(
        "spec.devices.0", {"name": "d", "attributes": _attrs(31), "capacity": {"c": {"value": "1"}}}
    ),
    "48 attribute values": _set(
        "spec.devices.0", {"name": "d", "attributes": {"a": {"ints": list(range(40))}, **_attrs(8)}}
    ),
    "string of 64 bytes": _attr("x", {"string": "s" * 64}),
    "string of 32 two-byte characters": _attr("x", {"string": "é" * 32}),
    "empty string": _attr("x", {"string": ""}),
    "version 12.4.0": _attr("x", {"version": "12.4.0"}),
    "version with pre-release and build": _attr("x", {"version": "1.2.3-rc.1+build.5"}),
    "version of 64 bytes": _attr("x", {"version": "1.2.3-" + "a" * 58}),
    "list attributes": _attr("x", {"strings": ["a", "b"]}),
    "qualified key with a 63-character domain": _attr("a" * 59 + ".com/" + "b" * 32, {"int": 1}),
    "upper-case domain in key": _attr("Example.COM/x", {"int": 1}),
    "negative capacity": _set("spec.devices.0.capacity.memory.value", "-1"),
    "capacity with surrounding spaces": _set("spec.devices.0.capacity.memory.value", " 40Gi "),
    "16 taints": _set("spec.devices.0.taints", [dict(TAINT, value=str(i)) for i in range(16)]),
    "taint effect None without value": _set("spec.devices.0.taints", [{"key": "k", "effect": "None"}]),
    "same taint key with two effects": _set(
        "spec.devices.0.taints", [TAINT, dict(TAINT, effect="NoExecute")]
    ),
    "taint timeAdded": _set("spec.devices.0.taints", [dict(TAINT, timeAdded="2026-01-02T15:04:05Z")]),
    "consumesCounters without any counter set (not checked by the server)": _set(
        "spec.devices.0.consumesCounters", [COUNTERS, dict(COUNTERS, counterSet="other")]
    ),
    "per-device node selection": _per_device(
        {"name": "a", "nodeName": "node-1"},
        {"name": "b", "allNodes": True},
        {"name": "c", "nodeSelector": {"nodeSelectorTerms": SELECTOR["nodeSelectorTerms"] * 2}},
    ),
    "binding conditions": lambda o: device(o).update(
        bindingConditions=["example.com/attached"], bindingFailureConditions=["example.com/failed"]
    ),
    "request policy with validValues": _policy(default="8", validValues=["4", "8", "40"]),
    "request policy with validRange": _policy(default="8", validRange={"min": "4", "max": "40", "step": "2"}),
    "request policy with only a default": _policy(default="8"),
}


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
        f'{DEV}.attributes["x"]',
        f'{DEV}.capacity["memory"].value',
    }


def test_validate_device_alone() -> None:
    assert validate_device(baseline()["spec"]["devices"][0]) == []
    assert paths(validate_device({"name": "Bad"})) == {"device.name"}
    assert paths(validate_device({"name": "a", "nodeName": "n"}, path="d")) == {"d"}
    assert validate_device({"name": "a", "nodeName": "n"}, per_device_node_selection=True) == []
    assert paths(validate_device({"name": "a"}, per_device_node_selection=True)) == {"device"}


# --- S14: updates ------------------------------------------------------------------------------

UPDATE_CASES: dict[str, tuple[Mutation, set[str]]] = {
    "driver changed": (_set("spec.driver", "nic.example.com"), {"spec.driver"}),
    "pool name changed": (_set("spec.pool.name", "node-2"), {"spec.pool.name"}),
    "nodeName changed": (_set("spec.nodeName", "node-2"), {"spec.nodeName"}),
    "nodeName unset": (lambda o: o["spec"].update(nodeName=None, allNodes=True), {"spec.nodeName"}),
    "name changed": (_set("metadata.name", "other"), {"metadata.name"}),
    "invalid new object": (_set("spec.pool.generation", -1), {"spec.pool.generation"}),
}


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
    new["spec"]["devices"] = _devices(3)
    assert validate_resource_slice_update(old, new) == []
    assert validate_resource_slice_update(baseline(), baseline()) == []


# --- 2.9: pool rules ---------------------------------------------------------------------------


def pool_slice(index: int, count: int, generation: int = 1, **spec: Any) -> Obj:
    obj = baseline()
    obj["metadata"]["name"] = f"slice-{index}"
    obj["spec"]["pool"].update(generation=generation, resourceSliceCount=count)
    obj["spec"]["devices"] = _devices(2)
    for device_obj in obj["spec"]["devices"]:
        device_obj["name"] += f"-{index}"
    obj["spec"].update(spec)
    return obj


def counter_slice(count: int) -> Obj:
    obj = pool_slice(9, count)
    del obj["spec"]["devices"]
    obj["spec"]["sharedCounters"] = [{"name": "gpu-0-cs", "counters": {"memory": {"value": "40Gi"}}}]
    return obj


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


def _pool_with(mutate: Callable[[list[Obj]], object]) -> list[Obj]:
    slices = [pool_slice(0, 2), pool_slice(1, 2)]
    mutate(slices)
    return slices


def _consumer(counter_set: str, counter: str) -> list[Obj]:
    """A counter slice plus a slice whose device consumes ``counter`` from ``counter_set``."""
    use = {"counterSet": counter_set, "counters": {counter: {"value": "1"}}}
    return [counter_slice(2), pool_slice(1, 2, devices=[{"name": "mig-0", "consumesCounters": [use]}])]


POOL_CASES: dict[str, tuple[list[Obj], set[str], str]] = {
    "incomplete pool": ([pool_slice(0, 2)], {"slices"}, "incomplete pool"),
    "too many slices": ([pool_slice(0, 1), pool_slice(1, 1)], {"slices"}, "incomplete pool"),
    "slices disagree on resourceSliceCount": (
        [pool_slice(0, 2), pool_slice(1, 3)],
        {"slices"},
        "incomplete pool",
    ),
    "incomplete at the highest generation": (
        [pool_slice(0, 2, generation=2), pool_slice(1, 2)],
        {"slices"},
        "incomplete pool",
    ),
    "another driver": (
        _pool_with(lambda s: s[1]["spec"].update(driver="nic.example.com")),
        {"slices[1].spec.driver"},
        "one pool",
    ),
    "another pool name": (
        _pool_with(lambda s: s[1]["spec"]["pool"].update(name="node-2")),
        {"slices[1].spec.pool.name"},
        "one pool",
    ),
    "device name repeated across slices": (
        _pool_with(lambda s: s[1]["spec"]["devices"][1].update(name="dev-0-0")),
        {"slices[1].spec.devices[1].name"},
        "also used in slices[0]",
    ),
    "counter set name repeated across slices": (
        [counter_slice(2), counter_slice(2)],
        {"slices[1].spec.sharedCounters[0].name"},
        "also defined",
    ),
    "consumed counter set missing": (
        _consumer("gpu-1-cs", "memory"),
        {"slices[1].spec.devices[0].consumesCounters[0].counterSet"},
        "no slice of the pool defines",
    ),
    "consumed counter missing": (
        _consumer("gpu-0-cs", "decoders"),
        {'slices[1].spec.devices[0].consumesCounters[0].counters["decoders"]'},
        "has no counter",
    ),
}


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
