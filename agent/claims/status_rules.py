"""The API server's rules for a ResourceClaim's `status.devices` (KEP-4817 `AllocatedDeviceStatus`).

Objects are JSON-shaped, with the wire's camelCase keys. Every error is a string `"<json path>: <message>"` worded
as the real server words it (collected in `FieldErrors`, with the server's words for the name formats from
agent/kube/names.py) (`validateDeviceStatus`, `validateNetworkDeviceData`, metav1 `ValidateConditions` in
kube-apiserver's resource validation). The agent checks each entry it is about to write with
:func:`device_status_errors`, so one bad fact leaves out that entry instead of failing the whole write; a whole
claim's status is checked by :func:`claim_status_errors` (each entry, duplicates, and that every entry names a
device of the claim's allocation).
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from agent.kube.field_errors import FieldErrors, shown_as_server
from agent.kube.names import (
    SERVER_CONDITION_REASON_MSG,
    SERVER_DNS_LABEL_MSG,
    SERVER_NAME_PART_MSG,
    SERVER_SUBDOMAIN_MSG,
    is_condition_reason,
    is_dns_label,
    is_dns_subdomain,
    is_label_key,
    is_uid,
)
from agent.kube.times import TIME_LAYOUT, is_rfc3339

__all__ = [
    "DATA_MAX_BYTES",
    "MAX_CONDITIONS",
    "MAX_IPS",
    "DeviceKey",
    "allocated_keys",
    "canonical_interface_address",
    "claim_status_errors",
    "device_key",
    "device_status_errors",
    "json_size",
    "unreadable_time",
]

DATA_MAX_BYTES = 10 * 1024
"""`data` may take this many bytes of JSON."""
MAX_CONDITIONS = 8
MAX_IPS = 16
MAX_DRIVER_NAME = 63
MAX_INTERFACE_NAME = 256
MAX_HARDWARE_ADDRESS = 128
MAX_POOL_NAME = 253
MAX_REASON = 1024
MAX_MESSAGE = 32 * 1024
CONDITION_STATUSES = ("False", "True", "Unknown")

DeviceKey = tuple[str, str, str, str | None]
"""What identifies an entry of `status.devices` (a list-map): driver, pool, device and shareID."""

_CIDR_MSG = "must be a valid address in CIDR form, (e.g. 10.9.8.7/24 or 2001:db8::1/64)"
# Characters Go's encoding/json writes escaped, and their size so: two bytes for the short escapes, six for \u00XX.
_SHORT_ESCAPES = frozenset('"\\\b\f\n\r\t')
_LONG_ESCAPES = frozenset("<>&\u2028\u2029")
_INT64 = range(-(2**63), 2**63)


def json_size(value: Any) -> int:
    """Bytes of `value` as compact JSON the way Go's encoding/json writes it, which is how the server measures
    `data` after a server-side apply (it decodes the body, then encodes `data` again): '<', '>', '&', U+2028 and
    U+2029 escaped in six bytes each, other characters in UTF-8; a float in Go's shortest form (1e20 in full,
    2.0 as 2), and an integer beyond 64 bits as the float it becomes."""
    if value is None or value is True:
        return 4
    if value is False:
        return 5
    if isinstance(value, int):
        return len(str(value)) if value in _INT64 else _float_size(float(value))
    if isinstance(value, float):
        return _float_size(value)
    if isinstance(value, str):
        return 2 + sum(_char_size(char) for char in value)
    if isinstance(value, Mapping):
        return 1 + len(value) + sum(json_size(str(k)) + 1 + json_size(v) for k, v in value.items()) + (not value)
    if isinstance(value, (list, tuple)):
        return 1 + len(value) + sum(json_size(item) for item in value) + (not value)
    return json_size(str(value))


def _char_size(char: str) -> int:
    if char in _SHORT_ESCAPES:
        return 2
    if char < " " or char in _LONG_ESCAPES:
        return 6
    if "\ud800" <= char <= "\udfff":
        return 3  # a lone surrogate: decoded as U+FFFD
    return len(char.encode())


def _float_size(value: float) -> int:
    if not math.isfinite(value):
        return DATA_MAX_BYTES + 1  # no JSON number: never fits
    magnitude = abs(value)
    if magnitude == 0 or 1e-6 <= magnitude < 1e21:
        return len(format(Decimal(repr(value)).normalize(), "f"))
    text = repr(value)  # the shortest digits with an exponent, as Go's 'e' format writes them
    return len(text) - (1 if re.search(r"e-0\d$", text) else 0)  # Go writes e-7 where Python writes e-07


def device_key(entry: Mapping[str, Any]) -> DeviceKey:
    share = entry.get("shareID")
    return (str(entry.get("driver") or ""), str(entry.get("pool") or ""), str(entry.get("device") or ""),
            share if isinstance(share, str) and share else None)


def _shown(key: DeviceKey) -> str:
    """A key as the server prints a SharedDeviceID: driver/pool/device[/shareID]."""
    return "/".join(part for part in key if part is not None)


def allocated_keys(claim_status: Mapping[str, Any]) -> set[DeviceKey]:
    """The keys of the devices in a claim status's allocation results."""
    allocation = claim_status.get("allocation")
    devices = allocation.get("devices") if isinstance(allocation, Mapping) else None
    results = devices.get("results") if isinstance(devices, Mapping) else None
    return {device_key(r) for r in results or () if isinstance(r, Mapping)}


def unreadable_time(claim_status: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first condition time of `status.devices` the server cannot read (it refuses the request before
    validating it), and the layout it reads it with; None when it reads every one."""
    devices = claim_status.get("devices")
    for entry in devices if isinstance(devices, list) else ():
        conditions = entry.get("conditions") if isinstance(entry, Mapping) else None
        for condition in conditions if isinstance(conditions, list) else ():
            when = condition.get("lastTransitionTime") if isinstance(condition, Mapping) else None
            if when is not None and not is_rfc3339(when):
                return json.dumps(when), TIME_LAYOUT
    return None


def claim_status_errors(claim_status: Mapping[str, Any]) -> list[str]:
    """Every error of `status.devices` in a claim's status (the allocation in the same status)."""
    devices = claim_status.get("devices")
    errors = FieldErrors()
    if devices is None:
        return errors
    if not isinstance(devices, list):
        errors.invalid("status.devices", devices, "must be a list")
        return errors
    allocated = allocated_keys(claim_status)
    for i, entry in enumerate(devices):
        path = f"status.devices[{i}]"
        if not isinstance(entry, Mapping):
            errors.invalid(path, entry, "must be an object")
            continue
        _entry_errors(entry, path, allocated, errors)
    seen: set[DeviceKey] = set()
    for i, entry in enumerate(devices):
        if not isinstance(entry, Mapping):
            continue
        if (key := device_key(entry)) in seen:
            errors.duplicate(f"status.devices[{i}]", _shown(key))
        seen.add(key)
    return errors


def device_status_errors(entry: Mapping[str, Any], path: str = "status.devices[0]") -> list[str]:
    """The errors of one `status.devices` entry on its own (not whether its device is allocated), a condition
    time the server cannot read among them."""
    errors = FieldErrors()
    _entry_errors(entry, path, None, errors)
    conditions = entry.get("conditions")
    for i, condition in enumerate(conditions if isinstance(conditions, list) else ()):
        when = condition.get("lastTransitionTime") if isinstance(condition, Mapping) else None
        if when is not None and not is_rfc3339(when):
            errors.invalid(f"{path}.conditions[{i}].lastTransitionTime", when,
                           "must be an RFC 3339 time such as 2026-01-02T15:04:05Z")
    return errors


def _entry_errors(entry: Mapping[str, Any], path: str, allocated: set[DeviceKey] | None,
                  errors: FieldErrors) -> None:
    _driver(entry.get("driver"), f"{path}.driver", errors)
    _pool(entry.get("pool"), f"{path}.pool", errors)
    device = entry.get("device")
    if not device:
        errors.required(f"{path}.device")
    elif not is_dns_label(device):
        errors.invalid(f"{path}.device", device, SERVER_DNS_LABEL_MSG)
    share = entry.get("shareID")
    if share is not None and not is_uid(share):
        errors.invalid(f"{path}.shareID", share, "must be a lowercase UUID in 8-4-4-4-12 hex format")
    if allocated is not None and (key := device_key(entry)) not in allocated:
        errors.invalid(path, _shown(key), "must be an allocated device in the claim")
    _conditions(entry.get("conditions"), f"{path}.conditions", errors)
    if entry.get("data") is not None:
        _data(entry["data"], f"{path}.data", errors)
    network = entry.get("networkData")
    if network is not None:
        _network(network, f"{path}.networkData", errors)


def _driver(driver: Any, path: str, errors: FieldErrors) -> None:
    if not driver:
        errors.required(path)
        return
    if not isinstance(driver, str):
        errors.invalid(path, driver, "must be a string")
        return
    if len(driver.encode()) > MAX_DRIVER_NAME:
        errors.too_long(path, MAX_DRIVER_NAME)
    # Checked lower-cased, as Go lower-cases (U+0130 to a plain 'i'): upper case is allowed.
    if not is_dns_subdomain(driver.replace("\u0130", "i").lower()):
        errors.invalid(path, driver, SERVER_SUBDOMAIN_MSG)


def _pool(pool: Any, path: str, errors: FieldErrors) -> None:
    if not pool:
        errors.required(path)
        return
    if not isinstance(pool, str):
        errors.invalid(path, pool, "must be a string")
        return
    if len(pool) > MAX_POOL_NAME:
        errors.too_long(path, MAX_POOL_NAME)
    for part in pool.split("/"):
        if not is_dns_subdomain(part):
            errors.invalid(path, part, SERVER_SUBDOMAIN_MSG)


def _conditions(conditions: Any, path: str, errors: FieldErrors) -> None:
    if conditions is None:
        return
    if not isinstance(conditions, list):
        errors.invalid(path, conditions, "must be a list")
        return
    if len(conditions) > MAX_CONDITIONS:
        errors.too_many(path, len(conditions), MAX_CONDITIONS)
    types: set[str] = set()
    for i, condition in enumerate(conditions):
        at = f"{path}[{i}]"
        if not isinstance(condition, Mapping):
            errors.invalid(at, condition, "must be an object")
            continue
        kind = str(condition.get("type") or "")
        if kind in types:
            errors.duplicate(at, kind)
        types.add(kind)
        _condition(condition, at, errors)


def _condition(condition: Mapping[str, Any], at: str, errors: FieldErrors) -> None:
    kind = condition.get("type")
    if not kind:
        errors.required(f"{at}.type", "is required")
    elif not is_label_key(kind):
        errors.invalid(f"{at}.type", kind, SERVER_NAME_PART_MSG)
    status = condition.get("status")
    if not status:
        errors.required(f"{at}.status")
    elif status not in CONDITION_STATUSES:
        errors.unsupported(f"{at}.status", status, CONDITION_STATUSES)
    generation = condition.get("observedGeneration")
    if isinstance(generation, int) and generation < 0:
        errors.invalid(f"{at}.observedGeneration", generation, "must be greater than or equal to zero")
    if condition.get("lastTransitionTime") is None:
        errors.required(f"{at}.lastTransitionTime")
    reason = condition.get("reason")
    if not reason:
        errors.required(f"{at}.reason")
    else:
        if not is_condition_reason(reason):
            errors.invalid(f"{at}.reason", reason, SERVER_CONDITION_REASON_MSG)
        if len(str(reason).encode()) > MAX_REASON:
            errors.too_long(f"{at}.reason", MAX_REASON)
    message = condition.get("message")
    if isinstance(message, str) and len(message.encode()) > MAX_MESSAGE:
        errors.too_long(f"{at}.message", MAX_MESSAGE)


def _data(data: Any, path: str, errors: FieldErrors) -> None:
    if json_size(data) > DATA_MAX_BYTES:
        errors.too_long(path, DATA_MAX_BYTES)
    elif not isinstance(data, Mapping):
        errors.add(path, 'Invalid value: "<value omitted>": must be valid JSON object')


def _network(network: Any, path: str, errors: FieldErrors) -> None:
    if not isinstance(network, Mapping):
        errors.invalid(path, network, "must be an object")
        return
    for field, limit in (("interfaceName", MAX_INTERFACE_NAME), ("hardwareAddress", MAX_HARDWARE_ADDRESS)):
        value = network.get(field)
        if value is not None and not isinstance(value, str):
            errors.invalid(f"{path}.{field}", value, "must be a string")
        elif isinstance(value, str) and len(value.encode()) > limit:
            errors.too_long(f"{path}.{field}", limit)
    ips = network.get("ips")
    if ips is None:
        return
    if not isinstance(ips, list):
        errors.invalid(f"{path}.ips", ips, "must be a list")
        return
    if len(ips) > MAX_IPS:  # the server says so and checks none of them
        errors.too_many(f"{path}.ips", len(ips), MAX_IPS)
        return
    for i, ip in enumerate(ips):
        _interface_address(ip, f"{path}.ips[{i}]", errors)
    seen: set[str] = set()
    for i, ip in enumerate(ips):
        if str(ip) in seen:
            errors.duplicate(f"{path}.ips[{i}]", ip)
        seen.add(str(ip))


def canonical_interface_address(value: str) -> str | None:
    """The canonical form of an interface address in CIDR form (`192.0.2.5/24`, `2001:db8::5/64`): the address
    as Go prints it (IPv4-mapped IPv6 as IPv4) and the prefix length; None when it is not one."""
    if "/" not in value or "%" in value:
        return None
    address, _, bits = value.partition("/")
    if not bits.isdigit():
        return None
    try:
        interface = ipaddress.ip_interface(f"{address}/{int(bits)}")
    except ValueError:
        return None
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address = interface.ip
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"{ip.compressed}/{interface.network.prefixlen}"


def _interface_address(value: Any, at: str, errors: FieldErrors) -> None:
    canonical = canonical_interface_address(value) if isinstance(value, str) else None
    if canonical is None:
        errors.invalid(at, value, _CIDR_MSG)
    elif canonical != value:
        errors.invalid(at, value, f"must be in canonical form ({shown_as_server(canonical)})")
