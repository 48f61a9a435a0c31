"""SR-IOV in the simulated kernel: what writing a PF's `sriov_numvfs` does.

VFs are enabled where the PF's capability places them and named as a profile with that many VFs names them
(`layout.plan_vf`, `layout.vf_netdev`); a VF the profile has keeps its IOMMU group and RDMA device, one beyond
it gets the next free ones.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from simulator.kernel.pci import PciCore, read_text
from simulator.node.layout import NicPlan, PciFunction, plan_vf, vf_netdev
from simulator.node.sysfs_tree import bind as link_driver
from simulator.node.sysfs_tree import write_function, write_netdev, write_rdma
from simulator.udev.delivery import send
from simulator.udev.hotplug import _devices_deepest_first

__all__ = ["SriovControl"]

_log = logging.getLogger(__name__)


class SriovControl:
    """Enables and disables the VFs of the PFs of one node."""

    def __init__(self, pci: PciCore) -> None:
        self.pci = pci
        self.nics = {nic.bus_id: nic for nic in pci.plan.nics}
        self.refusals: list[str] = []

    def numvfs_written(self, pf_bus_id: str, pf: Path) -> list[Path]:
        """Apply what was written to the PF's sriov_numvfs; the folders of the VFs it enabled."""
        current = len(list(pf.glob("virtfn*")))
        text = read_text(pf / "sriov_numvfs").strip("\0 \n")
        try:
            wanted = int(text)
        except ValueError:
            wanted = -1
        total = int(read_text(pf / "sriov_totalvfs") or 0)
        nic = self.nics.get(pf_bus_id)
        if nic is None:
            refusal = "not an SR-IOV adapter of the profile"
        elif not 0 <= wanted <= total:
            refusal = f"{text!r} is not a VF count from 0 to sriov_totalvfs ({total})"
        elif wanted and current:
            refusal = f"{current} VFs are enabled; write 0 before enabling {wanted} (EBUSY)"
        else:
            refusal = None
        created: list[Path] = []
        if wanted == current:
            return created
        if refusal is not None:
            # The kernel fails the write and the attribute keeps its value; here the value is put back.
            self.refusals.append(f"{pf_bus_id}: sriov_numvfs {text!r} refused: {refusal}")
            _log.warning("simulated kernel: %s", self.refusals[-1])
            # Put back only what this write changed: a newer write has its own event coming.
            if read_text(pf / "sriov_numvfs").strip("\0 \n") == text:
                (pf / "sriov_numvfs").write_text(f"{current}\n")
        elif nic is not None and wanted:
            created = self._enable(nic, pf, wanted)
        elif current:
            self._disable(pf, current)
        return created

    def _enable(self, nic: NicPlan, pf: Path, count: int) -> list[Path]:
        pci = self.pci
        pf_fn = pci.function(nic.bus_id, pf)
        groups, rdma = self._free_numbers()
        vfs: list[tuple[PciFunction, int | None]] = []
        for index in range(count):
            planned = nic.vfs[index] if index < len(nic.vfs) else None
            if planned is not None:
                vf = plan_vf(pf_fn, nic.model, index, pci.planned[planned.bus_id].iommu_group)
                vfs.append((vf, planned.rdma_index))
            else:
                vf = plan_vf(pf_fn, nic.model, index, next(groups))
                vfs.append((vf, next(rdma) if nic.model.rdma else None))
        clash = [vf.bus_id for vf, _ in vfs if (pci.sys / "bus/pci/devices" / vf.bus_id).exists()]
        if clash:
            self.refusals.append(f"{nic.bus_id}: sriov_numvfs {count} refused: {clash[0]} is taken")
            _log.warning("simulated kernel: %s", self.refusals[-1])
            if read_text(pf / "sriov_numvfs").strip("\0 \n") == str(count):
                (pf / "sriov_numvfs").write_text("0\n")
            return []
        autoprobe = read_text(pf / "sriov_drivers_autoprobe").strip() != "0"
        up = read_text(pci.sys / "class/net" / nic.netdev / "operstate").strip() != "down"
        sysfs = str(pci.sys)
        created: list[Path] = []
        # Per VF, the driver link and then the PF's virtfn link come last: whoever waits for them finds the rest.
        for vf, rdma_index in vfs:
            write_function(sysfs, dataclasses.replace(vf, driver=None))
            folder = pci.sys / "devices" / Path(*vf.path)
            os.symlink(f"../{nic.bus_id}", folder / "physfn")
            events = [pci.pci_event("add", folder)]
            if autoprobe and vf.driver:
                write_netdev(sysfs, vf, vf_netdev(nic.netdev, len(created)), nic.model.speed_mbps, up)
                if rdma_index is not None:
                    write_rdma(sysfs, str(pci.root / "dev"), vf, rdma_index,
                               char=pci.plan.profile.device_nodes == "char")
                link_driver(sysfs, vf, vf.driver)
                children = _devices_deepest_first(folder)[:-1]
                events += [pci.injector._event("add", child) for child in reversed(children)]
                events.append(pci.pci_event("bind", folder, vf.driver))
            os.symlink(f"../{vf.bus_id}", pf / f"virtfn{len(created)}")
            send(pci.root, events)
            created.append(folder)
        return created

    def _disable(self, pf: Path, current: int) -> None:
        """VFs go last first, each unbound from its driver and then removed."""
        pci = self.pci
        for index in reversed(range(current)):
            link = pf / f"virtfn{index}"
            if not link.is_symlink():
                continue
            folder = pci.injector.inside(link)
            bus_id = folder.name
            pci.unbind(bus_id)
            pci.forget_class_devices(bus_id)
            event = pci.pci_event("remove", folder)
            group = os.path.basename(os.readlink(folder / "iommu_group"))
            members = pci.sys / "kernel/iommu_groups" / group / "devices"
            (members / bus_id).unlink(missing_ok=True)
            if not any(members.iterdir()):
                shutil.rmtree(members.parent)
            (pci.sys / "bus/pci/devices" / bus_id).unlink(missing_ok=True)
            shutil.rmtree(folder)
            link.unlink()  # last: whoever waits for the virtfn links to go finds the VF gone
            send(pci.root, [event])

    def _free_numbers(self) -> tuple[Iterator[int], Iterator[int]]:
        """IOMMU group and RDMA numbers no function of the profile or the tree uses."""
        pci = self.pci
        groups = {f.iommu_group for f in pci.plan.functions}
        groups |= {int(p.name) for p in (pci.sys / "kernel/iommu_groups").iterdir() if p.name.isdigit()}
        rdma = {i for nic in pci.plan.nics for i in (nic.rdma_index, *(vf.rdma_index for vf in nic.vfs))
                if i is not None}
        rdma |= {int(p.name.removeprefix("mlx5_")) for p in (pci.sys / "class/infiniband").iterdir()
                 if p.name.removeprefix("mlx5_").isdigit()}
        return itertools.count(max(groups, default=-1) + 1), itertools.count(max(rdma, default=-1) + 1)

