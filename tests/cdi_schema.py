"""The CDI JSON schema (draft-07) shipped by Debian's container-device-interface Go package, as a checker."""

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
    """Messages for each way `spec_json` breaks the CDI schema; empty when it conforms."""
    return [
        f"{'/'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}"
        for error in _validator().iter_errors(spec_json)
    ]


def schema_example(name: str) -> dict[str, Any]:
    """A spec from the package's schema test data, e.g. "good/spec-example.json"."""
    path = SCHEMA_DIR / "testdata" / name
    if not path.is_file():
        pytest.fail(f"CDI schema test data {path} not found: run `apt-get install -y {APT_PACKAGE}`")
    data: dict[str, Any] = json.loads(path.read_text())
    return data
