"""Everything a backend plugin uses from dra-agent, in one module: `from backends.plugin import ...`.

A plugin package imports from the project only this module (its tests add `simulator.conformance`), so the
modules behind it may be regrouped without breaking a plugin. docs/plugin-guide.md has one table of the names.

- The contract (`backends.contract`): the `Backend` protocol and the values a backend exchanges with the agent;
  the optional members the agent recognises, as protocols (`backends.capabilities`).
- Typed settings and claim parameters (`backends.config`).
- `BackendBase`, the plumbing most backends share, and the health helpers (`backends.base`).
- The container edits `prepare` returns (`cdi.spec`) and a journal for records of hardware changes
  (`backends.journal`).
- Reading sysfs and the PCI topology (`backends.sysfs`, `backends.topology`).

The built-in backends import the modules behind this one directly.
"""

from __future__ import annotations

from backends.base import BackendBase, DeviceEventQueue, HealthLedger, pci_events_summary
from backends.capabilities import HasConfigModel, HasConfigTypes, ListsHardware, Reconciles, RecordsOwnChanges
from backends.config import BackendConfig, OpaqueConfig, Reconfiguration, parse_config
from backends.contract import (
    Allocated,
    AttributeValue,
    Backend,
    BackendContext,
    BackendError,
    CapacityPolicy,
    CapacityRange,
    ClaimRef,
    ConfigError,
    CounterConsumption,
    CounterSet,
    Device,
    DeviceEvents,
    DevicesChanged,
    Health,
    HealthEvent,
    Inventory,
    LinkEvents,
    NetworkData,
    Prepared,
    PrepareError,
    Unserved,
    Version,
)
from backends.journal import Journal
from backends.sysfs import SysfsError, list_dir, list_pci_devices, read_attr, read_hex, read_int, read_link_name
from backends.topology import (
    NUMA_NODE,
    PCI_BUS_ID,
    PCIE_ROOT,
    PCIE_SWITCH,
    PciTopology,
    TopologyError,
    TopologyReader,
    device_name,
    is_bus_id,
    normalize_bus_id,
)
from cdi.spec import ContainerEdits, DeviceNode, Hook, Mount, NetDevice

__all__ = [
    "NUMA_NODE",
    "PCIE_ROOT",
    "PCIE_SWITCH",
    "PCI_BUS_ID",
    "Allocated",
    "AttributeValue",
    "Backend",
    "BackendBase",
    "BackendConfig",
    "BackendContext",
    "BackendError",
    "CapacityPolicy",
    "CapacityRange",
    "ClaimRef",
    "ConfigError",
    "ContainerEdits",
    "CounterConsumption",
    "CounterSet",
    "Device",
    "DeviceEventQueue",
    "DeviceEvents",
    "DeviceNode",
    "DevicesChanged",
    "HasConfigModel",
    "HasConfigTypes",
    "Health",
    "HealthEvent",
    "HealthLedger",
    "Hook",
    "Inventory",
    "Journal",
    "LinkEvents",
    "ListsHardware",
    "Mount",
    "NetDevice",
    "NetworkData",
    "OpaqueConfig",
    "PciTopology",
    "PrepareError",
    "Prepared",
    "Reconciles",
    "Reconfiguration",
    "RecordsOwnChanges",
    "SysfsError",
    "TopologyError",
    "TopologyReader",
    "Unserved",
    "Version",
    "device_name",
    "is_bus_id",
    "list_dir",
    "list_pci_devices",
    "normalize_bus_id",
    "parse_config",
    "pci_events_summary",
    "read_attr",
    "read_hex",
    "read_int",
    "read_link_name",
]
