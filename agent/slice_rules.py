"""The API server's validation rules for ``resource.k8s.io/v1`` ResourceSlice objects.

Objects are JSON-shaped mappings with camelCase keys, as on the wire. Every error is a string
``"<json path>: <message>"``. Rule ids refer to reference/resourceslice.md section 2.

Implemented: M1, M2 (namespace, labels, annotation keys, ownerReferences), apiVersion and
kind, S1-S14, D1-D11, Q1-Q5, V1-V6, C1, C2, T1-T4, and the pool rules of 2.9 in
:func:`validate_pool`. Not implemented: S15, S16 and D12 (fields that exist only on the 1.37
development branch), and the server's ratcheting on update, which skips re-validating
unchanged taints and capacities; here every field of the new object is checked.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from fractions import Fraction
from typing import Any, TypeGuard

from agent.api_names import (
    DNS_LABEL_MSG,
    DRIVER_MSG,
    LABEL_KEY_MSG,
    LABEL_VALUE_MSG,
    NODE_NAME_MSG,
    QUALIFIED_MSG,
    SEMVER_MSG,
    SUBDOMAIN_MSG,
    is_dns_label,
    is_dns_subdomain,
    is_driver_name,
    is_label_key,
    is_label_value,
    is_node_name,
    is_qualified_name,
    is_semver,
)
from agent.quantity import parse_quantity

API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceSlice"
MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_WITH_TAINTS_OR_COUNTERS = 64
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_ATTRIBUTE_VALUES = 48
MAX_TAINTS = 16
MAX_COUNTER_SETS = 8
MAX_COUNTERS = 32
MAX_CONSUMES_COUNTERS = 2
MAX_STRING_ATTRIBUTE_BYTES = 64
MAX_BINDING_CONDITIONS = 4
MAX_VALID_VALUES = 10
MAX_POOL_NAME_LENGTH = 253
TAINT_EFFECTS = ("NoSchedule", "NoExecute", "None")
NODE_SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")

_RFC3339_RE = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]+)?(?:Z|[+-][0-9]{2}:[0-9]{2})"
)

_LIST_FIELDS = {"int": "ints", "bool": "bools", "string": "strings", "version": "versions"}
_SCALAR_OF = {plural: scalar for scalar, plural in _LIST_FIELDS.items()}
_VALUE_FIELDS = frozenset(_LIST_FIELDS) | frozenset(_SCALAR_OF)


# --- helpers -----------------------------------------------------------------------------------


class _Errors(list[str]):
    def add(self, path: str, message: str) -> None:
        self.append(f"{path}: {message}")

    def check(self, ok: bool, path: str, message: str, value: Any) -> None:
        if not ok:
            self.add(path, f"{message}, got {_show(value)}")

    def check_key(self, ok: bool, path: str, message: str) -> None:
        """Like check, for map keys: the offending key is already part of the path."""
        if not ok:
            self.add(path, message)


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def _key(path: str, key: Any) -> str:
    if isinstance(key, str) and key.isprintable() and '"' not in key and "\\" not in key:
        return f'{path}["{key}"]'  # what json.dumps would give, without its cost on every attribute
    return f"{path}[{json.dumps(key, ensure_ascii=False, default=str)}]"


def _get(obj: Any, *keys: str) -> Any:
    for key in keys:
        obj = obj.get(key) if type(obj) is dict or isinstance(obj, Mapping) else None
    return obj


def _is_int64(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63


def _as_map(value: Any, path: str, errs: _Errors) -> Mapping[str, Any]:
    """``value`` if it is an object; absent counts as empty, any other type is an error."""
    if value is None or type(value) is dict or isinstance(value, Mapping):  # dict first: the abc check is slow
        return value or {}
    errs.add(path, f"must be an object, got {_show(value)}")
    return {}


def _as_list(value: Any, path: str, errs: _Errors) -> Sequence[Any]:
    if value is None or isinstance(value, list | tuple):
        return value or ()
    errs.add(path, f"must be a list, got {_show(value)}")
    return ()


def _quantity(value: Any, path: str, errs: _Errors) -> Fraction | None:
    if value is None:
        errs.add(path, "is required (a quantity such as 8, 40Gi or 500m)")
        return None
    # The server's JSON decoder also takes bare numbers and trims surrounding whitespace.
    text = str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value
    try:
        return parse_quantity(text.strip() if isinstance(text, str) else text)
    except (TypeError, ValueError):
        errs.add(path, f"must be a quantity such as 8, 40Gi or 500m, got {_show(value)}")
        return None


def _is_rfc3339(value: object) -> bool:
    if not isinstance(value, str) or _RFC3339_RE.fullmatch(value.upper()) is None:
        return False
    try:
        datetime.fromisoformat(value.upper())
    except ValueError:  # well-formed but out of range, e.g. month 13
        return False
    return True


# --- metadata ----------------------------------------------------------------------------------


def _check_metadata(meta: Mapping[str, Any], errs: _Errors) -> None:
    """M1, M2."""
    name, prefix = meta.get("name"), meta.get("generateName")
    if name:
        errs.check(is_dns_subdomain(name), "metadata.name", SUBDOMAIN_MSG, name)
    elif not prefix:
        errs.add("metadata.name", "name or generateName is required")
    if prefix:
        # The prefix itself may end in '-'; the server then keeps 58 of its characters and
        # appends 5 random ones, and that name must be valid too.
        masked = prefix[:-1] + "a" if isinstance(prefix, str) and prefix.endswith("-") else prefix
        ok = is_dns_subdomain(masked) and (bool(name) or is_dns_subdomain(prefix[:58] + "xxxxx"))
        errs.check(ok, "metadata.generateName", "must be a prefix that, cut to 58 characters and followed "
                   "by 5 random characters, is a DNS subdomain", prefix)  # fmt: skip
    if meta.get("namespace"):
        errs.add("metadata.namespace", "must not be set: ResourceSlice is cluster-scoped")
    for key, value in _as_map(meta.get("labels"), "metadata.labels", errs).items():
        errs.check_key(is_label_key(key), _key("metadata.labels", key), LABEL_KEY_MSG)
        errs.check(is_label_value(value), _key("metadata.labels", key), LABEL_VALUE_MSG, value)
    for key in _as_map(meta.get("annotations"), "metadata.annotations", errs):
        errs.check_key(is_label_key(str(key).lower()), _key("metadata.annotations", key), LABEL_KEY_MSG)
    refs = _as_list(meta.get("ownerReferences"), "metadata.ownerReferences", errs)
    for i, ref in enumerate(refs):
        for field in ("apiVersion", "kind", "name", "uid"):
            value = _get(ref, field)
            errs.check(isinstance(value, str) and value != "", f"metadata.ownerReferences[{i}].{field}",
                       "is required and must be a non-empty string", value)  # fmt: skip
    if sum(_get(ref, "controller") is True for ref in refs) > 1:
        errs.add("metadata.ownerReferences", "at most one owner reference may set controller to true")


# --- node selection ----------------------------------------------------------------------------


def _check_requirement(req: Any, path: str, errs: _Errors, *, by_field: bool) -> None:
    req = _as_map(req, path, errs)
    key, op = req.get("key"), req.get("operator")
    values = _as_list(req.get("values"), f"{path}.values", errs)
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
        ok = is_node_name(value) if by_field else is_label_value(value)
        errs.check(ok, f"{path}.values[{j}]", NODE_NAME_MSG if by_field else LABEL_VALUE_MSG, value)


def _check_node_selector(selector: Any, path: str, errs: _Errors, *, one_term: bool) -> None:
    """Core NodeSelector validation; S7 adds the one-term rule for the slice-level selector."""
    terms_path = f"{path}.nodeSelectorTerms"
    terms = _as_list(_as_map(selector, path, errs).get("nodeSelectorTerms"), terms_path, errs)
    if not terms:
        errs.add(terms_path, "must have at least one node selector term")
    elif one_term and len(terms) != 1:
        errs.add(terms_path, f"must have exactly one node selector term, got {len(terms)}")
    for i, term in enumerate(terms):
        term_map = _as_map(term, f"{terms_path}[{i}]", errs)
        for kind in ("matchExpressions", "matchFields"):
            kind_path = f"{terms_path}[{i}].{kind}"
            for j, req in enumerate(_as_list(term_map.get(kind), kind_path, errs)):
                _check_requirement(req, f"{kind_path}[{j}]", errs, by_field=kind == "matchFields")


def _check_node_selection(obj: Mapping[str, Any], path: str, errs: _Errors, *, slice_level: bool) -> None:
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
            errs.add(f"{path}.{flag}", f"must be unset or true, got {_show(obj[flag])}")
    options = ("nodeName, nodeSelector, allNodes or perDeviceNodeSelection" if slice_level
               else "nodeName, nodeSelector or allNodes (spec.perDeviceNodeSelection is true)")  # fmt: skip
    if not chosen:
        errs.add(path, f"exactly one of {options} is required")
    elif len(chosen) > 1:
        errs.add(path, f"exactly one of {options} may be set, but {', '.join(chosen)} are set")


# --- devices -----------------------------------------------------------------------------------


def _check_attribute_value(kind: str, value: Any, path: str, errs: _Errors) -> None:
    if kind == "int":
        errs.check(_is_int64(value), path, "must be a 64-bit integer", value)
    elif kind == "bool":
        errs.check(isinstance(value, bool), path, "must be true or false", value)
    elif not isinstance(value, str):
        errs.add(path, f"must be a string, got {_show(value)}")
    else:
        if kind == "version":
            errs.check(is_semver(value), path, SEMVER_MSG, value)
        if (size := len(value.encode())) > MAX_STRING_ATTRIBUTE_BYTES:
            errs.add(path, f"must be at most {MAX_STRING_ATTRIBUTE_BYTES} bytes of UTF-8, got {size} bytes")


def _check_attribute(attribute: Any, path: str, errs: _Errors) -> None:
    """V1-V5."""
    attr = _as_map(attribute, path, errs)
    # Iterate the attribute's own keys (usually one) rather than all eight value fields: this runs for
    # every attribute of every device published.
    present = [f for f, v in attr.items() if v is not None and f in _VALUE_FIELDS]
    if len(present) != 1:
        errs.add(path, "exactly one value must be specified: int, bool, string, version (or a list: ints, "
                 f"bools, strings, versions), got {', '.join(present) or 'none'}")  # fmt: skip
    for field in present:
        scalar = _SCALAR_OF.get(field)
        if scalar is None:
            _check_attribute_value(field, attr[field], f"{path}.{field}", errs)
            continue
        items = _as_list(attr[field], f"{path}.{field}", errs)
        if not items:
            errs.add(f"{path}.{field}", "must not be empty when set")
        for i, item in enumerate(items):
            _check_attribute_value(scalar, item, f"{path}.{field}[{i}]", errs)


def _attribute_value_count(attributes: Mapping[str, Any]) -> int:
    """D3: a scalar counts once, a list counts its length."""
    total = 0
    for attr in attributes.values():
        items = attr.items() if isinstance(attr, Mapping) else ()
        sizes = [len(v) for f, v in items if f in _SCALAR_OF and isinstance(v, list | tuple)]
        total += sum(sizes) if any(sizes) else 1
    return total


def _int_value(q: Fraction) -> int:
    # Without fractional-range support the server reads each bound as an integer, rounding up.
    return int(math.copysign(math.ceil(abs(q)), q))


def _check_valid_values(
    raw: Sequence[Any], cap: Fraction, default: Fraction, path: str, errs: _Errors
) -> None:
    if len(raw) > MAX_VALID_VALUES:
        errs.add(f"{path}.validValues", f"must have at most {MAX_VALID_VALUES} entries, got {len(raw)}")
        return
    values = [_quantity(v, f"{path}.validValues[{i}]", errs) for i, v in enumerate(raw)]
    previous: Fraction | None = None
    for i, value in enumerate(values):
        if value is not None and value > cap:
            errs.add(f"{path}.validValues[{i}]", f"must not exceed the capacity value, got {_show(raw[i])}")
        if value is not None and previous is not None and value <= previous:
            errs.add(f"{path}.validValues[{i}]", "values must be unique and in ascending order")
        previous = value if value is not None else previous
    if default not in values:
        errs.add(f"{path}.default", "must be one of validValues")


def _check_valid_range(
    rng: Mapping[str, Any], cap: Fraction, default: Fraction, path: str, errs: _Errors
) -> None:
    low = _quantity(rng.get("min"), f"{path}.min", errs)
    high = None if rng.get("max") is None else _quantity(rng["max"], f"{path}.max", errs)
    step = None if rng.get("step") is None else _quantity(rng["step"], f"{path}.step", errs)
    if low is None:
        return
    over_capacity = "must not exceed the capacity value"
    problems = [(low > cap, "min", over_capacity), (default < low, "default", "must be >= min")]
    if high is not None:
        problems += [(low > high, "max", "must be >= min"), (high > cap, "max", over_capacity)]
        problems.append((default > high, "default", "must be <= max"))
    if step is not None:
        problems.append((step <= 0, "step", "must be greater than zero"))
    if step is not None and step > 0:
        problems.append((low + step > cap, "step", "min plus one step must not exceed the capacity value"))
        for name, value in (("default", default), ("max", high)):
            if value is not None:  # the remainder is zero for truncated and floored division alike
                off_grid = (_int_value(value) - _int_value(low)) % _int_value(step) != 0
                problems.append((off_grid, "step", f"{name} minus min must be a multiple of step"))
    for failed, field, message in problems:
        if failed:
            errs.add(f"{path}.{field}", message)


def _check_capacity(capacity: Any, path: str, multi: bool, errs: _Errors) -> None:
    """V6, D10, D11."""
    cap_map = _as_map(capacity, path, errs)
    value = _quantity(cap_map.get("value"), f"{path}.value", errs)
    if cap_map.get("requestPolicy") is None:
        return
    path = f"{path}.requestPolicy"
    if not multi:
        errs.add(path, "may only be set when the device sets allowMultipleAllocations to true")
        return
    policy = _as_map(cap_map["requestPolicy"], path, errs)
    valid_values, valid_range = policy.get("validValues"), policy.get("validRange")
    if valid_values and valid_range is not None:
        errs.add(path, "validValues and validRange are mutually exclusive: set at most one")
    elif (valid_values or valid_range is not None) and value is not None:
        if policy.get("default") is None:
            errs.add(f"{path}.default", "is required when validValues or validRange is set")
        elif (default := _quantity(policy["default"], f"{path}.default", errs)) is None:
            pass
        elif valid_values:
            values = _as_list(valid_values, f"{path}.validValues", errs)
            _check_valid_values(values, value, default, path, errs)
        else:
            rng_path = f"{path}.validRange"
            _check_valid_range(_as_map(valid_range, rng_path, errs), value, default, rng_path, errs)


def _check_counters(counters: Any, path: str, errs: _Errors) -> None:
    """Counters of a counter set (C1) or of a consumesCounters entry (C2)."""
    counter_map = _as_map(counters, path, errs)
    if not counter_map:
        errs.add(path, "is required and must not be empty")
    elif len(counter_map) > MAX_COUNTERS:
        errs.add(path, f"must have at most {MAX_COUNTERS} counters, got {len(counter_map)}")
    else:
        for key, counter in counter_map.items():
            errs.check_key(is_dns_label(key), _key(path, key), f"counter name {DNS_LABEL_MSG}")
            _quantity(_get(counter, "value"), f"{_key(path, key)}.value", errs)


def _check_taint(taint: Any, path: str, errs: _Errors) -> None:
    """T1-T4."""
    taint_map = _as_map(taint, path, errs)
    key, value, effect = taint_map.get("key"), taint_map.get("value"), taint_map.get("effect")
    errs.check(is_label_key(key), f"{path}.key", f"is required and {LABEL_KEY_MSG}", key)
    if value is not None and value != "":
        errs.check(is_label_value(value), f"{path}.value", LABEL_VALUE_MSG, value)
    effects = ", ".join(TAINT_EFFECTS)
    errs.check(effect in TAINT_EFFECTS, f"{path}.effect", f"is required and must be one of {effects}", effect)
    added = taint_map.get("timeAdded")
    if added is not None:
        message = "must be an RFC 3339 time such as 2026-01-02T15:04:05Z"
        errs.check(_is_rfc3339(added), f"{path}.timeAdded", message, added)


def _check_binding_conditions(device: Mapping[str, Any], path: str, errs: _Errors) -> None:
    """D9."""
    lists: dict[str, Sequence[Any]] = {}
    for field in ("bindingConditions", "bindingFailureConditions"):
        items = lists[field] = _as_list(device.get(field), f"{path}.{field}", errs)
        if (count := len(items)) > MAX_BINDING_CONDITIONS:
            errs.add(f"{path}.{field}", f"must have at most {MAX_BINDING_CONDITIONS} entries, got {count}")
            continue
        for i, item in enumerate(items):
            errs.check(is_label_key(item), f"{path}.{field}[{i}]", LABEL_KEY_MSG, item)
            if item in items[:i]:
                errs.add(f"{path}.{field}[{i}]", f"duplicate entry {_show(item)}")
    conditions, failures = lists["bindingConditions"], lists["bindingFailureConditions"]
    for i, item in enumerate(failures):
        if item in conditions:
            errs.add(f"{path}.bindingFailureConditions[{i}]", "must not also appear in bindingConditions")
    if bool(conditions) != bool(failures):
        missing = "bindingFailureConditions" if conditions else "bindingConditions"
        errs.add(f"{path}.{missing}", "bindingConditions and bindingFailureConditions must be set together")


def _check_consumes_counters(entries: Sequence[Any], path: str, errs: _Errors) -> None:
    """D6, C2."""
    if len(entries) > MAX_CONSUMES_COUNTERS:
        errs.add(path, f"must have at most {MAX_CONSUMES_COUNTERS} entries, got {len(entries)}")
        return
    for i, entry in enumerate(entries):
        counter_set = _get(entry, "counterSet")
        errs.check(is_dns_label(counter_set), f"{path}[{i}].counterSet", f"is required and {DNS_LABEL_MSG}",
                   counter_set)  # fmt: skip
        if any(_get(other, "counterSet") == counter_set for other in entries[:i]):
            errs.add(f"{path}[{i}].counterSet", f"duplicate counter set {_show(counter_set)} in this device")
        _check_counters(_get(_as_map(entry, f"{path}[{i}]", errs), "counters"), f"{path}[{i}].counters", errs)


def _check_device(device: Any, path: str, per_device_node_selection: bool, errs: _Errors) -> None:
    dev = _as_map(device, path, errs)
    name = dev.get("name")
    errs.check(is_dns_label(name), f"{path}.name", f"is required and {DNS_LABEL_MSG}", name)
    attributes = _as_map(dev.get("attributes"), f"{path}.attributes", errs)
    capacities = _as_map(dev.get("capacity"), f"{path}.capacity", errs)
    if (count := len(attributes) + len(capacities)) > MAX_ATTRIBUTES_AND_CAPACITIES:
        limit = MAX_ATTRIBUTES_AND_CAPACITIES
        errs.add(path, f"has {count} attributes and capacities together, at most {limit} are allowed")
    if (values := _attribute_value_count(attributes)) > MAX_ATTRIBUTE_VALUES:
        errs.add(path, f"has {values} attribute values, at most {MAX_ATTRIBUTE_VALUES} allowed")
    for key, attribute in attributes.items():
        where = _key(f"{path}.attributes", key)
        errs.check_key(is_qualified_name(key), where, QUALIFIED_MSG)
        _check_attribute(attribute, where, errs)
    multi = dev.get("allowMultipleAllocations") is True
    for key, capacity in capacities.items():
        where = _key(f"{path}.capacity", key)
        errs.check_key(is_qualified_name(key), where, QUALIFIED_MSG)
        _check_capacity(capacity, where, multi, errs)
    taints = _as_list(dev.get("taints"), f"{path}.taints", errs)
    if len(taints) > MAX_TAINTS:
        errs.add(f"{path}.taints", f"must have at most {MAX_TAINTS} entries, got {len(taints)}")
    for i, taint in enumerate(taints if len(taints) <= MAX_TAINTS else ()):
        _check_taint(taint, f"{path}.taints[{i}]", errs)
    consumes_path = f"{path}.consumesCounters"
    _check_consumes_counters(_as_list(dev.get("consumesCounters"), consumes_path, errs), consumes_path, errs)
    if per_device_node_selection:
        _check_node_selection(dev, path, errs, slice_level=False)
    elif any(dev.get(f) is not None for f in ("nodeName", "nodeSelector", "allNodes")):
        errs.add(path, "nodeName, nodeSelector and allNodes need spec.perDeviceNodeSelection set to true")
    _check_binding_conditions(dev, path, errs)


def validate_device(
    device: Mapping[str, Any], *, per_device_node_selection: bool = False, path: str = "device"
) -> list[str]:
    """Errors for one entry of ``spec.devices`` (D1-D11, V1-V6, C2, T1-T4); paths start at ``path``."""
    errs = _Errors()
    _check_device(device, path, per_device_node_selection, errs)
    return errs


# --- slice -------------------------------------------------------------------------------------


def _lowers_device_limit(device: Any) -> bool:
    attributes = _get(device, "attributes")
    lists = isinstance(attributes, Mapping) and any(
        _get(attr, f) is not None for attr in attributes.values() for f in _LIST_FIELDS.values()
    )
    return bool(_get(device, "taints")) or bool(_get(device, "consumesCounters")) or lists


def _check_pool_fields(pool: Mapping[str, Any], errs: _Errors) -> None:
    """S2-S4."""
    name, count, generation = pool.get("name"), pool.get("resourceSliceCount"), pool.get("generation")
    if not isinstance(name, str) or not name:
        errs.add("spec.pool.name", f"is required and must be a non-empty string, got {_show(name)}")
    else:
        if len(name) > MAX_POOL_NAME_LENGTH:
            errs.add("spec.pool.name", f"must be at most {MAX_POOL_NAME_LENGTH} characters, got {len(name)}")
        ok = all(is_dns_subdomain(part) for part in name.split("/"))
        errs.check(ok, "spec.pool.name", "must be DNS subdomains separated by '/', with no empty part", name)
    count_ok, generation_ok = _is_int64(count) and count > 0, _is_int64(generation) and generation >= 0
    errs.check(count_ok, "spec.pool.resourceSliceCount", "is required and must be an integer > 0", count)
    errs.check(generation_ok, "spec.pool.generation", "is required and must be an integer >= 0", generation)


def _check_named_list(
    items: Sequence[Any], path: str, limit: int, why: str, errs: _Errors, check: Callable[[Any, str], None]
) -> None:
    """Size limit (checked first, as the server does), per-item checks and unique names."""
    if len(items) > limit:
        errs.add(path, f"must have at most {limit} entries{why}, got {len(items)}")
        return
    seen: set[str] = set()
    for i, item in enumerate(items):
        check(item, f"{path}[{i}]")
        name = _get(item, "name")
        if isinstance(name, str):
            if name in seen:
                errs.add(f"{path}[{i}].name", f"duplicate name {_show(name)}: names must be unique in a slice")
            seen.add(name)


def _check_counter_set(counter_set: Any, path: str, errs: _Errors) -> None:
    """C1."""
    name = _get(_as_map(counter_set, path, errs), "name")
    errs.check(is_dns_label(name), f"{path}.name", f"is required and {DNS_LABEL_MSG}", name)
    _check_counters(_get(counter_set, "counters"), f"{path}.counters", errs)


def validate_resource_slice(obj: Mapping[str, Any]) -> list[str]:
    """Errors the API server would report when creating ``obj``; empty if it is valid."""
    if not isinstance(obj, Mapping):
        return [f"<root>: must be a ResourceSlice object, got {_show(obj)}"]
    errs = _Errors()
    api_version, kind = obj.get("apiVersion"), obj.get("kind")
    errs.check(api_version == API_VERSION, "apiVersion", f"must be {API_VERSION}", api_version)
    errs.check(kind == KIND, "kind", f"must be {KIND}", kind)
    _check_metadata(_as_map(obj.get("metadata"), "metadata", errs), errs)
    if obj.get("spec") is None:
        errs.add("spec", "is required")
        return errs
    spec = _as_map(obj["spec"], "spec", errs)
    driver = spec.get("driver")
    errs.check(is_driver_name(driver), "spec.driver", f"is required and {DRIVER_MSG}", driver)
    _check_pool_fields(_as_map(spec.get("pool"), "spec.pool", errs), errs)
    _check_node_selection(spec, "spec", errs, slice_level=True)
    if spec.get("devices") is not None and spec.get("sharedCounters") is not None:
        errs.add("spec", "only one of sharedCounters or devices may be set: put counter sets in their own "
                 "slice and leave the unused field out (an empty list counts as set)")  # fmt: skip
    devices = _as_list(spec.get("devices"), "spec.devices", errs)
    per_device = spec.get("perDeviceNodeSelection") is True
    if any(_lowers_device_limit(d) for d in devices):
        limit, why = MAX_DEVICES_WITH_TAINTS_OR_COUNTERS, " (a device has taints, counters or lists)"
    else:
        limit, why = MAX_DEVICES_PER_SLICE, ""
    _check_named_list(devices, "spec.devices", limit, why, errs,
                      lambda d, p: _check_device(d, p, per_device, errs))  # fmt: skip
    counter_sets = _as_list(spec.get("sharedCounters"), "spec.sharedCounters", errs)
    _check_named_list(counter_sets, "spec.sharedCounters", MAX_COUNTER_SETS, "", errs,
                      lambda s, p: _check_counter_set(s, p, errs))  # fmt: skip
    return errs


def validate_resource_slice_update(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Errors for replacing ``old`` by ``new``: S14 immutability plus every check on ``new``."""
    errs = _Errors(validate_resource_slice(new))
    for path in ("metadata.name", "spec.driver", "spec.pool.name", "spec.nodeName"):
        before, after = _get(old, *path.split(".")), _get(new, *path.split("."))
        if before != after:
            errs.add(path, f"is immutable: was {_show(before)}, now {_show(after)}")
    return errs


# --- pool (checked by the scheduler and the publishing library, not the API server) ------------


def validate_pool(slices: Sequence[Mapping[str, Any]]) -> list[str]:
    """Errors that make the scheduler refuse a pool (2.9), given all slices of one pool.

    Paths are ``slices[<index in the argument>]...``. As in the scheduler, only slices
    with the highest ``spec.pool.generation`` count.
    """
    if not slices:
        return ["slices: a pool needs at least one slice"]
    errs = _Errors()
    for field in ("spec.driver", "spec.pool.name"):
        expected = _get(slices[0], *field.split("."))
        for i, rs in enumerate(slices):
            if _get(rs, *field.split(".")) != expected:
                errs.add(f"slices[{i}].{field}", f"must be {_show(expected)} like slices[0]: one pool only")
    generations = [_get(rs, "spec", "pool", "generation") for rs in slices]
    if not all(_is_int64(g) for g in generations):
        errs.add("slices", "every slice needs an integer spec.pool.generation")
    if errs:
        return errs
    top = max(generations)
    current = [(i, rs) for i, rs in enumerate(slices) if generations[i] == top]
    counts: list[Any] = []
    for _, rs in current:
        if (count := _get(rs, "spec", "pool", "resourceSliceCount")) not in counts:
            counts.append(count)
    if len(counts) > 1:
        errs.add("slices", f"incomplete pool: slices of generation {top} disagree on resourceSliceCount "
                 f"({', '.join(map(_show, counts))})")  # fmt: skip
    elif counts[0] != len(current):
        errs.add("slices", f"incomplete pool: {len(current)} slice(s) of generation {top} "
                 f"but resourceSliceCount is {_show(counts[0])}")  # fmt: skip
    _check_pool_references(current, errs)
    return errs


def _check_pool_references(current: Sequence[tuple[int, Mapping[str, Any]]], errs: _Errors) -> None:
    """Unique device and counter-set names across the pool; consumed counters must exist."""
    devices: dict[str, int] = {}
    counter_sets: dict[str, tuple[int, Mapping[str, Any]]] = {}
    for i, rs in current:
        for j, counter_set in enumerate(_get(rs, "spec", "sharedCounters") or ()):
            name, counters = _get(counter_set, "name"), _get(counter_set, "counters")
            if not isinstance(name, str):
                continue
            if name in counter_sets:
                first = counter_sets[name][0]
                errs.add(f"slices[{i}].spec.sharedCounters[{j}].name",
                         f"counter set {_show(name)} is also defined in slices[{first}]")  # fmt: skip
            else:
                counter_sets[name] = (i, counters if isinstance(counters, Mapping) else {})
    for i, rs in current:
        for j, device in enumerate(_get(rs, "spec", "devices") or ()):
            path, name = f"slices[{i}].spec.devices[{j}]", _get(device, "name")
            if isinstance(name, str) and name in devices:
                errs.add(f"{path}.name", f"device name {_show(name)} is also used in slices[{devices[name]}]")
            elif isinstance(name, str):
                devices[name] = i
            for k, use in enumerate(_get(device, "consumesCounters") or ()):
                use_path, set_name = f"{path}.consumesCounters[{k}]", _get(use, "counterSet")
                if not isinstance(set_name, str) or set_name not in counter_sets:
                    message = f"no slice of the pool defines counter set {_show(set_name)}"
                    errs.add(f"{use_path}.counterSet", message)
                    continue
                counters = _get(use, "counters")
                for counter in counters if isinstance(counters, Mapping) else ():
                    if counter not in counter_sets[set_name][1]:
                        message = f"counter set {_show(set_name)} has no counter {_show(counter)}"
                        errs.add(_key(f"{use_path}.counters", counter), message)
