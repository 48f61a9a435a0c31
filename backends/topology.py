"""PCIe topology of a PCI device from sysfs: root complex, closest switch, NUMA node, IOMMU group, ids, driver.

The root complex follows the upstream Kubernetes algorithm for `resource.kubernetes.io/pcieRoot` exactly, so our
values match those of every other driver on the node: read the `bus/pci/devices/<BDF>` link without following the
chain, resolve it against its directory, and take the first component under `devices/` (e.g. `pci0000:15`).
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from backends.attributes import AttributeValue
from backends.sysfs import SysfsError, read_hex, read_int, read_link_name

__all__ = [
    "NUMA_NODE",
    "PCIE_ROOT",
    "PCIE_SWITCH",
    "PCI_BUS_ID",
    "PciTopology",
    "TopologyError",
    "TopologyReader",
    "device_name",
    "is_bus_id",
    "normalize_bus_id",
]

PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
NUMA_NODE = "resource.kubernetes.io/numaNode"
PCIE_SWITCH = "dra-agent.io/pcieSwitch"

_T = TypeVar("_T")

_BUS_ID = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f]")
_LOOSE_BUS_ID = re.compile(r"([0-9A-Fa-f]{4,8}):([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})\.([0-7])")

# PCI Express capability: id 0x10; the port type sits in bits 7:4 of its capabilities register.
_CAP_PCIE = 0x10
_PORT_UPSTREAM = 0x5
_PORT_TYPES_KNOWN = frozenset(range(0x0, 0xB))


class TopologyError(Exception):
    """The topology of a device cannot be determined from sysfs."""


def is_bus_id(text: str) -> bool:
    """Whether `text` is an extended BDF in the form the Kubernetes attributes use: '0000:3b:00.0'."""
    return _BUS_ID.fullmatch(text) is not None


def normalize_bus_id(raw: str) -> str:
    """Sysfs form of a PCI address given in another spelling, e.g. NVML's '00000000:3B:00.0'."""
    m = _LOOSE_BUS_ID.fullmatch(raw.strip())
    if m is None or int(m[1], 16) > 0xFFFF:
        raise TopologyError(f"{raw!r} is not a PCI address (domain:bus:device.function)")
    return f"{int(m[1], 16):04x}:{m[2].lower()}:{m[3].lower()}.{m[4]}"


@dataclass(frozen=True)
class PciTopology:
    """Where a PCI device sits and what it is; unknown facts are None (numa_node -1)."""

    bus_id: str
    pcie_root: str | None = None
    pcie_switch: str | None = None
    numa_node: int = -1
    iommu_group: int | None = None
    vendor_id: int | None = None
    device_id: int | None = None
    class_code: int | None = None
    driver: str | None = None
    problems: tuple[str, ...] = ()

    def attributes(self) -> dict[str, AttributeValue]:
        """The standard topology attributes, identical in name and form for every backend."""
        attrs: dict[str, AttributeValue] = {PCI_BUS_ID: self.bus_id}
        if self.pcie_root is not None:
            attrs[PCIE_ROOT] = self.pcie_root
        if self.numa_node >= 0:
            attrs[NUMA_NODE] = self.numa_node
        if self.pcie_switch is not None:
            attrs[PCIE_SWITCH] = self.pcie_switch
        return attrs


class TopologyReader:
    """Reads PCI topology below one sysfs root (normally /sys)."""

    def __init__(self, sysfs_root: Path) -> None:
        self.sysfs_root = sysfs_root
        # Paths are built as strings here: lookups run for every device, and pathlib's joins cost more
        # than the file reads they lead to.
        self._devices = os.path.join(sysfs_root, "bus", "pci", "devices")
        # A bridge's port type is fixed by its silicon; cache it, since every device below reads it.
        self._port_types: dict[tuple[str, ...], int | None] = {}

    def device_dir(self, bus_id: str) -> Path:
        """The `bus/pci/devices/<BDF>` entry of a device."""
        return Path(self.device_folder(bus_id))

    def device_folder(self, bus_id: str) -> str:
        """`device_dir` as a string, for reading many devices' files: discovery looks at every PCI device of the
        node, and four pathlib joins per device cost more than the file it reads next."""
        return f"{self._devices}/{bus_id}"

    def device_path(self, bus_id: str) -> tuple[str, ...]:
        """Components of the device's path under `devices/`: root complex, bridges, then the device."""
        if not is_bus_id(bus_id):
            raise TopologyError(f"{bus_id!r} is not a PCI bus id of the form 0000:3b:00.0")
        link = f"{self._devices}/{bus_id}"
        try:
            target = os.readlink(link)
        except FileNotFoundError:
            raise TopologyError(f"{link} does not exist") from None
        except OSError as e:
            raise TopologyError(f"cannot read link {link}: {e.strerror or e}") from None
        if posixpath.isabs(target):
            # Real sysfs links are relative; an absolute one must still point into this sysfs root.
            root = str(self.sysfs_root).rstrip("/") + "/"
            if not target.startswith(root):
                raise TopologyError(f"{link} points outside {self.sysfs_root}: {target}")
            resolved = target[len(root) :]
        else:
            resolved = posixpath.normpath(posixpath.join("bus/pci/devices", target))
        parts = tuple(resolved.split("/"))
        if len(parts) < 3 or parts[0] != "devices" or not parts[1].startswith("pci") or parts[-1] != bus_id:
            raise TopologyError(f"{link} points to {target}, not to a device below a PCI root complex")
        return parts[1:]

    def pcie_root(self, bus_id: str) -> str:
        """The root complex (host bridge) of a device, e.g. 'pci0000:15'."""
        return self.device_path(bus_id)[0]

    def pcie_switch(self, bus_id: str) -> str | None:
        """The upstream port of the closest PCIe switch above the device, or None below a bare root port."""
        return self._switch(self.device_path(bus_id))

    def _port_type(self, bridge: tuple[str, ...]) -> int | None:
        if bridge not in self._port_types:
            self._port_types[bridge] = _port_type(os.path.join(self.sysfs_root, "devices", *bridge, "config"))
        return self._port_types[bridge]

    def _switch(self, path: tuple[str, ...]) -> str | None:
        bridges = path[1:-1]
        port_types = [self._port_type(path[: i + 2]) for i in range(len(bridges))]
        if bridges and all(t is not None for t in port_types):
            upstream = [b for b, t in zip(bridges, port_types, strict=True) if t == _PORT_UPSTREAM]
            return upstream[-1] if upstream else None
        # Without readable config space: a pure PCIe hierarchy is root port, then (upstream, downstream)
        # pairs, one pair per switch level; the closest switch's upstream port is the second-last bridge.
        return bridges[-2] if len(bridges) >= 3 else None

    def lookup(self, bus_id: str) -> PciTopology:
        """Everything known about a device; facts that cannot be read are left unknown and listed in problems."""
        problems: list[str] = []
        path = f"{self._devices}/{bus_id}"

        def attempt(what: str, read: Callable[[], _T]) -> _T | None:
            try:
                return read()
            except (SysfsError, TopologyError) as e:
                problems.append(f"{bus_id}: {what}: {e}")
                return None

        device_path = attempt("pcieRoot", lambda: self.device_path(bus_id))
        root = device_path[0] if device_path else None
        switch = self._switch(device_path) if device_path else None
        numa = attempt("numa_node", lambda: read_int(f"{path}/numa_node"))
        group = attempt("iommu_group", lambda: read_link_name(f"{path}/iommu_group"))
        return PciTopology(
            bus_id=bus_id,
            pcie_root=root,
            pcie_switch=switch,
            numa_node=numa if numa is not None and numa >= 0 else -1,
            iommu_group=int(group) if group is not None and group.isdigit() else None,
            vendor_id=attempt("vendor", lambda: read_hex(f"{path}/vendor")),
            device_id=attempt("device", lambda: read_hex(f"{path}/device")),
            class_code=attempt("class", lambda: read_hex(f"{path}/class")),
            driver=attempt("driver", lambda: read_link_name(f"{path}/driver")),
            problems=tuple(problems),
        )


def _port_type(config: str) -> int | None:
    """The PCIe port type from a bridge's config space, or None when it cannot be read."""
    try:
        fd = os.open(config, os.O_RDONLY)
    except OSError:
        return None
    try:
        space = os.read(fd, 256)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(space) < 0x40 or not space[0x06] & 0x10:  # status register: capability list present
        return None
    pointer, seen = space[0x34] & 0xFC, 0
    while pointer and pointer + 4 <= len(space) and seen < 48:
        if space[pointer] == _CAP_PCIE:
            port_type = (int.from_bytes(space[pointer + 2 : pointer + 4], "little") >> 4) & 0xF
            return port_type if port_type in _PORT_TYPES_KNOWN else None
        pointer, seen = space[pointer + 1] & 0xFC, seen + 1
    return None


def device_name(prefix: str, bus_id: str) -> str:
    """A stable device name derived from a PCI address: ('gpu', '0000:18:00.0') → 'gpu-0000-18-00-0'."""
    return f"{prefix}-{bus_id.replace(':', '-').replace('.', '-')}"
