"""The simulated kernel's side effects of sysfs writes: plain writes to a simulated node's control files unbind,
bind and probe drivers (with vfio groups and class devices following) and enable or disable VFs, as the kernel
does, with its uevents; refused writes leave the tree as it was."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from backends.sriov.backend import SriovNicBackend
from backends.topology import device_name
from simulator.node.layout import PciFunction, plan_vf, vf_netdev
from simulator.node.node import SimulatedNode
from tests.support.node_tree_env import Tree, dangling_links, inventory, tree
from tests.support.timing import scaled


def write(path: Path, text: str) -> None:
    """As the agent writes a sysfs attribute: open, write, close."""
    with open(path, "w") as f:
        f.write(text)


def settle(condition: Callable[[], bool], what: str) -> None:
    """The kernel's effect lands shortly after close(): wait for it, within bounds."""
    limit = scaled(2)
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"not within {limit:g} s: {what}"
        time.sleep(0.01)


def driver(node: SimulatedNode, bus_id: str) -> str | None:
    """The driver bound to the device, None when none is; read once (the simulated kernel may be unbinding it)."""
    try:
        return os.path.basename(os.readlink(node.sysfs / "bus/pci/devices" / bus_id / "driver"))
    except FileNotFoundError:
        return None


def function(node: SimulatedNode, bus_id: str) -> PciFunction:
    return next(f for f in node.plan.functions if f.bus_id == bus_id)


# Control files keep what was last written to them (the kernel shows them normalized); /dev/vfio/vfio comes
# with the vfio module at the first vfio-pci bind.
_WRITTEN = ("sys/bus/pci/drivers_probe", "dev/vfio", "dev/vfio/vfio")


def without_written(snapshot: Tree) -> Tree:
    return {k: v for k, v in snapshot.items()
            if k not in _WRITTEN and not k.endswith(("/bind", "/unbind", "/driver_override", "/sriov_numvfs"))}


def test_unbind_takes_the_driver_and_its_netdev(sim_node: Callable[[str], SimulatedNode]) -> None:
    node = sim_node("mixed")
    nic = node.plan.nics[0]
    vf, other = nic.vfs[0], nic.vfs[1]
    devices = node.sysfs / "bus/pci/devices"
    write(devices / vf.bus_id / "driver/unbind", vf.bus_id + "\n")
    settle(lambda: driver(node, vf.bus_id) is None, "unbound through the function's driver link")
    assert not (node.sysfs / "bus/pci/drivers" / nic.model.vf_driver / vf.bus_id).exists()
    assert not (node.sysfs / "class/net" / str(vf.netdev)).is_symlink(), "the netdev goes with its driver"
    assert not (devices / vf.bus_id / "net").exists()
    write(node.sysfs / "bus/pci/drivers/nvidia/unbind", other.bus_id)  # not that function's driver: no effect
    write(node.sysfs / "bus/pci/drivers" / nic.model.vf_driver / "unbind", other.bus_id)
    settle(lambda: driver(node, other.bus_id) is None, "unbound through the driver's unbind file")
    assert not dangling_links(node.root)


def test_override_and_probe_move_a_vf_to_vfio_and_back(sim_node: Callable[[str], SimulatedNode]) -> None:
    node = sim_node("mixed")
    nic = node.plan.nics[0]
    vf = nic.vfs[1]
    group = function(node, vf.bus_id).iommu_group
    folder = node.sysfs / "bus/pci/devices" / vf.bus_id
    before = tree(node.root)
    write(folder / "driver/unbind", vf.bus_id)
    settle(lambda: driver(node, vf.bus_id) is None, "unbound")
    write(folder / "driver_override", "vfio-pci")
    write(node.sysfs / "bus/pci/drivers_probe", vf.bus_id)
    settle(lambda: driver(node, vf.bus_id) == "vfio-pci", "bound to vfio-pci by drivers_probe")
    assert (node.dev / "vfio" / str(group)).is_file() and (node.dev / "vfio/vfio").is_file()
    assert (node.sysfs / "class/vfio" / str(group) / "dev").read_text() == f"243:{group}\n"
    assert not (node.sysfs / "class/net" / str(vf.netdev)).exists()

    write(folder / "driver/unbind", vf.bus_id)
    settle(lambda: driver(node, vf.bus_id) is None, "unbound from vfio-pci")
    assert not (node.dev / "vfio" / str(group)).exists(), "the group node goes with its last vfio-pci member"
    write(folder / "driver_override", "\n")
    settle(lambda: (folder / "driver_override").read_text() == "(null)\n", "a cleared override reads (null)")
    write(node.sysfs / "bus/pci/drivers_probe", vf.bus_id)
    settle(lambda: driver(node, vf.bus_id) == nic.model.vf_driver, "back on its own driver")
    assert (node.sysfs / "class/net" / str(vf.netdev) / "operstate").read_text() == "up\n", "its netdev is back"
    assert without_written(tree(node.root)) == without_written(before)
    assert not any((node.root / ".sim/udev/removed").iterdir()), "nothing left aside"


def test_bind_file_honours_driver_override(sim_node: Callable[[str], SimulatedNode]) -> None:
    """The NVIDIA driver's passthrough scripts: unbind, override, then the driver's own bind file."""
    node = sim_node("mixed")
    gpu = node.plan.gpus[0]
    group = function(node, gpu.bus_id).iommu_group
    drivers = node.sysfs / "bus/pci/drivers"
    write(drivers / "nvidia/unbind", gpu.bus_id)
    settle(lambda: driver(node, gpu.bus_id) is None, "GPU unbound")
    write(drivers / "vfio-pci/bind", gpu.bus_id)  # vfio-pci matches no device without an override
    write(drivers / "nvidia/bind", node.plan.gpus[1].bus_id)  # bound already
    write(node.sysfs / "bus/pci/devices" / gpu.bus_id / "driver_override", "vfio-pci\n")
    write(drivers / "nvidia/bind", gpu.bus_id)  # the override excludes every other driver
    write(drivers / "vfio-pci/bind", gpu.bus_id)
    settle(lambda: driver(node, gpu.bus_id) == "vfio-pci", "GPU bound to vfio-pci")
    assert (node.dev / "vfio" / str(group)).is_file()
    assert driver(node, node.plan.gpus[1].bus_id) == "nvidia"


def test_a_vfio_group_stays_while_a_member_is_bound(sim_node: Callable[[str], SimulatedNode]) -> None:
    node = sim_node("mixed")
    tpu = next(t for t in node.plan.tpus if t.interface == "vfio")
    group = function(node, tpu.bus_id).iommu_group
    members = node.sysfs / "kernel/iommu_groups" / str(group) / "devices"
    assert [m.name for m in members.iterdir()] == [tpu.bus_id]
    write(node.sysfs / "bus/pci/drivers/vfio-pci/unbind", tpu.bus_id)
    settle(lambda: driver(node, tpu.bus_id) is None, "TPU unbound")
    assert not (node.dev / "vfio" / str(group)).exists()
    write(node.sysfs / "bus/pci/drivers_probe", tpu.bus_id)
    settle(lambda: driver(node, tpu.bus_id) == "vfio-pci", "TPU back on its own driver, vfio-pci")
    assert (node.dev / "vfio" / str(group)).is_file()


async def test_sriov_numvfs_disables_and_enables_vfs(sim_node: Callable[[str], SimulatedNode]) -> None:
    node = sim_node("dgx-h100")
    nic = node.plan.nics[0]
    pf = node.sysfs / "bus/pci/devices" / nic.bus_id
    assert nic.spec.sriov is not None and nic.spec.sriov.total_vfs == 64 and len(nic.vfs) == 8
    before = tree(node.root)
    published = await inventory(node, SriovNicBackend())
    write(pf / "sriov_numvfs", "0")
    settle(lambda: not list(pf.glob("virtfn*")), "VFs disabled")
    for vf in nic.vfs:
        assert not (node.sysfs / "bus/pci/devices" / vf.bus_id).exists()
        assert not (node.sysfs / "class/net" / str(vf.netdev)).exists()
    assert not dangling_links(node.root)
    assert await inventory(node, SriovNicBackend()) == published - {device_name("vf", v.bus_id) for v in nic.vfs}

    write(pf / "sriov_numvfs", "16")
    settle(lambda: (pf / "virtfn15/driver").exists(), "16 VFs enabled")
    expected = [plan_vf(function(node, nic.bus_id), nic.model, i, 0).bus_id for i in range(16)]
    assert expected[:8] == [vf.bus_id for vf in nic.vfs], "the profile's VFs come back where they were"
    for i, bus_id in enumerate(expected):
        assert os.readlink(pf / f"virtfn{i}") == f"../{bus_id}"
        vf_folder = node.sysfs / "bus/pci/devices" / bus_id
        assert os.readlink(vf_folder / "physfn") == f"../{nic.bus_id}"
        assert driver(node, bus_id) == nic.model.vf_driver
        assert (vf_folder / "net" / vf_netdev(nic.netdev, i)).is_dir()
        assert (node.sysfs / "class/net" / vf_netdev(nic.netdev, i)).is_symlink()
    groups = [os.readlink(node.sysfs / "bus/pci/devices" / b / "iommu_group") for b in expected]
    assert len(set(groups)) == 16, "every VF in a group of its own"
    assert not dangling_links(node.root)
    found = await inventory(node, SriovNicBackend())
    assert found - published == {device_name("vf", b) for b in expected[8:]}
    assert {device_name("vf", b) for b in expected} <= found

    write(pf / "sriov_numvfs", "0")
    settle(lambda: not list(pf.glob("virtfn*")), "16 VFs disabled")
    write(pf / "sriov_numvfs", "8")
    settle(lambda: (pf / "virtfn7/driver").exists(), "the profile's 8 VFs enabled")
    settle(lambda: without_written(tree(node.root)) == without_written(before), "the tree as the profile made it")


def test_refused_vf_counts_leave_the_tree_unchanged(sim_node: Callable[[str], SimulatedNode]) -> None:
    node = sim_node("dgx-h100")
    nic = node.plan.nics[0]
    numvfs = node.sysfs / "bus/pci/devices" / nic.bus_id / "sriov_numvfs"
    before = tree(node.root)
    for text in ("16", "65", "lots", "-1"):
        write(numvfs, text)
        settle(lambda: numvfs.read_text() == "8\n", f"sriov_numvfs {text!r} put back")
        assert tree(node.root) == before
    pf = node.sysfs / "bus/pci/devices" / nic.bus_id
    write(pf / "sriov_numvfs", "0")
    settle(lambda: not list(pf.glob("virtfn*")), "VFs disabled")
    write(pf / "sriov_numvfs", "65")
    settle(lambda: numvfs.read_text() == "0\n", "more than sriov_totalvfs refused")
    assert not list(pf.glob("virtfn*"))


def test_uevents_reach_a_listener(sim_node: Callable[[str], SimulatedNode]) -> None:
    node = sim_node("mixed")
    nic = node.plan.nics[0]
    vf = nic.vfs[0]
    group = function(node, vf.bus_id).iommu_group
    folder = node.sysfs / "bus/pci/devices" / vf.bus_id
    pf = node.sysfs / "bus/pci/devices" / nic.bus_id
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(str(node.root / "event3"))
        listener.settimeout(scaled(2))

        def receive(count: int) -> list[tuple[str, str, str, str | None]]:
            seen = []
            for _ in range(count):
                message = listener.recv(65536)
                fields = dict(p.split("=", 1) for p in message[40:].decode().split("\0") if p)
                seen.append((fields["ACTION"], fields["SUBSYSTEM"], os.path.basename(fields["DEVPATH"]),
                             fields.get("DRIVER")))
            return seen

        write(folder / "driver/unbind", vf.bus_id)
        class_devices = [("net", str(vf.netdev)), ("infiniband", f"mlx5_{vf.rdma_index}"),
                         ("infiniband_verbs", f"uverbs{vf.rdma_index}")]
        assert receive(4) == [*(("remove", cls, name, None) for cls, name in class_devices),
                              ("unbind", "pci", vf.bus_id, None)], "the driver's class devices go first"
        write(folder / "driver_override", "vfio-pci")
        write(node.sysfs / "bus/pci/drivers_probe", vf.bus_id)
        assert receive(2) == [("add", "vfio", str(group), None), ("bind", "pci", vf.bus_id, "vfio-pci")]
        write(pf / "sriov_numvfs", "0")
        seen = receive(3 * 5 + 3)
        assert seen[:5] == [*(("remove", cls, name, None) for cls, name in
                              (("net", str(nic.vfs[3].netdev)), ("infiniband", f"mlx5_{nic.vfs[3].rdma_index}"),
                               ("infiniband_verbs", f"uverbs{nic.vfs[3].rdma_index}"))),
                            ("unbind", "pci", nic.vfs[3].bus_id, None), ("remove", "pci", nic.vfs[3].bus_id, None)]
        assert seen[-3:] == [("remove", "vfio", str(group), None), ("unbind", "pci", vf.bus_id, None),
                             ("remove", "pci", vf.bus_id, None)], "VF 0 goes last, its vfio group with it"
        write(pf / "sriov_numvfs", "1")
        added = receive(5)
        assert added[0] == ("add", "pci", vf.bus_id, None) and added[-1] == ("bind", "pci", vf.bus_id, "mlx5_core")
        assert sorted(added[1:4]) == sorted(("add", cls, name, None) for cls, name in class_devices)
