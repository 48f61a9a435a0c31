"""Inputs for allocator tests: the slices the agent publishes on simulated nodes, the shipped DeviceClasses and
example claims, and small hand-made slices and claims."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
from typing import Any

import pytest
import yaml

from agent.commands.cli import main
from tests.support.repository import ROOT

Obj = dict[str, Any]


@functools.cache
def _discover(profile: str, backend_config: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        for key in list(os.environ):
            if key.startswith("DRA_AGENT_") or key in ("NODE_NAME", "KUBECONFIG"):
                patch.delenv(key)
        if backend_config:
            patch.setenv("DRA_AGENT_BACKEND_CONFIG", backend_config)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["discover", "--simulate", profile, "-o", "json", "--log-format", "json"])
    assert code == 0, err.getvalue()
    return out.getvalue()


def discovered(profile: str, backend_config: Obj | None = None) -> list[Obj]:
    """The slices `dra-agent discover` prints for a simulated node, named as the API server would name them."""
    slices: list[Obj] = json.loads(_discover(profile, json.dumps(backend_config) if backend_config else ""))
    for index, obj in enumerate(slices):
        obj["metadata"]["name"] = f"{obj['metadata']['generateName']}{index:05d}"
    return slices


def device_classes() -> list[Obj]:
    return [d for d in yaml.safe_load_all((ROOT / "deploy/base/30-deviceclasses.yaml").read_text()) if d]


def example_claim(name: str, namespace: str = "default") -> Obj:
    """The claim of an example's ResourceClaimTemplate in deploy/examples/."""
    for doc in yaml.safe_load_all((ROOT / "deploy/examples" / f"{name}.yaml").read_text()):
        if doc and doc["kind"] == "ResourceClaimTemplate":
            return claim(name, namespace=namespace, spec=doc["spec"]["spec"])
    raise AssertionError(f"no ResourceClaimTemplate in {name}.yaml")


def claim(name: str, *requests: Obj, namespace: str = "default", spec: Obj | None = None,
          constraints: list[Obj] | None = None, config: list[Obj] | None = None) -> Obj:  # fmt: skip
    devices: Obj = {"requests": list(requests)}
    if constraints:
        devices["constraints"] = constraints
    if config:
        devices["config"] = config
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec or {"devices": devices}}  # fmt: skip


def exactly(name: str, class_name: str, *selectors: str, count: int | None = None, mode: str | None = None,
            **extra: Any) -> Obj:  # fmt: skip
    spec: Obj = {"deviceClassName": class_name, **extra}
    if selectors:
        spec["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    if count is not None:
        spec["count"] = count
    if mode is not None:
        spec["allocationMode"] = mode
    return {"name": name, "exactly": spec}


def held_by(obj: Obj, allocation: Any) -> Obj:
    """``obj`` (a claim) with ``allocation.status`` as its ``status.allocation``."""
    return {**obj, "status": {"allocation": allocation.status}}


def device_class(name: str, *selectors: str, config: list[Obj] | None = None) -> Obj:
    spec: Obj = {"selectors": [{"cel": {"expression": s}} for s in selectors]}
    if config:
        spec["config"] = config
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name}, "spec": spec}


def device(name: str, attributes: Obj | None = None, *, taints: list[Obj] | None = None,
           consumes: dict[str, dict[str, str]] | None = None) -> Obj:  # fmt: skip
    """A device with attributes (bool, int or str by Python type), optional taints and counter consumption."""
    kinds = {bool: "bool", int: "int", str: "string"}
    found: Obj = {"name": name, "attributes": {k: {kinds[type(v)]: v} for k, v in (attributes or {}).items()}}
    if taints:
        found["taints"] = taints
    if consumes:
        found["consumesCounters"] = [{"counterSet": s, "counters": {c: {"value": v} for c, v in counters.items()}}
                                     for s, counters in consumes.items()]  # fmt: skip
    return found


def resource_slice(name: str, *devices: Obj, driver: str = "x.example.com", pool: str = "node-a",
                   node: str | None = "node-a", generation: int = 0, count: int = 1,
                   counters: dict[str, dict[str, str]] | None = None, **placement: Any) -> Obj:  # fmt: skip
    spec: Obj = {"driver": driver, "pool": {"name": pool, "generation": generation, "resourceSliceCount": count}}
    if node is not None:
        spec["nodeName"] = node
    spec.update(placement)
    if devices:
        spec["devices"] = list(devices)
    if counters:
        spec["sharedCounters"] = [{"name": s, "counters": {c: {"value": v} for c, v in cs.items()}}
                                  for s, cs in counters.items()]  # fmt: skip
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name}, "spec": spec}
