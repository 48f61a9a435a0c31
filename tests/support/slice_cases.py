"""The ResourceSlice validation cases shared by the fast tier (tests/agent/slices/test_rules.py, against the project's
rules) and the real-cluster tier (tests/real_cluster/test_slice_rules_real.py, against kube-apiserver 1.37).

Each case mutates a valid baseline so that one rule breaks, and states the exact set of error paths the API server
reports, in the server's syntax. Pool cases are the scheduler's cross-slice rules, which the API server does not
check per object.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

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


# --- one row per rule: (mutation, expected error paths) ----------------------------------------

Mutation = Callable[[Obj], object]


def set_at(path: str, value: Any) -> Mutation:
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


def attr(key: str, value: Any) -> Mutation:
    return lambda obj: device(obj)["attributes"].__setitem__(key, copy.deepcopy(value))


def cap(key: str, value: Any) -> Mutation:
    return lambda obj: device(obj)["capacity"].__setitem__(key, copy.deepcopy(value))


def numbered_devices(n: int, **extra: Any) -> list[Obj]:
    return [{"name": f"dev-{i}", **copy.deepcopy(extra)} for i in range(n)]


def int_attributes(n: int) -> dict[str, Obj]:
    return {f"a{i}": {"int": i} for i in range(n)}


TAINT = {"key": "gpu.example.com/xid", "value": "79", "effect": "NoSchedule"}
TERM = {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]}
SELECTOR = {"nodeSelectorTerms": [TERM]}
COUNTERS = {"counterSet": "gpu-0-counter-set", "counters": {"memory": {"value": "5Gi"}}}
MULTI: Obj = {"name": "gpu-0", "allowMultipleAllocations": True}
CAP = f"{DEV}.capacity[memory].requestPolicy"
ATTRIBUTES = {f"{DEV}.attributes"}  # a bad key is reported at the map, with the key in the message


def policy(**fields: Any) -> Mutation:
    return set_at("spec.devices.0", {**MULTI, "capacity": {"memory": {"value": "40", "requestPolicy": fields}}})


def selector(*terms: Obj) -> Mutation:
    """Mutation that replaces nodeName by a nodeSelector with ``terms``."""
    return lambda obj: obj["spec"].update(nodeName=None, nodeSelector={"nodeSelectorTerms": list(terms)})


def per_device(*entries: Obj) -> Mutation:
    def mutate(obj: Obj) -> None:
        del obj["spec"]["nodeName"]
        obj["spec"]["perDeviceNodeSelection"] = True
        obj["spec"]["devices"] = [copy.deepcopy(d) for d in entries]

    return mutate


def shared_counters(*sets: Obj) -> Mutation:
    """Mutation that turns the slice into a counter slice holding ``sets``."""

    def mutate(obj: Obj) -> None:
        del obj["spec"]["devices"]
        obj["spec"]["sharedCounters"] = [copy.deepcopy(s) for s in sets]

    return mutate


SLICE_CASES: dict[str, tuple[Mutation, set[str]]] = {
    # metadata, apiVersion, kind
    "M1 no name nor generateName": (set_at("metadata.name", None), {"metadata.name"}),
    "M1 name not a DNS subdomain": (set_at("metadata.name", "Node_1"), {"metadata.name"}),
    "M1 name too long": (set_at("metadata.name", "a" * 254), {"metadata.name"}),
    "M1 name a number beside generateName": (set_at("metadata", {"generateName": "a-", "name": 0}), {"metadata.name"}),
    "M1 generateName a number": (set_at("metadata.generateName", 7), {"metadata.generateName"}),
    "M1 namespace a number": (set_at("metadata.namespace", 0), {"metadata.namespace"}),
    "M1 generateName invalid beside a name": (set_at("metadata.generateName", "Node_1-"), {"metadata.generateName"}),
    "M1 generateName invalid, so is the name made of it": (
        set_at("metadata", {"generateName": "Node_1-"}),
        {"metadata.generateName", "metadata.name"},
    ),
    "M1 generateName cut at 58 ends the label with '-'": (
        set_at("metadata", {"generateName": "a" * 56 + ".-"}),
        {"metadata.name"},
    ),
    "M2 bad label key": (set_at("metadata.labels", {"bad key": "x"}), {"metadata.labels"}),
    "M2 bad label value": (set_at("metadata.labels", {"k": "-x"}), {"metadata.labels"}),
    "M2 bad annotation key": (
        set_at("metadata.annotations", {"a/b/c": "x"}),
        {"metadata.annotations"},
    ),
    "M2 owner uid missing": (set_at("metadata.ownerReferences.0.uid", ""), {"metadata.ownerReferences[0].uid"}),
    "M2 owner kind missing": (
        set_at("metadata.ownerReferences.0.kind", None),
        {"metadata.ownerReferences[0].kind"},
    ),
    "M2 two controllers": (
        lambda o: o["metadata"]["ownerReferences"].append({**o["metadata"]["ownerReferences"][0], "name": "other"}),
        {"metadata.ownerReferences"},
    ),
    "M2 owner apiVersion without a version": (
        set_at("metadata.ownerReferences.0.apiVersion", "example.com/"),
        {"metadata.ownerReferences[0].apiVersion"},
    ),
    "M2 owner apiVersion with two slashes": (
        set_at("metadata.ownerReferences.0.apiVersion", "a/b/c"),
        {"metadata.ownerReferences[0].apiVersion"},
    ),
    "M2 an Event as owner": (set_at("metadata.ownerReferences.0.kind", "Event"), {"metadata.ownerReferences[0]"}),
    "apiVersion beta": (set_at("apiVersion", "resource.k8s.io/v1beta2"), {"apiVersion"}),
    "kind wrong": (set_at("kind", "ResourceClaim"), {"kind"}),
    "spec missing, so empty: no driver, pool name, count or node selection": (
        set_at("spec", None),
        {"spec.driver", "spec.pool.name", "spec.pool.resourceSliceCount", "spec"},
    ),
    # S1-S4
    "S1 driver missing": (set_at("spec.driver", None), {"spec.driver"}),
    "S1 driver not a subdomain": (set_at("spec.driver", "gpu_example.com"), {"spec.driver"}),
    "S1 driver 64 characters": (set_at("spec.driver", "a" * 60 + ".com"), {"spec.driver"}),
    "S2 pool name missing": (set_at("spec.pool.name", None), {"spec.pool.name"}),
    "S2 pool name upper case": (set_at("spec.pool.name", "Node-1"), {"spec.pool.name"}),
    "S2 pool name empty segment": (set_at("spec.pool.name", "a//b"), {"spec.pool.name"}),
    "S2 pool name leading slash": (set_at("spec.pool.name", "/a"), {"spec.pool.name"}),
    "S2 pool name of 254 characters": (
        set_at("spec.pool.name", "/".join(["a" * 63] * 3 + ["a" * 62])),
        {"spec.pool.name"},
    ),
    "S3 resourceSliceCount zero": (set_at("spec.pool.resourceSliceCount", 0), {"spec.pool.resourceSliceCount"}),
    "S3 resourceSliceCount missing": (
        set_at("spec.pool.resourceSliceCount", None),
        {"spec.pool.resourceSliceCount"},
    ),
    "S4 generation negative": (set_at("spec.pool.generation", -1), {"spec.pool.generation"}),
    "S4 generation not an integer": (set_at("spec.pool.generation", "1"), {"spec.pool.generation"}),
    # S5-S9
    "S5 no node selection": (set_at("spec.nodeName", None), {"spec"}),
    "S5 two node selection fields": (set_at("spec.allNodes", True), {"spec"}),
    "S5 nodeName and nodeSelector": (set_at("spec.nodeSelector", SELECTOR), {"spec"}),
    "S6 nodeName empty": (set_at("spec.nodeName", ""), {"spec.nodeName", "spec"}),
    "S6 nodeName invalid": (set_at("spec.nodeName", "Node_1"), {"spec.nodeName"}),
    "S7 nodeSelector with two terms": (selector(TERM, TERM), {"spec.nodeSelector.nodeSelectorTerms"}),
    "S7 nodeSelector without terms": (selector(), {"spec.nodeSelector.nodeSelectorTerms"}),
    "S7 nodeSelector bad operator": (
        selector({"matchExpressions": [{"key": "pool", "operator": "Like", "values": ["a"]}]}),
        {"spec.nodeSelector.nodeSelectorTerms[0].matchExpressions[0].operator"},
    ),
    "S7 nodeSelector In without values": (
        selector({"matchExpressions": [{"key": "pool", "operator": "In"}]}),
        {"spec.nodeSelector.nodeSelectorTerms[0].matchExpressions[0].values"},
    ),
    "S7 nodeSelector Exists with values": (
        selector({"matchExpressions": [{"key": "pool", "operator": "Exists", "values": ["a"]}]}),
        {"spec.nodeSelector.nodeSelectorTerms[0].matchExpressions[0].values"},
    ),
    "S7 nodeSelector bad key": (
        selector({"matchExpressions": [{"key": "a b", "operator": "Exists"}]}),
        {"spec.nodeSelector.nodeSelectorTerms[0].matchExpressions[0].key"},
    ),
    "S7 nodeSelector bad value": (
        selector({"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a b"]}]}),
        {"spec.nodeSelector.nodeSelectorTerms[0].matchExpressions[0].values[0]"},
    ),
    "S7 nodeSelector matchFields other than metadata.name": (
        selector({"matchFields": [{"key": "spec.unschedulable", "operator": "In", "values": ["x"]}]}),
        {"spec.nodeSelector.nodeSelectorTerms[0].matchFields[0].key"},
    ),
    "S8 allNodes false": (
        lambda o: o["spec"].update(nodeName=None, allNodes=False),
        {"spec.allNodes", "spec"},
    ),
    "S9 perDeviceNodeSelection false": (
        set_at("spec.perDeviceNodeSelection", False),
        {"spec.perDeviceNodeSelection"},
    ),
    # S10-S13
    "S10 devices and sharedCounters": (
        set_at("spec.sharedCounters", [{"name": "cs", "counters": {"c": {"value": "1"}}}]),
        {"spec"},
    ),
    "S10 empty devices list counts as set": (
        lambda o: o["spec"].update(devices=[], sharedCounters=[{"name": "cs", "counters": {"c": {"value": "1"}}}]),
        {"spec"},
    ),
    "S11 129 devices": (set_at("spec.devices", numbered_devices(129)), {"spec.devices"}),
    "S11 65 devices, one tainted": (
        lambda o: o["spec"].update(devices=[{"name": "t", "taints": [TAINT]}, *numbered_devices(64)]),
        {"spec.devices"},
    ),
    "S11 65 devices, one consuming counters": (
        lambda o: o["spec"].update(devices=[{"name": "c", "consumesCounters": [COUNTERS]}, *numbered_devices(64)]),
        {"spec.devices"},
    ),
    "S12 duplicate device name": (set_at("spec.devices.1.name", "gpu-0"), {"spec.devices[1]"}),
    # D1-D4
    "D1 device name missing": (set_at("spec.devices.0.name", None), {f"{DEV}.name"}),
    "D1 device name upper case": (set_at("spec.devices.0.name", "GPU-0"), {f"{DEV}.name"}),
    "D1 device name with a dot": (set_at("spec.devices.0.name", "gpu.0"), {f"{DEV}.name"}),
    "D1 device name 64 characters": (set_at("spec.devices.0.name", "g" * 64), {f"{DEV}.name"}),
    "D2 33 attributes and capacities": (
        set_at("spec.devices.0", {"name": "d", "attributes": int_attributes(32), "capacity": {"c": {"value": "1"}}}),
        {DEV},
    ),
    "D4 attribute key with '-'": (attr("bad-key", {"int": 1}), ATTRIBUTES),
    "D4 attribute key with empty domain": (attr("/x", {"int": 1}), ATTRIBUTES),
    "D4 attribute key with empty id": (attr("x/", {"int": 1}), ATTRIBUTES),
    "D4 attribute id of 33 characters": (attr("a" * 33, {"int": 1}), ATTRIBUTES),
    "D4 attribute domain of 64 characters": (
        attr("a" * 60 + ".com/x", {"int": 1}),
        ATTRIBUTES,
    ),
    "D4 key of 100 characters, cut in the middle in paths": (
        attr("a" * 63 + "/" + "b" * 36, {}),
        # The server checks the value twice, naming it once by the cut key and once by the whole key.
        {
            *ATTRIBUTES,
            f"{DEV}.attributes[{'a' * 47}...{'a' * 9}/{'b' * 36}]",
            f"{DEV}.attributes[{'a' * 63}/{'b' * 36}]",
        },
    ),
    "D4 capacity key invalid": (cap("mem.size", {"value": "1"}), {f"{DEV}.capacity"}),
    # D5, T1-T4
    "D5 17 taints": (
        set_at("spec.devices.0.taints", [dict(TAINT, value=str(i)) for i in range(17)]),
        {f"{DEV}.taints"},
    ),
    "T1 taint key missing": (
        set_at("spec.devices.0.taints", [{"effect": "NoSchedule"}]),
        {f"{DEV}.taints[0].key"},
    ),
    "T1 taint key invalid": (
        set_at("spec.devices.0.taints", [dict(TAINT, key="a/b/c")]),
        {f"{DEV}.taints[0].key"},
    ),
    "T2 taint value invalid": (
        set_at("spec.devices.0.taints", [dict(TAINT, value="x" * 64)]),
        {f"{DEV}.taints[0].value"},
    ),
    "T3 taint effect PreferNoSchedule": (
        set_at("spec.devices.0.taints", [dict(TAINT, effect="PreferNoSchedule")]),
        {f"{DEV}.taints[0].effect"},
    ),
    "T3 taint effect missing": (set_at("spec.devices.0.taints", [{"key": "k"}]), {f"{DEV}.taints[0].effect"}),
    "T4 taint timeAdded not RFC 3339": (
        set_at("spec.devices.0.taints", [dict(TAINT, timeAdded="yesterday")]),
        {f"{DEV}.taints[0].timeAdded"},
    ),
    "T4 taint timeAdded with lower-case t and z": (
        set_at("spec.devices.0.taints", [dict(TAINT, timeAdded="2026-01-02t15:04:05z")]),
        {f"{DEV}.taints[0].timeAdded"},
    ),
    "T4 taint timeAdded on 29 February of a common year": (
        set_at("spec.devices.0.taints", [dict(TAINT, timeAdded="2025-02-29T15:04:05Z")]),
        {f"{DEV}.taints[0].timeAdded"},
    ),
    "T4 taint timeAdded out of range": (
        set_at("spec.devices.0.taints", [dict(TAINT, timeAdded="2026-13-01T00:00:00Z")]),
        {f"{DEV}.taints[0].timeAdded"},
    ),
    # D6, C2
    "D6 three consumesCounters entries": (
        set_at("spec.devices.0.consumesCounters", [dict(COUNTERS, counterSet=f"s{i}") for i in range(3)]),
        {f"{DEV}.consumesCounters"},
    ),
    "D6 duplicate counterSet": (
        set_at("spec.devices.0.consumesCounters", [COUNTERS, COUNTERS]),
        {f"{DEV}.consumesCounters[1]"},
    ),
    "C2 counterSet missing": (
        set_at("spec.devices.0.consumesCounters", [{"counters": COUNTERS["counters"]}]),
        {f"{DEV}.consumesCounters[0].counterSet"},
    ),
    "C2 counterSet not a DNS label": (
        set_at("spec.devices.0.consumesCounters", [dict(COUNTERS, counterSet="gpu.0")]),
        {f"{DEV}.consumesCounters[0].counterSet"},
    ),
    "C2 counters empty": (
        set_at("spec.devices.0.consumesCounters", [dict(COUNTERS, counters={})]),
        {f"{DEV}.consumesCounters[0].counters"},
    ),
    "C2 counter key not a DNS label": (
        set_at("spec.devices.0.consumesCounters", [dict(COUNTERS, counters={"memorySlice0": {"value": "1"}})]),
        {f"{DEV}.consumesCounters[0].counters"},
    ),
    "C2 33 counters": (
        set_at(
            "spec.devices.0.consumesCounters",
            [dict(COUNTERS, counters={f"c{i}": {"value": "1"} for i in range(33)})],
        ),
        {f"{DEV}.consumesCounters[0].counters"},
    ),
    "C2 counter value not a quantity": (
        set_at("spec.devices.0.consumesCounters", [dict(COUNTERS, counters={"memory": {"value": "5GB"}})]),
        {f"{DEV}.consumesCounters[0].counters[memory].value"},
    ),
    # D7, D8
    "D7 device without node selection": (
        per_device({"name": "a", "nodeName": "node-1"}, {"name": "b"}),
        {"spec.devices[1]"},
    ),
    "D7 device with two node selection fields": (
        per_device({"name": "a", "nodeName": "node-1", "allNodes": True}),
        {DEV},
    ),
    "D7 device nodeName empty": (per_device({"name": "a", "nodeName": ""}), {f"{DEV}.nodeName", DEV}),
    "D7 device nodeName invalid": (per_device({"name": "a", "nodeName": "Node_1"}), {f"{DEV}.nodeName"}),
    "D7 device allNodes false": (per_device({"name": "a", "allNodes": False}), {f"{DEV}.allNodes", DEV}),
    "D7 device nodeSelector invalid": (
        per_device({"name": "a", "nodeSelector": {"nodeSelectorTerms": []}}),
        {f"{DEV}.nodeSelector.nodeSelectorTerms"},
    ),
    "D8 device nodeName without perDeviceNodeSelection": (set_at("spec.devices.0.nodeName", "node-1"), {DEV}),
    "D8 device allNodes without perDeviceNodeSelection": (set_at("spec.devices.0.allNodes", True), {DEV}),
    # D9
    "D9 bindingConditions alone": (
        set_at("spec.devices.0.bindingConditions", ["example.com/ready"]),
        {f"{DEV}.bindingFailureConditions"},
    ),
    "D9 bindingFailureConditions alone": (
        set_at("spec.devices.0.bindingFailureConditions", ["example.com/failed"]),
        {f"{DEV}.bindingConditions"},
    ),
    "D9 five bindingConditions": (
        lambda o: device(o).update(bindingConditions=[f"c{i}" for i in range(5)], bindingFailureConditions=["f"]),
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
        set_at("spec.devices.0.capacity.memory.requestPolicy", {"default": "1Gi", "validValues": ["1Gi"]}),
        {f"{DEV}.capacity[memory].requestPolicy"},
    ),
    "D11 validValues and validRange": (
        policy(default="1", validValues=["1"], validRange={"min": "1"}),
        {CAP},
    ),
    "D11 validValues without default": (policy(validValues=["1"]), {f"{CAP}.default"}),
    "D11 validRange without default": (policy(validRange={"min": "1"}), {f"{CAP}.default"}),
    "D11 validValues unsorted": (
        policy(default="1", validValues=["1", "4", "2"]),
        {f"{CAP}.validValues[2]"},
    ),
    "D11 validValues duplicate": (
        policy(default="1", validValues=["1", "2", "2000m"]),
        {f"{CAP}.validValues[2]"},
    ),
    "D11 validValues above capacity": (
        policy(default="1", validValues=["1", "41"]),
        {f"{CAP}.validValues[1]"},
    ),
    "D11 default not among validValues": (policy(default="3", validValues=["1", "2"]), {f"{CAP}.validValues"}),
    "D11 validValues out of order and repeated": (
        policy(default="1", validValues=["2", "1", "2"]),
        {f"{CAP}.validValues[1]", f"{CAP}.validValues[2]"},
    ),
    "D11 validValues equal as integers (fractions are rounded up)": (
        policy(default="2", validValues=["1500m", "2"]),
        {f"{CAP}.validValues[1]"},
    ),
    "D11 11 unsorted validValues": (
        policy(default="1", validValues=[str(i) for i in range(11, 0, -1)]),
        {f"{CAP}.validValues", *(f"{CAP}.validValues[{i}]" for i in range(1, 11))},
    ),
    "D11 11 validValues": (
        policy(default="1", validValues=[str(i) for i in range(1, 12)]),
        {f"{CAP}.validValues"},
    ),
    "D11 validRange without min": (policy(default="1", validRange={"max": "4"}), {f"{CAP}.validRange.min"}),
    "D11 min above capacity": (policy(default="41", validRange={"min": "41"}), {f"{CAP}.validRange.min"}),
    "D11 default below min": (policy(default="1", validRange={"min": "2"}), {f"{CAP}.validRange.default"}),
    "D11 max below min": (
        policy(default="4", validRange={"min": "4", "max": "2"}),
        {f"{CAP}.validRange.max", f"{CAP}.validRange.default"},
    ),
    "D11 max above capacity": (
        policy(default="4", validRange={"min": "1", "max": "41"}),
        {f"{CAP}.validRange.max"},
    ),
    "D11 default above max": (
        policy(default="8", validRange={"min": "1", "max": "4"}),
        {f"{CAP}.validRange.default"},
    ),
    "D11 negative min with a step": (
        policy(default="1", validRange={"min": "-1", "step": "1"}),
        {f"{CAP}.validRange.min"},
    ),
    "D11 step beyond 64-bit integers": (
        policy(default="1", validRange={"min": "1", "step": "10E"}),
        {f"{CAP}.validRange.step"},
    ),
    "D11 step zero": (policy(default="4", validRange={"min": "4", "step": "0"}), {f"{CAP}.validRange.step"}),
    "D11 one step beyond capacity": (
        policy(default="4", validRange={"min": "4", "step": "37"}),
        {f"{CAP}.validRange.step"},
    ),
    "D11 default off the step grid": (
        policy(default="5", validRange={"min": "4", "step": "2"}),
        {f"{CAP}.validRange.step"},
    ),
    "D11 max off the step grid": (
        policy(default="4", validRange={"min": "4", "max": "9", "step": "2"}),
        {f"{CAP}.validRange.step"},
    ),
    # V1-V6
    "V1 attribute without value": (attr("x", {}), {f"{DEV}.attributes[x]"}),
    "V1 attribute with two values": (attr("x", {"int": 1, "string": "1"}), {f"{DEV}.attributes[x]"}),
    "V1 attribute with unknown value type": (attr("x", {"float": 1.5}), {f"{DEV}.attributes[x]"}),
    "V2 int beyond int64": (attr("x", {"int": 2**63}), {f"{DEV}.attributes[x].int"}),
    "V2 int given as bool": (attr("x", {"int": True}), {f"{DEV}.attributes[x].int"}),
    "allowMultipleAllocations given as a string": (
        set_at("spec.devices.0.allowMultipleAllocations", "yes"),
        {f"{DEV}.allowMultipleAllocations"},
    ),
    "V2 int written as 1.5": (attr("x", {"int": 1.5}), {f"{DEV}.attributes[x].int"}),
    "V2 bool given as string": (attr("x", {"bool": "yes"}), {f"{DEV}.attributes[x].bool"}),
    "V3 string of 65 bytes": (attr("x", {"string": "s" * 65}), {f"{DEV}.attributes[x].string"}),
    "V3 string of 33 characters, 65 bytes": (
        attr("x", {"string": "é" * 32 + "s"}),
        {f"{DEV}.attributes[x].string"},
    ),
    "V3 string of 22 euro signs, 66 bytes": (
        attr("x", {"string": "€" * 22}),
        {f"{DEV}.attributes[x].string"},
    ),
    "V4 version with two parts": (attr("x", {"version": "12.4"}), {f"{DEV}.attributes[x].version"}),
    "V4 version with leading zero": (attr("x", {"version": "01.2.3"}), {f"{DEV}.attributes[x].version"}),
    "V4 version with v prefix": (attr("x", {"version": "v1.2.3"}), {f"{DEV}.attributes[x].version"}),
    "V4 version with numeric pre-release leading zero": (
        attr("x", {"version": "1.2.3-01"}),
        {f"{DEV}.attributes[x].version"},
    ),
    "V4 version of 65 bytes": (
        attr("x", {"version": "1.2.3-" + "a" * 59}),
        {f"{DEV}.attributes[x].version"},
    ),
    # List values need DRAListTypeAttributes, off by default in 1.37: the server drops them, then finds no value.
    "V5 list value alone: dropped, no value left": (attr("x", {"strings": ["a", "b"]}), {f"{DEV}.attributes[x]"}),
    "V5 empty list: dropped, no value left": (attr("x", {"ints": []}), {f"{DEV}.attributes[x]"}),
    "V5 list string too long: dropped unchecked, no value left": (
        attr("x", {"strings": ["ok", "s" * 65]}),
        {f"{DEV}.attributes[x]"},
    ),
    "V5 list version invalid: dropped unchecked, no value left": (
        attr("x", {"versions": ["1.0"]}),
        {f"{DEV}.attributes[x]"},
    ),
    "V5 list of the wrong type, beside a scalar": (
        attr("x", {"int": 1, "ints": ["1"]}),
        {f"{DEV}.attributes[x].ints[0]"},
    ),
    "D3 49 list values: dropped, no value left": (
        set_at("spec.devices.0", {"name": "d", "attributes": {"a": {"ints": list(range(40))}, **int_attributes(9)}}),
        {f"{DEV}.attributes[a]"},
    ),
    "V6 capacity value not a quantity": (
        set_at("spec.devices.0.capacity.memory.value", "40GB"),
        {f"{DEV}.capacity[memory].value"},
    ),
}


COUNTER_CASES: dict[str, tuple[Mutation, set[str]]] = {
    "S13 nine counter sets": (
        set_at("spec.sharedCounters", [{"name": f"s{i}", "counters": {"c": {"value": "1"}}} for i in range(9)]),
        {"spec.sharedCounters"},
    ),
    "S13 duplicate counter set name": (
        lambda o: o["spec"]["sharedCounters"].append(o["spec"]["sharedCounters"][0]),
        {"spec.sharedCounters[1]"},
    ),
    "C1 counter set name missing": (
        set_at("spec.sharedCounters.0.name", None),
        {"spec.sharedCounters[0].name"},
    ),
    "C1 counter set name not a DNS label": (
        set_at("spec.sharedCounters.0.name", "gpu_0"),
        {"spec.sharedCounters[0].name"},
    ),
    "C1 counters missing": (
        set_at("spec.sharedCounters.0.counters", None),
        {"spec.sharedCounters[0].counters"},
    ),
    "C1 counters empty": (set_at("spec.sharedCounters.0.counters", {}), {"spec.sharedCounters[0].counters"}),
    "C1 33 counters": (
        set_at("spec.sharedCounters.0.counters", {f"c{i}": {"value": "1"} for i in range(33)}),
        {"spec.sharedCounters[0].counters"},
    ),
    "C1 counter key not a DNS label": (
        set_at("spec.sharedCounters.0.counters.memorySlice0", {"value": "1"}),
        {"spec.sharedCounters[0].counters"},
    ),
    "C1 counter value not a quantity": (
        set_at("spec.sharedCounters.0.counters.memory", {"value": "lots"}),
        {"spec.sharedCounters[0].counters[memory].value"},
    ),
    "S10 sharedCounters and an empty devices list": (set_at("spec.devices", []), {"spec"}),
}


# --- valid variants and boundaries: each must stay error-free -----------------------------------

VALID_CASES: dict[str, Mutation] = {
    "generateName instead of name": set_at("metadata", {"generateName": "00000-gpu.example.com-node-1-"}),
    "generateName beside a name, checked with its '-' and the character before it replaced": set_at(
        "metadata.generateName", "a-.-"
    ),
    "namespace (cleared by the server: the kind is cluster-scoped)": set_at("metadata.namespace", "default"),
    "generateName longer than 58 characters": set_at("metadata", {"generateName": "a" * 58 + "." + "b" * 41}),
    "driver with upper case (only a warning)": set_at("spec.driver", "GPU.Example.com"),
    "pool name with slashes": set_at("spec.pool.name", "rack-1/node-1"),
    "taint timeAdded with a one-digit hour and a comma fraction, as Go's parser reads it": set_at(
        "spec.devices.0.taints", [dict(TAINT, timeAdded="2026-01-02T5:04:05,5+24:60")]
    ),
    "pool name of 253 characters": set_at("spec.pool.name", "/".join(["a" * 63] * 3 + ["a" * 61])),
    "generation zero": set_at("spec.pool.generation", 0),
    "allNodes": lambda o: o["spec"].update(nodeName=None, allNodes=True),
    "nodeSelector with one term": lambda o: o["spec"].update(nodeName=None, nodeSelector=SELECTOR),
    "nodeSelector matchFields": lambda o: o["spec"].update(
        nodeName=None,
        nodeSelector={
            "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-1"]}]}]
        },
    ),
    "128 devices": set_at("spec.devices", numbered_devices(128)),
    "64 devices, one tainted": lambda o: o["spec"].update(
        devices=[{"name": "t", "taints": [TAINT]}, *numbered_devices(63)]
    ),
    "64 devices consuming counters": set_at("spec.devices", numbered_devices(64, consumesCounters=[COUNTERS])),
    "32 attributes and capacities": set_at(
        "spec.devices.0", {"name": "d", "attributes": int_attributes(31), "capacity": {"c": {"value": "1"}}}
    ),
    "string of 64 bytes": attr("x", {"string": "s" * 64}),
    "string of 32 two-byte characters": attr("x", {"string": "é" * 32}),
    "empty string": attr("x", {"string": ""}),
    "version 12.4.0": attr("x", {"version": "12.4.0"}),
    "version with pre-release and build": attr("x", {"version": "1.2.3-rc.1+build.5"}),
    "version of 64 bytes": attr("x", {"version": "1.2.3-" + "a" * 58}),
    "list value beside a scalar (the list is dropped)": attr("x", {"int": 1, "ints": [1, 2]}),
    "65 devices, one with a list value (dropped, so the limit stays 128)": lambda o: o["spec"].update(
        devices=[{"name": "l", "attributes": {"x": {"int": 1, "ints": [1]}}}, *numbered_devices(64)]
    ),
    "qualified key with a 63-character domain": attr("a" * 59 + ".com/" + "b" * 32, {"int": 1}),
    "keys with two slashes (1.37 checks no key with more than one '/')": lambda o: device(o).update(
        attributes={"a/b/c": {"int": 1}, "-/-/-": {"int": 2}}, capacity={"//": {"value": "1"}}
    ),
    "bad values in fields of 1.37's alpha feature gates (dropped by the server)": lambda o: (
        o["spec"].update(partitionTypeAttribute="x", skipNodeOperations=["NodePrepareResources"]),
        device(o).update(
            nodeAllocatableResources={"cpu": {}}, consumesCounters=[{**COUNTERS, "compatibilityGroups": ["-"]}]
        ),
    ),
    "upper-case domain in key": attr("Example.COM/x", {"int": 1}),
    "capacity value missing (zero to the server)": set_at("spec.devices.0.capacity.memory", {}),
    "counter value missing (zero to the server)": shared_counters({"name": "s", "counters": {"c": {}}}),
    "null label value (empty to the server)": set_at("metadata.labels", {"k": None}),
    "null node selector value (empty to the server)": selector(
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": [None]}]}
    ),
    "null entry of validValues (zero to the server)": policy(default="8", validValues=[None, "8"]),
    "generation missing (zero to the server)": set_at("spec.pool.generation", None),
    "negative capacity": set_at("spec.devices.0.capacity.memory.value", "-1"),
    "capacity with surrounding spaces": set_at("spec.devices.0.capacity.memory.value", " 40Gi "),
    "16 taints": set_at("spec.devices.0.taints", [dict(TAINT, value=str(i)) for i in range(16)]),
    "taint effect None without value": set_at("spec.devices.0.taints", [{"key": "k", "effect": "None"}]),
    "same taint key with two effects": set_at("spec.devices.0.taints", [TAINT, dict(TAINT, effect="NoExecute")]),
    "taint timeAdded with a ',' fraction and a +24:60 offset (Go reads both)": set_at(
        "spec.devices.0.taints", [dict(TAINT, timeAdded="2024-02-29T15:04:05,5+24:60")]
    ),
    "taint timeAdded in year 0": set_at("spec.devices.0.taints", [dict(TAINT, timeAdded="0000-01-01T00:00:00Z")]),
    "owner apiVersion with an empty group": set_at("metadata.ownerReferences.0.apiVersion", "/v1"),
    "taint timeAdded": set_at("spec.devices.0.taints", [dict(TAINT, timeAdded="2026-01-02T15:04:05Z")]),
    "consumesCounters without any counter set (not checked by the server)": set_at(
        "spec.devices.0.consumesCounters", [COUNTERS, dict(COUNTERS, counterSet="other")]
    ),
    "per-device node selection": per_device(
        {"name": "a", "nodeName": "node-1"},
        {"name": "b", "allNodes": True},
        {"name": "c", "nodeSelector": {"nodeSelectorTerms": SELECTOR["nodeSelectorTerms"] * 2}},
    ),
    "binding conditions": lambda o: device(o).update(
        bindingConditions=["example.com/attached"], bindingFailureConditions=["example.com/failed"]
    ),
    "request policy with validValues": policy(default="8", validValues=["4", "8", "40"]),
    "request policy with validRange": policy(default="8", validRange={"min": "4", "max": "40", "step": "2"}),
    "request policy with only a default": policy(default="8"),
    "validRange with a fractional default, rounded up onto the grid": policy(
        default="1500m", validRange={"min": "1", "step": "1"}
    ),
}


# --- S14: updates ------------------------------------------------------------------------------

UPDATE_CASES: dict[str, tuple[Mutation, set[str]]] = {
    "driver changed": (set_at("spec.driver", "nic.example.com"), {"spec.driver"}),
    "pool name changed": (set_at("spec.pool.name", "node-2"), {"spec.pool.name"}),
    "nodeName changed": (set_at("spec.nodeName", "node-2"), {"spec.nodeName"}),
    "nodeName unset": (lambda o: o["spec"].update(nodeName=None, allNodes=True), {"spec.nodeName"}),
    "name changed": (set_at("metadata.name", "other"), {"metadata.name"}),
    "invalid new object": (set_at("spec.pool.generation", -1), {"spec.pool.generation"}),
}


# --- 2.9: pool rules ---------------------------------------------------------------------------


def pool_slice(index: int, count: int, generation: int = 1, **spec: Any) -> Obj:
    obj = baseline()
    obj["metadata"]["name"] = f"slice-{index}"
    obj["spec"]["pool"].update(generation=generation, resourceSliceCount=count)
    obj["spec"]["devices"] = numbered_devices(2)
    for device_obj in obj["spec"]["devices"]:
        device_obj["name"] += f"-{index}"
    obj["spec"].update(spec)
    return obj


def counter_slice(count: int) -> Obj:
    obj = pool_slice(9, count)
    del obj["spec"]["devices"]
    obj["spec"]["sharedCounters"] = [{"name": "gpu-0-cs", "counters": {"memory": {"value": "40Gi"}}}]
    return obj


def pool_with(mutate: Callable[[list[Obj]], object]) -> list[Obj]:
    slices = [pool_slice(0, 2), pool_slice(1, 2)]
    mutate(slices)
    return slices


def consumer(counter_set: str, counter: str) -> list[Obj]:
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
        pool_with(lambda s: s[1]["spec"].update(driver="nic.example.com")),
        {"slices[1].spec.driver"},
        "one pool",
    ),
    "another pool name": (
        pool_with(lambda s: s[1]["spec"]["pool"].update(name="node-2")),
        {"slices[1].spec.pool.name"},
        "one pool",
    ),
    "device name repeated across slices": (
        pool_with(lambda s: s[1]["spec"]["devices"][1].update(name="dev-0-0")),
        {"slices[1].spec.devices[1].name"},
        "also used in slices[0]",
    ),
    "counter set name repeated across slices": (
        [counter_slice(2), counter_slice(2)],
        {"slices[1].spec.sharedCounters[0].name"},
        "also defined",
    ),
    "consumed counter set missing": (
        consumer("gpu-1-cs", "memory"),
        {"slices[1].spec.devices[0].consumesCounters[0].counterSet"},
        "no slice of the pool defines",
    ),
    "consumed counter missing": (
        consumer("gpu-0-cs", "decoders"),
        {"slices[1].spec.devices[0].consumesCounters[0].counters[decoders]"},
        "has no counter",
    ),
}


# --- sent as they are ------------------------------------------------------------------------------------------

RAW_CASES: dict[str, tuple[Mutation, set[str]]] = {
    # kubectl create decodes the object and writes it again, 2.0 as 2; the agent sends JSON as it is, and the
    # server cannot read 2.0 into a 64-bit integer.
    "V2 int written as 1000.0": (attr("x", {"int": 1000.0}), {f"{DEV}.attributes[x].int"}),
    "S4 generation written as 2.0": (set_at("spec.pool.generation", 2.0), {"spec.pool.generation"}),
}
"""Cases the real server refuses only when it gets the JSON as written (while decoding, like DECODING cases)."""


# --- refused before validation -------------------------------------------------------------------

DECODING = "cannot be handled as a ResourceSlice"
REFUSED_BEFORE_VALIDATION: dict[str, str] = {
    # The server cannot read these into a ResourceSlice (400 Bad Request): wrong JSON types, a quantity or time
    # it cannot parse. Its message then names no field path the way validation does. (A field it does not know
    # is dropped, with a warning, unless the client asks for strict field validation.)
    "S4 generation not an integer": DECODING,
    "T4 taint timeAdded not RFC 3339": DECODING,
    "T4 taint timeAdded out of range": DECODING,
    "C2 counter value not a quantity": DECODING,
    "C1 counter value not a quantity": DECODING,
    "V2 int beyond int64": DECODING,
    "V2 int given as bool": DECODING,
    "V2 bool given as string": DECODING,
    "V2 int written as 1.5": DECODING,
    "T4 taint timeAdded with lower-case t and z": DECODING,
    "T4 taint timeAdded on 29 February of a common year": DECODING,
    "allowMultipleAllocations given as a string": DECODING,
    "V6 capacity value not a quantity": DECODING,
    "V5 list of the wrong type, beside a scalar": DECODING,
    # kubectl itself cannot read a name that is not a string, and sends nothing.
    "M1 name a number beside generateName": "unable to decode",
    "M1 generateName a number": "unable to decode",
    "M1 namespace a number": "unable to decode",
    # Not a ResourceSlice of a served version: kubectl finds no such resource, or sends it as the other kind.
    "apiVersion beta": 'no matches for kind "ResourceSlice" in version "resource.k8s.io/v1beta2"',
    "kind wrong": "cannot be handled as a ResourceClaim",
    # A replace names the object by its name: another name is another object, which does not exist.
    "name changed": "not found",
}
"""Cases the real server refuses before it validates the object, with a part of its message; every other refused
case is refused as invalid, at the fields the case names."""
