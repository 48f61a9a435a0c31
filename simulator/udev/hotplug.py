"""Hot-plug and link events on a simulated node: its sysfs and /dev change as the kernel changes them, then the
uevents go to every process watching the node through umockdev's preload (see `preload`).

    python -m simulator.udev.hotplug --sim-root DIR pci-remove 0000:18:00.0

A removed PCI function takes its children (below a bridge), its VFs, class devices (netdevs, RDMA, accel),
device nodes, vfio group and every sysfs link to them along; it is kept aside under the node's root, so adding
it back restores exactly what was there. Without umockdev the tree still changes; no process hears of it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.topology import TopologyError, normalize_bus_id
from simulator.udev.delivery import STATE_DIR, Uevent, send

__all__ = ["Injection", "InjectionError", "UdevInjector", "main"]


# Network adapters' class devices: theirs are not the function's own device node.
_NETWORK_CLASSES = ("net", "infiniband", "infiniband_verbs")


class InjectionError(Exception):
    """The event cannot happen on this node (unknown device, already removed, ...); the message says why."""


@dataclass(frozen=True)
class Injection:
    """What an injection did: the uevents it sent, in order, and how many monitors received them."""

    events: tuple[Uevent, ...]
    listeners: int

    def __str__(self) -> str:
        what = ", ".join(f"{e.action} {e.subsystem} {os.path.basename(e.devpath)}" for e in self.events)
        return f"{len(self.events)} uevent(s) ({what}) to {self.listeners} monitor(s)"


class UdevInjector:
    """Injects events into the simulated node at `root` (which holds its sys/ and dev/)."""

    def __init__(self, root: Path) -> None:
        # Links are compared as paths, so every folder is named from one root: the one given, kept unresolved
        # (umockdev's preload takes every file opened below /dev for a device node, and a node kept in /dev/shm
        # is reached through a link elsewhere), with links inside the tree resolved by `inside`.
        self.root = Path(os.path.abspath(root))
        self._real_root = root.resolve()
        self.sys = self.root / "sys"
        if not (self.sys / "devices").is_dir():
            raise InjectionError(f"{root} holds no simulated node (no sys/devices folder)")

    def inside(self, path: Path | str) -> Path:
        """`path` with every link resolved, named from the node's root as given."""
        real = os.path.realpath(path)
        if real == str(self._real_root) or real.startswith(str(self._real_root) + os.sep):
            return self.root / os.path.relpath(real, self._real_root)
        return Path(real)

    # PCI hot-plug -------------------------------------------------------------------------------------------

    def pci_remove(self, bus_id: str) -> Injection:
        """Remove a PCI function as `echo 1 > remove` does: its VFs first, then everything below it, and the IOMMU
        (and vfio) groups left without members."""
        bus_id = _bus_id(bus_id)
        entry = self.sys / "bus/pci/devices" / bus_id
        if not entry.is_dir():
            if (self.root / STATE_DIR / "removed" / f"pci-{bus_id}").exists():
                raise InjectionError(f"PCI function {bus_id} is already removed (pci-add brings it back)")
            raise InjectionError(f"no PCI function {bus_id} on the simulated node at {self.root}")
        function = self.inside(entry)
        vfs = [self.inside(link) for link in sorted(function.glob("virtfn*"))]
        folders = [vf for vf in vfs if vf.is_dir() and not vf.is_relative_to(function)] + [function]
        groups = self._emptied_groups(folders)
        # Unbinding from vfio-pci destroys a function's vfio group before the function itself goes.
        vfio = [v for g in groups if (v := self.sys / "devices/virtual/vfio" / g.name).is_dir()]
        return self._take_away(f"pci-{bus_id}", vfio + folders, groups)

    def pci_add(self, bus_id: str) -> Injection:
        """Bring back a function removed with `pci_remove`, exactly as it was, as a rescan finds it again."""
        return self._bring_back(f"pci-{_bus_id(bus_id)}", f"PCI function {_bus_id(bus_id)}")

    # Device nodes ---------------------------------------------------------------------------------------------

    def node_remove(self, bus_id: str) -> Injection:
        """Remove the character device of a function (its accel or other class device, else its vfio group) and
        its /dev node."""
        bus_id = _bus_id(bus_id)
        folder = self._char_device(bus_id)
        return self._take_away(f"node-{bus_id}", [folder])

    def node_add(self, bus_id: str) -> Injection:
        """Bring back the character device and node taken by `node_remove`."""
        return self._bring_back(f"node-{_bus_id(bus_id)}", f"the device node of {_bus_id(bus_id)}")

    # Link state -----------------------------------------------------------------------------------------------

    def link_down(self, interface: str) -> Injection:
        """Carrier lost on a network interface (by name, or a PCI function's first one): operstate, carrier and
        speed change, and the netdev gets a "change" uevent."""
        return self._set_link(interface, up=False)

    def link_up(self, interface: str) -> Injection:
        """Carrier back: the interface's files read up again with the speed it had."""
        return self._set_link(interface, up=True)

    def _set_link(self, interface: str, up: bool) -> Injection:
        folder = self._netdev(interface)
        saved = self.root / STATE_DIR / "speed" / folder.name  # a link that is down reads -1
        if up:
            speed = saved.read_text() if saved.exists() else _read(folder / "speed")
            saved.unlink(missing_ok=True)
        else:
            if not saved.exists():
                saved.parent.mkdir(parents=True, exist_ok=True)
                saved.write_text(_read(folder / "speed") or "-1")
            speed = "-1"
        for name, text in (("operstate", "up" if up else "down"), ("carrier", "1" if up else "0"),
                           ("speed", speed or "-1")):
            (folder / name).write_text(text + "\n")
        return self._send([self._event("change", folder)])

    # Taking away and bringing back ---------------------------------------------------------------------------

    def _take_away(self, key: str, folders: list[Path], extra: Sequence[Path] = ()) -> Injection:
        """Move device folders (with their device nodes) and `extra` paths aside, drop the links to them, and send
        a "remove" for every device, children first."""
        stash = self.root / STATE_DIR / "removed" / key
        if stash.exists():
            raise InjectionError(f"{key.partition('-')[2]} is already removed")
        devices = [d for folder in folders for d in _devices_deepest_first(folder)]
        events = [self._event("remove", d) for d in devices]
        moved = [*folders, *extra, *self._device_nodes(devices)]
        links = self._links_into(moved)
        stash.mkdir(parents=True)
        record: dict[str, list[Any]] = {"moved": [], "links": [], "events": []}
        for index, path in enumerate(moved):
            os.rename(path, stash / str(index))
            record["moved"].append([str(path.relative_to(self.root)), str(index)])
        for link in links:
            record["links"].append([str(link.relative_to(self.root)), os.readlink(link)])
            link.unlink()
        record["events"] = [[e.devpath, e.subsystem, dict(e.properties)] for e in events]
        (stash / "record.json").write_text(json.dumps(record, indent=1))
        return self._send(events)

    def _bring_back(self, key: str, what: str) -> Injection:
        """Undo `_take_away`: everything back in place, then an "add" for every device, parents first."""
        stash = self.root / STATE_DIR / "removed" / key
        try:
            record = json.loads((stash / "record.json").read_text())
        except FileNotFoundError:
            raise InjectionError(f"{what} was not removed (only what a remove injection took can be added "
                                 "back)") from None
        for original, _ in record["moved"]:
            if (self.root / original).exists():
                raise InjectionError(f"cannot add {what} back: {original} exists")
            if not (self.root / original).parent.is_dir():
                raise InjectionError(f"cannot add {what} back: {Path(original).parent} is missing; add what "
                                     "holds it first")
        for original, index in record["moved"]:
            os.rename(stash / index, self.root / original)
        for link, target in record["links"]:
            os.symlink(target, self.root / link)
        shutil.rmtree(stash)
        events = [Uevent("add", devpath, subsystem, props) for devpath, subsystem, props in record["events"]]
        return self._send(events[::-1])

    def _emptied_groups(self, folders: list[Path]) -> list[Path]:
        """The IOMMU groups all of whose members are in `folders`: the kernel deletes them with their last device."""
        groups: list[Path] = []
        for folder in folders:
            for device in _devices_deepest_first(folder):
                if not (device / "iommu_group").is_symlink():
                    continue
                group = self.inside(device / "iommu_group")
                members = [self.inside(m) for m in (group / "devices").iterdir()]
                if group not in groups and all(any(m.is_relative_to(f) for f in folders) for m in members):
                    groups.append(group)
        return groups

    def _device_nodes(self, devices: list[Path]) -> list[Path]:
        nodes = []
        for device in devices:
            name = _uevent(device).get("DEVNAME")
            if name and (self.root / "dev" / name).exists():
                nodes.append(self.root / "dev" / name)
        return nodes

    def _links_into(self, moved: list[Path]) -> list[Path]:
        """Every symlink of the sysfs tree, outside what moves, that points into what moves."""
        targets = tuple(str(p) + os.sep for p in moved)
        skip = {str(p) for p in moved}
        found: list[Path] = []
        for folder, subdirs, files in os.walk(self.sys):
            subdirs[:] = [d for d in subdirs if os.path.join(folder, d) not in skip]
            for name in files + subdirs:
                path = os.path.join(folder, name)
                if os.path.islink(path) and path not in skip:
                    target = os.path.normpath(os.path.join(folder, os.readlink(path))) + os.sep
                    if target.startswith(targets):
                        found.append(Path(path))
        return found

    def _char_device(self, bus_id: str) -> Path:
        entry = self.sys / "bus/pci/devices" / bus_id
        if not entry.is_dir():
            raise InjectionError(f"no PCI function {bus_id} on the simulated node at {self.root}")
        accel = sorted((entry / "accel").glob("accel*"))
        if accel:
            return self.inside(accel[0])
        # A generic function's class device: <function>/<class>/<name> with a dev file (see PciSpec.char_class).
        owned = sorted(p for p in entry.glob("*/*/dev")
                       if not p.parent.parent.is_symlink() and p.parent.parent.name not in _NETWORK_CLASSES)
        if owned:
            return self.inside(owned[0].parent)
        driver, group = entry / "driver", entry / "iommu_group"
        if driver.is_symlink() and os.path.basename(os.readlink(driver)) == "vfio-pci" and group.is_symlink():
            vfio = self.sys / "devices/virtual/vfio" / os.path.basename(os.readlink(group))
            if vfio.is_dir():
                return vfio
        if (self.root / STATE_DIR / "removed" / f"node-{bus_id}").exists():
            raise InjectionError(f"the device node of {bus_id} is already removed")
        raise InjectionError(f"{bus_id} has no device node of its own (neither an accel device nor a vfio group, "
                             "nor a class device of a generic function)")

    def _netdev(self, interface: str) -> Path:
        if ":" in interface:
            bus_id = _bus_id(interface)
            names = sorted((self.sys / "bus/pci/devices" / bus_id / "net").glob("*"))
            if not names:
                raise InjectionError(f"PCI function {bus_id} has no network interface on the simulated node")
            return self.inside(names[0])
        entry = self.sys / "class/net" / interface
        if not entry.is_dir():
            raise InjectionError(f"no network interface {interface!r} on the simulated node at {self.root}")
        return self.inside(entry)

    def _event(self, action: str, device: Path) -> Uevent:
        devpath = "/" + str(device.relative_to(self.sys))
        subsystem = os.path.basename(os.readlink(device / "subsystem"))
        return Uevent(action, devpath, subsystem, _uevent(device))

    def _send(self, events: Sequence[Uevent]) -> Injection:
        return Injection(tuple(events), send(self.root, list(events)))


def _bus_id(text: str) -> str:
    try:
        return normalize_bus_id(text)
    except TopologyError as e:
        raise InjectionError(str(e)) from None


def _devices_deepest_first(folder: Path) -> list[Path]:
    """The devices (folders with a uevent file) at and below `folder`, children before parents; within a folder
    VFs before the others, as disabling SR-IOV removes them before their PF."""
    found: list[Path] = []
    entries = [e for e in sorted(folder.iterdir()) if e.is_dir() and not e.is_symlink()]
    for entry in sorted(entries, key=lambda e: not (e / "physfn").is_symlink()):
        found.extend(_devices_deepest_first(entry))
    if (folder / "uevent").is_file():
        found.append(folder)
    return found


def _uevent(device: Path) -> dict[str, str]:
    text = _read(device / "uevent") or ""
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m simulator.udev.hotplug",
        description="Inject hot-plug and link events into a simulated node kept with --sim-root; agents running "
                    "on it under umockdev receive the uevents.",
    )
    parser.add_argument("--sim-root", required=True, type=Path, metavar="DIR", help="the simulated node's folder")
    commands = {
        "pci-remove": ("remove a PCI function (and its VFs, children, class devices)", UdevInjector.pci_remove),
        "pci-add": ("add back a function removed with pci-remove", UdevInjector.pci_add),
        "link-down": ("carrier lost on a network interface (name or PCI address)", UdevInjector.link_down),
        "link-up": ("carrier back on a network interface (name or PCI address)", UdevInjector.link_up),
        "node-remove": ("remove a function's device node (TPU accel device or vfio group)", UdevInjector.node_remove),
        "node-add": ("add back a device node removed with node-remove", UdevInjector.node_add),
    }
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (text, _) in commands.items():
        sub.add_parser(name, help=text).add_argument("device", help="PCI address, or interface name for links")
    args = parser.parse_args(argv)
    try:
        injection = commands[args.command][1](UdevInjector(args.sim_root), args.device)
    except InjectionError as e:
        print(f"udev_events: {e}", file=sys.stderr)
        return 2
    print(f"{args.command} {args.device}: {injection}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
