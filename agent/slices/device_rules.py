"""The API server's rules for one device of a ``resource.k8s.io/v1`` ResourceSlice, and for node selection.

Rule ids refer to reference/resourceslice.md section 2. Implemented here: D1, D2, D4-D11, Q1-Q4 (attribute and
capacity keys; the 1.37 server does not enforce Q5), V1-V4, V6, the counters of C1 and C2, T1-T4, and the node
selection of S5-S9 and D7, shared by a slice and, with perDeviceNodeSelection, by each of its devices. D3 and V5
are about list values, which a 1.37 server drops (DRAListTypeAttributes is off by default): such a value counts
as none. Not implemented: D12 (a field that exists only on the 1.37 development branch). The slice around the
devices is checked in :mod:`agent.slices.rules`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

from agent.kube.names import (
    DNS_LABEL_MSG,
    LABEL_KEY_MSG,
    LABEL_VALUE_MSG,
    NODE_NAME_MSG,
    QUALIFIED_MSG,
    SEMVER_MSG,
    is_dns_label,
    is_label_key,
    is_label_value,
    is_node_name,
    is_qualified_name,
    is_semver,
)
from agent.slices.rule_checks import (
    FieldErrors,
    as_list,
    as_map,
    as_quantity,
    is_int64,
    is_rfc3339,
    key_path,
    lookup,
    show,
)

__all__ = [
    "LIST_FIELDS",
    "MAX_ATTRIBUTES_AND_CAPACITIES",
    "MAX_BINDING_CONDITIONS",
    "MAX_CONSUMES_COUNTERS",
    "MAX_COUNTERS",
    "MAX_STRING_ATTRIBUTE_BYTES",
    "MAX_TAINTS",
    "MAX_VALID_VALUES",
    "NODE_SELECTOR_OPERATORS",
    "TAINT_EFFECTS",
    "check_counters",
    "check_device",
    "check_node_selection",
    "validate_device",
]

MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_TAINTS = 16
MAX_COUNTERS = 32
MAX_CONSUMES_COUNTERS = 2
MAX_STRING_ATTRIBUTE_BYTES = 64
MAX_BINDING_CONDITIONS = 4
MAX_VALID_VALUES = 10
_MAX_INT64 = 2**63 - 1
# Keys longer than these are cut in the middle in error paths: a domain, '/' and an identifier; a DNS label.
MAX_KEY_LENGTH = 63 + 1 + 32
MAX_COUNTER_NAME_LENGTH = 63
TAINT_EFFECTS = ("NoSchedule", "NoExecute", "None")
NODE_SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")

_VALUE_FIELDS = frozenset({"int", "bool", "string", "version"})
# List values exist behind DRAListTypeAttributes, alpha and off by default in 1.37: the server drops them before
# it validates (after reading them, so their JSON types must still be right).
LIST_FIELDS = {"ints": "int", "bools": "bool", "strings": "string", "versions": "version"}


# --- node selection ----------------------------------------------------------------------------


def _check_requirement(req: Any, path: str, errs: FieldErrors, *, by_field: bool) -> None:
    req = as_map(req, path, errs)
    key, op = req.get("key"), req.get("operator")
    values = as_list(req.get("values"), f"{path}.values", errs)
    if by_field:  # matchFields only knows metadata.name, with In/NotIn and one value
        errs.check(key == "metadata.name", f"{path}.key", "must be metadata.name in matchFields", key)
        errs.check(op in ("In", "NotIn"), f"{path}.operator", "must be In or NotIn in matchFields", op)
        errs.check(len(values) == 1, f"{path}.values", "must hold one node name in matchFields", values)
    else:
        errs.check(is_label_key(key), f"{path}.key", LABEL_KEY_MSG, key)
        if op not in NODE_SELECTOR_OPERATORS:
            errs.add(f"{path}.operator", f"must be one of {', '.join(NODE_SELECTOR_OPERATORS)}, got {op!r}")
        elif op in ("In", "NotIn") and not values:
            errs.add(f"{path}.values", f"must not be empty when operator is {op}")
        elif op in ("Exists", "DoesNotExist") and values:
            errs.add(f"{path}.values", f"must be empty when operator is {op}")
        elif op in ("Gt", "Lt") and len(values) != 1:
            errs.add(f"{path}.values", f"must hold exactly one value when operator is {op}")
    for j, value in enumerate(values):
        ok = is_node_name(value) if by_field else value is None or is_label_value(value)  # null is "" to the server
        errs.check(ok, f"{path}.values[{j}]", NODE_NAME_MSG if by_field else LABEL_VALUE_MSG, value)


def _check_node_selector(selector: Any, path: str, errs: FieldErrors, *, one_term: bool) -> None:
    """Core NodeSelector validation; S7 adds the one-term rule for the slice-level selector."""
    terms_path = f"{path}.nodeSelectorTerms"
    terms = as_list(as_map(selector, path, errs).get("nodeSelectorTerms"), terms_path, errs)
    if not terms:
        errs.add(terms_path, "must have at least one node selector term")
    elif one_term and len(terms) != 1:
        errs.add(terms_path, f"must have exactly one node selector term, got {len(terms)}")
    for i, term in enumerate(terms):
        term_map = as_map(term, f"{terms_path}[{i}]", errs)
        for kind in ("matchExpressions", "matchFields"):
            kind_path = f"{terms_path}[{i}].{kind}"
            for j, req in enumerate(as_list(term_map.get(kind), kind_path, errs)):
                _check_requirement(req, f"{kind_path}[{j}]", errs, by_field=kind == "matchFields")


def check_node_selection(obj: Mapping[str, Any], path: str, errs: FieldErrors, *, slice_level: bool) -> None:
    """S5-S9 for a slice; D7 for a device of a slice with perDeviceNodeSelection."""
    chosen: list[str] = []
    name = obj.get("nodeName")
    if name == "":
        errs.add(f"{path}.nodeName", "must be unset or a non-empty node name")
    elif name is not None:
        chosen.append("nodeName")
        errs.check(is_node_name(name), f"{path}.nodeName", NODE_NAME_MSG, name)
    if obj.get("nodeSelector") is not None:
        chosen.append("nodeSelector")
        _check_node_selector(obj["nodeSelector"], f"{path}.nodeSelector", errs, one_term=slice_level)
    for flag in ("allNodes", "perDeviceNodeSelection") if slice_level else ("allNodes",):
        if obj.get(flag) is True:
            chosen.append(flag)
        elif obj.get(flag) is not None:
            errs.add(f"{path}.{flag}", f"must be unset or true, got {show(obj[flag])}")
    options = ("nodeName, nodeSelector, allNodes or perDeviceNodeSelection" if slice_level
               else "nodeName, nodeSelector or allNodes (spec.perDeviceNodeSelection is true)")  # fmt: skip
    if not chosen:
        errs.add(path, f"exactly one of {options} is required")
    elif len(chosen) > 1:
        errs.add(path, f"exactly one of {options} may be set, but {', '.join(chosen)} are set")


# --- devices -----------------------------------------------------------------------------------


def _check_attribute_value(kind: str, value: Any, path: str, errs: FieldErrors) -> None:
    if kind == "int":
        errs.check(is_int64(value), path, "must be a 64-bit integer", value)
    elif kind == "bool":
        errs.check(isinstance(value, bool), path, "must be true or false", value)
    elif not isinstance(value, str):
        errs.add(path, f"must be a string, got {show(value)}")
    else:
        if kind == "version":
            errs.check(is_semver(value), path, SEMVER_MSG, value)
        if (size := len(value.encode())) > MAX_STRING_ATTRIBUTE_BYTES:
            errs.add(path, f"must be at most {MAX_STRING_ATTRIBUTE_BYTES} bytes of UTF-8, got {size} bytes")


def _check_attribute(attribute: Any, path: str, errs: FieldErrors, full_path: str) -> None:
    """V1-V4. List values (V5) are dropped by the server, so they count as no value and are not checked further.

    ``path`` has the key cut as the server cuts long keys; ``full_path`` has it whole. For a long key the server
    reports a missing or second value twice, at both: once from each of its two checks of that rule."""
    attr = as_map(attribute, path, errs)
    # Iterate the attribute's own keys (usually one) rather than every value field: this runs for every attribute
    # of every device published.
    present = [f for f, v in attr.items() if v is not None and f in _VALUE_FIELDS]
    lists = [f for f, v in attr.items() if v is not None and f in LIST_FIELDS]
    if len(present) != 1:
        dropped = (f" ({', '.join(lists)} dropped: list values need the DRAListTypeAttributes feature gate, off "
                   "by default)") if lists else ""  # fmt: skip
        got = ", ".join(present) or "none"
        for where in dict.fromkeys((path, full_path)):
            errs.add(where, f"exactly one value must be specified: int, bool, string or version, got {got}{dropped}")
    for field in present:
        _check_attribute_value(field, attr[field], f"{path}.{field}", errs)
    for field in lists:
        kind = LIST_FIELDS[field]
        for i, item in enumerate(as_list(attr[field], f"{path}.{field}", errs)):
            if not (is_int64(item) if kind == "int" else isinstance(item, bool if kind == "bool" else str)):
                errs.add(f"{path}.{field}[{i}]", f"must be a {'64-bit integer' if kind == 'int' else kind}, "
                         f"got {show(item)}")  # fmt: skip


def _int_value(q: Fraction) -> int:
    # Without fractional-range support (DRAFractionalCapacityRange, off in 1.37) the server reads each amount
    # as an integer, rounding away from zero.
    return int(math.copysign(math.ceil(abs(q)), q))


def _quantity_or_zero(value: Any, path: str, errs: FieldErrors) -> Fraction | None:
    """A capacity's or counter's value, or an entry of validValues: absent or null, it is zero to the server (a
    quantity, not a pointer, in Go)."""
    return Fraction(0) if value is None else as_quantity(value, path, errs)


def _check_valid_values(
    raw: Sequence[Any], cap: Fraction, default: Fraction, path: str, errs: FieldErrors
) -> None:
    """The checks and their order are the server's: order first, then the size limit (which skips the rest but
    the default's), then each value and repeats (amounts equal once rounded to integers repeat)."""
    path = f"{path}.validValues"
    values = [_quantity_or_zero(v, f"{path}[{i}]", errs) for i, v in enumerate(raw)]
    for i in range(1, len(values)):
        before, value = values[i - 1], values[i]
        if before is not None and value is not None and before > value:
            errs.add(f"{path}[{i}]", f"values must be in ascending order, got {show(raw[i])} after {show(raw[i - 1])}")
    if len(values) > MAX_VALID_VALUES:
        errs.add(path, f"must have at most {MAX_VALID_VALUES} entries, got {len(values)}")
    else:
        seen: set[int] = set()
        for i, value in enumerate(values):
            if value is None:
                continue
            if value > cap:
                errs.add(f"{path}[{i}]", f"must not exceed the capacity value, got {show(raw[i])}")
            if _int_value(value) in seen:
                errs.add(f"{path}[{i}]", f"duplicate value {show(raw[i])}: values must be unique as integers")
            seen.add(_int_value(value))
    if len(values) > MAX_VALID_VALUES or default not in values:
        errs.add(path, "must include the default")


def _check_valid_range(
    rng: Mapping[str, Any], cap: Fraction, default: Fraction, path: str, errs: FieldErrors
) -> None:
    low = as_quantity(rng.get("min"), f"{path}.min", errs)
    high = None if rng.get("max") is None else as_quantity(rng["max"], f"{path}.max", errs)
    step = None if rng.get("step") is None else as_quantity(rng["step"], f"{path}.step", errs)
    if low is None:
        return
    over_capacity = "must not exceed the capacity value"
    problems = [(low > cap, "min", over_capacity), (default < low, "default", "must be >= min")]
    if high is not None:
        problems += [(low > high, "max", "must be >= min"), (high > cap, "max", over_capacity)]
        problems.append((default > high, "default", "must be <= max"))
    if step is not None and step <= 0:
        problems.append((True, "step", "must be greater than zero"))
    elif step is not None:
        problems.append((low + step > cap, "step", "min plus one step must not exceed the capacity value"))
        # The server does the grid arithmetic on 64-bit integers, so it first requires every amount to be one.
        amounts = {"default": default, "min": low, "max": high, "step": step}
        outside = [name for name, q in amounts.items() if q is not None and not 0 <= q <= _MAX_INT64]
        problems += [(True, name, "must be between 0 and 2^63-1 when step is set") for name in outside]
        for name, value in (("default", default), ("max", high)):
            if value is not None and not outside:
                off_grid = (_int_value(value) - _int_value(low)) % _int_value(step) != 0
                problems.append((off_grid, "step", f"{name} minus min must be a multiple of step"))
    for failed, field, message in problems:
        if failed:
            errs.add(f"{path}.{field}", message)


def _check_capacity(capacity: Any, path: str, multi: bool, errs: FieldErrors) -> None:
    """V6, D10, D11."""
    cap_map = as_map(capacity, path, errs)
    value = _quantity_or_zero(cap_map.get("value"), f"{path}.value", errs)
    if cap_map.get("requestPolicy") is None:
        return
    path = f"{path}.requestPolicy"
    if not multi:
        errs.add(path, "may only be set when the device sets allowMultipleAllocations to true")
        return
    policy = as_map(cap_map["requestPolicy"], path, errs)
    valid_values, valid_range = policy.get("validValues"), policy.get("validRange")
    if valid_values and valid_range is not None:
        errs.add(path, "validValues and validRange are mutually exclusive: set at most one")
    elif (valid_values or valid_range is not None) and value is not None:
        if policy.get("default") is None:
            errs.add(f"{path}.default", "is required when validValues or validRange is set")
        elif (default := as_quantity(policy["default"], f"{path}.default", errs)) is None:
            pass
        elif valid_values:
            values = as_list(valid_values, f"{path}.validValues", errs)
            _check_valid_values(values, value, default, path, errs)
        else:
            rng_path = f"{path}.validRange"
            _check_valid_range(as_map(valid_range, rng_path, errs), value, default, rng_path, errs)


def check_counters(counters: Any, path: str, errs: FieldErrors) -> None:
    """Counters of a counter set (C1) or of a consumesCounters entry (C2)."""
    counter_map = as_map(counters, path, errs)
    if not counter_map:
        errs.add(path, "is required and must not be empty")
    elif len(counter_map) > MAX_COUNTERS:
        errs.add(path, f"must have at most {MAX_COUNTERS} counters, got {len(counter_map)}")
    else:
        for key, counter in counter_map.items():
            errs.check_key(is_dns_label(key), path, key, f"(a counter name) {DNS_LABEL_MSG}")
            where = key_path(path, key, MAX_COUNTER_NAME_LENGTH)
            _quantity_or_zero(as_map(counter, where, errs).get("value"), f"{where}.value", errs)


def _check_taint(taint: Any, path: str, errs: FieldErrors) -> None:
    """T1-T4."""
    taint_map = as_map(taint, path, errs)
    key, value, effect = taint_map.get("key"), taint_map.get("value"), taint_map.get("effect")
    errs.check(is_label_key(key), f"{path}.key", f"is required and {LABEL_KEY_MSG}", key)
    if value is not None and value != "":
        errs.check(is_label_value(value), f"{path}.value", LABEL_VALUE_MSG, value)
    effects = ", ".join(TAINT_EFFECTS)
    errs.check(effect in TAINT_EFFECTS, f"{path}.effect", f"is required and must be one of {effects}", effect)
    added = taint_map.get("timeAdded")
    if added is not None:
        message = "must be an RFC 3339 time such as 2026-01-02T15:04:05Z"
        errs.check(is_rfc3339(added), f"{path}.timeAdded", message, added)


def _check_binding_conditions(device: Mapping[str, Any], path: str, errs: FieldErrors) -> None:
    """D9."""
    lists: dict[str, Sequence[Any]] = {}
    for field in ("bindingConditions", "bindingFailureConditions"):
        items = lists[field] = as_list(device.get(field), f"{path}.{field}", errs)
        if (count := len(items)) > MAX_BINDING_CONDITIONS:
            errs.add(f"{path}.{field}", f"must have at most {MAX_BINDING_CONDITIONS} entries, got {count}")
            continue
        for i, item in enumerate(items):
            errs.check(is_label_key(item), f"{path}.{field}[{i}]", LABEL_KEY_MSG, item)
            if item in items[:i]:
                errs.add(f"{path}.{field}[{i}]", f"duplicate entry {show(item)}")
    conditions, failures = lists["bindingConditions"], lists["bindingFailureConditions"]
    for i, item in enumerate(failures):
        if item in conditions:
            errs.add(f"{path}.bindingFailureConditions[{i}]", "must not also appear in bindingConditions")
    if bool(conditions) != bool(failures):
        missing = "bindingFailureConditions" if conditions else "bindingConditions"
        errs.add(f"{path}.{missing}", "bindingConditions and bindingFailureConditions must be set together")


def _check_consumes_counters(entries: Sequence[Any], path: str, errs: FieldErrors) -> None:
    """D6, C2."""
    if len(entries) > MAX_CONSUMES_COUNTERS:
        errs.add(path, f"must have at most {MAX_CONSUMES_COUNTERS} entries, got {len(entries)}")
        return
    for i, entry in enumerate(entries):
        counter_set = lookup(entry, "counterSet")
        errs.check(is_dns_label(counter_set), f"{path}[{i}].counterSet", f"is required and {DNS_LABEL_MSG}",
                   counter_set)  # fmt: skip
        if any(lookup(other, "counterSet") == counter_set for other in entries[:i]):
            errs.add(f"{path}[{i}]", f"duplicate counter set {show(counter_set)} in this device")
        check_counters(lookup(as_map(entry, f"{path}[{i}]", errs), "counters"), f"{path}[{i}].counters", errs)


def _is_key(key: Any) -> bool:
    """An attribute or capacity key the server takes: a qualified name (Q1-Q4), or any key with more than one '/',
    which 1.37 does not check at all (its validation leaves that case open, so Q5 is not enforced)."""
    return (isinstance(key, str) and key.count("/") > 1) or is_qualified_name(key)


def check_device(device: Any, path: str, per_device_node_selection: bool, errs: FieldErrors) -> None:
    dev = as_map(device, path, errs)
    name = dev.get("name")
    errs.check(is_dns_label(name), f"{path}.name", f"is required and {DNS_LABEL_MSG}", name)
    attributes = as_map(dev.get("attributes"), f"{path}.attributes", errs)
    capacities = as_map(dev.get("capacity"), f"{path}.capacity", errs)
    if (count := len(attributes) + len(capacities)) > MAX_ATTRIBUTES_AND_CAPACITIES:
        limit = MAX_ATTRIBUTES_AND_CAPACITIES
        errs.add(path, f"has {count} attributes and capacities together, at most {limit} are allowed")
    for key, attribute in attributes.items():
        errs.check_key(_is_key(key), f"{path}.attributes", key, QUALIFIED_MSG)
        where = f"{path}.attributes"
        _check_attribute(attribute, key_path(where, key, MAX_KEY_LENGTH), errs, key_path(where, key))
    for flag in ("allowMultipleAllocations", "bindsToNode"):
        errs.check_flag(dev, flag, path)
    multi = dev.get("allowMultipleAllocations") is True
    for key, capacity in capacities.items():
        errs.check_key(_is_key(key), f"{path}.capacity", key, QUALIFIED_MSG)
        _check_capacity(capacity, key_path(f"{path}.capacity", key, MAX_KEY_LENGTH), multi, errs)
    taints = as_list(dev.get("taints"), f"{path}.taints", errs)
    if len(taints) > MAX_TAINTS:
        errs.add(f"{path}.taints", f"must have at most {MAX_TAINTS} entries, got {len(taints)}")
    for i, taint in enumerate(taints if len(taints) <= MAX_TAINTS else ()):
        _check_taint(taint, f"{path}.taints[{i}]", errs)
    consumes_path = f"{path}.consumesCounters"
    _check_consumes_counters(as_list(dev.get("consumesCounters"), consumes_path, errs), consumes_path, errs)
    if per_device_node_selection:
        check_node_selection(dev, path, errs, slice_level=False)
    elif any(dev.get(f) is not None for f in ("nodeName", "nodeSelector", "allNodes")):
        errs.add(path, "nodeName, nodeSelector and allNodes need spec.perDeviceNodeSelection set to true")
    _check_binding_conditions(dev, path, errs)


def validate_device(
    device: Mapping[str, Any], *, per_device_node_selection: bool = False, path: str = "device"
) -> list[str]:
    """FieldErrors for one entry of ``spec.devices`` (D1-D11, V1-V6, C2, T1-T4 as above); paths start at ``path``."""
    errs = FieldErrors()
    check_device(device, path, per_device_node_selection, errs)
    return errs
