"""Generated ResourceSlices: slices the agent's builder (agent.slices.build.pool_slices) makes of generated devices,
counter sets and taints, and the same slices with random mutations (a value replaced, a field removed or added, a
list entry repeated). Shared by the fast tier and by the real-cluster test that compares the project's rules with
kube-apiserver's verdicts."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import strategies as st

from agent.slices.build import pool_slices
from backends.attributes import AttributeValue, Version
from backends.contract import CapacityPolicy, CapacityRange, CounterConsumption, CounterSet, Device
from backends.topology import PciTopology

__all__ = ["built_slices", "mutated_slices"]

Obj = dict[str, Any]

DRIVERS = ["gpu.example.com", "nic.example.com", "a.b"]  # the agent takes lower-case driver names only
NODES = ["node-1", "ip-10-0-0-1.ec2.internal", "127.0.0.1"]
DOMAINS = ["", "gpu.example.com/", "resource.kubernetes.io/", "a" * 63 + "/"]

_names = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?", fullmatch=True)
_ids = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,31}", fullmatch=True)
_keys = st.builds(lambda domain, ident: domain + ident, st.sampled_from(DOMAINS), _ids)
_versions = st.builds(lambda a, b, c, pre: Version(f"{a}.{b}.{c}{pre}"), st.integers(0, 999), st.integers(0, 99),
                      st.integers(0, 99), st.sampled_from(["", "-rc.1", "+build.5", "-0a", "-alpha.1+x"]))
_strings = st.text(max_size=64).filter(lambda s: len(s.encode()) <= 64)
_values: st.SearchStrategy[AttributeValue] = st.one_of(
    st.booleans(), st.integers(-(2**63), 2**63 - 1), _strings, _versions)
_amounts = st.integers(0, 2**50)


@st.composite
def _policy(draw: st.DrawFn, capacity: int) -> CapacityPolicy:
    if draw(st.booleans()):
        values = sorted(draw(st.sets(st.integers(1, max(capacity, 1)), min_size=1, max_size=10)))
        return CapacityPolicy(default=draw(st.sampled_from(values)), valid_values=tuple(values))
    low = draw(st.integers(0, capacity))
    step = draw(st.none() | st.integers(1, 2**20))
    return CapacityPolicy(default=low, valid_range=CapacityRange(min=low, max=draw(st.none() | st.just(capacity)),
                                                                 step=step))


@st.composite
def _device(draw: st.DrawFn, counter_sets: list[CounterSet]) -> Device:
    name = draw(_names)
    attributes = draw(st.dictionaries(_keys, _values, max_size=6))
    capacity = draw(st.dictionaries(_keys, _amounts, max_size=4))
    topology = draw(st.none() | st.builds(
        PciTopology, bus_id=st.sampled_from(["0000:3b:00.0", "0000:18:00.1"]),
        pcie_root=st.none() | st.just("pci0000:3a"), numa_node=st.integers(-1, 3)))
    uses: tuple[CounterConsumption, ...] = ()
    if len(counter_sets) > 0 and draw(st.booleans()):
        chosen = draw(st.lists(st.sampled_from(counter_sets), min_size=1, max_size=2, unique_by=lambda c: c.name))
        uses = tuple(CounterConsumption(c.name, {k: draw(st.integers(0, v)) for k, v in c.counters.items()})
                     for c in chosen)
    multi = bool(capacity) and draw(st.booleans())
    policies = {k: draw(_policy(v)) for k, v in capacity.items() if draw(st.booleans())} if multi else {}
    return Device(name, attributes=attributes, capacity=capacity, consumes_counters=uses, topology=topology,
                  allow_multiple_allocations=multi, capacity_policies=policies)


_taints = st.lists(st.fixed_dictionaries(
    {"key": st.sampled_from(["gpu.example.com/xid", "example.com/unhealthy", "k"]),
     "effect": st.sampled_from(["NoSchedule", "NoExecute", "None"])},
    optional={"value": st.sampled_from(["79", "", "gpu-lost"]), "timeAdded": st.just("2026-01-02T15:04:05Z")}),
    max_size=3)


@st.composite
def built_slices(draw: st.DrawFn) -> Obj:
    """One slice of a pool the builder made: devices (with topology, counters, taints, shares) or counter sets."""
    counter_sets = draw(st.lists(st.builds(
        CounterSet, _names, st.dictionaries(_names, _amounts, min_size=1, max_size=4)),
        max_size=3, unique_by=lambda c: c.name))
    devices = draw(st.lists(_device(counter_sets), max_size=5, unique_by=lambda d: d.name))
    taints = {d.name: draw(_taints) for d in devices if draw(st.booleans())}
    pool = pool_slices(draw(st.sampled_from(DRIVERS)), draw(st.sampled_from(NODES)), devices, counter_sets,
                       taints=taints, generation=draw(st.integers(0, 3)))
    return copy.deepcopy(draw(st.sampled_from(pool.slices)))


# --- mutations ---------------------------------------------------------------------------------------------------

_STRINGS = ["", "a", "A", "-a", "a-", "a.b", "a_b", "a b", "a/b", "a/b/c", "/x", "x/", "é", "a" * 63, "a" * 64,
            "a" * 65, "a" * 254, "1.2.3", "01.2.3", "12.4", "40Gi", "-1", "1500m", "NoSchedule", "None",
            "PreferNoSchedule", "In", "Exists", "metadata.name", "2026-01-02T15:04:05Z"]
_INTS = [0, -1, 1, 2, 8, 64, 129, 2**63 - 1]
_SCALARS = st.sampled_from(_STRINGS) | st.sampled_from(_INTS) | st.booleans() | st.none()
_OBJECTS = st.sampled_from([
    {}, [], ["a"], ["a", "a"], {"a": "b"}, {"int": 1}, {"value": "1"}, {"string": "x", "int": 1},
    {"nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]}]},
    [{"key": "k", "effect": "NoSchedule"}], [{"counterSet": "s", "counters": {"c": {"value": "1"}}}],
    {"default": "1", "validValues": ["1", "2"]}, {"default": "1", "validRange": {"min": "1", "step": "1"}},
])
_VALUES = _SCALARS | _OBJECTS
# Fields an object may gain, by what it is: the name of the field holding it, with "[]" for a list entry or "{}"
# for a map entry. Only fields the server knows at that place, so that none is refused as unknown.
_FIELDS = {
    "metadata": ["name", "generateName", "labels", "annotations", "namespace"],
    "spec": ["nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection", "devices", "sharedCounters"],
    "pool": ["name", "generation", "resourceSliceCount"],
    "devices[]": ["name", "attributes", "capacity", "taints", "consumesCounters", "nodeName", "allNodes",
                  "nodeSelector", "bindingConditions", "bindingFailureConditions", "bindsToNode",
                  "allowMultipleAllocations"],
    "attributes{}": ["int", "bool", "string", "version"],
    "capacity{}": ["value", "requestPolicy"],
    "taints[]": ["key", "value", "effect"],
    "sharedCounters[]": ["name", "counters"],
    "consumesCounters[]": ["counterSet", "counters"],
}


def _places(obj: Any, top: bool = True) -> list[tuple[Any, Any]]:
    """Every (container, key or index) in ``obj``, depth first; not apiVersion and kind, which the tables cover (a
    slice with others is not sent as a ResourceSlice at all)."""
    found: list[tuple[Any, Any]] = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        if not (top and key in ("apiVersion", "kind")):
            found.append((obj, key))
            found += _places(value, top=False)
    return found


@st.composite
def _mutate(draw: st.DrawFn, obj: Obj) -> None:
    how = draw(st.sampled_from(["replace", "replace", "remove", "add", "repeat"]))
    if how == "add":  # a field the object's kind has, with a random value
        targets = [obj, *(c[k] for c, k in _places(obj) if isinstance(c[k], dict))]
        target = draw(st.sampled_from(targets))
        fields = _FIELDS.get(_kind_of(obj, target))
        if fields:
            target[draw(st.sampled_from(fields))] = copy.deepcopy(draw(_VALUES))
        return
    places = _places(obj)
    if not places:
        return
    container, key = draw(st.sampled_from(places))
    if how == "replace":
        container[key] = copy.deepcopy(draw(_VALUES))
    elif how == "remove":
        del container[key]
    elif isinstance(container, list):  # repeat a list entry
        container.append(copy.deepcopy(container[key]))


def _kind_of(root: Obj, target: Any) -> str:
    """What ``target`` (an object inside ``root``) is, as a key of ``_FIELDS``."""
    if target is root:
        return ""

    def walk(obj: Any, kind: str) -> str | None:
        if obj is target:
            return kind
        items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
        for key, value in items:
            if isinstance(obj, list):
                child = f"{kind}[]"
            elif kind in ("attributes", "capacity", "counters"):
                child = f"{kind}{{}}"
            else:
                child = str(key)
            if (found := walk(value, child)) is not None:
                return found
        return None

    return walk(root, "") or ""


@st.composite
def mutated_slices(draw: st.DrawFn) -> Obj:
    """A built slice, named, with up to three random mutations (none in about one case in six)."""
    obj = draw(built_slices())
    if draw(st.booleans()):  # a name instead of generateName, as an update would carry
        obj["metadata"]["name"] = obj["metadata"].pop("generateName") + "h5v2c"
    for _ in range(draw(st.sampled_from([0, 1, 1, 2, 2, 3]))):
        draw(_mutate(obj))
    return obj
