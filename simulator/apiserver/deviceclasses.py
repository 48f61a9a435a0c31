"""What the test API server checks on a DeviceClass beyond its name: ``spec.extendedResourceName``.

The real server (``validateDeviceClassSpec``) accepts the field only when it passes core's
``IsExtendedResourceName``: a name with a domain, not in the ``kubernetes.io/`` namespace, not starting with
``requests.``, and that is still a qualified name (label-key format) once ``requests.`` is put in front of it,
as ResourceQuota does. Two classes may carry the same name: the scheduler, not the API server, picks one. With
the ``DRAExtendedResource`` gate off, the field is dropped on write, as the DeviceClass strategy drops it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from agent.kube.names import is_label_key
from simulator.apiserver.resources import ApiError

__all__ = ["EXTENDED_RESOURCE_GATE", "EXTENDED_RESOURCE_MSG", "drop_disabled_class_fields",
           "is_extended_resource_name", "validate_device_class"]

EXTENDED_RESOURCE_GATE = "DRAExtendedResource"

EXTENDED_RESOURCE_MSG = "must be a valid extended resource name"
_NATIVE = "kubernetes.io/"
_QUOTA_PREFIX = "requests."


def is_extended_resource_name(name: object) -> bool:
    """core/v1 helper ``IsExtendedResourceName``: e.g. ``nvidia.com/gpu``, not ``gpu``, ``kubernetes.io/x``,
    ``foo.kubernetes.io/x`` or ``requests.example.com/x``."""
    if not isinstance(name, str) or "/" not in name or _NATIVE in name or name.startswith(_QUOTA_PREFIX):
        return False
    return is_label_key(_QUOTA_PREFIX + name)


def drop_disabled_class_fields(obj: dict[str, Any], old: Mapping[str, Any] | None, disabled: set[str]) -> None:
    """The strategy's ``dropDisabledFields``: with ``DRAExtendedResource`` off, ``spec.extendedResourceName`` is
    dropped silently, unless the stored class already has one (then an update keeps it)."""
    spec = obj.get("spec")
    if EXTENDED_RESOURCE_GATE not in disabled or not isinstance(spec, dict):
        return
    if old is not None and (old.get("spec") or {}).get("extendedResourceName") is not None:
        return
    spec.pop("extendedResourceName", None)


def validate_device_class(obj: Mapping[str, Any]) -> list[str]:
    """``"<field path>: <message>"`` for each problem of the DeviceClass's spec the real server reports (422);
    a value that is not a string is refused by the decoder first (400), as the real server's is."""
    spec = obj.get("spec")
    if not isinstance(spec, Mapping) or "extendedResourceName" not in spec:
        return []
    name = spec["extendedResourceName"]
    if name is None or is_extended_resource_name(name):
        return []
    if not isinstance(name, str):
        raise ApiError(400, f"json: cannot unmarshal {_json_type(name)} into Go struct field "
                       "DeviceClassSpec.spec.extendedResourceName of type string")
    return [f"spec.extendedResourceName: Invalid value: {json.dumps(name)}: {EXTENDED_RESOURCE_MSG}"]


def _json_type(value: object) -> str:
    """How Go's JSON decoder names the type of a value it cannot put into a string."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return "array" if isinstance(value, list) else "object"
