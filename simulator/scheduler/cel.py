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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import celpy
import lark
from celpy import celtypes
from celpy.celparser import CELParseError
from celpy.evaluation import CELEvalError, base_functions

from agent.kube.quantity import parse_quantity
from simulator.scheduler.cel_library import LIBRARY, Quantity, Semver, Value

__all__ = ["CelError", "Quantity", "Selector", "Semver", "compile_selector", "device_value"]


class CelError(Exception):
    """A selector expression this environment cannot compile, or whose evaluation failed."""

    def __init__(self, expression: str, problem: str) -> None:
        super().__init__(f"CEL expression {expression!r}: {problem}")
        self.expression, self.problem = expression, problem


_MACROS = frozenset({"has", "all", "exists", "exists_one", "map", "filter"})
_KNOWN_FUNCTIONS = frozenset(base_functions) | frozenset(LIBRARY) | _MACROS
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
    return Selector(expression, _ENV.program(ast, functions=LIBRARY))
