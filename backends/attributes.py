"""The values a device attribute may take: booleans, integers, strings and versions (`Version`, strict semver).

Shared by the device model (`backends.contract`) and the PCI topology (`backends.topology`), which both publish
attributes; it depends on neither.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["AttributeValue", "Version", "attribute_from_json", "attribute_json", "is_semver"]

# Strict semantic versioning 2.0.0, the only form the API server accepts for version attributes.
_SEMVER = re.compile(
    r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*)(?:\.(?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*))*))?"
    r"(?:\+([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?"
)


def is_semver(text: str) -> bool:
    """Whether `text` is strict semantic versioning 2.0.0 (MAJOR.MINOR.PATCH[-pre][+build])."""
    return _SEMVER.fullmatch(text) is not None


@dataclass(frozen=True, order=True)
class Version:
    """A version attribute value; always valid strict semver."""

    text: str

    def __post_init__(self) -> None:
        if len(self.text) > 64 or not is_semver(self.text):
            raise ValueError(f"{self.text!r} is not a strict semantic version (MAJOR.MINOR.PATCH)")

    @classmethod
    def lenient(cls, raw: str) -> Version:
        """Turn a vendor version such as '580.95.05' or '12.4' into semver ('580.95.5', '12.4.0')."""
        parts = raw.strip().split(".")
        if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"cannot read {raw!r} as a version")
        numbers = [str(int(p)) for p in parts] + ["0"] * (3 - len(parts))
        return cls(".".join(numbers))

    def __str__(self) -> str:
        return self.text


AttributeValue = bool | int | str | Version


def attribute_json(value: AttributeValue) -> dict[str, Any]:
    """The API form of one attribute value (`{"string": ...}`, `{"int": ...}`, `{"bool": ...}`, `{"version": ...}`),
    as ResourceSlices and device metadata files carry it."""
    if isinstance(value, bool):  # before int: bool is an int in Python
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    if isinstance(value, Version):
        return {"version": value.text}
    return {"string": value}


def attribute_from_json(body: Mapping[str, Any]) -> AttributeValue:
    """The value of an attribute's API form; ValueError when it is not one."""
    if len(body) != 1:
        raise ValueError(f"an attribute value has exactly one of bool, int, string, version: {dict(body)!r}")
    ((kind, value),) = body.items()
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind == "string" and isinstance(value, str):
        return value
    if kind == "version" and isinstance(value, str):
        return Version(value)
    raise ValueError(f"not an attribute value: {dict(body)!r}")
