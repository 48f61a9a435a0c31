"""A PCI function's network interface leaving the host's network namespace and coming back, as the host's sysfs and
procfs show it.

A container runtime moves a VF's interface into a pod's namespace (OCI `linux.netDevices`); when that namespace
dies the kernel moves it back under the name it had in the pod (`dev<N>` when the host has that name already).
Seen from the host's sysfs meanwhile, the function's `net/` folder is still there but lists nothing (the kernel
hides class devices of other namespaces and keeps their folder); `class/net` has no entry; the host's procfs has
neither its routes nor its addresses (the kernel drops them; a runtime keeps the permanent global ones inside the
pod). The host hears a `remove` of the interface when it leaves and an `add` when it comes back.

    python -m simulator.udev.netns_moves --sim-root DIR leave enp25s0f0v0
    python -m simulator.udev.netns_moves --sim-root DIR return 0000:19:00.1 --name net1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from cdi.interface_names import kernel_name_problem
from simulator.node.procfs import forget_interface
from simulator.udev.delivery import STATE_DIR
from simulator.udev.hotplug import Injection, InjectionError, UdevInjector, _bus_id

__all__ = ["main", "netns_leave", "netns_return"]

_AWAY = f"{STATE_DIR}/netns"


def netns_leave(injector: UdevInjector, interface: str) -> Injection:
    """The interface (by name, or a PCI function's first one) moves into another network namespace."""
    if ":" in interface and (injector.root / _AWAY / _bus_id(interface)).exists():
        raise InjectionError(f"the interface of {_bus_id(interface)} is in another network namespace already")
    folder = injector._netdev(interface)
    device = injector.inside(folder / "device")
    bus_id = device.name
    stash = injector.root / _AWAY / bus_id
    if stash.exists():
        raise InjectionError(f"the interface of {bus_id} is in another network namespace already")
    event = injector._event("remove", folder)
    stash.mkdir(parents=True)
    link = injector.sys / "class/net" / folder.name
    record = {"name": folder.name, "folder": str(folder.relative_to(injector.root)), "link": os.readlink(link)}
    link.unlink()
    os.rename(folder, stash / "netdev")  # the function's net/ folder stays, empty
    (stash / "record.json").write_text(json.dumps(record))
    forget_interface(injector.root, folder.name)
    return injector._send([event])


def netns_return(injector: UdevInjector, bus_id: str, name: str | None = None) -> Injection:
    """The function's interface comes back to the host's namespace as `name` (by default the name it left with):
    the name it had in the pod. A name the host has already makes the kernel pick `dev<N>`."""
    bus_id = _bus_id(bus_id)
    stash = injector.root / _AWAY / bus_id
    try:
        record = json.loads((stash / "record.json").read_text())
    except FileNotFoundError:
        raise InjectionError(f"the interface of {bus_id} is not in another network namespace") from None
    wanted = name or record["name"]
    problem = kernel_name_problem(wanted)
    if problem is not None:
        raise InjectionError(problem)
    classes = injector.sys / "class/net"
    if (classes / wanted).exists():
        wanted = next(f"dev{n}" for n in range(1 << 16) if not (classes / f"dev{n}").exists())
    old = injector.root / record["folder"]
    folder = old.parent / wanted
    os.rename(stash / "netdev", folder)
    uevent = folder / "uevent"
    lines = [f"INTERFACE={wanted}" if line.startswith("INTERFACE=") else line
             for line in uevent.read_text().splitlines()]
    uevent.write_text("\n".join(lines) + "\n")
    os.symlink(str(Path(record["link"]).parent / wanted), classes / wanted)
    (stash / "record.json").unlink()
    stash.rmdir()
    return injector._send([injector._event("add", folder)])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m simulator.udev.netns_moves",
        description="Move a network interface of a simulated node (kept with --sim-root) into another network "
                    "namespace and back, as a container runtime and the kernel do; agents running on it under "
                    "umockdev receive the uevents.")
    parser.add_argument("--sim-root", required=True, type=Path, metavar="DIR", help="the simulated node's folder")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("leave", help="the interface moves away").add_argument(
        "device", help="interface name, or a PCI address for the function's interface")
    back = sub.add_parser("return", help="the function's interface comes back")
    back.add_argument("device", help="PCI address")
    back.add_argument("--name", help="the name it comes back with: the one it had in the pod (default: as it left)")
    args = parser.parse_args(argv)
    try:
        injector = UdevInjector(args.sim_root)
        injection = (netns_leave(injector, args.device) if args.command == "leave"
                     else netns_return(injector, args.device, args.name))
    except InjectionError as e:
        print(f"netns_moves: {e}", file=sys.stderr)
        return 2
    print(f"{args.command} {args.device}: {injection}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
