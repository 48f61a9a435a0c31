"""Field and label selectors of list, watch and deletecollection requests, parsed and matched as the API server does.

Field selectors: ``=``, ``==`` and ``!=`` terms joined by commas (AND), ``\\`` escaping ``,``, ``=`` and ``\\``.
Label selectors: ``k=v``, ``k==v``, ``k!=v``, ``k in (a,b)``, ``k notin (a,b)``, ``k`` and ``!k``; as upstream,
``!=`` and ``notin`` also match objects without the label.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.kube.names import is_label_key, is_label_value
from simulator.apiserver.resources import ApiError, ResourceType


@dataclass(frozen=True)
class FieldTerm:
    label: str
    value: str
    negated: bool


def _split_unescaped(text: str, sep: str) -> list[str]:
    parts, current, escaped = [], [], False
    for char in text:
        if escaped:
            current.append("\\" + char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == sep:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if escaped:
        current.append("\\")
    parts.append("".join(current))
    return parts


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text)


def _split_term(term: str) -> tuple[str, str, str] | None:
    escaped = False
    for i, char in enumerate(term):
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        else:
            for op in ("!=", "==", "="):
                if term.startswith(op, i):
                    return term[:i], op, term[i + len(op) :]
    return None


def parse_field_selector(text: str, rt: ResourceType) -> tuple[FieldTerm, ...]:
    """Terms of ``fieldSelector``; a label the type does not support gives 400, as upstream."""
    terms: list[FieldTerm] = []
    for raw in _split_unescaped(text, ",") if text else ():
        split = _split_term(raw)
        if split is None:
            raise ApiError(400, f"invalid selector: '{text}'; can't understand '{raw}'")
        label, op, value = _unescape(split[0].strip()), split[1], _unescape(split[2].strip())
        if label not in rt.field_labels:
            raise ApiError(400, rt.field_error.format(label=label))
        terms.append(FieldTerm(label, value, op == "!="))
    return tuple(terms)


def fields_match(terms: tuple[FieldTerm, ...], obj: Mapping[str, Any], rt: ResourceType) -> bool:
    return all((rt.field_value(obj, t.label) == t.value) != t.negated for t in terms)


# --- labels ----------------------------------------------------------------------------------------

LabelTest = Callable[[Mapping[str, str]], bool]

_KEY = r"[^\s!=(),]+"
_EQUALITY_RE = re.compile(rf"({_KEY})\s*(==|=|!=)\s*([^\s,()]*)")
_SET_RE = re.compile(rf"({_KEY})\s+(in|notin)\s*\(([^()]*)\)")
_EXISTS_RE = re.compile(rf"(!?)\s*({_KEY})")


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _requirement(term: str) -> LabelTest:
    def bad(why: str) -> ApiError:
        return ApiError(400, f"unable to parse requirement: {term!r}: {why}")

    if match := _SET_RE.fullmatch(term):
        key, op = match[1], match[2]
        values = frozenset(v.strip() for v in match[3].split(","))
        if not all(is_label_value(v) for v in values):
            raise bad("values must be valid label values")
    elif match := _EQUALITY_RE.fullmatch(term):
        key, op, values = match[1], match[2], frozenset((match[3],))
        if not is_label_value(match[3]):
            raise bad("the value must be a valid label value")
    elif match := _EXISTS_RE.fullmatch(term):
        key, op, values = match[2], "!" if match[1] else "exists", frozenset()
    else:
        raise bad("expected key, !key, key=value, key!=value, key in (...) or key notin (...)")
    if not is_label_key(key):
        raise bad(f"invalid label key {key!r}")
    if op in ("=", "==", "in"):
        return lambda labels: labels.get(key) in values
    if op in ("!=", "notin"):
        return lambda labels: labels.get(key) not in values
    if op == "!":
        return lambda labels: key not in labels
    return lambda labels: key in labels


def parse_label_selector(text: str) -> tuple[LabelTest, ...]:
    """Requirements of ``labelSelector``, all of which must hold; a malformed one gives 400."""
    terms = [term.strip() for term in _split_top_level(text)] if text.strip() else []
    if any(not term for term in terms):
        raise ApiError(400, f"unable to parse requirement: empty term in {text!r}")
    return tuple(_requirement(term) for term in terms)


def labels_match(tests: tuple[LabelTest, ...], obj: Mapping[str, Any]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(test(labels) for test in tests)


@dataclass(frozen=True)
class Selector:
    """A namespace (or all namespaces) plus field and label selectors: what a list or a watch sees."""

    rt: ResourceType
    namespace: str | None = None
    fields: tuple[FieldTerm, ...] = ()
    labels: tuple[LabelTest, ...] = ()

    @classmethod
    def parse(cls, rt: ResourceType, namespace: str | None, query: Mapping[str, str]) -> Selector:
        return cls(rt, namespace, parse_field_selector(query.get("fieldSelector", ""), rt),
                   parse_label_selector(query.get("labelSelector", "")))  # fmt: skip

    def matches(self, obj: Mapping[str, Any]) -> bool:
        if self.namespace is not None and (obj.get("metadata") or {}).get("namespace") != self.namespace:
            return False
        return fields_match(self.fields, obj, self.rt) and labels_match(self.labels, obj)
