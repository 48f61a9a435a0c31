"""The JSON schema of an opaque configuration model (pydantic's `model_json_schema()`) turned into CEL checks.

Pure. Each `Check` is one rule about one field (`sharing.strategy` must be one of ...): a CEL condition over `p`,
one parameters object of the model's kind, that is true when the rule holds. Every check guards what it reads
(`has()`, `type()`), so it never fails on parameters of another shape: the check of the shape fails instead.

Only what both Kubernetes CEL (cel-go) and cel-python evaluate alike is used: no optional types (`.?`), no
comparison of values of different types (cel-go answers false, cel-python fails), regular expressions anchored
and written so that RE2 and Python read them alike. A schema keyword this module does not know is an error, so a
model cannot gain a rule the admission policy silently misses.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["Check", "SchemaError", "checks_for"]

# Keywords that say nothing about validity.
_DESCRIPTIVE = frozenset({"title", "description", "default", "examples", "$defs"})
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_RESERVED = frozenset({"in", "as", "break", "const", "continue", "else", "for", "function", "if", "import", "let",
                       "loop", "package", "namespace", "return", "var", "void", "while", "true", "false", "null"})


class SchemaError(ValueError):
    """A schema the admission policy cannot express."""


@dataclass(frozen=True)
class Check:
    """One rule: `condition` (CEL over `p`) holds for valid parameters. `field` is what the rule is about
    (`sharing.strategy`); `message` says what is wrong. `unknown` is set for the rule against unknown fields:
    the CEL of the object and of its known names, so the policy can name the first unknown one."""

    field: str
    condition: str
    message: str
    unknown: tuple[str, str] | None = None


def literal(value: Any) -> str:
    """A CEL literal of a JSON value (strings, numbers, booleans, lists of them)."""
    if isinstance(value, str):
        return json.dumps(value)  # CEL's double-quoted strings take JSON's escapes
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    raise SchemaError(f"no CEL literal for {value!r}")


def _shown(values: Sequence[Any]) -> str:
    return ", ".join(json.dumps(v, ensure_ascii=False) for v in values)


def checks_for(schema: Mapping[str, Any], skip: frozenset[str] = frozenset({"apiVersion", "kind"})) -> list[Check]:
    """The checks of a model's JSON schema, its top-level object being `p`. `skip`: top-level fields the policy
    checks elsewhere (the type's apiVersion and kind select the model)."""
    return _Compiler(schema.get("$defs", {})).object(schema, "p", "", 0, skip, typed=True)


def _guarded(guard: str, checks: list[Check]) -> list[Check]:
    """The checks, holding trivially where `guard` (a CEL condition) does not. A conditional, not `||`: only the
    branch taken is evaluated (cel-python evaluates both sides of `||`, and fails on a macro over null)."""
    return [replace(c, condition=f"({guard}) ? ({c.condition}) : true") for c in checks]


def _field(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


class _Compiler:
    def __init__(self, defs: Mapping[str, Any]) -> None:
        self.defs = defs

    def resolve(self, schema: Mapping[str, Any]) -> Mapping[str, Any]:
        ref = schema.get("$ref")
        if ref is None:
            return schema
        prefix = "#/$defs/"
        if not isinstance(ref, str) or not ref.startswith(prefix) or ref[len(prefix):] not in self.defs:
            raise SchemaError(f"unresolvable $ref {ref!r}")
        return self.resolve(self.defs[ref[len(prefix):]])

    def node(self, schema: Mapping[str, Any], expr: str, path: str, depth: int) -> list[Check]:
        """Checks of a value that is present."""
        schema = self.resolve(schema)
        any_of = schema.get("anyOf")
        if any_of is not None:
            others = [s for s in any_of if self.resolve(s) != {"type": "null"}]
            if len(others) != 1 or len(any_of) != 2:
                raise SchemaError(f"{path}: only `anyOf` of one schema and null is supported")
            return _guarded(f"type({expr}) != null_type", self.node(others[0], expr, path, depth))
        if "oneOf" in schema:
            return self.tagged(schema, expr, path, depth)
        kind = schema.get("type")
        handlers: dict[Any, Callable[[], list[Check]]] = {
            "object": lambda: self.object(schema, expr, path, depth, frozenset(), typed=False),
            "array": lambda: self.array(schema, expr, path, depth),
            "string": lambda: self.scalar(schema, expr, path, "string", "a string"),
            "boolean": lambda: self.scalar(schema, expr, path, "bool", "a boolean"),
            "integer": lambda: self.scalar(schema, expr, path, "int", "an integer"),
            "number": lambda: self.scalar(schema, expr, path, "number", "a number"),
        }
        if kind not in handlers:
            raise SchemaError(f"{path}: unsupported schema {dict(schema)!r}")
        return handlers[kind]()

    def object(self, schema: Mapping[str, Any], expr: str, path: str, depth: int, skip: frozenset[str], *,
               typed: bool) -> list[Check]:
        """An object's checks; `typed`: it is known to be an object (its own type is checked elsewhere)."""
        self.known(schema, {"type", "properties", "required", "additionalProperties", "maxProperties"}, path)
        properties: Mapping[str, Any] = schema.get("properties", {})
        inner: list[Check] = []
        if "maxProperties" in schema:
            inner.append(Check(path, f"size({expr}) <= {schema['maxProperties']}",
                               f"must have at most {schema['maxProperties']} entries"))
        values = schema.get("additionalProperties", True)
        if isinstance(values, Mapping):  # a map: every value follows one schema
            if properties:
                raise SchemaError(f"{path}: an object with both named fields and a schema for other keys")
            key = f"k{depth}"
            for check in self.node(values, f"{expr}[{key}]", path, depth + 1):
                inner.append(replace(check, condition=f"{expr}.all({key}, {check.condition})", unknown=None))
        for name in schema.get("required", []):
            if name not in skip:
                inner.append(Check(_field(path, name), f"has({expr}.{self.name(name, path)})", "is required"))
        if schema.get("additionalProperties", True) is False:
            names = literal(sorted(properties))
            inner.append(Check(path, f"{expr}.all(k, k in {names})", f"unknown field (known: {', '.join(properties)})",
                               unknown=(expr, names)))
        for name, sub in properties.items():
            if name in skip:
                continue
            member = f"{expr}.{self.name(name, path)}"
            inner += _guarded(f"has({member})", self.node(sub, member, _field(path, name), depth))
        if typed:
            return inner
        return [Check(path, f"type({expr}) == map", "must be an object"), *_guarded(f"type({expr}) == map", inner)]

    def tagged(self, schema: Mapping[str, Any], expr: str, path: str, depth: int) -> list[Check]:
        """A discriminated union: an object whose tag field picks the schema of the rest."""
        self.known(schema, {"oneOf", "discriminator"}, path)
        discriminator = schema.get("discriminator", {})
        tag_name, mapping = discriminator.get("propertyName"), discriminator.get("mapping")
        if not isinstance(tag_name, str) or not isinstance(mapping, Mapping):
            raise SchemaError(f"{path}: `oneOf` without a discriminator is not supported")
        tag, tag_field = f"{expr}.{self.name(tag_name, path)}", _field(path, tag_name)
        tags = list(mapping)
        inner = [Check(tag_field, f"has({tag}) && type({tag}) == string && {tag} in {literal(tags)}",
                       f"must be one of {_shown(tags)}")]
        for value, ref in mapping.items():
            variant = self.resolve({"$ref": ref})
            checks = self.object(variant, expr, path, depth, frozenset(), typed=True)
            # The tag's own rules are what selected the variant, except a refusal (`not`) of the tag's value.
            tag_schema = self.resolve(variant.get("properties", {}).get(tag_name, {}))
            checks = [c for c in checks if c.field != tag_field]
            if "not" in tag_schema:
                checks += self.refusal(tag_schema, tag, tag_field)
            inner += _guarded(f"has({tag}) && type({tag}) == string && {tag} == {literal(value)}", checks)
        return [Check(path, f"type({expr}) == map", "must be an object"), *_guarded(f"type({expr}) == map", inner)]

    def array(self, schema: Mapping[str, Any], expr: str, path: str, depth: int) -> list[Check]:
        self.known(schema, {"type", "items", "minItems", "maxItems"}, path)
        inner: list[Check] = []
        if "minItems" in schema:
            inner.append(Check(path, f"size({expr}) >= {schema['minItems']}",
                               f"must have at least {schema['minItems']} items"))
        if "maxItems" in schema:
            inner.append(Check(path, f"size({expr}) <= {schema['maxItems']}",
                               f"must have at most {schema['maxItems']} items"))
        if "items" in schema:
            item = f"x{depth}"
            for check in self.node(schema["items"], item, path, depth + 1):
                if check.unknown is not None:  # named only at the top: the policy names the list's field
                    check = replace(check, unknown=None)
                inner.append(replace(check, condition=f"{expr}.all({item}, {check.condition})"))
        return [Check(path, f"type({expr}) == list", "must be a list"), *_guarded(f"type({expr}) == list", inner)]

    def scalar(self, schema: Mapping[str, Any], expr: str, path: str, cel_type: str, noun: str) -> list[Check]:
        self.known(schema, {"type", "enum", "const", "minLength", "maxLength", "pattern", "x-maxBytes", "not",
                            "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}, path)
        is_type = (f"(type({expr}) == int || type({expr}) == double)" if cel_type == "number"
                   else f"type({expr}) == {cel_type}")
        inner: list[Check] = []
        if "const" in schema:
            inner.append(Check(path, f"{expr} == {literal(schema['const'])}", f"must be {_shown([schema['const']])}"))
        if "enum" in schema:
            inner.append(Check(path, f"{expr} in {literal(schema['enum'])}",
                               f"must be one of {_shown(schema['enum'])}"))
        bounds = {"minLength": ("size({}) >= {}", "must have at least {} characters"),
                  "maxLength": ("size({}) <= {}", "must have at most {} characters"),
                  "x-maxBytes": ("size(bytes({})) <= {}", "must have at most {} bytes in UTF-8"),
                  "minimum": ("{} >= {}", "must be at least {}"), "maximum": ("{} <= {}", "must be at most {}"),
                  "exclusiveMinimum": ("{} > {}", "must be more than {}"),
                  "exclusiveMaximum": ("{} < {}", "must be less than {}")}
        for keyword, (condition, message) in bounds.items():
            if keyword in schema:
                inner.append(Check(path, condition.format(expr, schema[keyword]), message.format(schema[keyword])))
        if "pattern" in schema:
            pattern = schema["pattern"]
            if not (pattern.startswith("^") and pattern.endswith("$")):
                raise SchemaError(f"{path}: pattern {pattern!r} must be anchored (^...$)")
            # A pattern's own text is seldom a message for people: the schema's description is used when there is one.
            what = f"must be {schema['description']}" if "description" in schema else f"must match {pattern}"
            inner.append(Check(path, f"{expr}.matches({literal(pattern)})", what))
        if "not" in schema:
            inner += self.refusal(schema, expr, path)
        return [Check(path, is_type, f"must be {noun}"), *_guarded(is_type, inner)]

    def refusal(self, schema: Mapping[str, Any], expr: str, path: str) -> list[Check]:
        """`not`: `{}` refuses every value (with the schema's description as the reason), `{enum: [...]}` those."""
        refused = schema["not"]
        if refused == {}:
            return [Check(path, "false", str(schema.get("description", "is not allowed")))]
        if set(refused) == {"enum"}:
            return [Check(path, f"!({expr} in {literal(refused['enum'])})",
                          f"must not be {' or '.join(json.dumps(v) for v in refused['enum'])}")]
        raise SchemaError(f"{path}: unsupported `not` {refused!r}")

    @staticmethod
    def known(schema: Mapping[str, Any], keywords: set[str], path: str) -> None:
        unknown = set(schema) - keywords - _DESCRIPTIVE
        if unknown:
            raise SchemaError(f"{path or '(top)'}: unsupported schema keywords {sorted(unknown)}")

    @staticmethod
    def name(name: str, path: str) -> str:
        if not _IDENTIFIER.fullmatch(name) or name in _RESERVED:
            raise SchemaError(f"{_field(path, name)}: not a name CEL can select with `.`")
        return name
