"""Writes a simulated node's sysfs and /dev trees to disk with the kernel's real file and symlink structure.

`bus/pci/devices/<BDF>` links point into `devices/pci<domain>:<bus>/…`, devices carry their ids, NUMA node,
config space, `driver` and `iommu_group` links; PFs carry SR-IOV files and `virtfn<N>` links, VFs `physfn`;
network and RDMA devices appear under the function and in `class/`. Device nodes are plain files.
"""

from __future__ import annotations

import os
from pathlib import Path

from backends.simulation.layout import GpuPlan, NicPlan, NodePlan, PciFunction, TpuPlan

__all__ = ["config_space", "write_tree"]


def write_tree(plan: NodePlan, sysfs_root: Path, dev_root: Path) -> None:
    """Create the sysfs tree under `sysfs_root` and device nodes under `dev_root` (both may exist, empty)."""
    # Plain strings and os calls: a large node has tens of thousands of entries and pathlib's overhead
    # would dominate the time to build it.
    sysfs, dev = str(sysfs_root), str(dev_root)
    for sub in ("devices", "bus/pci/devices", "bus/pci/drivers", "kernel/iommu_groups", "class/net",
                "class/infiniband", "class/infiniband_verbs", "class/accel", "module"):
        os.makedirs(f"{sysfs}/{sub}", exist_ok=True)
    os.makedirs(dev, exist_ok=True)
    _write(f"{sysfs}/bus/pci/drivers_probe", "")
    _write(f"{sysfs}/bus/pci/rescan", "")
    for driver in sorted({f.driver for f in plan.functions if f.driver} | {"vfio-pci"}):
        write_driver(sysfs, driver)
    for fn in plan.functions:
        write_function(sysfs, fn)
    for gpu in plan.gpus:
        _write_gpu(dev, gpu)
    if plan.gpus:
        for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
            _write(f"{dev}/{name}", "")
    by_id = {f.bus_id: f for f in plan.functions}
    for nic in plan.nics:
        _write_nic(sysfs, dev, by_id, nic)
    for tpu in plan.tpus:
        _write_tpu(sysfs, dev, by_id[tpu.bus_id], tpu)
    for other in plan.others:
        for node in other.spec.dev_nodes:
            os.makedirs(os.path.dirname(f"{dev}/{node}"), exist_ok=True)
            _write(f"{dev}/{node}", "")


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
    """Link a function and a driver both ways, as the kernel does when the driver binds."""
    folder = function_dir(sysfs, fn)
    _link(f"{folder}/driver", "../" * (len(fn.path) + 1) + f"bus/pci/drivers/{driver}")
    _link(f"{sysfs}/bus/pci/drivers/{driver}/{fn.bus_id}", "../../../../devices/" + "/".join(fn.path))


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


def _write_gpu(dev: str, gpu: GpuPlan) -> None:
    _write(f"{dev}/nvidia{gpu.minor}", "")


def _write_nic(sysfs: str, dev: str, by_id: dict[str, PciFunction], nic: NicPlan) -> None:
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
        write_rdma(sysfs, dev, pf, nic.rdma_index)
    for vf in nic.vfs:
        vf_fn = by_id[vf.bus_id]
        _link(f"{pf_dir}/virtfn{vf.index}", f"../{vf.bus_id}")
        _link(f"{function_dir(sysfs, vf_fn)}/physfn", f"../{nic.bus_id}")
        if vf.netdev:
            write_netdev(sysfs, vf_fn, vf.netdev, nic.model.speed_mbps, up)
        if vf.rdma_index is not None:
            write_rdma(sysfs, dev, vf_fn, vf.rdma_index)


def write_netdev(sysfs: str, fn: PciFunction, name: str, speed: int, up: bool) -> None:
    """A network interface below a function, linked from class/net."""
    folder = f"{function_dir(sysfs, fn)}/net/{name}"
    os.makedirs(folder, exist_ok=True)
    mac = int.from_bytes(name.encode()[-5:].rjust(5, b"\0"), "big")
    attrs = {
        "operstate": "up" if up else "down",
        "carrier": "1" if up else "0",
        "speed": str(speed) if up else "-1",
        "address": ":".join(f"{b:02x}" for b in (0x02, *mac.to_bytes(5, "big"))),
    }
    for attr, text in attrs.items():
        _write(f"{folder}/{attr}", text + "\n")
    _link(f"{sysfs}/class/net/{name}", "../../devices/" + "/".join(fn.path) + f"/net/{name}")


def write_rdma(sysfs: str, dev: str, fn: PciFunction, index: int) -> None:
    """An RDMA device (mlx5_N) and its verbs character device (uverbsN)."""
    folder = function_dir(sysfs, fn)
    ib = f"{folder}/infiniband/mlx5_{index}"
    os.makedirs(ib, exist_ok=True)
    verbs = f"{folder}/infiniband_verbs/uverbs{index}"
    os.makedirs(verbs, exist_ok=True)
    _write(f"{verbs}/dev", f"231:{192 + index}\n")
    base = "../../devices/" + "/".join(fn.path)
    _link(f"{sysfs}/class/infiniband/mlx5_{index}", f"{base}/infiniband/mlx5_{index}")
    _link(f"{sysfs}/class/infiniband_verbs/uverbs{index}", f"{base}/infiniband_verbs/uverbs{index}")
    os.makedirs(f"{dev}/infiniband", exist_ok=True)
    _write(f"{dev}/infiniband/uverbs{index}", "")
    _write(f"{dev}/infiniband/rdma_cm", "")


def _write_tpu(sysfs: str, dev: str, fn: PciFunction, tpu: TpuPlan) -> None:
    if tpu.interface == "accel":
        folder = f"{function_dir(sysfs, fn)}/accel/accel{tpu.index}"
        os.makedirs(folder, exist_ok=True)
        _write(f"{folder}/dev", f"121:{tpu.index}\n")
        _link(f"{sysfs}/class/accel/accel{tpu.index}",
              "../../devices/" + "/".join(fn.path) + f"/accel/accel{tpu.index}")
        _write(f"{dev}/accel{tpu.index}", "")
    else:
        os.makedirs(f"{dev}/vfio", exist_ok=True)
        _write(f"{dev}/vfio/vfio", "")
        _write(f"{dev}/vfio/{fn.iommu_group}", "")


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
