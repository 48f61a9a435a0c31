"""Shared plumbing of the ResourceSlice rule modules: tolerant field access.

Objects are JSON-shaped mappings with camelCase keys, as on the wire. Every error is a string
``"<field path>: <message>"`` collected in agent/kube/field_errors.py's `FieldErrors`, the path written as the API
server writes it (``spec.devices[0].attributes[model]``: list indices and map keys in brackets, keys unquoted). The
helpers here build those paths, read fields without trusting their types, and report a field of the wrong type as an
error instead of raising.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any, TypeGuard

from agent.kube.field_errors import FieldErrors, show
from agent.kube.quantity import parse_quantity
from agent.kube.times import is_rfc3339  # a taint's timeAdded is read as every other Time is

__all__ = [
    "FieldErrors",
    "as_list",
    "as_map",
    "as_quantity",
    "is_int64",
    "is_rfc3339",
    "key_path",
    "lookup",
    "show",
]

def key_path(path: str, key: Any, limit: int | None = None) -> str:
    """The path of the entry ``key`` of the map at ``path``. A key of more than ``limit`` bytes is cut in the middle
    to ``<start>...<end>`` of ``limit`` bytes, as the server cuts the keys of attributes, capacities and counters
    (at least 16 bytes are kept; a cut inside a UTF-8 character leaves a replacement character, as there)."""
    text = str(key)
    if limit is not None and len(raw := text.encode()) > (limit := max(limit, 16)):
        keep = limit - 3
        text = (raw[: (keep + 1) // 2] + b"..." + raw[len(raw) - keep // 2 :]).decode(errors="replace")
    return f"{path}[{text}]"


def lookup(obj: Any, *keys: str) -> Any:
    for key in keys:
        obj = obj.get(key) if type(obj) is dict or isinstance(obj, Mapping) else None
    return obj


def is_int64(value: object) -> TypeGuard[int]:
    """A number the server reads as a 64-bit integer: not a float, not even 2.0 (JSON ``2.0``), which it refuses."""
    return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63


def as_map(value: Any, path: str, errs: FieldErrors) -> Mapping[str, Any]:
    """``value`` if it is an object; absent counts as empty, any other type is an error."""
    if value is None or type(value) is dict or isinstance(value, Mapping):  # dict first: the abc check is slow
        return value or {}
    errs.add(path, f"must be an object, got {show(value)}")
    return {}


def as_list(value: Any, path: str, errs: FieldErrors) -> Sequence[Any]:
    if value is None or isinstance(value, list | tuple):
        return value or ()
    errs.add(path, f"must be a list, got {show(value)}")
    return ()


def as_quantity(value: Any, path: str, errs: FieldErrors) -> Fraction | None:
    if value is None:
        errs.add(path, "is required (a quantity such as 8, 40Gi or 500m)")
        return None
    # The server's JSON decoder also takes bare numbers and trims surrounding whitespace.
    text = str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value
    try:
        return parse_quantity(text.strip() if isinstance(text, str) else text)
    except (TypeError, ValueError):
        errs.add(path, f"must be a quantity such as 8, 40Gi or 500m, got {show(value)}")
        return None
