"""The API server's rules for a ResourceClaim's `status.devices` (KEP-4817 `AllocatedDeviceStatus`).

Objects are JSON-shaped, with the wire's camelCase keys. Every error is a string `"<json path>: <message>"` worded
as the real server words it (`validateDeviceStatus`, `validateNetworkDeviceData`, metav1 `ValidateConditions` in
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

from agent.kube.names import is_dns_label, is_dns_subdomain, is_label_key
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

_UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_REASON = re.compile(r"[A-Za-z](?:[A-Za-z0-9_,:]*[A-Za-z0-9_])?")
_REASON_MSG = ("a condition reason must start with alphabetic character, optionally followed by a string of "
               "alphanumeric characters or '_,:', and must end with an alphanumeric character or '_'")
_LABEL_MSG = ("name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
              "alphanumeric character")
_DNS_LABEL_MSG = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must "
                  "start and end with an alphanumeric character")
_SUBDOMAIN_MSG = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
                  "and must start and end with an alphanumeric character")
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
    if devices is None:
        return []
    if not isinstance(devices, list):
        return [f"status.devices: Invalid value: {_json(devices)}: must be a list"]
    allocated = allocated_keys(claim_status)
    errors: list[str] = []
    for i, entry in enumerate(devices):
        path = f"status.devices[{i}]"
        if not isinstance(entry, Mapping):
            errors.append(f"{path}: Invalid value: {_json(entry)}: must be an object")
            continue
        errors += _entry_errors(entry, path, allocated)
    seen: set[DeviceKey] = set()
    for i, entry in enumerate(devices):
        if not isinstance(entry, Mapping):
            continue
        if (key := device_key(entry)) in seen:
            errors.append(f"status.devices[{i}]: Duplicate value: {_json(_shown(key))}")
        seen.add(key)
    return errors


def device_status_errors(entry: Mapping[str, Any], path: str = "status.devices[0]") -> list[str]:
    """The errors of one `status.devices` entry on its own (not whether its device is allocated), a condition
    time the server cannot read among them."""
    errors = _entry_errors(entry, path, None)
    conditions = entry.get("conditions")
    for i, condition in enumerate(conditions if isinstance(conditions, list) else ()):
        when = condition.get("lastTransitionTime") if isinstance(condition, Mapping) else None
        if when is not None and not is_rfc3339(when):
            errors.append(f"{path}.conditions[{i}].lastTransitionTime: Invalid value: {_json(when)}: must be an "
                          "RFC 3339 time such as 2026-01-02T15:04:05Z")
    return errors


def _entry_errors(entry: Mapping[str, Any], path: str, allocated: set[DeviceKey] | None) -> list[str]:
    errors = _driver(entry.get("driver"), f"{path}.driver") + _pool(entry.get("pool"), f"{path}.pool")
    device = entry.get("device")
    if not device:
        errors.append(f"{path}.device: Required value")
    elif not is_dns_label(device):
        errors.append(f"{path}.device: Invalid value: {_json(device)}: {_DNS_LABEL_MSG}")
    share = entry.get("shareID")
    if share is not None and not (isinstance(share, str) and _UID.fullmatch(share)):
        errors.append(f"{path}.shareID: Invalid value: {_json(share)}: must be a lowercase UUID in 8-4-4-4-12 "
                      "hex format")
    if allocated is not None and (key := device_key(entry)) not in allocated:
        errors.append(f"{path}: Invalid value: {_json(_shown(key))}: must be an allocated device in the claim")
    errors += _conditions(entry.get("conditions"), f"{path}.conditions")
    if entry.get("data") is not None:
        errors += _data(entry["data"], f"{path}.data")
    network = entry.get("networkData")
    if network is not None:
        errors += _network(network, f"{path}.networkData")
    return errors


def _driver(driver: Any, path: str) -> list[str]:
    if not driver:
        return [f"{path}: Required value"]
    if not isinstance(driver, str):
        return [f"{path}: Invalid value: {_json(driver)}: must be a string"]
    errors = [f"{path}: Too long: may not be more than {MAX_DRIVER_NAME} bytes"] \
        if len(driver.encode()) > MAX_DRIVER_NAME else []
    # Checked lower-cased, as Go lower-cases (U+0130 to a plain 'i'): upper case is allowed.
    if not is_dns_subdomain(driver.replace("\u0130", "i").lower()):
        errors.append(f"{path}: Invalid value: {_json(driver)}: {_SUBDOMAIN_MSG}")
    return errors
def _pool(pool: Any, path: str) -> list[str]:
    if not pool:
        return [f"{path}: Required value"]
    if not isinstance(pool, str):
        return [f"{path}: Invalid value: {_json(pool)}: must be a string"]
    errors = [f"{path}: Too long: may not be more than {MAX_POOL_NAME} bytes"] if len(pool) > MAX_POOL_NAME else []
    return errors + [f"{path}: Invalid value: {_json(part)}: {_SUBDOMAIN_MSG}"
                     for part in pool.split("/") if not is_dns_subdomain(part)]


def _conditions(conditions: Any, path: str) -> list[str]:
    if conditions is None:
        return []
    if not isinstance(conditions, list):
        return [f"{path}: Invalid value: {_json(conditions)}: must be a list"]
    errors = [f"{path}: Too many: {len(conditions)}: must have at most {MAX_CONDITIONS} items"] \
        if len(conditions) > MAX_CONDITIONS else []
    types: set[str] = set()
    for i, condition in enumerate(conditions):
        at = f"{path}[{i}]"
        if not isinstance(condition, Mapping):
            errors.append(f"{at}: Invalid value: {_json(condition)}: must be an object")
            continue
        kind = str(condition.get("type") or "")
        if kind in types:
            errors.append(f"{at}: Duplicate value: {_json(kind)}")
        types.add(kind)
        errors += _condition(condition, at)
    return errors


def _condition(condition: Mapping[str, Any], at: str) -> list[str]:
    errors: list[str] = []
    kind = condition.get("type")
    if not kind:
        errors.append(f"{at}.type: Required value: is required")
    elif not is_label_key(kind):
        errors.append(f"{at}.type: Invalid value: {_json(kind)}: {_LABEL_MSG}")
    status = condition.get("status")
    if not status:
        errors.append(f"{at}.status: Required value")
    elif status not in CONDITION_STATUSES:
        supported = ", ".join(_json(s) for s in CONDITION_STATUSES)
        errors.append(f"{at}.status: Unsupported value: {_json(status)}: supported values: {supported}")
    generation = condition.get("observedGeneration")
    if isinstance(generation, int) and generation < 0:
        errors.append(f"{at}.observedGeneration: Invalid value: {generation}: must be greater than or equal to zero")
    if condition.get("lastTransitionTime") is None:
        errors.append(f"{at}.lastTransitionTime: Required value")
    reason = condition.get("reason")
    if not reason:
        errors.append(f"{at}.reason: Required value")
    else:
        if not isinstance(reason, str) or not _REASON.fullmatch(reason):
            errors.append(f"{at}.reason: Invalid value: {_json(reason)}: {_REASON_MSG}")
        if len(str(reason).encode()) > MAX_REASON:
            errors.append(f"{at}.reason: Too long: may not be more than {MAX_REASON} bytes")
    message = condition.get("message")
    if isinstance(message, str) and len(message.encode()) > MAX_MESSAGE:
        errors.append(f"{at}.message: Too long: may not be more than {MAX_MESSAGE} bytes")
    return errors


def _data(data: Any, path: str) -> list[str]:
    if json_size(data) > DATA_MAX_BYTES:
        return [f"{path}: Too long: may not be more than {DATA_MAX_BYTES} bytes"]
    if not isinstance(data, Mapping):
        return [f'{path}: Invalid value: "<value omitted>": must be valid JSON object']
    return []


def _network(network: Any, path: str) -> list[str]:
    if not isinstance(network, Mapping):
        return [f"{path}: Invalid value: {_json(network)}: must be an object"]
    errors: list[str] = []
    for field, limit in (("interfaceName", MAX_INTERFACE_NAME), ("hardwareAddress", MAX_HARDWARE_ADDRESS)):
        value = network.get(field)
        if value is not None and not isinstance(value, str):
            errors.append(f"{path}.{field}: Invalid value: {_json(value)}: must be a string")
        elif isinstance(value, str) and len(value.encode()) > limit:
            errors.append(f"{path}.{field}: Too long: may not be more than {limit} bytes")
    ips = network.get("ips")
    if ips is None:
        return errors
    if not isinstance(ips, list):
        return [*errors, f"{path}.ips: Invalid value: {_json(ips)}: must be a list"]
    if len(ips) > MAX_IPS:  # the server says so and checks none of them
        return [*errors, f"{path}.ips: Too many: {len(ips)}: must have at most {MAX_IPS} items"]
    seen: set[str] = set()
    for i, ip in enumerate(ips):
        errors += _interface_address(ip, f"{path}.ips[{i}]")
    for i, ip in enumerate(ips):
        if str(ip) in seen:
            errors.append(f"{path}.ips[{i}]: Duplicate value: {_json(ip)}")
        seen.add(str(ip))
    return errors


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


def _interface_address(value: Any, at: str) -> list[str]:
    canonical = canonical_interface_address(value) if isinstance(value, str) else None
    if canonical is None:
        return [f"{at}: Invalid value: {_json(value)}: {_CIDR_MSG}"]
    if canonical != value:
        return [f"{at}: Invalid value: {_json(value)}: must be in canonical form ({_json(canonical)})"]
    return []


def _json(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 200 else text[:197] + "..."

