"""Typed backend configuration: each backend validates its own section of the agent's settings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from backends.contract import ConfigError

__all__ = ["CONFIG_API_VERSION", "BackendConfig", "OpaqueConfig", "Reconfiguration", "parse_config"]

CONFIG_API_VERSION = "dra-agent.io/v1alpha1"
"""The API version of the opaque configuration kinds of the built-in backends."""

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


@dataclass(frozen=True)
class Reconfiguration:
    """A change beyond handing a device over as it is, which a claim's opaque parameters can ask for and which a
    node makes only when its operator allows it by `name` (the agent's `allowed_configs` setting; the admission
    policy's parameters use the same names).

    The parameters ask for it when the value at `field` (a path of the parameters' keys, as the claim spells
    them) is `value`, or, with `value` None, is there and not null; an empty `field` means the kind itself asks
    for it. `what` says in a few words what the node then does."""

    name: str
    field: tuple[str, ...] = ()
    value: str | None = None
    what: str = ""

    def asked_by(self, parameters: Mapping[str, Any]) -> bool:
        """Whether parameters of the declaring kind (as the claim gives them) ask for this."""
        found: Any = parameters
        for key in self.field:
            if not isinstance(found, Mapping) or found.get(key) is None:
                return False
            found = found[key]
        return self.value is None or found == self.value


class OpaqueConfig(BaseModel):
    """Typed opaque parameters of a claim or device class, selected by `apiVersion` and `kind`.

    A backend lists the types it accepts in `config_types`; subclasses set API_VERSION and KIND. Unknown
    fields are rejected, and no field can name a path, device node, mount or hook of the caller's choosing:
    backends derive every container edit from the hardware they own.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    API_VERSION: ClassVar[str]
    KIND: ClassVar[str]
    RECONFIGURATIONS: ClassVar[tuple[Reconfiguration, ...]] = ()
    """The reconfigurations parameters of this kind can ask for; a node makes them only where allowed."""

    api_version: str = Field(alias="apiVersion")
    kind: str

    @model_validator(mode="after")
    def _type_matches(self) -> OpaqueConfig:
        if (self.api_version, self.kind) != (self.API_VERSION, self.KIND):
            raise ValueError(f"expected apiVersion {self.API_VERSION} and kind {self.KIND}")
        return self

    def reconfigurations(self) -> tuple[Reconfiguration, ...]:
        """The reconfigurations these parameters ask for (of the kind's `RECONFIGURATIONS`)."""
        given = self.model_dump(by_alias=True, mode="json")
        return tuple(r for r in self.RECONFIGURATIONS if r.asked_by(given))

    def conflict(self, other: OpaqueConfig) -> str | None:
        """Why this configuration and `other`, another entry applying to the same device (from the device class or
        the claim, weaker or stronger), ask for things that exclude each other; None (the default) when the last
        entry may simply apply. A conflict fails the claim rather than one of the two being dropped unseen."""
        return None
