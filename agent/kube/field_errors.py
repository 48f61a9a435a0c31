"""The one form of a validation error in the agent: `"<field path>: <what is wrong>"`, collected in `FieldErrors`.

The paths are written as the API server writes them (`spec.devices[0].attributes[model]`, `status.devices[1].pool`).
Two kinds of rule use the collector:

- rules that answer as the API server does (a claim's status, an Event, the test API server) word each error as the
  server's field errors do: `Required value`, `Invalid value: <value as JSON>: <detail>`, `Too long`, `Too many`,
  `Duplicate value`, `Unsupported value` (apimachinery's `field.Error`);
- rules that tell a plugin author or an operator what to change (a ResourceSlice a backend would publish) say it in
  their own words, with the value they refuse after `got` (`check`).

Either way the result is a list of strings, one per error, in the order found.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["FieldErrors", "show", "shown_as_server"]

_SHOWN = 80  # characters of a refused value the agent's own words show
_SHOWN_BY_SERVER = 200  # ... and those the server's words show (it shows whole values; ours are cut for the log)


def _json(value: Any, limit: int) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def show(value: Any) -> str:
    """A refused value as the agent's own words show it: JSON, cut to 80 characters."""
    return _json(value, _SHOWN)


def shown_as_server(value: Any) -> str:
    """A refused value as the server's `Invalid value` shows it: JSON (cut to 200 characters for the log)."""
    return _json(value, _SHOWN_BY_SERVER)


class FieldErrors(list[str]):
    """The errors of one object, in the order found."""

    def add(self, path: str, message: str) -> None:
        self.append(f"{path}: {message}")

    # --- the server's words ---------------------------------------------------------------------------------

    def required(self, path: str, detail: str = "") -> None:
        self.add(path, f"Required value: {detail}" if detail else "Required value")

    def invalid(self, path: str, value: Any, detail: str) -> None:
        self.add(path, f"Invalid value: {shown_as_server(value)}: {detail}")

    def invalid_unshown(self, path: str, detail: str) -> None:
        """An invalid value the server does not show (it writes `""` in its place)."""
        self.add(path, f'Invalid value: "": {detail}')

    def too_long(self, path: str, limit: int, unit: str = "bytes") -> None:
        self.add(path, f"Too long: may not be more than {limit} {unit}")

    def too_many(self, path: str, count: int, limit: int) -> None:
        self.add(path, f"Too many: {count}: must have at most {limit} items")

    def duplicate(self, path: str, value: Any) -> None:
        self.add(path, f"Duplicate value: {shown_as_server(value)}")

    def unsupported(self, path: str, value: Any, supported: Iterable[str]) -> None:
        listed = ", ".join(shown_as_server(s) for s in supported)
        self.add(path, f"Unsupported value: {shown_as_server(value)}: supported values: {listed}")

    # --- the agent's own words ------------------------------------------------------------------------------

    def check(self, ok: bool, path: str, message: str, value: Any) -> None:
        if not ok:
            self.add(path, f"{message}, got {show(value)}")

    def check_flag(self, obj: Mapping[str, Any], field: str, path: str) -> None:
        """An optional boolean field: the server cannot read any other JSON type into it."""
        if (value := obj.get(field)) is not None and not isinstance(value, bool):
            self.add(f"{path}.{field}", f"must be true or false, got {show(value)}")

    def check_key(self, ok: bool, path: str, key: Any, message: str) -> None:
        """Like check, for a key of the map at `path`: the server names the map, not the entry, for a bad key."""
        if not ok:
            self.add(path, f"key {show(key)} {message}")
