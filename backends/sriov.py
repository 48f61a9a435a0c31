"""The sriov-nic backend: the virtual functions of every SR-IOV capable network adapter.

A physical function is any network-class PCI function with `sriov_totalvfs` > 0; its VFs are found through its
`virtfn<N>` links. Each VF is one allocatable device carrying its PF, kernel driver, netdev, RDMA capability
and the standard topology attributes, so a claim can pair it with a GPU on the same PCIe root or switch.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

from backends.base import BuiltinBackend
from backends.contract import Allocated, AttributeValue, ClaimRef, Device, Inventory, Prepared, PrepareError
from backends.sysfs import SysfsError, list_dir, list_pci_devices, read_hex, read_int, read_link_name
from backends.topology import device_name
from cdi.spec import ContainerEdits, DeviceNode

__all__ = ["SriovNicBackend"]

_NETWORK_CLASS = 0x02


class SriovNicBackend(BuiltinBackend):
    """SR-IOV virtual functions of network adapters."""

    name = "sriov-nic"
    driver = "sriov.dra-agent.io"

    def __init__(self) -> None:
        super().__init__()
        self._vfs: dict[str, str] = {}  # device name → VF bus id, from the last discovery

    async def prepare(self, claim: ClaimRef, devices: Sequence[Allocated]) -> Sequence[Prepared]:
        """A VF keeps its kernel driver: the container gets its RDMA verbs device, when it has one."""
        missing = [a.device for a in devices if a.device not in self._vfs]
        if missing:
            raise PrepareError(f"{', '.join(missing)} not found on this node (any more)")
        return await asyncio.to_thread(self._prepare, devices)

    def _prepare(self, devices: Sequence[Allocated]) -> list[Prepared]:
        prepared: list[Prepared] = []
        has_cm = (self.ctx.dev_root / "infiniband/rdma_cm").exists()
        rdma_cm = (DeviceNode("/dev/infiniband/rdma_cm"),) if has_cm else ()
        for allocated in devices:
            folder = self.ctx.topology.device_dir(self._vfs[allocated.device])
            try:
                verbs = [v for v in list_dir(folder / "infiniband_verbs") if v.startswith("uverbs")]
            except SysfsError as e:
                raise PrepareError(f"{allocated.device}: {e}") from None
            nodes = tuple(DeviceNode(f"/dev/infiniband/{v}") for v in verbs)
            prepared.append(Prepared(
                device=allocated.device,
                edits=ContainerEdits(device_nodes=nodes),
                common_edits=ContainerEdits(device_nodes=rdma_cm) if nodes else None,
            ))
        return prepared

    async def discover(self) -> Inventory:
        return await asyncio.to_thread(self._discover)

    def _discover(self) -> Inventory:
        devices: list[Device] = []
        warnings: list[str] = []
        try:
            bus_ids = list_pci_devices(self.ctx.sysfs_root)
        except SysfsError as e:
            return Inventory(warnings=(str(e),))
        for bus_id in bus_ids:
            folder = str(self.ctx.topology.device_dir(bus_id))
            try:
                if not _is_physical_function(folder):
                    continue
                devices.extend(self._virtual_functions(bus_id, folder, warnings))
            except SysfsError as e:
                warnings.append(f"NIC {bus_id}: {e}; its VFs are left out")
        self._vfs = {d.name: d.topology.bus_id for d in devices if d.topology is not None}
        return Inventory(devices=tuple(devices), warnings=tuple(warnings))

    def _virtual_functions(self, pf_bus_id: str, pf: str, warnings: list[str]) -> list[Device]:
        pf_netdevs = list_dir(f"{pf}/net")
        pf_name = pf_netdevs[0] if pf_netdevs else None
        speed = read_int(f"{pf}/net/{pf_name}/speed") if pf_name else None
        links = sorted(
            (int(entry.removeprefix("virtfn")), entry)
            for entry in list_dir(pf)
            if entry.startswith("virtfn") and entry.removeprefix("virtfn").isdigit()
        )
        devices: list[Device] = []
        for index, link in links:
            vf_bus_id = read_link_name(f"{pf}/{link}")
            if vf_bus_id is None:
                continue
            topology = self.ctx.topology.lookup(vf_bus_id)
            warnings.extend(topology.problems)
            vf = os.path.dirname(pf) + "/" + vf_bus_id
            attrs: dict[str, AttributeValue] = {
                "type": "vf",
                "pfPciBusID": pf_bus_id,
                "vfIndex": index,
                "rdma": bool(list_dir(f"{vf}/infiniband")),
            }
            if pf_name:
                attrs["pfName"] = pf_name
            if topology.vendor_id is not None and topology.device_id is not None:
                attrs["vendorID"] = f"{topology.vendor_id:04x}"
                attrs["deviceID"] = f"{topology.device_id:04x}"
            if topology.driver:
                attrs["driver"] = topology.driver
            netdevs = list_dir(f"{vf}/net")
            if netdevs:
                attrs["netdev"] = netdevs[0]
            if speed is not None and speed > 0:
                attrs["linkSpeedMbps"] = speed
            devices.append(Device(name=device_name("vf", vf_bus_id), attributes=attrs, topology=topology))
        return devices


def _is_physical_function(folder: str) -> bool:
    total = read_int(f"{folder}/sriov_totalvfs")
    if not total:
        return False
    cls = read_hex(f"{folder}/class")
    return cls is not None and cls >> 16 == _NETWORK_CLASS
