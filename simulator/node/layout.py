"""Bus numbering and identity of every PCI function of a simulated node, computed from its profile.

Pure: turns a `NodeProfile` into a `NodePlan` (bus ids, sysfs paths, drivers, IOMMU groups, GPU minors, netdev
names) the way firmware enumerates a PCIe tree depth first; `sysfs_tree` writes the plan to disk.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

from simulator.node.catalog import GOOGLE, GPU_MODELS, NIC_MODELS, NVIDIA, TPU_MODELS, NicModel
from simulator.node.profile import GpuSpec, NicSpec, NodeProfile, PciSpec, ProfileError, Slot, TpuSpec

__all__ = ["GpuPlan", "NicPlan", "NodePlan", "OtherPlan", "PciFunction", "TpuPlan", "VfPlan", "plan_node", "plan_vf",
           "vf_netdev"]

# PCIe port types as the capability register encodes them.
PORT_ENDPOINT, PORT_ROOT, PORT_UPSTREAM, PORT_DOWNSTREAM, PORT_INTEGRATED = 0x0, 0x4, 0x5, 0x6, 0x9
_BRIDGE_CLASS = 0x060400
_INTEL = 0x8086
_SIM_NAMESPACE = uuid.UUID("6f1d5c1e-3a43-4c52-9a57-3d1c8e4b7a10")


@dataclass(frozen=True)
class PciFunction:
    """A PCI function as sysfs shows it."""

    bus_id: str
    path: tuple[str, ...]  # components under devices/: root complex, bridges..., bus_id
    vendor_id: int
    device_id: int
    class_code: int
    driver: str | None
    numa_node: int
    iommu_group: int
    port_type: int

    @property
    def is_bridge(self) -> bool:
        return self.class_code == _BRIDGE_CLASS


@dataclass(frozen=True)
class GpuPlan:
    bus_id: str
    spec: GpuSpec
    minor: int
    uuid: str
    numa_node: int


@dataclass(frozen=True)
class VfPlan:
    bus_id: str
    index: int
    netdev: str | None
    rdma_index: int | None


@dataclass(frozen=True)
class NicPlan:
    bus_id: str
    spec: NicSpec
    model: NicModel
    netdev: str
    rdma_index: int | None
    vfs: tuple[VfPlan, ...]


@dataclass(frozen=True)
class TpuPlan:
    bus_id: str
    spec: TpuSpec
    index: int
    interface: str


@dataclass(frozen=True)
class OtherPlan:
    """A generic PCI function; `dev_nodes` are the spec's with `{n}` replaced by `index`, its number among the
    profile's functions of the same vendor and device id."""

    bus_id: str
    spec: PciSpec
    index: int = 0
    dev_nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class NodePlan:
    """Everything the simulated node consists of, in bus-id order within each kind."""

    profile: NodeProfile
    functions: tuple[PciFunction, ...]
    gpus: tuple[GpuPlan, ...]
    nics: tuple[NicPlan, ...]
    tpus: tuple[TpuPlan, ...]
    others: tuple[OtherPlan, ...]


@dataclass
class _Counter:
    next_bus: dict[int, int] = field(default_factory=dict)
    iommu_group: int = 0
    rdma: int = 0

    def bus(self, domain: int) -> int:
        bus = self.next_bus.get(domain, 0)
        if bus > 0xFF:
            raise ProfileError(f"PCI domain {domain:04x} has run out of bus numbers (256)")
        self.next_bus[domain] = bus + 1
        return bus

    def group(self) -> int:
        self.iommu_group += 1
        return self.iommu_group - 1


def _bdf(domain: int, bus: int, devfn: int) -> str:
    return f"{domain:04x}:{bus:02x}:{devfn >> 3:02x}.{devfn & 7:x}"


class _Planner:
    def __init__(self, profile: NodeProfile) -> None:
        self.profile = profile
        self.counter = _Counter()
        self.functions: list[PciFunction] = []
        self.gpus: list[tuple[str, GpuSpec, int]] = []
        self.nics: list[NicPlan] = []
        self.tpus: list[tuple[str, TpuSpec]] = []
        self.others: list[OtherPlan] = []

    def add(self, path: tuple[str, ...], vendor: int, device: int, cls: int, driver: str | None,
            numa: int, port: int) -> PciFunction:
        fn = PciFunction(path[-1], path, vendor, device, cls, driver, numa, self.counter.group(), port)
        self.functions.append(fn)
        return fn

    def root_complex(self, index: int) -> None:
        spec = self.profile.root_complexes[index]
        taken = self.counter.next_bus.get(spec.domain, 0)
        if spec.bus is not None:
            if spec.bus < taken:
                raise ProfileError(f"root_complexes[{index}]: bus {spec.bus:#04x} overlaps buses already in use")
            self.counter.next_bus[spec.domain] = spec.bus
        root_bus = self.counter.bus(spec.domain)
        top = (f"pci{spec.domain:04x}:{root_bus:02x}",)
        devfn = 0x08  # root ports start at device 01
        for slot in spec.ports:
            for _ in range(slot.count):
                port_id = _bdf(spec.domain, root_bus, devfn)
                devfn += 0x08
                self.add((*top, port_id), _INTEL, 0x2030, _BRIDGE_CLASS, "pcieport", spec.numa_node, PORT_ROOT)
                self.place(slot, (*top, port_id), spec.domain, spec.numa_node)
        devfn = max(devfn, 0x20)  # cloud VMs put their endpoints from device 04 on
        for slot in spec.integrated:
            for _ in range(slot.count):
                self.endpoint(slot, top, spec.domain, root_bus, devfn, spec.numa_node, PORT_INTEGRATED)
                devfn += 0x08
        if devfn > 0xFF:
            raise ProfileError(f"root_complexes[{index}]: too many devices on the root bus (at most 31)")

    def place(self, slot: Slot, parent: tuple[str, ...], domain: int, numa: int) -> None:
        """Put a slot's occupant on a fresh bus below the bridge at `parent`."""
        bus = self.counter.bus(domain)
        if slot.switch is None:
            self.endpoint(slot, parent, domain, bus, 0, numa, PORT_ENDPOINT)
            return
        upstream = (*parent, _bdf(domain, bus, 0))
        self.add(upstream, 0x1000, 0xC030, _BRIDGE_CLASS, "pcieport", numa, PORT_UPSTREAM)
        internal = self.counter.bus(domain)
        devfn = 0
        for child in slot.switch:
            for _ in range(child.count):
                downstream = (*upstream, _bdf(domain, internal, devfn))
                devfn += 0x08
                self.add(downstream, 0x1000, 0xC030, _BRIDGE_CLASS, "pcieport", numa, PORT_DOWNSTREAM)
                self.place(child, downstream, domain, numa)
        if devfn > 0x100:
            raise ProfileError("a switch has at most 32 downstream ports")

    def endpoint(self, slot: Slot, parent: tuple[str, ...], domain: int, bus: int, devfn: int,
                 numa: int, port: int) -> None:
        path = (*parent, _bdf(domain, bus, devfn))
        if slot.gpu is not None:
            model = GPU_MODELS[slot.gpu.model]
            self.add(path, NVIDIA, model.device_id, model.class_code, "nvidia", numa, port)
            self.gpus.append((path[-1], slot.gpu, numa))
        elif slot.tpu is not None:
            tpu = TPU_MODELS[slot.tpu.model]
            driver = "vfio-pci" if tpu.interface == "vfio" else "gasket"
            self.add(path, GOOGLE, tpu.device_id, tpu.class_code, driver, numa, port)
            self.tpus.append((path[-1], slot.tpu))
        elif slot.pci is not None:
            spec = slot.pci
            self.add(path, spec.vendor, spec.device, spec.class_code, spec.driver, numa, port)
            index = sum(1 for o in self.others if (o.spec.vendor, o.spec.device) == (spec.vendor, spec.device))
            nodes = tuple(node.replace("{n}", str(index)) for node in spec.dev_nodes)
            self.others.append(OtherPlan(path[-1], spec, index, nodes))
        elif slot.nic is not None:
            self.nic(slot.nic, path, domain, bus, devfn, numa, port)

    def nic(self, spec: NicSpec, path: tuple[str, ...], domain: int, bus: int, devfn: int, numa: int,
            port: int) -> None:
        model = NIC_MODELS[spec.model]
        pf = self.add(path, model.vendor_id, model.device_id, model.class_code, model.driver, numa, port)
        netdev = spec.name or f"enp{bus}s{devfn >> 3}f{devfn & 7}np0"
        rdma = self.next_rdma() if model.rdma else None
        vfs: list[VfPlan] = []
        for i in range(spec.sriov.num_vfs if spec.sriov else 0):
            vf_fn = plan_vf(pf, model, i, self.counter.group())
            self.functions.append(vf_fn)
            vfs.append(VfPlan(vf_fn.bus_id, i, vf_netdev(netdev, i), self.next_rdma() if model.rdma else None))
        self.nics.append(NicPlan(pf.bus_id, spec, model, netdev, rdma, tuple(vfs)))

    def next_rdma(self) -> int:
        self.counter.rdma += 1
        return self.counter.rdma - 1


def plan_vf(pf: PciFunction, model: NicModel, index: int, iommu_group: int) -> PciFunction:
    """VF `index` of a PF, where the PF's SR-IOV capability puts it, bound to the model's VF driver."""
    domain, bus, devfn = int(pf.bus_id[:4], 16), int(pf.bus_id[5:7], 16), int(pf.bus_id[8:10], 16) << 3
    # With ARI, VF i sits at routing id PF + offset(1) + i, on the PF's bus.
    vf_devfn = devfn + int(pf.bus_id[11], 16) + 1 + index
    if vf_devfn > 0xFF:
        raise ProfileError(f"{pf.bus_id}: too many VFs for one bus")
    assert model.vf_device_id is not None  # profile validation guarantees SR-IOV support
    return PciFunction(_bdf(domain, bus, vf_devfn), (*pf.path[:-1], _bdf(domain, bus, vf_devfn)), model.vendor_id,
                       model.vf_device_id, model.class_code, model.vf_driver, pf.numa_node, iommu_group, pf.port_type)


def vf_netdev(pf_netdev: str, index: int) -> str:
    """The name udev gives VF `index`'s network interface."""
    return f"{pf_netdev.removesuffix('np0')}v{index}"


def plan_node(profile: NodeProfile) -> NodePlan:
    """Enumerate the profile's PCIe tree: bus ids, paths, identities."""
    planner = _Planner(profile)
    for index in range(len(profile.root_complexes)):
        planner.root_complex(index)
    _check_unique(planner)
    gpus = tuple(
        GpuPlan(bus_id, spec, minor, spec.uuid or f"GPU-{uuid.uuid5(_SIM_NAMESPACE, f'{profile.name}/{bus_id}')}", numa)
        for minor, (bus_id, spec, numa) in enumerate(sorted(planner.gpus, key=lambda g: g[0]))
    )
    tpus = tuple(
        TpuPlan(bus_id, spec, index, TPU_MODELS[spec.model].interface)
        for index, (bus_id, spec) in enumerate(sorted(planner.tpus, key=lambda t: t[0]))
    )
    return NodePlan(
        profile=profile,
        functions=tuple(planner.functions),
        gpus=gpus,
        nics=tuple(sorted(planner.nics, key=lambda n: n.bus_id)),
        tpus=tpus,
        others=tuple(planner.others),
    )


def _check_unique(planner: _Planner) -> None:
    seen: set[str] = set()
    for name in _netdevs(planner):
        if name in seen:
            raise ProfileError(f"network interface name {name!r} is used twice")
        seen.add(name)
    nodes: dict[str, str] = {}
    for other in planner.others:
        for node in other.dev_nodes:
            if node in nodes:
                raise ProfileError(f"PCI functions {nodes[node]} and {other.bus_id} both have device node /dev/{node}; "
                                   "put {n} in dev_nodes to number them")
            nodes[node] = other.bus_id
    bus_ids = [f.bus_id for f in planner.functions]
    if len(set(bus_ids)) != len(bus_ids):
        raise ProfileError("two PCI functions got the same address; give root complexes distinct buses")


def _netdevs(planner: _Planner) -> Iterator[str]:
    for nic in planner.nics:
        yield nic.netdev
        yield from (vf.netdev for vf in nic.vfs if vf.netdev)
