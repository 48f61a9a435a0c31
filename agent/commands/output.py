"""Rendering command output: ResourceSlices as YAML, JSON or a readable table, and the backend list."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

__all__ = ["BackendRow", "render_backends", "render_slices", "table"]


def table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    """Left-aligned columns separated by two spaces."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in [header, *rows]]
    return "\n".join(lines)


def _value(attribute: Mapping[str, Any] | None) -> str:
    if not attribute:
        return ""
    (value,) = attribute.values()
    return str(value).lower() if isinstance(value, bool) else str(value)


def _describe(device: Mapping[str, Any]) -> str:
    attrs = device.get("attributes", {})

    def get(key: str) -> str:
        return _value(attrs.get(key))

    memory = device.get("capacity", {}).get("memory", {}).get("value", "")
    kind = get("type")
    if kind == "gpu":
        return f"{get('productName')} {memory}".strip()
    if kind == "mig":
        return f"{get('profile')} on {get('productName')} (GPU {get('parentIndex')})"
    if kind == "vf":
        rdma = " rdma" if get("rdma") == "true" else ""
        return f"VF {get('vfIndex')} of {get('pfName') or get('pfPciBusID')} ({get('driver')}{rdma})"
    if kind == "tpu":
        return f"TPU {get('generation')} chip {get('index')} ({get('deviceNodeKind')})"
    strings = [_value(v) for k, v in sorted(attrs.items()) if "string" in v and "/" not in k]
    return ", ".join(strings[:3])


def render_slices(slices: Sequence[Mapping[str, Any]], fmt: str) -> str:
    """The slices in the requested format: yaml (documents), json (a list), or table."""
    if fmt == "json":
        return json.dumps(list(slices), indent=2)
    if fmt == "yaml":
        return yaml.safe_dump_all(list(slices), sort_keys=False, explicit_start=True) if slices else ""
    pools: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for s in slices:
        pools.setdefault((s["spec"]["driver"], s["spec"]["pool"]["name"]), []).append(s)
    sections: list[str] = []
    for (driver, pool), members in pools.items():
        devices = [d for s in members for d in s["spec"].get("devices", [])]
        counter_sets = sum(len(s["spec"].get("sharedCounters", [])) for s in members)
        title = f"{driver}  pool {pool}: {len(devices)} devices in {len(members)} slice(s)"
        if counter_sets:
            title += f", {counter_sets} counter set(s)"
        rows = [
            (
                d["name"],
                _value(d.get("attributes", {}).get("type")),
                _describe(d),
                _value(d.get("attributes", {}).get("resource.kubernetes.io/pcieRoot")),
                _value(d.get("attributes", {}).get("dra-agent.io/pcieSwitch")) or "-",
                _value(d.get("attributes", {}).get("resource.kubernetes.io/numaNode")) or "-",
            )
            for d in devices
        ]
        sections.append(title + "\n" + table(rows, ("DEVICE", "TYPE", "DESCRIPTION", "PCIE ROOT", "SWITCH", "NUMA")))
    return "\n\n".join(sections)


@dataclass(frozen=True)
class BackendRow:
    """One line of `dra-agent backends`."""

    name: str
    distribution: str
    version: str
    driver: str | None
    enabled: bool
    devices: int | None
    status: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "driver": self.driver,
            "enabled": self.enabled,
            "devices": self.devices,
            "status": self.status,
        }


def render_backends(rows: Sequence[BackendRow], fmt: str) -> str:
    if fmt == "json":
        return json.dumps([r.as_dict() for r in rows], indent=2)
    return table(
        [(r.name, r.version, r.distribution, r.driver or "-", "yes" if r.enabled else "no", r.status) for r in rows],
        ("BACKEND", "VERSION", "DISTRIBUTION", "DRIVER", "ENABLED", "HARDWARE"),
    )
