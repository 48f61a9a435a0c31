"""A ValidatingAdmissionPolicy evaluated with cel-python as the API server evaluates it on a CREATE: `object`,
`request.kind` (from the object's apiVersion and kind), `request.namespace` and `params` (the binding's parameter
object, for a policy with `paramKind`), its variables in order (`variables.<name>`), then each validation; a failing
one gives its `messageExpression` (or, when that fails, its `message`). An expression that fails to evaluate fails
its validation, as with `failurePolicy: Fail`."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import celpy
from celpy import celtypes
from celpy.adapter import json_to_cel
from celpy.evaluation import CELEvalError, CELFunction

__all__ = ["Evaluation", "evaluate"]

_ENV = celpy.Environment()


# The Kubernetes CEL library's functions the policies use: `min` of lists (k8s.io/apiserver/pkg/cel/library/lists.go),
# `split` and `trim` of strings (cel-go's strings extension, which Kubernetes' CEL environment includes).
_KUBERNETES_FUNCTIONS: dict[str, CELFunction] = {
    "min": lambda items: min(items),
    "split": lambda text, separator: celtypes.ListType([celtypes.StringType(s) for s in text.split(separator)]),
    "trim": lambda text: celtypes.StringType(text.strip(" \t\n\r\f\v")),
}


@functools.cache
def _program(expression: str) -> celpy.Runner:
    return _ENV.program(_ENV.compile(expression), functions=_KUBERNETES_FUNCTIONS)


def _run(expression: str, activation: Mapping[str, Any]) -> Any:
    return _program(expression).evaluate(dict(activation))


class Evaluation:
    """What a policy says of one object: `messages` of the failing validations (empty: admitted), and `errors`,
    the validations whose expression could not be evaluated (each also a failure)."""

    def __init__(self, messages: list[str], errors: list[str]) -> None:
        self.messages, self.errors = messages, errors

    @property
    def admitted(self) -> bool:
        return not self.messages


def evaluate(policy: Mapping[str, Any], obj: Mapping[str, Any], params: Mapping[str, Any] | None = None) -> Evaluation:
    spec = policy["spec"]
    variables: dict[str, Any] = {}
    group, _, version = str(obj.get("apiVersion", "")).rpartition("/")
    namespace = obj.get("metadata", {}).get("namespace", "")
    request = {"kind": {"group": group, "version": version, "kind": obj.get("kind", "")}, "operation": "CREATE",
               "namespace": namespace}
    activation: dict[str, Any] = {"object": json_to_cel(dict(obj)), "request": json_to_cel(request),
                                  "variables": celtypes.MapType()}
    if "paramKind" in spec:
        assert params is not None, "a policy with paramKind is evaluated with its parameter object"
        activation["params"] = json_to_cel(dict(params))
    for variable in spec.get("variables", ()):
        activation["variables"] = celtypes.MapType(
            {celtypes.StringType(k): v for k, v in variables.items()})
        value = _run(variable["expression"], activation)
        if isinstance(value, CELEvalError):
            raise AssertionError(f"variable {variable['name']}: {value}")
        variables[variable["name"]] = value
    activation["variables"] = celtypes.MapType({celtypes.StringType(k): v for k, v in variables.items()})
    messages: list[str] = []
    errors: list[str] = []
    for validation in spec["validations"]:
        try:
            verdict = _run(validation["expression"], activation)
        except CELEvalError as e:
            verdict = e
        if verdict is True or verdict == celtypes.BoolType(True):
            continue
        if not isinstance(verdict, celtypes.BoolType):
            errors.append(f"{validation['expression']}: {verdict}")
        message = validation["message"]
        if "messageExpression" in validation:
            try:
                said = _run(validation["messageExpression"], activation)
                if isinstance(said, str):
                    message = str(said)
            except CELEvalError:
                pass
        messages.append(message)
    return Evaluation(messages, errors)
