"""The Kubernetes CEL libraries device selectors use: quantities (``quantity("80Gi")`` and its methods) and
semantic versions (``semver("1.2.3")``, version attributes), as values and as the functions CEL calls.

Methods are plain functions taking the receiver first (cel-python calls ``x.f(y)`` as ``f(x, y)``); one that gets
a value of a wrong type returns a CEL error naming the overload, as Kubernetes reports it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from celpy import celtypes
from celpy.evaluation import CELEvalError

from agent.kube.quantity import format_quantity, parse_quantity

__all__ = ["LIBRARY", "Quantity", "Semver", "Value"]


class Quantity:
    """A Kubernetes ``resource.Quantity`` as a CEL value: equal by value, ordered only through its methods
    (``<`` is no overload, as in Kubernetes)."""

    def __init__(self, value: Fraction, text: str | None = None) -> None:
        self.value, self.text = value, text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Quantity) and self.value == other.value

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return f"quantity({self.text or _text(self.value)!r})"


def _text(value: Fraction) -> str:
    if value.denominator == 1 and value >= 0:
        return format_quantity(int(value))
    return str(float(value))


_SEMVER = re.compile(
    r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*)(?:\.(?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*))*))?"
    r"(?:\+([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?",
    re.ASCII,
)


@dataclass(frozen=True)
class Semver:
    """A strict semantic version (2.0.0) as a CEL value; build metadata does not count in comparisons."""

    major: int
    minor: int
    patch: int
    pre: tuple[int | str, ...] = ()
    text: str = ""

    @classmethod
    def parse(cls, text: str) -> Semver:
        match = _SEMVER.fullmatch(text)
        if match is None:
            raise ValueError(f"invalid semantic version {text!r}: expected MAJOR.MINOR.PATCH[-PRE][+BUILD]")
        pre = tuple(int(p) if p.isdigit() else p for p in match[4].split(".")) if match[4] else ()
        return cls(int(match[1]), int(match[2]), int(match[3]), pre, text)

    def compare(self, other: Semver) -> int:
        mine, theirs = (self.major, self.minor, self.patch), (other.major, other.minor, other.patch)
        if mine != theirs:
            return -1 if mine < theirs else 1
        if self.pre == other.pre:
            return 0
        if not self.pre or not other.pre:  # a pre-release ranks below its release
            return 1 if not self.pre else -1
        for a, b in zip(self.pre, other.pre, strict=False):
            if a != b:
                if isinstance(a, int) != isinstance(b, int):  # numeric identifiers rank below text
                    return -1 if isinstance(a, int) else 1
                return -1 if a < b else 1  # type: ignore[operator]  # same type here
        return -1 if len(self.pre) < len(other.pre) else 1

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Semver) and self.compare(other) == 0

    def __hash__(self) -> int:
        return hash((self.major, self.minor, self.patch, self.pre))

    def __repr__(self) -> str:
        return f"semver({self.text!r})"


# --- the functions ---------------------------------------------------------------------------------------

Value = Any  # a celpy value, or our Quantity / Semver


def _error(message: str) -> CELEvalError:
    return CELEvalError(message)


def _quantity(text: Value) -> Value:
    try:
        return Quantity(parse_quantity(str(text)), str(text))
    except ValueError as e:
        return _error(f"quantity: {e}")


def _is_quantity(text: Value) -> Value:
    try:
        parse_quantity(str(text))
    except ValueError:
        return celtypes.BoolType(False)
    return celtypes.BoolType(True)


_LOOSE_VERSION = re.compile(r"v?(\d+)(?:\.(\d+))?(?:\.(\d+))?(.*)", re.ASCII | re.DOTALL)


def _semver(text: Value, normalize: Value = False) -> Value:
    source = str(text)
    loose = _LOOSE_VERSION.fullmatch(source) if normalize else None
    if loose:  # as Kubernetes' normalize: no "v", leading zeros dropped, missing minor and patch added
        source = f"{int(loose[1])}.{int(loose[2] or 0)}.{int(loose[3] or 0)}{loose[4]}"
    try:
        return Semver.parse(source)
    except ValueError as e:
        return _error(f"semver: {e}")


def _is_semver(text: Value, normalize: Value = False) -> Value:
    return celtypes.BoolType(not isinstance(_semver(text, normalize), CELEvalError))


def _number(value: Value) -> Fraction | None:
    if isinstance(value, Quantity):
        return value.value
    if isinstance(value, int) and not isinstance(value, bool):
        return Fraction(value)
    return None


def _compare(a: Value, b: Value) -> int | None:
    if isinstance(a, Semver) and isinstance(b, Semver):
        return a.compare(b)
    if isinstance(a, Quantity) and isinstance(b, Quantity):
        return (a.value > b.value) - (a.value < b.value)
    return None


def _method(name: str, body: Callable[..., Any]) -> Callable[..., Value]:
    """A library method: returns a CEL error naming the method when the receiver or argument is of a wrong type."""

    def call(*args: Value) -> Value:
        result = body(*args)
        if result is None:
            kinds = ", ".join(type(a).__name__.removesuffix("Type").lower() for a in args)
            return _error(f"no such overload: {name}({kinds})")
        return result

    return call


def _arith(sign: int) -> Callable[[Value, Value], Value]:
    def apply(a: Value, b: Value) -> Value:
        left, right = (_number(a) if isinstance(a, Quantity) else None), _number(b)
        return None if left is None or right is None else Quantity(left + sign * right)

    return apply


def _as_integer(q: Value) -> Value:
    if not isinstance(q, Quantity):
        return None
    if q.value.denominator != 1 or not -(2**63) <= q.value < 2**63:
        return _error(f"asInteger: {q!r} is not an int64")
    return celtypes.IntType(int(q.value))


def _part(field: str) -> Callable[[Value], Value]:
    return lambda v: celtypes.IntType(getattr(v, field)) if isinstance(v, Semver) else None


def _cmp_bool(test: Callable[[int], bool]) -> Callable[[Value, Value], Value]:
    def apply(a: Value, b: Value) -> Value:
        result = _compare(a, b)
        return None if result is None else celtypes.BoolType(test(result))

    return apply


LIBRARY: dict[str, Callable[..., Any]] = {
    "quantity": _quantity,
    "isQuantity": _is_quantity,
    "semver": _semver,
    "isSemver": _is_semver,
    "compareTo": _method("compareTo", lambda a, b: None if (r := _compare(a, b)) is None else celtypes.IntType(r)),
    "isGreaterThan": _method("isGreaterThan", _cmp_bool(lambda r: r > 0)),
    "isLessThan": _method("isLessThan", _cmp_bool(lambda r: r < 0)),
    "add": _method("add", _arith(1)),
    "sub": _method("sub", _arith(-1)),
    "sign": _method("sign", lambda q: celtypes.IntType((q.value > 0) - (q.value < 0))
                    if isinstance(q, Quantity) else None),
    "isInteger": _method("isInteger", lambda q: celtypes.BoolType(q.value.denominator == 1)
                         if isinstance(q, Quantity) else None),
    "asInteger": _method("asInteger", _as_integer),
    "asApproximateFloat": _method("asApproximateFloat", lambda q: celtypes.DoubleType(float(q.value))
                                  if isinstance(q, Quantity) else None),
    "major": _method("major", _part("major")),
    "minor": _method("minor", _part("minor")),
    "patch": _method("patch", _part("patch")),
}  # fmt: skip
