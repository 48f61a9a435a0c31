"""Typed backend configuration: each backend validates its own section of the agent's settings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from backends.contract import ConfigError

__all__ = ["BackendConfig", "parse_config"]

_M = TypeVar("_M", bound="BackendConfig")


class BackendConfig(BaseModel):
    """Base for a backend's settings: immutable, unknown keys rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def parse_config(model: type[_M], raw: Mapping[str, Any], backend: str) -> _M:
    """Validate `raw` against `model`; errors name the backend and the field path."""
    try:
        return model.model_validate(dict(raw))
    except ValidationError as e:
        details = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(top)'}: {err['msg']}" for err in e.errors()
        )
        raise ConfigError(f"invalid configuration for backend {backend}: {details}") from None
