"""The simulated node: profile validation, the kernel's sysfs structure, /dev nodes, NVML agreeing with sysfs."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

import pynvml
import pytest

from backends.nvidia.nvml import nvml_session
from simulator.node.layout import plan_node
from simulator.node.node import SimulatedNode
from simulator.node.profile import NodeProfile, ProfileError, load_profile
from simulator.node.variants import with_char_devices
from tests.support.timing import scaled


def profile(text: str, scratch: Path) -> NodeProfile:
    path = scratch / "p.yaml"
    path.write_text(text)
    return load_profile(str(path))


def test_dgx_plan_identities() -> None:
    plan = plan_node(load_profile("dgx-h100"))
    assert [g.minor for g in plan.gpus] == list(range(8))
    assert [g.bus_id for g in plan.gpus] == sorted(g.bus_id for g in plan.gpus)
    assert len({g.uuid for g in plan.gpus}) == 8
    assert len(plan.nics) == 8 and all(len(n.vfs) == 8 for n in plan.nics)
    bus_ids = [f.bus_id for f in plan.functions]
    assert len(bus_ids) == len(set(bus_ids))
    assert len({f.iommu_group for f in plan.functions}) == len(plan.functions)
    assert plan_node(load_profile("dgx-h100")) == plan, "layout is deterministic"


def test_sysfs_has_the_kernels_link_structure(sim_node: Callable[[str], SimulatedNode]) -> None:
    node = sim_node("dgx-h100")
    sysfs = node.sysfs.resolve()  # links below it are compared as resolved paths
    for fn in node.plan.functions:
        entry = sysfs / "bus/pci/devices" / fn.bus_id
        real = Path(os.path.realpath(entry))
        assert real == sysfs.joinpath("devices", *fn.path) and real.is_dir()
        assert os.readlink(entry).startswith("../../../devices/pci")
        assert Path(os.path.realpath(real / "iommu_group")) == sysfs / "kernel/iommu_groups" / str(fn.iommu_group)
        assert (sysfs / "kernel/iommu_groups" / str(fn.iommu_group) / "devices" / fn.bus_id).resolve() == real
        if fn.driver:
            assert Path(os.path.realpath(real / "driver")) == sysfs / "bus/pci/drivers" / fn.driver
            assert (sysfs / "bus/pci/drivers" / fn.driver / fn.bus_id).resolve() == real
        assert (real / "vendor").read_text() == f"0x{fn.vendor_id:04x}\n"
        assert len((real / "config").read_bytes()) == 256
    for nic in node.plan.nics:
        pf = sysfs / "bus/pci/devices" / nic.bus_id
        assert (pf / "sriov_numvfs").read_text() == "8\n" and (pf / "sriov_totalvfs").read_text() == "64\n"
        assert (sysfs / "class/net" / nic.netdev).resolve() == (pf / "net" / nic.netdev).resolve()
        for vf in nic.vfs:
            assert os.readlink(pf / f"virtfn{vf.index}") == f"../{vf.bus_id}"
            assert (sysfs / "bus/pci/devices" / vf.bus_id / "physfn").resolve() == pf.resolve()


def test_dev_nodes(sim_node: Callable[[str], SimulatedNode]) -> None:
    dgx = sim_node("dgx-h100")
    for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", *(f"nvidia{i}" for i in range(8))):
        assert (dgx.dev / name).is_file()
    assert len(list((dgx.dev / "infiniband").glob("uverbs*"))) == 8 + 64


def _device_entries(dev: Path) -> list[Path]:
    return [p for p in dev.rglob("*") if not p.is_dir()]


def _is_null_char_device(path: Path) -> bool:
    st = os.lstat(path)
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)


@pytest.mark.skipif(os.geteuid() != 0, reason="character devices are made with mknod, as root")
def test_char_device_nodes_when_the_profile_asks(sim_node: Callable[[str], SimulatedNode], scratch: Path) -> None:
    """`device_nodes: char`: every /dev entry is a character device with /dev/null's numbers, as a container
    runtime needs them, also those the kernel makes later (a vfio group at a vfio-pci bind) and the copies in the
    driver container's /dev."""
    folder = scratch / "profiles"
    folder.mkdir()
    node = sim_node(str(with_char_devices("dgx-h100", folder)))
    entries = _device_entries(node.dev)
    assert len(entries) > 1000  # GPUs, control nodes, nvidia-caps, uverbs
    assert [p for p in entries if not _is_null_char_device(p)] == []
    gpu = node.plan.gpus[0]
    folder_of_gpu = node.sysfs / "bus/pci/devices" / gpu.bus_id
    group = os.path.basename(os.readlink(folder_of_gpu / "iommu_group"))
    (node.sysfs / "bus/pci/drivers/nvidia/unbind").write_text(gpu.bus_id)
    (folder_of_gpu / "driver_override").write_text("vfio-pci")
    (node.sysfs / "bus/pci/drivers_probe").write_text(gpu.bus_id)
    deadline = time.monotonic() + scaled(2)
    while not (node.dev / "vfio" / group).exists():
        assert time.monotonic() < deadline, "the vfio group's node did not appear"
        time.sleep(0.01)
    assert _is_null_char_device(node.dev / "vfio" / group) and _is_null_char_device(node.dev / "vfio/vfio")

    in_container = sim_node(str(with_char_devices("gke-g2-l4", folder, layout="container")))
    copies = _device_entries(in_container.driver_root / "dev")
    assert {p.name for p in copies} >= {"nvidia0", "nvidiactl"}
    assert all(_is_null_char_device(p) for p in copies)


def test_nvml_agrees_with_sysfs(sim_node: Callable[[str], SimulatedNode]) -> None:
    node = sim_node("dgx-h100")
    with nvml_session():
        assert pynvml.nvmlDeviceGetCount() == 8
        for gpu in node.plan.gpus:
            handle = pynvml.nvmlDeviceGetHandleByIndex(gpu.minor)
            bus = pynvml.nvmlDeviceGetPciInfo(handle).busId
            assert (bus.decode() if isinstance(bus, bytes) else bus) == "0000" + gpu.bus_id.upper()
            assert pynvml.nvmlDeviceGetMinorNumber(handle) == gpu.minor
            assert pynvml.nvmlDeviceGetUUID(handle) == gpu.uuid
            assert (node.sysfs / "bus/pci/devices" / gpu.bus_id / "device").read_text() == "0x2330\n"


def test_static_mig_layout_from_profile(sim_node: Callable[[str], SimulatedNode]) -> None:
    node = sim_node("mixed")
    (mig_gpu,) = [g for g in node.plan.gpus if g.spec.mig]
    assert [(v.profile, v.start) for v in node.nvml.instances(mig_gpu.minor)] == [
        ("3g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name: x\nroot_complexes:\n  - integrated: [{nic: {model: E810, sriov: {total_vfs: 4, num_vfs: 5}}}]\n",
         "num_vfs 5 exceeds total_vfs 4"),
        ("name: x\nroot_complexes:\n  - integrated: [{switch: [{gpu: L4}]}]\n", "a switch needs a root port"),
        ("name: x\nroot_complexes:\n  - ports: [{gpu: L4, tpu: v5e}]\n", "exactly one of gpu, nic, tpu, pci, switch"),
        ("name: x\nroot_complexes:\n  - ports: [{gpu: {model: L4, mig: {}}}]\n", "L4 does not support MIG"),
        ("name: x\nroot_complexes:\n  - ports: [{gpu: {model: H100-SXM5-80GB, mig: {instances: "
         "[{profile: 9g.1tb, start: 0}]}}}]\n", "has no MIG profile '9g.1tb'"),
        ("name: x\nroot_complexes:\n  - ports: [{nic: {model: gVNIC, sriov: {total_vfs: 2}}}]\n",
         "gVNIC supports at most 0 VFs"),
        ("name: Bad Name\nroot_complexes:\n  - ports: []\n", "name"),
        ("name: x\nroot_complexes: []\n", "root_complexes"),
    ],
)
def test_invalid_profiles(scratch: Path, text: str, message: str) -> None:
    with pytest.raises(ProfileError, match=message.replace("(", r"\(")):
        profile(text, scratch)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name: x\nroot_complexes:\n  - ports: [{nic: {model: E810, name: eth0}}, {nic: {model: E810, name: eth0}}]\n",
         "'eth0' is used twice"),
        ("name: x\nroot_complexes:\n  - bus: 0x10\n    ports: [{gpu: L4}]\n  - bus: 0x05\n    ports: [{gpu: L4}]\n",
         "overlaps buses already in use"),
    ],
)
def test_inconsistent_layouts(scratch: Path, text: str, message: str) -> None:
    with pytest.raises(ProfileError, match=message):
        plan_node(profile(text, scratch))


def test_overlapping_mig_instances_are_refused(scratch: Path) -> None:
    spec = profile(
        "name: x\nroot_complexes:\n  - ports:\n      - gpu:\n          model: H100-SXM5-80GB\n"
        "          mig: {instances: [{profile: 3g.40gb, start: 0}, {profile: 1g.10gb, start: 2}]}\n",
        scratch,
    )
    with pytest.raises(ProfileError, match=r"cannot create MIG instance 1g\.10gb at 2"):
        SimulatedNode.build(spec, scratch / "node")


def test_kept_node_is_reused_with_its_changes(scratch: Path) -> None:
    from simulator.node.node import simulated_node

    root = scratch / "kept"
    with simulated_node("gke-g2-l4", root) as node:
        override = node.sysfs / "bus/pci/devices" / node.plan.gpus[0].bus_id / "driver_override"
        override.write_text("vfio-pci\n")
    with simulated_node("gke-g2-l4", root) as again:
        assert again.plan == node.plan
        assert override.read_text() == "vfio-pci\n", "a kept node keeps what was changed in its sysfs"
    with pytest.raises(ProfileError, match="another profile"), simulated_node("gke-n1-t4x2", root):
        pass
    (scratch / "junk").mkdir()
    (scratch / "junk" / "file").write_text("x")
    with pytest.raises(ProfileError, match="not empty"), simulated_node("gke-g2-l4", scratch / "junk"):
        pass
