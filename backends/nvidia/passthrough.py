"""GPUs a claim holds on vfio-pci: NVML lists only the GPUs the nvidia driver holds, so while a GPU is passed
through it is gone from NVML. nvidia-gpu keeps publishing it as it was (same name, attributes and capacity), from
a description kept with its vfio journal entry, until unprepare gives it back to nvidia and NVML lists it again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from backends.contract import AttributeValue, Device, Version
from backends.topology import TopologyReader

__all__ = ["describe", "held_device"]


def describe(device: Device, bus_id: str) -> dict[str, Any]:
    """What publishing `device` again needs, as JSON (a version attribute as {"version": text})."""
    attributes = {k: {"version": v.text} if isinstance(v, Version) else v for k, v in device.attributes.items()}
    return {"busId": bus_id, "attributes": attributes, "capacity": dict(device.capacity)}


def held_device(name: str, description: Mapping[str, Any], topology: TopologyReader) -> Device:
    """The device as `describe` saw it, with its topology read again from sysfs (the function is still there)."""
    attributes: dict[str, AttributeValue] = {}
    for key, value in description["attributes"].items():
        attributes[key] = Version(value["version"]) if isinstance(value, dict) else value
    return Device(name=name, attributes=attributes, capacity={k: int(v) for k, v in description["capacity"].items()},
                  topology=topology.lookup(description["busId"]))
