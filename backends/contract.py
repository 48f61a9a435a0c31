"""The backend contract: the protocol a device-family plugin implements and the values it exchanges with the core.

A backend owns some physical devices of the node. The core starts it with a `BackendContext`, asks it for an
`Inventory`, and later asks it to prepare and unprepare devices for claims and listens to its health events.
Backends never talk to Kubernetes or gRPC; they speak only in the types defined here (attribute values come from
`backends.attributes`, PCI topology from `backends.topology`; both sit below this module).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, NewType, Protocol, runtime_checkable

from backends.attributes import AttributeValue, Version, is_semver
from backends.topology import PciTopology, TopologyReader

if TYPE_CHECKING:
    import pyudev
    from prometheus_client import CollectorRegistry
    from structlog.typing import FilteringBoundLogger

    from cdi.spec import ContainerEdits

__all__ = [
    "Allocated",
    "AttributeValue",
    "Backend",
    "BackendContext",
    "BackendError",
    "CapacityPolicy",
    "CapacityRange",
    "ClaimRef",
    "ConfigError",
    "CounterConsumption",
    "CounterSet",
    "Device",
    "DeviceEvents",
    "DeviceName",
    "DevicesChanged",
    "Health",
    "HealthEvent",
    "Inventory",
    "LinkEvents",
    "NetworkData",
    "PrepareError",
    "Prepared",
    "Unserved",
    "Version",
    "is_semver",
]

DeviceName = NewType("DeviceName", str)


@dataclass(frozen=True)
class CounterSet:
    """A named set of counters that devices of the same pool draw from (partitionable devices)."""

    name: str
    counters: Mapping[str, int]


@dataclass(frozen=True)
class CounterConsumption:
    """How much of a counter set one device uses while it is allocated."""

    counter_set: str
    counters: Mapping[str, int]


@dataclass(frozen=True)
class CapacityRange:
    """The amounts a claim may take of a shared capacity: from `min` up to `max` (None: the whole capacity), in
    multiples of `step` above `min` (None: any amount)."""

    min: int
    max: int | None = None
    step: int | None = None


@dataclass(frozen=True)
class CapacityPolicy:
    """How claims may take a capacity of a device published with `allow_multiple_allocations` (the slice's
    `requestPolicy`): `default` is what a claim that names no amount gets; exactly one of `valid_values`
    (ascending, at most 10) or `valid_range` says which amounts exist. The scheduler rounds a request up to the
    next amount that exists. The API server's rules for it (all within the capacity, `default` one of the
    amounts) are checked when the slice is built: a device with a policy that breaks them is not published."""

    default: int
    valid_values: tuple[int, ...] = ()
    valid_range: CapacityRange | None = None

    def __post_init__(self) -> None:
        if bool(self.valid_values) == (self.valid_range is not None):
            raise ValueError("a capacity policy needs exactly one of valid_values or valid_range")


@dataclass(frozen=True)
class Device:
    """One allocatable device as a backend sees it.

    `attributes` keys without a domain live in the driver's domain. Set `topology` for a PCI device and the
    standard topology attributes (resource.kubernetes.io/pcieRoot, pciBusID, numaNode, dra-agent.io/pcieSwitch)
    are published with the same names for every backend.

    `allow_multiple_allocations`: the device may be allocated to several claims at once, each taking a share of
    every capacity (KEP-5075); `capacity_policies` names, per capacity, the amounts a share may take. Such a
    device's `prepare` gets `Allocated.share_id` set, once per share.
    """

    name: str
    attributes: Mapping[str, AttributeValue] = field(default_factory=dict)
    capacity: Mapping[str, int] = field(default_factory=dict)
    consumes_counters: tuple[CounterConsumption, ...] = ()
    topology: PciTopology | None = None
    allow_multiple_allocations: bool = False
    capacity_policies: Mapping[str, CapacityPolicy] = field(default_factory=dict)

    def published_attributes(self) -> dict[str, AttributeValue]:
        """Own attributes plus the standard topology attributes; a backend may not override the latter."""
        merged: dict[str, AttributeValue] = dict(self.topology.attributes()) if self.topology else {}
        clash = merged.keys() & self.attributes.keys()
        if clash:
            raise ValueError(f"device {self.name}: attributes {sorted(clash)} are set from the PCI topology")
        merged.update(self.attributes)
        return merged


@dataclass(frozen=True)
class Unserved:
    """Hardware a backend knows is on the node but cannot serve at all, and why: e.g. NVIDIA GPUs in sysfs whose
    driver's NVML library cannot be loaded. Unlike a warning about one device (left out, an attribute dropped),
    this is an error an operator must act on: the core logs it as one, counts it in the metric
    `dra_agent_unserved_devices` and answers /readyz with 503 and the reason until a discovery no longer reports
    it. A backend reporting it should look again by itself (and yield `DevicesChanged` once it can serve them)."""

    devices: tuple[str, ...]
    """How an operator finds the hardware, e.g. PCI addresses."""
    reason: str


@dataclass(frozen=True)
class Inventory:
    """What a backend owns right now, plus what it could not discover and why: `warnings` about single devices or
    attributes, `unserved` for hardware it cannot serve at all."""

    devices: tuple[Device, ...] = ()
    counter_sets: tuple[CounterSet, ...] = ()
    warnings: tuple[str, ...] = ()
    unserved: tuple[Unserved, ...] = ()


@dataclass(frozen=True)
class BackendContext:
    """Everything a backend may use from the host: where sysfs, /dev and the host's files are, topology, its
    config, a logger. Container edits name host paths as the container runtime sees them (e.g. /dev/nvidia0,
    /usr/lib/...), found by the backend under these roots: a file seen at `host_root / p` is `/p` on the host."""

    sysfs_root: Path
    dev_root: Path
    host_root: Path
    topology: TopologyReader
    config: Mapping[str, Any]
    log: FilteringBoundLogger
    udev: DeviceEvents | None = None
    """The node's udev events; None where udev cannot be watched (then there is no hot-plug)."""
    registry: CollectorRegistry | None = None
    """Where a backend registers its own Prometheus metrics (named `dra_agent_<backend>_...`)."""
    links: LinkEvents | None = None
    """The node's network link changes (rtnetlink); None where they cannot be watched."""
    state_dir: Path | None = None
    """A directory of the backend's own for records that must outlive the process (what it created on the
    hardware); None in one-off commands such as `discover`, which change nothing."""
    driver_root: Path = field(kw_only=True)
    """Where the accelerator vendor's driver user-space files (libraries, binaries, its own /dev when it has one)
    are seen: `host_root` for a driver installed on the host, or a folder below it (e.g.
    `<host_root>/run/nvidia/driver`, a driver container's root). Only the NVIDIA backends use it today."""


@dataclass(frozen=True)
class ClaimRef:
    """The ResourceClaim a prepare or unprepare is for."""

    uid: str
    namespace: str
    name: str


@dataclass(frozen=True)
class Allocated:
    """A device of this backend allocated to a claim, with the claim's typed opaque configuration for it.

    `config` is the effective configuration of the request the device was allocated for (class configuration
    first, claim configuration over it, request-specific over general), already validated against one of the
    backend's `config_types`; None when the claim gives none.

    `admin_access`: the device was allocated with admin access (a monitoring pod's claim). It is not in use: a
    workload claim may hold the same device before, during and after. Give access to the device as it is and
    change nothing on it (no mode, no partition, no driver binding); refuse a configuration that would, and make
    `unprepare` undo nothing a workload set up (key your records by claim, as the built-in backends do).
    """

    device: str
    request: str
    config: Any = None
    admin_access: bool = False
    share_id: str | None = None
    """Set when the device is shared by capacity (it is published with `allow_multiple_allocations`): this claim
    holds one share of it, and other claims may hold others at the same time."""
    consumed: Mapping[str, int] = field(default_factory=dict)
    """For a share: how much of each of the device's capacities it was allocated (`consumedCapacity`)."""


@dataclass(frozen=True)
class NetworkData:
    """The network interface a workload got with a device, as the claim's status reports it (`networkData`):
    its name inside the pod, its MAC address, and its addresses in CIDR form (e.g. `192.0.2.5/24`)."""

    interface_name: str = ""
    hardware_address: str = ""
    ips: tuple[str, ...] = ()


@dataclass(frozen=True)
class Prepared:
    """A device made ready for a claim: what the container gets, and what undoing it needs.

    `edits` apply to containers using this device; `common_edits` to every container using any device of the
    claim (shared control nodes, driver libraries, claim-wide environment) and are merged once per claim.
    `restore` is checkpointed by the core and handed back to `unprepare`, possibly after a restart, so it
    must be JSON-serialisable and sufficient on its own (e.g. MIG instance ids, the driver a device had).

    `facts` are what the workload learns about the device it got, in the form of slice attributes (names without
    a domain are in the driver's): the GPU's UUID, the PCI address of a device on vfio-pci, a VF's interface and
    MAC, a TPU's chip indices. The core puts them into the claim's status (`data`) and, where enabled, the device
    metadata file in the container. `network` is the interface the workload got, for the status's `networkData`.
    For a share of a device, repeat the `share_id` of the `Allocated` it is for.
    """

    device: str
    edits: ContainerEdits
    common_edits: ContainerEdits | None = None
    restore: Mapping[str, Any] = field(default_factory=dict)
    facts: Mapping[str, AttributeValue] = field(default_factory=dict)
    network: NetworkData | None = None
    share_id: str | None = None
    """The `Allocated.share_id` this answers for (a claim may hold two shares of one device); kept and handed
    back to `unprepare`."""


class Health(Enum):
    """Device health as reported to the kubelet."""

    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"
    UNKNOWN = "Unknown"


@dataclass(frozen=True)
class HealthEvent:
    """A change of one device's health.

    `reason` says why in words an operator understands; it becomes the kubelet's health message. `cause` is a
    short machine name for the condition (a DNS label, e.g. "xid", "ecc", "gpu-lost", "link-down") and `value`
    an optional detail (e.g. the Xid "79"): the core turns an unhealthy device's cause into a device taint
    `<driver>/<cause>=<value>`. A HEALTHY event clears whatever the device had.
    """

    device: str
    health: Health
    reason: str = ""
    cause: str = ""
    value: str = ""


@dataclass(frozen=True)
class DevicesChanged:
    """Devices of the backend appeared or disappeared (hot-plug, driver bound or unbound): the core calls
    `discover()` again and publishes the result. `reason` is logged."""

    reason: str = ""


class DeviceEvents(Protocol):
    """The node's udev events, from one monitor the core shares between backends (pyudev devices)."""

    def subscribe(self, subsystem: str, handler: Callable[[pyudev.Device], None]) -> Callable[[], None]:
        """Call `handler` on the event loop for every event of `subsystem` ("pci", "net", ...), with the
        device's `action` set; the returned function unsubscribes."""


class LinkEvents(Protocol):
    """The node's network links going down or up, appearing or going: what the kernel reports over rtnetlink
    and not as uevents. Shared by the backends like `DeviceEvents`."""

    def subscribe(self, handler: Callable[[str], None]) -> Callable[[], None]:
        """Call `handler(interface name)` on the event loop for every such change (read the state from sysfs);
        the returned function unsubscribes."""


class BackendError(Exception):
    """A backend could not do what was asked; the message is shown to operators as is."""


class ConfigError(BackendError):
    """The backend's configuration or a claim's opaque parameters are invalid."""


class PrepareError(BackendError):
    """Preparing or unpreparing a device for a claim failed; reported for that claim only."""


@runtime_checkable
class Backend(Protocol):
    """A device-family plugin. Blocking calls (sysfs, NVML) must run off the event loop."""

    # Read-only: a class attribute (as BackendBase's subclasses have), an instance attribute or a property.
    @property
    def name(self) -> str:
        """The entry-point name, e.g. 'nvidia-gpu'."""

    @property
    def driver(self) -> str:
        """The DRA driver name it publishes under by default, e.g. 'gpu.nvidia.com'."""

    async def start(self, ctx: BackendContext) -> None:
        """Validate configuration and open what discovery needs; raise ConfigError or BackendError."""

    async def discover(self) -> Inventory:
        """Return the devices this backend owns now; problems with single devices go into warnings."""

    def health(self) -> AsyncIterator[HealthEvent | DevicesChanged]:
        """Stream health changes of owned devices, and changes of the device set, until stopped.

        Event-driven: a backend waits on its sources (NVML events, udev), it never polls healthy devices.
        """

    async def prepare(self, claim: ClaimRef, devices: Sequence[Allocated]) -> Sequence[Prepared]:
        """Make the devices ready for the claim, one `Prepared` per device; idempotent for the same claim.

        Raise PrepareError (or ConfigError) with a message for the operator; the claim fails, nothing else.
        """

    async def unprepare(self, claim: ClaimRef, prepared: Sequence[Prepared]) -> None:
        """Undo `prepare` from its records alone; succeed if there is nothing left to undo.

        After a crash in the middle of `prepare`, the records carry only the device names (empty edits and
        restore): undo whatever of the preparation exists.
        """

    async def stop(self) -> None:
        """Release everything `start` opened."""

    # Optional members (`reconcile`, `records_own_changes`, `config_types`, `config_model`) have protocols of
    # their own in backends/capabilities.py, which the core checks with isinstance.
