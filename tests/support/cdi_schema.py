"""The CDI JSON schema (draft-07) shipped by Debian's container-device-interface Go package, as a checker.

Debian's package predates CDI v1.1.0, whose schema adds `containerEdits.netDevices`; its schema lets the key pass
unchecked. `netdevice_errors` checks it as the v1.1.0 schema (`LinuxNetDevice`: an object with the strings
`hostInterfaceName` and `name`, both required) and the Go library's validation do (neither may be empty; no
host name and no container name twice in one `containerEdits`; a spec using them declares cdiVersion 1.1.0 or
later). `cdi_schema_errors` reports both.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft7Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

APT_PACKAGE = "golang-github-container-orchestrated-devices-container-device-interface-dev"
SCHEMA_DIR = Path("/usr/share/gocode/src/github.com/container-orchestrated-devices/container-device-interface/schema")


@functools.cache
def _validator() -> Draft7Validator:
    schema_file, defs_file = SCHEMA_DIR / "schema.json", SCHEMA_DIR / "defs.json"
    if not (schema_file.is_file() and defs_file.is_file()):
        # A missing schema must fail loudly: a skip would let spec changes land unchecked.
        pytest.fail(f"CDI JSON schema not found in {SCHEMA_DIR}: run `apt-get install -y {APT_PACKAGE}`")
    schema = json.loads(schema_file.read_text())
    defs = Resource.from_contents(json.loads(defs_file.read_text()), default_specification=DRAFT7)
    # schema.json has no $id and refers to "defs.json#/definitions/...", so defs.json lives under that URI.
    registry: Registry[Any] = Registry().with_resource("defs.json", defs)
    return Draft7Validator(schema, registry=registry)


def cdi_schema_errors(spec_json: dict[str, Any]) -> list[str]:
    """Messages for each way `spec_json` breaks the CDI schema (netDevices included); empty when it conforms."""
    return [
        f"{'/'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}"
        for error in _validator().iter_errors(spec_json)
    ] + netdevice_errors(spec_json)


_NETDEVICE_KEYS = ("hostInterfaceName", "name")
_NETDEVICES_SINCE = (1, 1, 0)


def _version(text: object) -> tuple[int, ...] | None:
    try:
        return tuple(int(part) for part in str(text).removeprefix("v").split("."))
    except ValueError:
        return None


def netdevice_errors(spec_json: dict[str, Any]) -> list[str]:
    """Messages for each way the spec's `netDevices` break CDI v1.1.0 (see the module's docstring)."""
    errors: list[str] = []
    places = [("containerEdits", spec_json.get("containerEdits"))] + [
        (f"devices/{i}/containerEdits", device.get("containerEdits"))
        for i, device in enumerate(spec_json.get("devices") or []) if isinstance(device, dict)]
    used = False
    for where, edits in places:
        if not isinstance(edits, dict) or "netDevices" not in edits:
            continue
        used = True
        entries = edits["netDevices"]
        if not isinstance(entries, list):
            errors.append(f"{where}/netDevices: {entries!r} is not an array")
            continue
        seen: dict[str, set[str]] = {key: set() for key in _NETDEVICE_KEYS}
        for i, entry in enumerate(entries):
            at = f"{where}/netDevices/{i}"
            if not isinstance(entry, dict):
                errors.append(f"{at}: {entry!r} is not an object")
                continue
            for key in _NETDEVICE_KEYS:
                value = entry.get(key)
                if key not in entry:
                    errors.append(f"{at}: {key!r} is a required property")
                elif not isinstance(value, str):
                    errors.append(f"{at}/{key}: {value!r} is not a string")
                elif not value:
                    errors.append(f"{at}/{key}: empty")
                elif value in seen[key]:
                    errors.append(f"{at}/{key}: duplicate {value!r}")
                else:
                    seen[key].add(value)
    version = _version(spec_json.get("cdiVersion"))
    if used and (version is None or version < _NETDEVICES_SINCE):
        errors.append(f"cdiVersion: netDevices need 1.1.0 or later, the spec says {spec_json.get('cdiVersion')!r}")
    return errors


def schema_example(name: str) -> dict[str, Any]:
    """A spec from the package's schema test data, e.g. "good/spec-example.json"."""
    path = SCHEMA_DIR / "testdata" / name
    if not path.is_file():
        pytest.fail(f"CDI schema test data {path} not found: run `apt-get install -y {APT_PACKAGE}`")
    data: dict[str, Any] = json.loads(path.read_text())
    return data
