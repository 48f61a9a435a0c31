"""Pure checks of what a backend returns against what the API server, the kubelet, the CDI loader and the core
accept; `dra-agent backends --check` and the conformance kit (simulator/conformance) run them. Each problem
says what is wrong and what to change."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from agent.kube.names import is_dns_label, is_label_value
from agent.slices.build import device_body, pool_slices
from agent.slices.rules import validate_pool, validate_resource_slice
from backends.plugin import (
    Allocated,
    Device,
    DevicesChanged,
    HasConfigModel,
    HasConfigTypes,
    Health,
    HealthEvent,
    Inventory,
    OpaqueConfig,
    Prepared,
    Unserved,
)
from cdi.names import validate_spec
from cdi.spec import ContainerEdits, Spec
from cdi.spec import Device as CdiDevice

__all__ = [
    "config_problems",
    "device_view",
    "health_problems",
    "inventory_problems",
    "name_changes",
    "prepared_problems",
    "typed",
]

MAX_HEALTH_MESSAGE = 1024
"""The kubelet's limit on a device's health message."""

_NAME_RULES = ("device names are DNS labels (lower-case letters, digits and '-', at most 63); attribute and "
               "capacity names are C identifiers of at most 32 characters, optionally after a DNS-subdomain "
               "domain and '/'; string values hold at most 64 characters, versions are semver; a device has at "
               "most 32 attributes and capacities together")


def inventory_problems(inventory: object, driver: str, node: str) -> list[str]:
    """Whether discover()'s result is an Inventory that the API server and the scheduler accept as a pool."""
    if not isinstance(inventory, Inventory):
        return [f"discover() returned {type(inventory).__name__}; return backends.plugin.Inventory"]
    problems: list[str] = []
    if not all(isinstance(d, Device) for d in inventory.devices):
        return ["Inventory.devices holds something other than backends.plugin.Device objects"]
    if not all(isinstance(w, str) for w in inventory.warnings):
        problems.append("Inventory.warnings must hold strings (messages for the operator)")
    if not all(isinstance(u, Unserved) and u.reason and all(isinstance(d, str) for d in u.devices)
               for u in inventory.unserved):
        problems.append("Inventory.unserved must hold backends.plugin.Unserved objects with a reason and the "
                        "devices named as strings")
    seen: set[str] = set()
    for device in inventory.devices:
        if device.name in seen:
            problems.append(f"device name {device.name!r} is used twice: names must be unique in the backend "
                            "(derive them from something unique such as the PCI address)")
        seen.add(device.name)
    published = pool_slices(driver, node, inventory.devices, inventory.counter_sets)
    problems += [f"the API server would reject device {reason}" for reason in published.rejected]
    if published.rejected:
        problems.append(f"fix the Devices discover() builds: {_NAME_RULES}")
    for index, body in enumerate(published.slices):
        named = {**body, "metadata": {**body["metadata"], "name": f"{body['metadata']['generateName']}kit"}}
        for error in validate_resource_slice(named):
            problems.append(f"the API server would reject the pool's slice {index}: {error}")
    for error in validate_pool(list(published.slices)):
        problems.append(f"the scheduler would refuse the pool: {error} (check the counter sets and the counters "
                        "devices consume: every consumed set and counter must be defined)")
    return problems


def device_view(inventory: Inventory) -> dict[str, dict[str, Any]]:
    """Each device as it is published (its attributes, capacity and counters), by name."""
    views: dict[str, dict[str, Any]] = {}
    for device in inventory.devices:
        try:
            views[device.name] = device_body(device)
        except ValueError as e:
            views[device.name] = {"error": str(e)}
    return views


def name_changes(before: Inventory, after: Inventory, between: str) -> list[str]:
    """How the published devices differ between two discoveries that should agree."""
    old, new = device_view(before), device_view(after)
    problems: list[str] = []
    gone, added = sorted(old.keys() - new.keys()), sorted(new.keys() - old.keys())
    if gone or added:
        problems.append(
            f"device names changed {between}: gone {_few(gone)}, new {_few(added)}. Names must be stable: "
            "derive them from the hardware (PCI address, serial number, UUID), never from enumeration order, "
            "a counter, time or randomness")
    for name in sorted(old.keys() & new.keys()):
        if old[name] != new[name]:
            changed = sorted(k for k in old[name].keys() | new[name].keys() if old[name].get(k) != new[name].get(k))
            problems.append(f"device {name} changed {between} ({', '.join(changed)}): what is published must "
                            "depend on the hardware only, or every discovery rewrites the ResourceSlices")
    return problems


def health_problems(events: Iterable[object], known: set[str]) -> list[str]:
    """Whether each item health() yielded is a well-formed HealthEvent or DevicesChanged."""
    problems: list[str] = []
    for event in events:
        if isinstance(event, DevicesChanged):
            if not isinstance(event.reason, str):
                problems.append(f"{event!r}: DevicesChanged.reason must be a string")
            continue
        if not isinstance(event, HealthEvent):
            problems.append(f"health() yielded {type(event).__name__} {event!r}; yield HealthEvent or DevicesChanged")
            continue
        where = f"{event!r}"
        if event.device not in known:
            problems.append(f"{where}: device {event.device!r} was never published by discover(); health events "
                            "name published devices")
        if not isinstance(event.health, Health):
            problems.append(f"{where}: health must be a backends.plugin.Health member")
        if not isinstance(event.reason, str) or not event.reason:
            problems.append(f"{where}: give a reason an operator understands; the kubelet shows it")
        elif len(event.reason) > MAX_HEALTH_MESSAGE:
            problems.append(f"{where}: the reason has {len(event.reason)} characters; the kubelet takes at most "
                            f"{MAX_HEALTH_MESSAGE}")
        if event.health is Health.UNHEALTHY and not is_dns_label(event.cause):
            problems.append(f"{where}: an unhealthy device needs a cause that is a DNS label (e.g. 'link-down', "
                            f"'xid'), got {event.cause!r}; the device taint's key is <driver>/<cause>")
        if not is_label_value(event.value):
            problems.append(f"{where}: value {event.value!r} must be a label value (at most 63 letters, digits, "
                            "'-', '_' or '.'); it becomes the taint's value")
    return problems


def prepared_problems(allocated: Sequence[Allocated], prepared: object, claim_uid: str) -> list[str]:
    """Whether prepare()'s answer has one Prepared per device, CDI edits the container runtime loads, and restore
    records the checkpoint can keep."""
    if not isinstance(prepared, Sequence) or not all(isinstance(p, Prepared) for p in prepared):
        return [f"prepare() returned {prepared!r}; return a list with one backends.plugin.Prepared per device"]
    problems: list[str] = []
    wanted, got = sorted(a.device for a in allocated), sorted(p.device for p in prepared)
    if wanted != got:
        problems.append(f"prepare() answered for devices {got}, was asked for {wanted}: one Prepared per "
                        "allocated device, with its name")
    devices: list[CdiDevice] = []
    common = ContainerEdits()
    for p in prepared:
        if not isinstance(p.edits, ContainerEdits) or not (p.common_edits is None or
                                                           isinstance(p.common_edits, ContainerEdits)):
            problems.append(f"{p.device}: edits and common_edits must be backends.plugin.ContainerEdits")
            continue
        devices.append(CdiDevice(f"{p.device}-{claim_uid[:8]}", p.edits))
        if p.common_edits is not None:
            common = common.merge(p.common_edits)
        try:
            if json.loads(json.dumps(dict(p.restore))) != dict(p.restore):
                raise TypeError("it changes through JSON (tuples, non-string keys?)")
        except (TypeError, ValueError) as e:
            problems.append(f"{p.device}: the restore record {p.restore!r} is not plain JSON ({e}); the core "
                            "checkpoints it as JSON and hands it back after a restart")
    if devices and not problems:
        for error in validate_spec(Spec("k8s.kit.example/claim", tuple(devices), common)):
            problems.append(f"the CDI spec of the claim would not load: {error}")
    return problems


def config_problems(backend: object) -> list[str]:
    """Whether the backend declares typed, documented settings (`config_model`) and opaque claim parameters
    (`config_types`)."""
    problems: list[str] = []
    model = backend.config_model if isinstance(backend, HasConfigModel) else None
    if model is None:
        problems.append("no 'config_model': declare the backend's settings as a pydantic model (subclass "
                        "backends.plugin.BackendConfig, even with no fields) so bad settings fail at start")
    elif not (isinstance(model, type) and issubclass(model, BaseModel)):
        problems.append(f"'config_model' is {model!r}; it must be a pydantic model class")
    else:
        if model.model_config.get("extra") != "forbid":
            problems.append(f"config_model {model.__name__} accepts unknown keys: set extra='forbid' (subclass "
                            "BackendConfig) so a misspelt setting is an error, not ignored")
        problems += _undocumented(model, "config_model")
    types = backend.config_types if isinstance(backend, HasConfigTypes) else ()
    if not isinstance(types, (tuple, list)):
        return [*problems, f"'config_types' is {types!r}; it must be a tuple of OpaqueConfig subclasses"]
    for kind in types:
        if not (isinstance(kind, type) and issubclass(kind, OpaqueConfig)):
            problems.append(f"config_types holds {kind!r}; each entry must subclass backends.plugin.OpaqueConfig")
            continue
        if not getattr(kind, "API_VERSION", None) or not getattr(kind, "KIND", None):
            problems.append(f"{kind.__name__}: set the class variables API_VERSION and KIND")
        problems += _undocumented(kind, "config type")
    return problems


def _undocumented(model: type[BaseModel], what: str) -> list[str]:
    doc = model.__doc__ or ""
    base_docs = {(b.__doc__ or "") for b in model.__mro__[1:]}
    if not doc.strip() or doc in base_docs:
        return [f"{what} {model.__name__} has no docstring: document what each setting does (it is the "
                "operator's reference)"]
    return []


def _few(names: Sequence[str]) -> str:
    return "[" + ", ".join(names[:5]) + (f", ... {len(names) - 5} more" if len(names) > 5 else "") + "]"


def typed(parameters: Mapping[str, Any] | None, types: Sequence[type[OpaqueConfig]]) -> Any:
    """The claim parameters as the core hands them to prepare(): validated into the backend's declared type."""
    if parameters is None:
        return None
    for kind in types:
        if (parameters.get("apiVersion"), parameters.get("kind")) == (kind.API_VERSION, kind.KIND):
            return kind.model_validate(dict(parameters))
    raise ValueError(f"claim_config {dict(parameters)} matches none of the backend's config_types")
