"""How NVML's health signals become device health: what the watcher reports, what an Xid means, which events
make a GPU unhealthy, and which devices a GPU's condition reaches.

Pure values and functions: the watcher thread (`health`) produces the notices, each backend's feed
(`health_feed`) applies these rules with its own configuration.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from enum import IntFlag

from backends.contract import Health

__all__ = [
    "DEFAULT_IGNORED_XIDS",
    "GPU_LOST",
    "NO_INSTANCE",
    "WATCHED_EVENTS",
    "Condition",
    "DeviceRef",
    "EventType",
    "GpuEvent",
    "GpuLost",
    "GpuRecovered",
    "GpuUnmonitored",
    "Ignored",
    "Notice",
    "Unit",
    "classify",
    "describe_xid",
    "device_conditions",
    "unit_of",
    "unmonitored",
    "worse",
]

NO_INSTANCE = 0xFFFFFFFF
"""gpuInstanceId/computeInstanceId of an event that concerns the whole GPU."""


class EventType(IntFlag):
    """NVML event types the agent watches (values of nvml.h's nvmlEventType*)."""

    SINGLE_BIT_ECC = 0x1
    DOUBLE_BIT_ECC = 0x2
    XID = 0x8


WATCHED_EVENTS = EventType.XID | EventType.DOUBLE_BIT_ECC | EventType.SINGLE_BIT_ECC
"""What NVIDIA's own device plugin and DRA driver register for; masked by what each GPU supports."""

DEFAULT_IGNORED_XIDS = frozenset({13, 31, 43, 45, 68, 109})
"""Xids caused by applications, not by the GPU (NVIDIA's device plugin and DRA driver ignore the same)."""

# NVIDIA's Xid catalog, for the codes an operator is most likely to meet.
_XID_MEANINGS = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    32: "invalid or corrupted push buffer stream",
    38: "driver firmware error",
    43: "GPU stopped processing",
    45: "preemptive cleanup, due to previous errors",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure",
    68: "video processor exception",
    69: "graphics engine class error",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
    999: "unknown error",
}


def describe_xid(code: int) -> str:
    """'Xid 79: GPU has fallen off the bus', or 'Xid N' for a code without a well-known meaning."""
    meaning = _XID_MEANINGS.get(code)
    return f"Xid {code}: {meaning}" if meaning else f"Xid {code}"


# -- what the watcher reports -------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuEvent:
    """One NVML event of a GPU; the instance ids name the MIG instance it is attributed to, if any."""

    uuid: str
    event_type: int
    data: int = 0
    gpu_instance: int = NO_INSTANCE
    compute_instance: int = NO_INSTANCE


@dataclass(frozen=True)
class GpuLost:
    """NVML reports the GPU lost (fallen off the bus)."""

    uuid: str
    detail: str = ""


@dataclass(frozen=True)
class GpuUnmonitored:
    """The GPU's health cannot be watched: it delivers no events, or NVML failed."""

    uuid: str
    detail: str


@dataclass(frozen=True)
class GpuRecovered:
    """NVML answers normally for the GPU again. `everything`: the GPU itself recovered (every condition of it
    ends); otherwise only its "unmonitored" condition ends (NVML works again)."""

    uuid: str
    everything: bool = True


Notice = GpuEvent | GpuLost | GpuUnmonitored | GpuRecovered


# -- conditions ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Condition:
    """What is wrong with a GPU or one of its MIG instances, as the device's health event will say it."""

    health: Health
    reason: str
    cause: str
    value: str = ""


@dataclass(frozen=True)
class Ignored:
    """An event that changes no health; `notable` ones (an Xid on the ignore list) are logged at info."""

    message: str
    notable: bool = False


GPU_LOST = Condition(Health.UNHEALTHY, "GPU has fallen off the bus: NVML reports it lost", "gpu-lost")


def unmonitored(detail: str) -> Condition:
    return Condition(Health.UNKNOWN, f"health not monitored: {detail}", "unmonitored")


def classify(event: GpuEvent, ignored_xids: Collection[int]) -> Condition | Ignored:
    """An event's verdict: a critical Xid or a double-bit ECC error makes the GPU (or the MIG instance the event
    is attributed to) unhealthy; Xids on the ignore list, corrected ECC errors and other types do not."""
    if event.event_type & EventType.XID:
        text = describe_xid(event.data)
        if event.data in ignored_xids:
            return Ignored(f"{text} (ignored: caused by an application)", notable=True)
        return Condition(Health.UNHEALTHY, text, "xid", str(event.data))
    if event.event_type & EventType.DOUBLE_BIT_ECC:
        return Condition(Health.UNHEALTHY, "double-bit (uncorrectable) ECC error", "ecc")
    if event.event_type & EventType.SINGLE_BIT_ECC:
        return Ignored("single-bit ECC error (corrected)")
    return Ignored(f"NVML event type {event.event_type:#x}")


def worse(old: Condition | None, new: Condition) -> Condition:
    """The condition to keep when `new` arrives: the first unhealthy cause stays until the GPU recovers (an Xid 79
    followed by "GPU lost" keeps saying Xid 79); unhealthy beats unknown; a later unknown replaces an earlier."""
    if old is None or old.health is not Health.UNHEALTHY:
        return new
    return old


# -- which devices a condition reaches ------------------------------------------------------------------

Unit = tuple[str, int, int]
"""(GPU UUID, GPU instance id, compute instance id): the whole GPU has both ids NO_INSTANCE."""


def unit_of(event: GpuEvent) -> Unit:
    """The part of the GPU an event concerns; a compute instance without its GPU instance means the GPU."""
    if event.gpu_instance == NO_INSTANCE:
        return (event.uuid, NO_INSTANCE, NO_INSTANCE)
    return (event.uuid, event.gpu_instance, event.compute_instance)


@dataclass(frozen=True)
class DeviceRef:
    """What a published device is in NVML's terms: its GPU (the parent's UUID for a MIG device) and instance."""

    uuid: str
    bus_id: str
    gpu_instance: int = NO_INSTANCE
    compute_instance: int = NO_INSTANCE


def _covers(unit: Unit, ref: DeviceRef) -> bool:
    _, gi, ci = unit
    if gi == NO_INSTANCE or ref.gpu_instance == NO_INSTANCE:
        return True  # the whole GPU, or a full-GPU device that contains every instance
    return gi == ref.gpu_instance and ci in (NO_INSTANCE, ref.compute_instance)


def device_conditions(units: Mapping[Unit, Condition], devices: Mapping[str, DeviceRef]) -> dict[str, Condition]:
    """The condition of every device some unit reaches (devices not in the result are healthy).

    Where several reach a device, unhealthy beats unknown and the whole GPU's condition beats an instance's.
    """
    by_gpu: dict[str, list[tuple[Unit, Condition]]] = {}
    for unit, condition in units.items():
        by_gpu.setdefault(unit[0], []).append((unit, condition))
    result: dict[str, Condition] = {}
    for name, ref in devices.items():
        hits = [(u, c) for u, c in by_gpu.get(ref.uuid, ()) if _covers(u, ref)]
        if hits:
            hits.sort(key=lambda h: (h[1].health is not Health.UNHEALTHY, h[0][1] != NO_INSTANCE, h[0][1], h[0][2]))
            result[name] = hits[0][1]
    return result
