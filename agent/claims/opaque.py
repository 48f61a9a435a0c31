"""Opaque configuration of claims and device classes, turned into the typed objects a backend declares.

Pure. Each entry's parameters name their type by `apiVersion` and `kind`; the backend owning the device lists
the types it accepts (`config_types`). Unknown types and invalid fields are errors for the claim, with the field
path in the message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from agent.claims.read import ClaimError, OpaqueEntry
from backends.config import OpaqueConfig

__all__ = ["FieldProblem", "InvalidParameters", "effective_config", "validate_parameters"]


@dataclass(frozen=True)
class FieldProblem:
    """One thing wrong with opaque parameters: the field (`sharing.strategy`; list positions left out, `kind` when
    the type is not one the backend accepts) and the message the claim's error carries for it."""

    field: str
    message: str


class InvalidParameters(ValueError):
    """Opaque parameters the backend refuses; `problems` names each field."""

    def __init__(self, problems: Sequence[FieldProblem]) -> None:
        super().__init__("; ".join(p.message for p in problems))
        self.problems = tuple(problems)


def _path(error: ErrorDetails, params: Any) -> tuple[str, str]:
    """The field an error of pydantic is about, without and with list positions. Its location holds the tag of a
    discriminated union (`sharing.TimeSlicing.interval`), which no user wrote: found by walking the parameters (the
    tag is the discriminator's value), it is left out; an error about the tag itself names the tag's field
    (`sharing.strategy`)."""
    names: list[str] = []
    shown: list[str] = []
    value, loc = params, error["loc"]
    for i, part in enumerate(loc):
        if isinstance(part, int):
            shown.append(str(part))
            value = value[part] if isinstance(value, list) and -len(value) <= part < len(value) else None
        elif isinstance(value, Mapping) and i < len(loc) - 1 and part in value.values():
            continue  # the tag, which is the value of the discriminator (so a key of the same name is no tag)
        elif (isinstance(value, Mapping) and part in value) or i == len(loc) - 1:
            names.append(part)
            shown.append(part)
            value = value.get(part) if isinstance(value, Mapping) else None
    if error["type"] in ("union_tag_invalid", "union_tag_not_found"):
        discriminator = str(error.get("ctx", {}).get("discriminator", "")).strip("'")
        names.append(discriminator)
        shown.append(discriminator)
    return ".".join(names), ".".join(shown)


def validate_parameters(params: Any, types: Sequence[type[OpaqueConfig]]) -> OpaqueConfig:
    """The typed configuration `params` name by apiVersion and kind, among `types`; InvalidParameters says what is
    wrong, field by field. The admission policy (`agent.admission`) refuses the same parameters."""
    if not isinstance(params, Mapping):
        raise InvalidParameters([FieldProblem("", "parameters must be an object with apiVersion and kind")])
    wanted = (params.get("apiVersion"), params.get("kind"))
    for model in types:
        if wanted == (model.API_VERSION, model.KIND):
            try:
                return model.model_validate(dict(params))
            except ValidationError as e:
                problems = []
                for err in e.errors():
                    field, shown = _path(err, params)
                    problems.append(FieldProblem(field, f"{model.KIND}.{shown or '(object)'}: {err['msg']}"))
                raise InvalidParameters(problems) from None
    known = ", ".join(f"{t.API_VERSION}/{t.KIND}" for t in types) or "none"
    raise InvalidParameters([FieldProblem("kind", f"apiVersion {_json(wanted[0])} kind {_json(wanted[1])} is not "
                                                  f"accepted (accepted: {known})")])


def _parse(entry: OpaqueEntry, types: Sequence[type[OpaqueConfig]], backend: str) -> OpaqueConfig:
    try:
        return validate_parameters(entry.parameters, types)
    except InvalidParameters as e:
        if e.problems[0].field == "kind":
            params = entry.parameters
            known = ", ".join(f"{t.API_VERSION}/{t.KIND}" for t in types) or "none"
            raise ClaimError(
                f"{entry.describe()}: backend {backend} does not accept apiVersion {_json(params.get('apiVersion'))} "
                f"kind {_json(params.get('kind'))} (it accepts: {known})") from None
        raise ClaimError(f"{entry.describe()}: {e}") from None


def effective_config(entries: Sequence[OpaqueEntry], types: Sequence[type[OpaqueConfig]], backend: str) -> Any:
    """Validate every applicable entry (weakest first) and return the last one, or None when there is none. Two
    entries whose types say they exclude each other (`OpaqueConfig.conflict`) fail the claim."""
    typed: list[OpaqueConfig] = []
    for entry in entries:
        parsed = _parse(entry, types, backend)
        for index, earlier in enumerate(typed):
            reason = parsed.conflict(earlier) or earlier.conflict(parsed)
            if reason is not None:
                raise ClaimError(f"{entry.describe()} and {entries[index].describe()}: {reason}")
        typed.append(parsed)
    return typed[-1] if typed else None


def _json(value: Any) -> str:
    """A value of the claim as the claim's author wrote it (JSON: "v1", null, {...}), not as Python shows it."""
    return json.dumps(value, ensure_ascii=False)
