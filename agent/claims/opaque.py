"""Opaque configuration of claims and device classes, turned into the typed objects a backend declares.

Pure. Each entry's parameters name their type by `apiVersion` and `kind`; the backend owning the device lists
the types it accepts (`config_types`). Unknown types and invalid fields are errors for the claim, with the field
path in the message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from agent.claims.read import ClaimError, OpaqueEntry
from backends.config import OpaqueConfig

__all__ = ["effective_config"]


def _parse(entry: OpaqueEntry, types: Sequence[type[OpaqueConfig]], backend: str) -> OpaqueConfig:
    params = entry.parameters
    if not isinstance(params, Mapping):
        raise ClaimError(f"{entry.describe()}: parameters must be an object with apiVersion and kind")
    wanted = (params.get("apiVersion"), params.get("kind"))
    for model in types:
        if wanted == (model.API_VERSION, model.KIND):
            try:
                return model.model_validate(dict(params))
            except ValidationError as e:
                problems = "; ".join(
                    f"{model.KIND}.{'.'.join(str(p) for p in err['loc']) or '(object)'}: {err['msg']}"
                    for err in e.errors()
                )
                raise ClaimError(f"{entry.describe()}: {problems}") from None
    known = ", ".join(f"{t.API_VERSION}/{t.KIND}" for t in types) or "none"
    raise ClaimError(
        f"{entry.describe()}: backend {backend} does not accept apiVersion {wanted[0]!r} kind {wanted[1]!r} "
        f"(it accepts: {known})"
    )


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
