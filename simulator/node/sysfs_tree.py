"""Writes a simulated node's sysfs and /dev trees to disk with the kernel's real file and symlink structure.

`bus/pci/devices/<BDF>` links point into `devices/pci<domain>:<bus>/…`, devices carry their ids, NUMA node,
config space, `driver` and `iommu_group` links; PFs carry SR-IOV files and `virtfn<N>` links, VFs `physfn`;
network and RDMA devices appear under the function and in `class/`, vfio groups under `devices/virtual/vfio`.
Every device has its `uevent` file and `subsystem` link, so libudev (pyudev) accepts it. Device nodes are plain
files, or character devices when the profile asks (`simulator.node.devnodes`).
"""

from __future__ import annotations

import os
from pathlib import Path

from simulator.node.devnodes import make_device_node
from simulator.node.layout import GpuPlan, NicPlan, NodePlan, PciFunction, TpuPlan

__all__ = ["config_space", "write_tree"]


def write_tree(plan: NodePlan, sysfs_root: Path, dev_root: Path) -> None:
    """Create the sysfs tree under `sysfs_root` and device nodes under `dev_root` (both may exist, empty)."""
    # Plain strings and os calls: a large node has tens of thousands of entries and pathlib's overhead
    # would dominate the time to build it.
    sysfs, dev = str(sysfs_root), str(dev_root)
    char = plan.profile.device_nodes == "char"
    for sub in ("devices", "bus/pci/devices", "bus/pci/drivers", "kernel/iommu_groups", "class/net",
                "class/infiniband", "class/infiniband_verbs", "class/accel", "class/vfio", "module"):
        os.makedirs(f"{sysfs}/{sub}", exist_ok=True)
    os.makedirs(dev, exist_ok=True)
    _write(f"{sysfs}/bus/pci/drivers_probe", "")
    _write(f"{sysfs}/bus/pci/rescan", "")
    for driver in sorted({f.driver for f in plan.functions if f.driver} | {"vfio-pci"}):
        write_driver(sysfs, driver)
    for fn in plan.functions:
        write_function(sysfs, fn)
    for root_complex in sorted({fn.path[0] for fn in plan.functions}):
        _write(f"{sysfs}/devices/{root_complex}/uevent", "")
    for gpu in plan.gpus:
        _write_gpu(dev, gpu, char)
    if plan.gpus:
        for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
            make_device_node(f"{dev}/{name}", char=char)
    by_id = {f.bus_id: f for f in plan.functions}
    for nic in plan.nics:
        _write_nic(sysfs, dev, by_id, nic, char)
    for tpu in plan.tpus:
        _write_tpu(sysfs, dev, by_id[tpu.bus_id], tpu, char)
    minor = 0
    for other in plan.others:
        for name, value in other.spec.sysfs_attributes.items():
            _write(f"{function_dir(sysfs, by_id[other.bus_id])}/{name}", value + "\n")
        for node in other.dev_nodes:
            os.makedirs(os.path.dirname(f"{dev}/{node}"), exist_ok=True)
            make_device_node(f"{dev}/{node}", char=char)
            if other.spec.char_class:
                cls = other.spec.char_class
                os.makedirs(f"{sysfs}/class/{cls}", exist_ok=True)
                folder = write_class_device(sysfs, by_id[other.bus_id], cls, os.path.basename(node),
                                            f"MAJOR={_GENERIC_MAJOR}\nMINOR={minor}\nDEVNAME={node}\n")
                _write(f"{folder}/dev", f"{_GENERIC_MAJOR}:{minor}\n")
                minor += 1


# The character-device major of generic functions' class devices: one from the kernel's dynamic range.
_GENERIC_MAJOR = 511


def write_driver(sysfs: str, driver: str) -> None:
    """A `bus/pci/drivers/<name>` directory with its bind/unbind files."""
    folder = f"{sysfs}/bus/pci/drivers/{driver}"
    os.makedirs(folder, exist_ok=True)
    for name in ("bind", "unbind", "new_id", "remove_id"):
        _write(f"{folder}/{name}", "")
    os.makedirs(f"{sysfs}/module/{driver.replace('-', '_')}", exist_ok=True)


def function_dir(sysfs: str, fn: PciFunction) -> str:
    return f"{sysfs}/devices/" + "/".join(fn.path)


def write_function(sysfs: str, fn: PciFunction) -> None:
    """One PCI function: attribute files, config space, and the links that tie it into sysfs."""
    folder = function_dir(sysfs, fn)
    os.makedirs(folder, exist_ok=True)
    depth = len(fn.path) + 1  # levels from the function's folder up to the sysfs root
    up = "../" * depth
    # The attributes the agent and the kernel-side emulation use; real sysfs has more.
    attrs = {
        "vendor": f"0x{fn.vendor_id:04x}",
        "device": f"0x{fn.device_id:04x}",
        "class": f"0x{fn.class_code:06x}",
        "numa_node": str(fn.numa_node),
        "driver_override": "(null)",
    }
    for name, text in attrs.items():
        _write(f"{folder}/{name}", text + "\n")
    # The kernel adds DRIVER= while a driver is bound; libudev reads the `driver` link instead, so it is left out.
    _write(f"{folder}/uevent", f"PCI_CLASS={fn.class_code:X}\nPCI_ID={fn.vendor_id:04X}:{fn.device_id:04X}\n"
                               f"PCI_SLOT_NAME={fn.bus_id}\n")
    _write(f"{folder}/config", config_space(fn))
    _link(f"{folder}/subsystem", f"{up}bus/pci")
    _link(f"{sysfs}/bus/pci/devices/{fn.bus_id}", "../../../devices/" + "/".join(fn.path))
    group = f"{sysfs}/kernel/iommu_groups/{fn.iommu_group}"
    os.makedirs(f"{group}/devices", exist_ok=True)
    _link(f"{group}/devices/{fn.bus_id}", "../../../../devices/" + "/".join(fn.path))
    _link(f"{folder}/iommu_group", f"{up}kernel/iommu_groups/{fn.iommu_group}")
    if fn.driver:
        bind(sysfs, fn, fn.driver)


def bind(sysfs: str, fn: PciFunction, driver: str) -> None:
    """Link a function and a driver both ways, as the kernel does when the driver binds, and in its order (its
    driver_sysfs_add): the driver's entry first, the function's `driver` link last. Whoever waits for that link
    (the agent's rebinder) then finds the function listed by its driver, which is what the simulated NVML reads."""
    folder = function_dir(sysfs, fn)
    _link(f"{sysfs}/bus/pci/drivers/{driver}/{fn.bus_id}", "../../../../devices/" + "/".join(fn.path))
    _link(f"{folder}/driver", "../" * (len(fn.path) + 1) + f"bus/pci/drivers/{driver}")


def config_space(fn: PciFunction) -> bytes:
    """The first 256 bytes of config space: ids, class, header type and a PCI Express capability."""
    space = bytearray(256)
    space[0:2] = fn.vendor_id.to_bytes(2, "little")
    space[2:4] = fn.device_id.to_bytes(2, "little")
    space[0x06] = 0x10  # status: capabilities list present
    space[0x08] = 0xA1
    space[0x09:0x0C] = fn.class_code.to_bytes(3, "little")
    space[0x0E] = 0x01 if fn.is_bridge else 0x00
    space[0x34] = 0x40
    space[0x40] = 0x10  # PCI Express capability, last in the list
    space[0x42:0x44] = (0x2 | fn.port_type << 4).to_bytes(2, "little")
    return bytes(space)


def _write_gpu(dev: str, gpu: GpuPlan, char: bool) -> None:
    make_device_node(f"{dev}/nvidia{gpu.minor}", char=char)


def _write_nic(sysfs: str, dev: str, by_id: dict[str, PciFunction], nic: NicPlan, char: bool) -> None:
    pf = by_id[nic.bus_id]
    pf_dir = function_dir(sysfs, pf)
    if nic.spec.sriov is not None:
        sriov = {
            "sriov_totalvfs": nic.spec.sriov.total_vfs,
            "sriov_numvfs": len(nic.vfs),
            "sriov_offset": 1,
            "sriov_stride": 1,
            "sriov_vf_device": f"{nic.model.vf_device_id:x}",
            "sriov_drivers_autoprobe": 1,
        }
        for name, value in sriov.items():
            _write(f"{pf_dir}/{name}", f"{value}\n")
    up = nic.spec.link == "up"
    write_netdev(sysfs, pf, nic.netdev, nic.model.speed_mbps, up)
    if nic.rdma_index is not None:
        write_rdma(sysfs, dev, pf, nic.rdma_index, char=char)
    for vf in nic.vfs:
        vf_fn = by_id[vf.bus_id]
        _link(f"{pf_dir}/virtfn{vf.index}", f"../{vf.bus_id}")
        _link(f"{function_dir(sysfs, vf_fn)}/physfn", f"../{nic.bus_id}")
        if vf.netdev:
            write_netdev(sysfs, vf_fn, vf.netdev, nic.model.speed_mbps, up)
        if vf.rdma_index is not None:
            write_rdma(sysfs, dev, vf_fn, vf.rdma_index, char=char)


def write_netdev(sysfs: str, fn: PciFunction, name: str, speed: int, up: bool) -> None:
    """A network interface below a function, linked from class/net."""
    folder = write_class_device(sysfs, fn, "net", name, f"INTERFACE={name}\n")
    mac = int.from_bytes(name.encode()[-5:].rjust(5, b"\0"), "big")
    attrs = {
        "operstate": "up" if up else "down",
        "carrier": "1" if up else "0",
        "speed": str(speed) if up else "-1",
        "address": ":".join(f"{b:02x}" for b in (0x02, *mac.to_bytes(5, "big"))),
    }
    for attr, text in attrs.items():
        _write(f"{folder}/{attr}", text + "\n")


def write_rdma(sysfs: str, dev: str, fn: PciFunction, index: int, *, char: bool) -> None:
    """An RDMA device (mlx5_N) and its verbs character device (uverbsN); `char` as for `make_device_node`."""
    write_class_device(sysfs, fn, "infiniband", f"mlx5_{index}", f"NAME=mlx5_{index}\n")
    verbs = write_class_device(sysfs, fn, "infiniband_verbs", f"uverbs{index}",
                               f"MAJOR=231\nMINOR={192 + index}\nDEVNAME=infiniband/uverbs{index}\n")
    _write(f"{verbs}/dev", f"231:{192 + index}\n")
    os.makedirs(f"{dev}/infiniband", exist_ok=True)
    make_device_node(f"{dev}/infiniband/uverbs{index}", char=char)
    make_device_node(f"{dev}/infiniband/rdma_cm", char=char)


def _write_tpu(sysfs: str, dev: str, fn: PciFunction, tpu: TpuPlan, char: bool) -> None:
    if tpu.interface == "accel":
        folder = write_class_device(sysfs, fn, "accel", f"accel{tpu.index}",
                                    f"MAJOR=121\nMINOR={tpu.index}\nDEVNAME=accel{tpu.index}\n")
        _write(f"{folder}/dev", f"121:{tpu.index}\n")
        make_device_node(f"{dev}/accel{tpu.index}", char=char)
    else:
        os.makedirs(f"{dev}/vfio", exist_ok=True)
        make_device_node(f"{dev}/vfio/vfio", char=char)
        write_vfio_group(sysfs, dev, fn.iommu_group, char=char)


def write_class_device(sysfs: str, fn: PciFunction, cls: str, name: str, uevent: str) -> str:
    """A class device (netdev, RDMA device, accel node) below a function, linked from class/<cls>; its folder."""
    folder = f"{function_dir(sysfs, fn)}/{cls}/{name}"
    os.makedirs(folder, exist_ok=True)
    _write(f"{folder}/uevent", uevent)
    up = "../" * (len(fn.path) + 3)  # from the class device's folder up to the sysfs root
    _link(f"{folder}/subsystem", f"{up}class/{cls}")
    _link(f"{folder}/device", f"../../../{fn.bus_id}")
    _link(f"{sysfs}/class/{cls}/{name}", "../../devices/" + "/".join(fn.path) + f"/{cls}/{name}")
    return folder


def write_vfio_group(sysfs: str, dev: str, group: int, *, char: bool) -> None:
    """The vfio group of a function bound to vfio-pci: its class device and its /dev/vfio/<group> node (`char` as
    for `make_device_node`)."""
    folder = f"{sysfs}/devices/virtual/vfio/{group}"
    os.makedirs(folder, exist_ok=True)
    # Group minors are handed out in order of binding; the group number stands in for that order here.
    _write(f"{folder}/uevent", f"MAJOR=243\nMINOR={group}\nDEVNAME=vfio/{group}\n")
    _write(f"{folder}/dev", f"243:{group}\n")
    _link(f"{folder}/subsystem", "../../../../class/vfio")
    _link(f"{sysfs}/class/vfio/{group}", f"../../devices/virtual/vfio/{group}")
    make_device_node(f"{dev}/vfio/{group}", char=char)


def _write(path: str, content: str | bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, content.encode() if isinstance(content, str) else content)
    finally:
        os.close(fd)


def _link(path: str, target: str) -> None:
    try:
        os.symlink(target, path)
    except FileExistsError:
        os.unlink(path)
        os.symlink(target, path)
