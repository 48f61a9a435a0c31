"""The number of VFs each SR-IOV physical function should have, from the sriov-nic backend's configuration, and
setting it through sysfs as the kernel requires.

    backend_config:
      sriov-nic:
        numVfs:
          - {pf: enp25s0f0np0, count: 16}      # by interface name
          - {pf: "0000:1d:00.0", count: 32}    # by PCI address
          - {pf: "15b3:1021", count: 8}        # by vendor:device, every such PF

The first rule that matches a PF applies. A count can only be set from 0 (the kernel refuses N → M), so a change
goes through 0, which destroys the PF's VFs: the agent changes a PF only while none of its VFs is prepared for a
claim, and never touches a PF that carries the host's traffic (its default route or addresses). Each refusal or
failure is reported for that PF, and the others go on.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from backends.host_net import HostNetwork
from backends.sysfs import SysfsError, list_dir, read_attr, read_hex, read_int
from backends.topology import TopologyError, normalize_bus_id

__all__ = ["PhysicalFunction", "VfCountRule", "apply_vf_count", "physical_functions", "wanted_counts"]

SETTLE_SECONDS = 10.0
"""How long the VFs may take to appear or go after a write (the kernel creates them synchronously; their
drivers' probes and netdevs may follow)."""

_VENDOR_DEVICE = re.compile(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{4}$")
_NETWORK_CLASS = 0x02


class VfCountRule(BaseModel):
    """`{pf: <interface name | PCI address | vendor:device>, count: N}`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pf: str = Field(min_length=1, max_length=64)
    count: int = Field(ge=0, le=4096)

    @field_validator("pf")
    @classmethod
    def _selector(cls, value: str) -> str:
        if ":" in value and not _VENDOR_DEVICE.match(value):
            try:
                return normalize_bus_id(value)
            except TopologyError:
                raise ValueError(f"{value!r} is neither an interface name, a PCI address nor vendor:device "
                                 "(hex, e.g. 15b3:1021)") from None
        return value


@dataclass(frozen=True)
class PhysicalFunction:
    """An SR-IOV capable network function as sysfs shows it now."""

    bus_id: str
    netdevs: tuple[str, ...]
    vendor: int
    device: int
    total: int
    current: int
    vfs: tuple[str, ...]  # the VFs' PCI addresses

    def matches(self, rule: VfCountRule) -> bool:
        if _VENDOR_DEVICE.match(rule.pf):
            vendor, device = (int(part, 16) for part in rule.pf.split(":"))
            return (vendor, device) == (self.vendor, self.device)
        return rule.pf == self.bus_id or rule.pf in self.netdevs


def physical_functions(sysfs_root: Path) -> list[PhysicalFunction]:
    """Every network function with SR-IOV capability (blocking: sysfs reads)."""
    found: list[PhysicalFunction] = []
    devices = f"{sysfs_root}/bus/pci/devices"
    for bus_id in list_dir(devices):
        folder = f"{devices}/{bus_id}"
        total = read_int(f"{folder}/sriov_totalvfs")
        cls = read_hex(f"{folder}/class")
        if not total or cls is None or cls >> 16 != _NETWORK_CLASS:
            continue
        vfs = tuple(sorted(os.path.basename(os.path.realpath(f"{folder}/{link}"))
                           for link in list_dir(folder) if link.startswith("virtfn")))
        found.append(PhysicalFunction(
            bus_id=bus_id, netdevs=tuple(list_dir(f"{folder}/net")), vendor=read_hex(f"{folder}/vendor") or 0,
            device=read_hex(f"{folder}/device") or 0, total=total, current=read_int(f"{folder}/sriov_numvfs") or 0,
            vfs=vfs,
        ))
    return found


def wanted_counts(rules: Sequence[VfCountRule], pfs: Sequence[PhysicalFunction]) -> dict[str, int]:
    """PF address → the count its first matching rule asks for (PFs no rule names are left out)."""
    wanted: dict[str, int] = {}
    for pf in pfs:
        rule = next((r for r in rules if pf.matches(r)), None)
        if rule is not None:
            wanted[pf.bus_id] = rule.count
    return wanted


class VfCountError(Exception):
    """A PF's VF count was not changed; the message says why."""


def apply_vf_count(sysfs_root: Path, pf: PhysicalFunction, count: int, host: HostNetwork,
                   in_use: set[str], settle: float = SETTLE_SECONDS) -> bool:
    """Give `pf` `count` VFs (through 0 when it has others); False when it had them already. Blocking.

    `in_use` holds the PCI addresses of VFs prepared for claims: their PF is left as it is.
    """
    if count == pf.current:
        return False
    if count > pf.total:
        raise VfCountError(f"PF {pf.bus_id}: {count} VFs asked for, it supports at most {pf.total}")
    for netdev in pf.netdevs:
        reason = host.busy(netdev)
        if reason:
            raise VfCountError(f"PF {pf.bus_id}: left at {pf.current} VFs: {reason}")
    busy = sorted(set(pf.vfs) & in_use)
    if busy:
        raise VfCountError(f"PF {pf.bus_id}: left at {pf.current} VFs: VF(s) {', '.join(busy)} prepared for claims")
    path = f"{sysfs_root}/bus/pci/devices/{pf.bus_id}/sriov_numvfs"
    if pf.current:
        _write_and_wait(path, pf.bus_id, 0, settle)
    if count:
        _write_and_wait(path, pf.bus_id, count, settle)
    return True


def _write_and_wait(path: str, bus_id: str, count: int, settle: float) -> None:
    try:
        with open(path, "w") as f:
            f.write(f"{count}\n")
    except OSError as e:
        raise VfCountError(f"PF {bus_id}: writing {count} to sriov_numvfs failed: {e.strerror or e}") from None
    folder = os.path.dirname(path)
    deadline = time.monotonic() + settle
    while True:
        try:
            now = read_attr(path)
            links = sum(1 for name in list_dir(folder) if name.startswith("virtfn"))
        except SysfsError:
            now, links = None, -1
        if now == str(count) and links == count:
            return
        if time.monotonic() > deadline:
            raise VfCountError(f"PF {bus_id}: {count} VFs asked for, {links} present after {settle:g} s "
                               f"(sriov_numvfs reads {now})")
        time.sleep(0.01)  # the VFs' folders appear as the kernel (or its simulation) creates them
