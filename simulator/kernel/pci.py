"""The PCI core of the simulated kernel: binding and unbinding drivers and what drivers create when they do.

A function's own driver (the one the profile gives it) owns its class devices (netdevs, RDMA devices, accel
nodes): unbinding takes them away, kept aside under the node's root as `UdevInjector` keeps removed devices, and
binding the same driver again brings them back exactly. vfio-pci owns the function's vfio group
(`devices/virtual/vfio/<group>` and `/dev/vfio/<group>`) while any member of the IOMMU group is bound to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from collections import Counter
from pathlib import Path

from simulator.node.devnodes import make_device_node
from simulator.node.layout import NodePlan, PciFunction
from simulator.node.sysfs_tree import bind as link_driver
from simulator.node.sysfs_tree import write_vfio_group
from simulator.udev.delivery import STATE_DIR, Uevent, send
from simulator.udev.hotplug import InjectionError, UdevInjector

__all__ = ["VFIO_PCI", "PciCore", "read_text"]

VFIO_PCI = "vfio-pci"
# The class-device folders a driver creates below its function (the kernel's "glue" directories).
_CLASS_DIRS = ("net", "infiniband", "infiniband_verbs", "accel")


class PciCore:
    """Drivers and functions of the simulated node at `root` (resolved); `plan` says which driver is each
    function's own."""

    def __init__(self, root: Path, plan: NodePlan) -> None:
        # Generic functions' drivers make class devices of the classes their profile names.
        self.class_dirs = _CLASS_DIRS + tuple(sorted({o.spec.char_class for o in plan.others if o.spec.char_class}))
        self.injector = _ClassDeviceInjector(root, self.class_dirs)
        self.root = self.injector.root
        self.sys = self.root / "sys"
        self.plan = plan
        self.planned = {f.bus_id: f for f in plan.functions}
        self._vf_driver = {nic.bus_id: nic.model.vf_driver for nic in plan.nics}
        # Every driver change made, "<bus id> bind <driver>" or "<bus id> unbind <driver>" → how often: what tests
        # count to tell a change made once from one made twice (which the end state alone cannot show).
        self.driver_changes: Counter[str] = Counter()

    # Reading the tree -------------------------------------------------------------------------------------------

    def folder(self, bus_id: str) -> Path | None:
        """The function's folder under devices/, None when there is no such function."""
        entry = self.sys / "bus/pci/devices" / bus_id
        return self.injector.inside(entry) if entry.is_dir() else None

    def function(self, bus_id: str, folder: Path) -> PciFunction:
        """The function as the tree shows it now (a VF enabled at run time is not in the plan)."""
        path = folder.relative_to(self.sys / "devices").parts
        group = int(os.path.basename(os.readlink(folder / "iommu_group")))
        planned = self.planned.get(bus_id)
        if planned is not None:
            return dataclasses.replace(planned, path=path, iommu_group=group)
        return PciFunction(bus_id, path, int(read_text(folder / "vendor"), 16), int(read_text(folder / "device"), 16),
                           int(read_text(folder / "class"), 16), self.own_driver(bus_id, folder),
                           int(read_text(folder / "numa_node")), group, 0)

    def own_driver(self, bus_id: str, folder: Path) -> str | None:
        """The driver a probe without driver_override binds: the profile's, or for a VF its PF's VF driver."""
        planned = self.planned.get(bus_id)
        if planned is not None:
            return planned.driver
        physfn = folder / "physfn"
        return self._vf_driver.get(os.path.basename(os.readlink(physfn))) if physfn.is_symlink() else None

    @staticmethod
    def driver_of(folder: Path) -> str | None:
        link = folder / "driver"
        return os.path.basename(os.readlink(link)) if link.is_symlink() else None

    @staticmethod
    def override(folder: Path) -> str | None:
        """driver_override as the kernel keeps it: up to the first newline; empty (or a NUL) means unset."""
        value = read_text(folder / "driver_override").split("\n")[0].strip("\0 ")
        return None if value in ("", "(null)") else value

    # Effects ----------------------------------------------------------------------------------------------------

    def normalize_override(self, folder: Path) -> None:
        """A cleared driver_override reads back "(null)", as the kernel shows it. A name is left as written (the
        kernel would add a newline): a rewrite could race the writer's next write."""
        if self.override(folder) is None and read_text(folder / "driver_override") != "(null)\n":
            (folder / "driver_override").write_text("(null)\n")

    def bind(self, bus_id: str, driver: str) -> bool:
        """Bind an unbound function to `driver` if the driver takes it: the one driver_override names, else only
        the function's own driver (the simulation has no id tables; `new_id` is not emulated)."""
        folder = self.folder(bus_id)
        if folder is None or self.driver_of(folder) is not None:
            return False
        if not (self.sys / "bus/pci/drivers" / driver).is_dir():
            return False
        if driver != (self.override(folder) or self.own_driver(bus_id, folder)):
            return False
        fn = self.function(bus_id, folder)
        events: list[Uevent] = []
        if driver == VFIO_PCI:
            events += self._claim_vfio_group(fn.iommu_group)
        if driver == fn.driver:
            self._restore_class_devices(bus_id)
        # The driver link last: whoever waits for it finds what the driver made (as after a real bind's write).
        link_driver(str(self.sys), fn, driver)
        self.driver_changes[f"{bus_id} bind {driver}"] += 1
        events.append(self.pci_event("bind", folder, driver))
        send(self.root, events)
        return True

    def probe(self, bus_id: str) -> bool:
        """drivers_probe: an unbound function gets the driver driver_override names, else its own."""
        folder = self.folder(bus_id)
        if folder is None or self.driver_of(folder) is not None:
            return False
        driver = self.override(folder) or self.own_driver(bus_id, folder)
        return driver is not None and self.bind(bus_id, driver)

    def unbind(self, bus_id: str, driver: str | None = None) -> bool:
        """Unbind a function from its driver (from `driver` only, when written to that driver's unbind file)."""
        folder = self.folder(bus_id)
        current = None if folder is None else self.driver_of(folder)
        if folder is None or current is None or driver not in (None, current):
            return False
        # The driver's remove() tears its class devices down before the device is unbound; the driver link goes
        # last, so whoever waits for it to go finds them gone.
        glue = [folder / name for name in self.class_dirs if (folder / name).is_dir()]
        if glue:
            self.forget_class_devices(bus_id)  # what an earlier unbind kept is stale now
            self.injector._take_away(_stash_key(bus_id), glue)
        events: list[Uevent] = []
        if current == VFIO_PCI:
            events += self._release_vfio_group(bus_id, folder)
        (self.sys / "bus/pci/drivers" / current / bus_id).unlink(missing_ok=True)
        (folder / "driver").unlink()
        self.driver_changes[f"{bus_id} unbind {current}"] += 1
        events.append(self.pci_event("unbind", folder))
        send(self.root, events)
        return True

    def forget_class_devices(self, bus_id: str) -> None:
        """Drop what an unbind kept aside for a function that is gone for good (a disabled VF)."""
        shutil.rmtree(self.root / STATE_DIR / "removed" / _stash_key(bus_id), ignore_errors=True)

    def pci_event(self, action: str, folder: Path, driver: str | None = None) -> Uevent:
        """A uevent of a PCI function; "bind" carries DRIVER (an "unbind" does not: the driver is gone by then)."""
        event = self.injector._event(action, folder)
        if driver is None:
            return event
        return Uevent(action, event.devpath, event.subsystem, {**event.properties, "DRIVER": driver})

    def _restore_class_devices(self, bus_id: str) -> None:
        """Bring back what the function's own driver had; sends their "add" uevents."""
        # Nothing kept aside: never unbound, or its class devices cannot come back.
        with contextlib.suppress(InjectionError):
            self.injector._bring_back(_stash_key(bus_id), bus_id)

    def _claim_vfio_group(self, group: int) -> list[Uevent]:
        folder = self.sys / "devices/virtual/vfio" / str(group)
        if folder.is_dir():
            return []
        dev = self.root / "dev"
        (dev / "vfio").mkdir(parents=True, exist_ok=True)
        # The container node comes with the vfio module, which the first vfio-pci bind loads.
        char = self.plan.profile.device_nodes == "char"
        if not (dev / "vfio/vfio").exists():
            make_device_node(str(dev / "vfio/vfio"), char=char)
        write_vfio_group(str(self.sys), str(dev), group, char=char)
        return [self.injector._event("add", folder)]

    def _release_vfio_group(self, bus_id: str, folder: Path) -> list[Uevent]:
        """The vfio group goes with the last of its members bound to vfio-pci."""
        group = os.path.basename(os.readlink(folder / "iommu_group"))
        members = self.sys / "kernel/iommu_groups" / group / "devices"
        for member in members.iterdir():
            if member.name != bus_id and self.driver_of(member) == VFIO_PCI:
                return []
        vfio = self.sys / "devices/virtual/vfio" / group
        if not vfio.is_dir():
            return []
        event = self.injector._event("remove", vfio)
        (self.sys / "class/vfio" / group).unlink(missing_ok=True)
        (self.root / "dev/vfio" / group).unlink(missing_ok=True)
        shutil.rmtree(vfio)
        return [event]


class _ClassDeviceInjector(UdevInjector):
    """Takes class devices away and brings them back; their only links from elsewhere are their entries under
    class/, named as the devices are, so finding those needs neither a walk of the whole tree (tens of
    milliseconds on a large node) nor a look at every entry of those folders."""

    def __init__(self, root: Path, class_dirs: tuple[str, ...]) -> None:
        super().__init__(root)
        self.class_dirs = class_dirs

    def _links_into(self, moved: list[Path]) -> list[Path]:
        targets = tuple(str(p) + os.sep for p in moved)
        names = {f for path in moved if path.is_dir() and not path.is_symlink()
                 for f in (path.name, *(d for _, dirs, _ in os.walk(path) for d in dirs))}
        found: list[Path] = []
        for name in self.class_dirs:
            folder = self.sys / "class" / name
            for device in sorted(names):
                entry = folder / device
                if entry.is_symlink():
                    target = os.path.normpath(os.path.join(folder, os.readlink(entry))) + os.sep
                    if target.startswith(targets):
                        found.append(entry)
        return found


def _stash_key(bus_id: str) -> str:
    return f"driver-{bus_id}"


def read_text(path: Path) -> str:
    """A sysfs attribute's text; empty when the file is gone."""
    try:
        return path.read_bytes().decode(errors="replace")
    except FileNotFoundError:
        return ""
