"""CEL for device selectors, as Kubernetes evaluates them (``k8s.io/dynamic-resource-allocation/cel``).

The variable ``device`` has ``driver``, ``allowMultipleAllocations``, ``attributes`` (domain -> name ->
int/bool/string/semver) and ``capacity`` (domain -> name -> quantity). A name without a domain belongs to the
driver's domain. Reading a domain the device has nothing in gives an empty map (as upstream); reading a missing
name in it is a runtime error. On top of the CEL standard library (cel-python), the Kubernetes quantity and
semver libraries: ``quantity()``, ``isQuantity()``, ``semver()``, ``isSemver()`` and their methods.

Expressions are compiled once (cached) and checked for functions and variables this environment does not have,
so an unsupported expression fails with a :class:`CelError` naming it instead of failing on every device.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import celpy
import lark
from celpy import celtypes
from celpy.celparser import CELParseError
from celpy.evaluation import CELEvalError, base_functions

from agent.quantity import format_quantity, parse_quantity

__all__ = ["CelError", "Quantity", "Selector", "Semver", "compile_selector", "device_value"]


class CelError(Exception):
    """A selector expression this environment cannot compile, or whose evaluation failed."""

    def __init__(self, expression: str, problem: str) -> None:
        super().__init__(f"CEL expression {expression!r}: {problem}")
        self.expression, self.problem = expression, problem


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


# --- the library's functions ----------------------------------------------------------------------------

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


_LIBRARY: dict[str, Callable[..., Any]] = {
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
_MACROS = frozenset({"has", "all", "exists", "exists_one", "map", "filter"})
_KNOWN_FUNCTIONS = frozenset(base_functions) | frozenset(_LIBRARY) | _MACROS
_BINDING_MACROS = frozenset({"all", "exists", "exists_one", "map", "filter"})
_VARIABLES = frozenset({"device"}) | frozenset(base_functions)  # type names (int, string...) are identifiers too


# --- the device variable ----------------------------------------------------------------------------------


class _Domains(celtypes.MapType):
    """The outer attributes/capacity map: a domain the device has nothing in reads as an empty map."""

    def __missing__(self, key: Any) -> celtypes.MapType:
        return celtypes.MapType()


def _attribute(value: Mapping[str, Any]) -> Value:
    if "int" in value:
        return celtypes.IntType(value["int"])
    if "bool" in value:
        return celtypes.BoolType(value["bool"])
    if "string" in value:
        return celtypes.StringType(value["string"])
    if "version" in value:
        return Semver.parse(value["version"])
    raise ValueError(f"unsupported attribute value {dict(value)!r}")


def _split(name: str, driver: str) -> tuple[str, str]:
    domain, sep, ident = name.rpartition("/")
    return (domain, ident) if sep else (driver, name)


def device_value(device: Mapping[str, Any], driver: str) -> celtypes.MapType:
    """The ``device`` variable for one ``spec.devices[]`` entry of a slice of ``driver``.

    Raises ``ValueError`` for an attribute or capacity value that cannot be read (as Kubernetes, which then
    fails the whole evaluation)."""
    attributes: dict[str, dict[Any, Any]] = {}
    for name, value in (device.get("attributes") or {}).items():
        domain, ident = _split(name, driver)
        try:
            attributes.setdefault(domain, {})[celtypes.StringType(ident)] = _attribute(value)
        except (ValueError, TypeError) as e:
            raise ValueError(f"attribute {name}: {e}") from None
    capacity: dict[str, dict[Any, Any]] = {}
    for name, value in (device.get("capacity") or {}).items():
        domain, ident = _split(name, driver)
        try:
            capacity.setdefault(domain, {})[celtypes.StringType(ident)] = Quantity(parse_quantity(value["value"]),
                                                                                   value["value"])
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"capacity {name}: {e}") from None
    return celtypes.MapType({
        celtypes.StringType("driver"): celtypes.StringType(driver),
        celtypes.StringType("allowMultipleAllocations"):
            celtypes.BoolType(bool(device.get("allowMultipleAllocations"))),
        celtypes.StringType("attributes"): _Domains({celtypes.StringType(d): celtypes.MapType(m)
                                                     for d, m in attributes.items()}),
        celtypes.StringType("capacity"): _Domains({celtypes.StringType(d): celtypes.MapType(m)
                                                   for d, m in capacity.items()}),
    })  # fmt: skip


# --- compiling and evaluating -----------------------------------------------------------------------------

_ENV = celpy.Environment(runner_class=celpy.InterpretedRunner)


def _walk(tree: lark.Tree[Any]) -> Iterator[lark.Tree[Any]]:
    yield tree
    for child in tree.children:
        if isinstance(child, lark.Tree):
            yield from _walk(child)


def _ident(tree: lark.Tree[Any]) -> str | None:
    """The name if ``tree`` is a bare identifier (possibly wrapped in expression levels)."""
    while isinstance(tree, lark.Tree):
        if tree.data == "ident":
            return str(tree.children[0])
        if len(tree.children) != 1:
            return None
        tree = tree.children[0]
    return None


def _check(expression: str, ast: lark.Tree[Any]) -> None:
    """Refuse what evaluation would only report on each device: unknown functions and variables."""
    bound: set[str] = set()
    for node in _walk(ast):
        if node.data == "member_dot_arg" and str(node.children[1]) in _BINDING_MACROS and len(node.children) > 2:
            exprlist = node.children[2]
            if isinstance(exprlist, lark.Tree) and exprlist.children:
                name = _ident(exprlist.children[0])
                if name:
                    bound.add(name)
    for node in _walk(ast):
        if node.data == "member_dot_arg" and _ident(node.children[0]) == "cel":
            raise CelError(expression, f"cel.{node.children[1]}() is not supported (no CEL bindings extension)")
        if node.data in ("ident_arg", "member_dot_arg", "dot_ident_arg"):
            name = str(node.children[1] if node.data == "member_dot_arg" else node.children[0])
            if name not in _KNOWN_FUNCTIONS:
                raise CelError(expression, f"function {name}() is not supported")
        elif node.data == "ident":
            name = str(node.children[0])
            if name not in _VARIABLES and name not in bound:
                raise CelError(expression, f"undeclared variable {name!r}: only 'device' is defined")


@dataclass(frozen=True)
class Selector:
    """One compiled selector expression."""

    expression: str
    _program: celpy.Runner

    def matches(self, device: celtypes.MapType) -> bool:
        """Whether the device (from :func:`device_value`) matches; ``CelError`` for a runtime error or a
        result that is not a bool."""
        try:
            result = self._program.evaluate({"device": device})
        except CELEvalError as e:
            raise CelError(self.expression, _describe(e)) from None
        except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError) as e:
            raise CelError(self.expression, f"{type(e).__name__}: {e}") from None
        if not isinstance(result, celtypes.BoolType):
            kind, shown = type(result).__name__.removesuffix("Type").lower(), str(result)
            raise CelError(self.expression, f"must evaluate to bool, not {kind} ({shown})")
        return bool(result)


def _describe(error: CELEvalError) -> str:
    """celpy's error, in words: ``no such key: 'memory'``, ``no such overload: ...``."""
    args = error.args
    message = str(args[0]) if args else "evaluation error"
    detail = args[2][0] if len(args) > 2 and args[2] else None
    if isinstance(detail, CELEvalError):
        return _describe(detail)
    if len(args) > 1 and args[1] is TypeError and detail is not None:
        return f"no such overload: {detail}"
    message = message.replace("no such member in mapping", "no such key")
    if detail is not None and repr(str(detail)) not in message:
        message = f"{message}: {str(detail)!r}"
    return message


@functools.lru_cache(maxsize=1024)
def compile_selector(expression: str) -> Selector:
    """Compile ``expression`` once (cached); ``CelError`` when it does not parse or uses what is not here."""
    if not isinstance(expression, str) or not expression.strip():
        raise CelError(str(expression), "empty expression")
    try:
        ast = _ENV.compile(expression)
    except CELParseError as e:
        where = f" at line {e.line}, column {e.column}" if e.line is not None else ""
        raise CelError(expression, f"syntax error{where}") from None
    _check(expression, ast)
    return Selector(expression, _ENV.program(ast, functions=_LIBRARY))
