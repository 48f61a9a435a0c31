"""The settings that belong to the backends, checked against the installed ones before anything starts: every
`backend_config` section must be for an installed backend and hold only what that backend's settings model
(`config_model`) takes, and every reconfiguration `allowed_configs` names must be one an installed backend's claim
parameters can ask for.

One settings file may serve nodes that enable different backends: a section for an installed backend that
`backends` leaves out is not read, and a reconfiguration of such a backend is accepted. A backend that cannot be
loaded is skipped here: the start reports it.
"""

from __future__ import annotations

import difflib
import json
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from agent.node.plugins import LoadedPlugin, find_plugins, load_plugins
from agent.settings import Settings
from backends.capabilities import HasConfigModel, HasConfigTypes
from backends.config import Reconfiguration

__all__ = ["plugin_settings_problems", "reconfigurations_of"]


def plugin_settings_problems(settings: Settings, origins: Mapping[str, str]) -> list[str]:
    """One line per problem, as `load_settings` words its own: the setting's path, where it came from, what is
    wrong. Loads backends only when there is something to check: the enabled ones for their sections, every
    installed one for the reconfigurations."""
    if not settings.backend_config and not settings.allowed_configs:
        return []
    found, _ = find_plugins()
    installed = sorted(p.name for p in found)
    wanted = None if settings.allowed_configs else settings.backends
    loaded, _ = load_plugins(found, wanted)
    enabled = {p.found.name: p for p in loaded if settings.backends is None or p.found.name in settings.backends}
    problems: list[str] = []
    where = origins.get("backend_config", "default")
    for name, section in settings.backend_config.items():
        if name not in installed:
            close = difflib.get_close_matches(name, installed, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            problems.append(f"  backend_config.{name} (from {where}): no installed backend is named {name}{hint}; "
                            f"installed backends: {', '.join(installed) or 'none'}")
        elif name in enabled:
            problems += _section_problems(enabled[name], section, where)
    known = reconfigurations_of(loaded)
    unknown = [name for name in settings.allowed_configs if name not in known]
    if unknown:
        problems.append(f"  allowed_configs = {', '.join(unknown)} (from {origins.get('allowed_configs', 'default')}): "
                        f"no installed backend's claim parameters ask for {'this' if len(unknown) == 1 else 'these'}; "
                        f"known reconfigurations: {', '.join(sorted(known)) or 'none'}")
    return problems


def reconfigurations_of(loaded: Sequence[LoadedPlugin]) -> dict[str, Reconfiguration]:
    """The reconfigurations the claim parameters of these backends can ask for, by name."""
    found: dict[str, Reconfiguration] = {}
    for plugin in loaded:
        backend = plugin.backend
        for kind in backend.config_types if isinstance(backend, HasConfigTypes) else ():
            for reconfiguration in kind.RECONFIGURATIONS:
                found.setdefault(reconfiguration.name, reconfiguration)
    return found


def _section_problems(plugin: LoadedPlugin, section: Mapping[str, Any], where: str) -> list[str]:
    backend = plugin.backend
    model = backend.config_model if isinstance(backend, HasConfigModel) else None
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return []  # the backend validates its section when it starts
    name = plugin.found.name
    try:
        model.model_validate(dict(section))
    except ValidationError as e:
        lines = []
        for err in e.errors():
            path = ".".join(str(p) for p in err["loc"])
            field = f"backend_config.{name}" + (f".{path}" if path else "")
            if err["type"] == "extra_forbidden":
                known = _field_names(model, err["loc"][:-1])
                close = difflib.get_close_matches(str(err["loc"][-1]), known, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                lines.append(f"  {field} (from {where}): unknown field of backend {name}{hint}; its fields: "
                             f"{', '.join(known) or 'none'}")
            else:
                shown = "" if err["type"] == "missing" or not err["loc"] else f" = {_json(err['input'])}"
                lines.append(f"  {field}{shown} (from {where}): {err['msg'].removeprefix('Value error, ')}")
        return lines
    return []


def _json(value: Any) -> str:
    """A value as the operator wrote it (JSON), not as Python shows it."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def _field_names(model: type[BaseModel], loc: Sequence[int | str]) -> list[str]:
    """The names (as written in a section: aliases) of the fields of the model found at `loc` below `model`."""
    current: type[BaseModel] | None = model
    for part in loc:
        if current is None:
            return []
        if isinstance(part, int):
            continue  # a position in a list: the same model
        field = next((f for n, f in current.model_fields.items() if part in (n, f.alias)), None)
        current = _model_in(field.annotation) if field is not None else None
    if current is None:
        return []
    return [f.alias or n for n, f in current.model_fields.items()]


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (itself, or inside Optional, tuple, list, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None
