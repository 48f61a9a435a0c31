"""A VF's network interface as the host sees it, and handing it to a pod through a CDI `netDevices` edit.

The container runtime does the move (OCI `linux.netDevices`, runtime-spec 1.3.0): it moves the host interface
into the pod's network namespace under the requested name, keeps its permanent global addresses and sets it up. It
never moves it back: when the pod's namespace dies the kernel returns a physical or VF interface to the host's
namespace by itself (keeping the name it had in the pod when that is free on the host, else `dev<N>`). So nothing
is undone at unprepare, and at prepare the interface must be back.

**Where the agent sees the host's namespace.** sysfs shows network devices by namespace: a sysfs mount lists in
`class/net` and in a PCI function's `net/` folder only the interfaces of the namespace that mounted it. The agent
reads the host's sysfs (the DaemonSet mounts the host's /sys at `<host_root>/sys`, which the host mounted in its
own namespace; the agent warns at start when the sysfs it reads shows other devices than the host's
`/proc/1/net/dev`, see agent/node/host_netns.py), so whatever namespace the agent itself runs in, the VF's
`<sysfs>/bus/pci/devices/<VF>/net/` tells:

- an entry: the interface, present in the host's namespace, under its current name (read at every prepare: the
  name may have changed while it was in a pod);
- the folder, empty: the function has an interface, in another namespace (a pod's, or one being torn down). The
  kernel keeps a class device's folder (its "glue" directory) while the device exists and hides only the entries
  of other namespaces; tests/backends/sriov/test_vf_netdev_kernel.py shows this on the machine's real kernel;
- no folder: the function has no interface at all (on vfio-pci, unbound, or a driver without one).

The host's routes and addresses come from procfs of the host's PID 1 (`backends.host_net`), which shows the host's
namespace from any container that mounts the host's root.
"""

from __future__ import annotations

import errno
import itertools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from backends.attributes import AttributeValue
from backends.contract import Allocated, NetworkData, PrepareError
from backends.host_net import interface_addresses, interface_routes
from backends.sriov.vf_config import IFNAMSIZ, NetDeviceRequest, VfConfig
from backends.sysfs import SysfsError, list_dir, read_attr, read_link_name
from backends.vfio_sysfs import VFIO_PCI
from cdi.spec import NetDevice

__all__ = ["PCI_BUS_ID", "POD_INTERFACES", "VfInterface", "duplicate_names", "hand_over", "net_device_requests",
           "numbered", "read_vf_interface"]

PCI_BUS_ID = "resource.kubernetes.io/pciBusID"


@dataclass(frozen=True)
class VfInterface:
    """What the host sees of a VF's network interface now."""

    bus_id: str
    driver: str | None
    name: str | None
    """The interface in the host's namespace, or None."""
    elsewhere: bool
    """The VF has an interface, in another network namespace (not back from a pod yet)."""
    mac: str | None
    pf_name: str | None

    def facts(self, keeps_interface: bool = True) -> dict[str, AttributeValue]:
        """What the workload learns about the VF (`Prepared.facts`): its PCI address, PF, and the MAC and host-side
        name of its interface when it has one (the name only if the VF keeps it: on vfio-pci it has none)."""
        facts: dict[str, AttributeValue] = {PCI_BUS_ID: self.bus_id}
        name = self.name if keeps_interface else None
        for key, value in (("pfName", self.pf_name), ("netdev", name), ("macAddress", self.mac)):
            if value:
                facts[key] = value
        return facts


def read_vf_interface(folder: Path, bus_id: str) -> VfInterface:
    """The VF at `folder` (its `bus/pci/devices/<BDF>` entry in the host's sysfs); SysfsError when unreadable."""
    try:
        names: list[str] | None = sorted(os.listdir(folder / "net"))
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ENOTDIR):
            raise SysfsError(f"cannot list {folder / 'net'}: {e.strerror or e}") from e
        names = None
    name = names[0] if names else None
    pf_names = list_dir(folder / "physfn/net")
    return VfInterface(
        bus_id=bus_id,
        driver=read_link_name(folder / "driver"),
        name=name,
        elsewhere=names == [],
        mac=read_attr(folder / "net" / name / "address") if name else None,
        pf_name=pf_names[0] if pf_names else None,
    )


def hand_over(device: str, vf: VfInterface, request: NetDeviceRequest,
              host_root: Path) -> tuple[NetDevice, NetworkData]:
    """The CDI edit that moves the VF's interface into the pod as `request.name`, and the network data the claim's
    status reports; PrepareError naming the device when the interface cannot be handed over."""
    if vf.driver == VFIO_PCI:
        raise PrepareError(f"{device}: the VF is bound to vfio-pci and has no network interface to move into the pod "
                           "(VfConfig.netDevice)")
    if vf.name is None and vf.elsewhere:
        raise PrepareError(f"{device}: the VF's network interface is not back in the host's network namespace yet: it "
                           "is still in another one (a pod's that is being torn down; the kernel returns the "
                           "interface once that namespace is gone), try again")
    if vf.name is None:
        why = "no driver is bound to it" if vf.driver is None else f"its driver {vf.driver} made none"
        raise PrepareError(f"{device}: the VF has no network interface to move into the pod ({why})")
    routes = interface_routes(host_root, vf.name)
    if routes:
        raise PrepareError(f"{device}: its interface {vf.name} carries routes of the host ({'; '.join(routes[:4])}); "
                           "moving it into the pod would take them from the host, so it is left there")
    network = NetworkData(
        interface_name=request.name,
        hardware_address=vf.mac or "",
        ips=interface_addresses(host_root, vf.name),
    )
    return NetDevice(host_interface_name=vf.name, name=request.name), network


POD_INTERFACES = ("lo", "eth0")
"""The interfaces a pod's network namespace holds before the runtime moves a VF's in: the loopback, which every
namespace has, and the pod's own network interface, which containerd and CRI-O ask their CNI plugins to name eth0."""


def duplicate_names(requests: Mapping[str, NetDeviceRequest]) -> str | None:
    """Why the interface names asked for the devices of one claim (device → request) clash, or None: a container
    cannot get two interfaces of the same name (CDI refuses a spec that asks). Templates do not clash: each device
    gets its own number."""
    by_name: dict[str, list[str]] = {}
    for device, request in sorted(requests.items()):
        if not request.templated:
            by_name.setdefault(request.name, []).append(device)
    clashes = [f"{name!r} for {' and '.join(devices)}" for name, devices in sorted(by_name.items()) if len(devices) > 1]
    if not clashes:
        return None
    return f"VfConfig.netDevice asks for the same interface name in the pod more than once: {'; '.join(clashes)}"


def numbered(requests: Mapping[str, NetDeviceRequest]) -> dict[str, NetDeviceRequest]:
    """The requests (device → request, in the claim's order) with the `%d` of each template replaced by the number
    the kernel would pick in the pod: the smallest whose name is not taken there (`POD_INTERFACES`, the claim's
    other names, and the templates numbered before). The kernel could do it itself, but runc and crun look the
    interface up by the name they moved it under once it is in the pod, and a template names none."""
    taken = set(POD_INTERFACES) | {r.name for r in requests.values() if not r.templated}
    out: dict[str, NetDeviceRequest] = {}
    for device, request in requests.items():
        if request.templated:
            name = next(n for n in (request.name.replace("%d", str(i)) for i in itertools.count()) if n not in taken)
            if len(name.encode()) >= IFNAMSIZ:
                raise PrepareError(f"{device}: VfConfig.netDevice.name {request.name!r} has no room left for a "
                                   f"number: {name!r}, the next free name, has {len(name.encode())} bytes")
            taken.add(name)
            request = NetDeviceRequest(name=name)
        out[device] = request
    return out


def net_device_requests(devices: Sequence[Allocated]) -> dict[str, NetDeviceRequest]:
    """The interfaces the claim's devices ask to move into the pod (device → request), checked as a whole, under the
    names they get there (templates numbered)."""
    moves: dict[str, NetDeviceRequest] = {}
    for allocated in devices:
        config = allocated.config
        if not isinstance(config, VfConfig) or config.net_device is None:
            continue
        if allocated.admin_access:
            raise PrepareError(f"{allocated.device}: allocated with admin access, which never reconfigures a device; "
                               "VfConfig.netDevice would take its interface from the host and other claims")
        moves[allocated.device] = config.net_device
    clash = duplicate_names(moves)
    if clash is not None:
        raise PrepareError(clash)
    return numbered(moves)
