"""The API server's validation rules for ``resource.k8s.io/v1`` ResourceSlice objects.

Objects are JSON-shaped mappings with camelCase keys, as on the wire. Every error is a string
``"<field path>: <message>"``, the path as the API server names the field. Rule ids refer to
reference/resourceslice.md section 2.

Implemented here: M1, M2 (labels, annotation keys, ownerReferences), apiVersion and kind,
S1-S14, C1, and the pool rules of 2.9 in :func:`validate_pool`; each device and node selection are checked by
:mod:`agent.slices.device_rules`. The rules are those of a 1.37 server with its default feature gates. Not
implemented: S15 and S16 (fields whose feature gates are off by default: the server drops them), and the
server's ratcheting on update, which skips re-validating unchanged taints and capacities; here every field of
the new object is checked.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agent.kube.names import (
    DNS_LABEL_MSG,
    DRIVER_MSG,
    LABEL_KEY_MSG,
    LABEL_VALUE_MSG,
    SUBDOMAIN_MSG,
    is_dns_label,
    is_dns_subdomain,
    is_driver_name,
    is_label_key,
    is_label_value,
)
from agent.slices.device_rules import check_counters, check_device, check_node_selection
from agent.slices.rule_checks import FieldErrors, as_list, as_map, is_int64, key_path, lookup, show

__all__ = [
    "API_VERSION",
    "KIND",
    "MAX_COUNTER_SETS",
    "MAX_DEVICES_PER_SLICE",
    "MAX_DEVICES_WITH_TAINTS_OR_COUNTERS",
    "MAX_POOL_NAME_LENGTH",
    "validate_pool",
    "validate_resource_slice",
    "validate_resource_slice_update",
]

API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceSlice"
MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_WITH_TAINTS_OR_COUNTERS = 64
MAX_COUNTER_SETS = 8
MAX_POOL_NAME_LENGTH = 253


# --- metadata ----------------------------------------------------------------------------------


def _check_metadata(meta: Mapping[str, Any], errs: FieldErrors) -> None:
    """M1, M2. A namespace is no error: the server clears it, as for any cluster-scoped kind (once it could read it)."""
    name, prefix, namespace = meta.get("name"), meta.get("generateName"), meta.get("namespace")
    errs.check(namespace is None or isinstance(namespace, str), "metadata.namespace", "must be a string", namespace)
    # Absent and "" are no name to the server; anything else (a number, a list) is one it cannot read.
    if prefix not in (None, ""):
        # As a prefix: the server replaces a trailing '-' and the character before it by 'a' before checking.
        masked = prefix[:-2] + "a" if isinstance(prefix, str) and len(prefix) > 1 and prefix.endswith("-") else prefix
        errs.check(is_dns_subdomain(masked), "metadata.generateName", "must be the start of a DNS subdomain", prefix)
    if name not in (None, ""):
        errs.check(is_dns_subdomain(name), "metadata.name", SUBDOMAIN_MSG, name)
    elif prefix not in (None, ""):
        # The server makes the name of the prefix's first 58 characters and 5 random ones, and checks that.
        made = str(prefix)[:58] + "xxxxx"
        errs.check(is_dns_subdomain(made), "metadata.name", f"made from generateName, {SUBDOMAIN_MSG}", made)
    else:
        errs.add("metadata.name", "name or generateName is required")
    # The server names the map, not the entry, for a bad label or annotation. A null value is "" to it.
    for key, value in as_map(meta.get("labels"), "metadata.labels", errs).items():
        errs.check_key(is_label_key(key), "metadata.labels", key, LABEL_KEY_MSG)
        errs.check(value is None or is_label_value(value), "metadata.labels",
                   f"the value of label {show(key)} {LABEL_VALUE_MSG}", value)  # fmt: skip
    for key, value in as_map(meta.get("annotations"), "metadata.annotations", errs).items():
        errs.check_key(is_label_key(str(key).lower()), "metadata.annotations", key, LABEL_KEY_MSG)
        errs.check(value is None or isinstance(value, str), "metadata.annotations",
                   f"the value of annotation {show(key)} must be a string", value)  # fmt: skip
    refs = as_list(meta.get("ownerReferences"), "metadata.ownerReferences", errs)
    for i, ref in enumerate(refs):
        _check_owner(as_map(ref, f"metadata.ownerReferences[{i}]", errs), f"metadata.ownerReferences[{i}]", errs)
    if sum(lookup(ref, "controller") is True for ref in refs) > 1:
        errs.add("metadata.ownerReferences", "at most one owner reference may set controller to true")


def _check_owner(ref: Mapping[str, Any], path: str, errs: FieldErrors) -> None:
    for field in ("apiVersion", "kind", "name", "uid"):
        value = ref.get(field)
        errs.check(isinstance(value, str) and value != "", f"{path}.{field}", "is required and must be a non-empty "
                   "string", value)  # fmt: skip
    api_version = ref.get("apiVersion")
    if isinstance(api_version, str) and api_version:
        group, _, version = api_version.rpartition("/")
        errs.check(api_version.count("/") <= 1 and version != "", f"{path}.apiVersion",
                   "must be <group>/<version> or <version>", api_version)  # fmt: skip
        if (group, version, ref.get("kind")) == ("", "v1", "Event"):
            errs.add(path, "a core Event may not be an owner")
    for flag in ("controller", "blockOwnerDeletion"):
        errs.check_flag(ref, flag, path)


# --- slice -------------------------------------------------------------------------------------


def _lowers_device_limit(device: Any) -> bool:
    # List attribute values would lower it too, but a 1.37 server drops them before it counts.
    return bool(lookup(device, "taints")) or bool(lookup(device, "consumesCounters"))


def _check_pool_fields(pool: Mapping[str, Any], errs: FieldErrors) -> None:
    """S2-S4."""
    name, count, generation = pool.get("name"), pool.get("resourceSliceCount"), pool.get("generation")
    if not isinstance(name, str) or not name:
        errs.add("spec.pool.name", f"is required and must be a non-empty string, got {show(name)}")
    else:
        if len(name) > MAX_POOL_NAME_LENGTH:
            errs.add("spec.pool.name", f"must be at most {MAX_POOL_NAME_LENGTH} characters, got {len(name)}")
        ok = all(is_dns_subdomain(part) for part in name.split("/"))
        errs.check(ok, "spec.pool.name", "must be DNS subdomains separated by '/', with no empty part", name)
    # Absent numbers are zero to the server, as in Go: a count of zero is refused, a generation of zero is fine.
    count, generation = 0 if count is None else count, 0 if generation is None else generation
    count_ok, generation_ok = is_int64(count) and count > 0, is_int64(generation) and generation >= 0
    errs.check(count_ok, "spec.pool.resourceSliceCount", "is required and must be an integer > 0", count)
    errs.check(generation_ok, "spec.pool.generation", "must be an integer >= 0", generation)


def _check_named_list(
    items: Sequence[Any], path: str, limit: int, why: str, errs: FieldErrors, check: Callable[[Any, str], None]
) -> None:
    """Size limit (checked first, as the server does), per-item checks and unique names (a repeated name is
    reported at the entry that repeats it, as the server does)."""
    if len(items) > limit:
        errs.add(path, f"must have at most {limit} entries{why}, got {len(items)}")
        return
    seen: set[str] = set()
    for i, item in enumerate(items):
        check(item, f"{path}[{i}]")
        name = lookup(item, "name")
        if isinstance(name, str):
            if name in seen:
                errs.add(f"{path}[{i}]", f"duplicate name {show(name)}: names must be unique in a slice")
            seen.add(name)


def _check_counter_set(counter_set: Any, path: str, errs: FieldErrors) -> None:
    """C1."""
    name = lookup(as_map(counter_set, path, errs), "name")
    errs.check(is_dns_label(name), f"{path}.name", f"is required and {DNS_LABEL_MSG}", name)
    check_counters(lookup(counter_set, "counters"), f"{path}.counters", errs)


def validate_resource_slice(obj: Mapping[str, Any]) -> list[str]:
    """FieldErrors the API server would report when creating ``obj``; empty if it is valid."""
    if not isinstance(obj, Mapping):
        return [f"<root>: must be a ResourceSlice object, got {show(obj)}"]
    errs = FieldErrors()
    api_version, kind = obj.get("apiVersion"), obj.get("kind")
    errs.check(api_version == API_VERSION, "apiVersion", f"must be {API_VERSION}", api_version)
    errs.check(kind == KIND, "kind", f"must be {KIND}", kind)
    _check_metadata(as_map(obj.get("metadata"), "metadata", errs), errs)
    spec = as_map(obj.get("spec"), "spec", errs)  # absent, it is an empty spec to the server, checked as such
    driver = spec.get("driver")
    errs.check(is_driver_name(driver), "spec.driver", f"is required and {DRIVER_MSG}", driver)
    _check_pool_fields(as_map(spec.get("pool"), "spec.pool", errs), errs)
    check_node_selection(spec, "spec", errs, slice_level=True)
    if spec.get("devices") is not None and spec.get("sharedCounters") is not None:
        errs.add("spec", "only one of sharedCounters or devices may be set: put counter sets in their own "
                 "slice and leave the unused field out (an empty list counts as set)")  # fmt: skip
    devices = as_list(spec.get("devices"), "spec.devices", errs)
    per_device = spec.get("perDeviceNodeSelection") is True
    if any(_lowers_device_limit(d) for d in devices):
        limit, why = MAX_DEVICES_WITH_TAINTS_OR_COUNTERS, " (a device has taints or consumes counters)"
    else:
        limit, why = MAX_DEVICES_PER_SLICE, ""
    _check_named_list(devices, "spec.devices", limit, why, errs,
                      lambda d, p: check_device(d, p, per_device, errs))  # fmt: skip
    counter_sets = as_list(spec.get("sharedCounters"), "spec.sharedCounters", errs)
    _check_named_list(counter_sets, "spec.sharedCounters", MAX_COUNTER_SETS, "", errs,
                      lambda s, p: _check_counter_set(s, p, errs))  # fmt: skip
    return errs


def validate_resource_slice_update(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """FieldErrors for replacing ``old`` by ``new``: S14 immutability plus every check on ``new``."""
    errs = FieldErrors(validate_resource_slice(new))
    for path in ("metadata.name", "spec.driver", "spec.pool.name", "spec.nodeName"):
        before, after = lookup(old, *path.split(".")), lookup(new, *path.split("."))
        if before != after:
            errs.add(path, f"is immutable: was {show(before)}, now {show(after)}")
    return errs


# --- pool (checked by the scheduler and the publishing library, not the API server) ------------


def validate_pool(slices: Sequence[Mapping[str, Any]]) -> list[str]:
    """FieldErrors that make the scheduler refuse a pool (2.9), given all slices of one pool.

    Paths are ``slices[<index in the argument>]...``. As in the scheduler, only slices
    with the highest ``spec.pool.generation`` count.
    """
    if not slices:
        return ["slices: a pool needs at least one slice"]
    errs = FieldErrors()
    for field in ("spec.driver", "spec.pool.name"):
        expected = lookup(slices[0], *field.split("."))
        for i, rs in enumerate(slices):
            if lookup(rs, *field.split(".")) != expected:
                errs.add(f"slices[{i}].{field}", f"must be {show(expected)} like slices[0]: one pool only")
    generations = [lookup(rs, "spec", "pool", "generation") for rs in slices]
    if not all(is_int64(g) for g in generations):
        errs.add("slices", "every slice needs an integer spec.pool.generation")
    if errs:
        return errs
    top = max(generations)
    current = [(i, rs) for i, rs in enumerate(slices) if generations[i] == top]
    counts: list[Any] = []
    for _, rs in current:
        if (count := lookup(rs, "spec", "pool", "resourceSliceCount")) not in counts:
            counts.append(count)
    if len(counts) > 1:
        errs.add("slices", f"incomplete pool: slices of generation {top} disagree on resourceSliceCount "
                 f"({', '.join(map(show, counts))})")  # fmt: skip
    elif counts[0] != len(current):
        errs.add("slices", f"incomplete pool: {len(current)} slice(s) of generation {top} "
                 f"but resourceSliceCount is {show(counts[0])}")  # fmt: skip
    _check_pool_references(current, errs)
    return errs


def _check_pool_references(current: Sequence[tuple[int, Mapping[str, Any]]], errs: FieldErrors) -> None:
    """Unique device and counter-set names across the pool; consumed counters must exist."""
    devices: dict[str, int] = {}
    counter_sets: dict[str, tuple[int, Mapping[str, Any]]] = {}
    for i, rs in current:
        for j, counter_set in enumerate(lookup(rs, "spec", "sharedCounters") or ()):
            name, counters = lookup(counter_set, "name"), lookup(counter_set, "counters")
            if not isinstance(name, str):
                continue
            if name in counter_sets:
                first = counter_sets[name][0]
                errs.add(f"slices[{i}].spec.sharedCounters[{j}].name",
                         f"counter set {show(name)} is also defined in slices[{first}]")  # fmt: skip
            else:
                counter_sets[name] = (i, counters if isinstance(counters, Mapping) else {})
    for i, rs in current:
        for j, device in enumerate(lookup(rs, "spec", "devices") or ()):
            path, name = f"slices[{i}].spec.devices[{j}]", lookup(device, "name")
            if isinstance(name, str) and name in devices:
                errs.add(f"{path}.name", f"device name {show(name)} is also used in slices[{devices[name]}]")
            elif isinstance(name, str):
                devices[name] = i
            for k, use in enumerate(lookup(device, "consumesCounters") or ()):
                use_path, set_name = f"{path}.consumesCounters[{k}]", lookup(use, "counterSet")
                if not isinstance(set_name, str) or set_name not in counter_sets:
                    message = f"no slice of the pool defines counter set {show(set_name)}"
                    errs.add(f"{use_path}.counterSet", message)
                    continue
                counters = lookup(use, "counters")
                for counter in counters if isinstance(counters, Mapping) else ():
                    if counter not in counter_sets[set_name][1]:
                        message = f"counter set {show(set_name)} has no counter {show(counter)}"
                        errs.add(key_path(f"{use_path}.counters", counter), message)
