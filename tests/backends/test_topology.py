"""PCIe topology on hand-built sysfs trees, checked against the upstream pcieRoot algorithm."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from backends.topology import (
    NUMA_NODE,
    PCI_BUS_ID,
    PCIE_ROOT,
    PCIE_SWITCH,
    TopologyError,
    TopologyReader,
    device_name,
    normalize_bus_id,
)

ROOT_PORT, UPSTREAM, DOWNSTREAM, ENDPOINT = 0x4, 0x5, 0x6, 0x0


def config(port_type: int) -> bytes:
    """Minimal config space with a PCI Express capability of the given port type."""
    space = bytearray(256)
    space[0x06] = 0x10
    space[0x34] = 0x40
    space[0x40] = 0x10
    space[0x42] = 0x2 | port_type << 4
    return bytes(space)


def add(sysfs: Path, path: list[str], port_type: int | None = None, numa: str | None = "0",
        link: bool = True, **attrs: str) -> Path:
    """Create one PCI function at devices/<path> and its bus/pci/devices link, like the kernel does."""
    folder = sysfs.joinpath("devices", *path)
    folder.mkdir(parents=True, exist_ok=True)
    if port_type is not None:
        (folder / "config").write_bytes(config(port_type))
    if numa is not None:
        (folder / "numa_node").write_text(numa + "\n")
    for name, value in attrs.items():
        (folder / name).write_text(value + "\n")
    if link:
        devices = sysfs / "bus/pci/devices"
        devices.mkdir(parents=True, exist_ok=True)
        os.symlink("../../../devices/" + "/".join(path), devices / path[-1])
    return folder


def test_device_directly_on_root_port(scratch: Path) -> None:
    add(scratch, ["pci0000:3a", "0000:3a:01.0"], ROOT_PORT)
    add(scratch, ["pci0000:3a", "0000:3a:01.0", "0000:3b:00.0"], ENDPOINT, numa="1", vendor="0x10de")
    topo = TopologyReader(scratch).lookup("0000:3b:00.0")
    assert topo.pcie_root == "pci0000:3a"
    assert topo.pcie_switch is None
    assert topo.numa_node == 1
    assert topo.vendor_id == 0x10DE
    assert topo.attributes() == {PCI_BUS_ID: "0000:3b:00.0", PCIE_ROOT: "pci0000:3a", NUMA_NODE: 1}


def test_device_on_the_root_bus_of_a_vm(scratch: Path) -> None:
    add(scratch, ["pci0000:00", "0000:00:04.0"], None)
    reader = TopologyReader(scratch)
    assert reader.pcie_root("0000:00:04.0") == "pci0000:00"
    assert reader.pcie_switch("0000:00:04.0") is None


def test_device_behind_one_switch(scratch: Path) -> None:
    chain = ["pci0000:15", "0000:15:01.0", "0000:16:00.0", "0000:17:00.0"]
    for depth, port in zip(range(2, 5), (ROOT_PORT, UPSTREAM, DOWNSTREAM), strict=True):
        add(scratch, chain[:depth], port, link=False)
    add(scratch, [*chain, "0000:18:00.0"], ENDPOINT)
    topo = TopologyReader(scratch).lookup("0000:18:00.0")
    assert topo.pcie_root == "pci0000:15"
    assert topo.pcie_switch == "0000:16:00.0"
    assert topo.attributes()[PCIE_SWITCH] == "0000:16:00.0"


def test_device_behind_two_stacked_switches_reports_the_closest(scratch: Path) -> None:
    chain = ["pci0000:80", "0000:80:01.0", "0000:81:00.0", "0000:82:00.0", "0000:83:00.0", "0000:84:01.0"]
    ports = (ROOT_PORT, UPSTREAM, DOWNSTREAM, UPSTREAM, DOWNSTREAM)
    for depth, port in zip(range(2, 7), ports, strict=True):
        add(scratch, chain[:depth], port, link=False)
    add(scratch, [*chain, "0000:85:00.0"], ENDPOINT)
    reader = TopologyReader(scratch)
    assert reader.pcie_root("0000:85:00.0") == "pci0000:80"
    assert reader.pcie_switch("0000:85:00.0") == "0000:83:00.0"


def test_switch_found_from_tree_shape_when_config_space_is_unreadable(scratch: Path) -> None:
    chain = ["pci0000:80", "0000:80:01.0", "0000:81:00.0", "0000:82:00.0", "0000:83:00.0", "0000:84:01.0"]
    for depth in range(2, 7):
        add(scratch, chain[:depth], None, link=False)
    add(scratch, [*chain, "0000:85:00.0"], None)
    assert TopologyReader(scratch).pcie_switch("0000:85:00.0") == "0000:83:00.0"


def test_bridge_that_is_not_a_switch_port_is_not_a_switch(scratch: Path) -> None:
    # A root port, then a PCIe-to-PCI bridge (port type 7): no switch above the device.
    chain = ["pci0000:00", "0000:00:1c.0", "0000:01:00.0"]
    add(scratch, chain[:2], ROOT_PORT, link=False)
    add(scratch, chain, 0x7, link=False)
    add(scratch, [*chain, "0000:02:00.0"], ENDPOINT)
    assert TopologyReader(scratch).pcie_switch("0000:02:00.0") is None


def test_unknown_numa_node_is_left_out(scratch: Path) -> None:
    add(scratch, ["pci0000:00", "0000:00:05.0"], None, numa="-1")
    topo = TopologyReader(scratch).lookup("0000:00:05.0")
    assert topo.numa_node == -1
    assert NUMA_NODE not in topo.attributes()
    assert topo.problems == ()


def test_missing_link_is_an_error_and_lookup_keeps_what_it_can(scratch: Path) -> None:
    reader = TopologyReader(scratch)
    with pytest.raises(TopologyError, match="does not exist"):
        reader.pcie_root("0000:3b:00.0")
    topo = reader.lookup("0000:3b:00.0")
    assert topo.pcie_root is None and topo.pcie_switch is None
    assert topo.attributes() == {PCI_BUS_ID: "0000:3b:00.0"}
    assert any("pcieRoot" in p for p in topo.problems)


def test_dangling_link_still_names_its_root_like_upstream(scratch: Path) -> None:
    # Upstream reads the link text only; a target that does not exist still yields the root complex.
    devices = scratch / "bus/pci/devices"
    devices.mkdir(parents=True)
    os.symlink("../../../devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0", devices / "0000:3b:00.0")
    assert TopologyReader(scratch).pcie_root("0000:3b:00.0") == "pci0000:3a"


@pytest.mark.parametrize(
    "target",
    [
        "../../../class/net/eth0",  # not below devices/
        "../../../devices/platform/0000:3b:00.0",  # not below a pci root complex
        "../../../devices/pci0000:3a/0000:3a:00.0/0000:3b:00.1",  # last component is another device
        "/elsewhere/devices/pci0000:3a/0000:3b:00.0",  # absolute, outside this sysfs
    ],
)
def test_malformed_links_are_rejected(scratch: Path, target: str) -> None:
    devices = scratch / "bus/pci/devices"
    devices.mkdir(parents=True)
    os.symlink(target, devices / "0000:3b:00.0")
    with pytest.raises(TopologyError):
        TopologyReader(scratch).pcie_root("0000:3b:00.0")


def test_absolute_link_inside_the_sysfs_root_is_accepted(scratch: Path) -> None:
    devices = scratch / "bus/pci/devices"
    devices.mkdir(parents=True)
    os.symlink(f"{scratch}/devices/pci0001:00/0001:00:02.0", devices / "0001:00:02.0")
    assert TopologyReader(scratch).pcie_root("0001:00:02.0") == "pci0001:00"


@pytest.mark.parametrize("bad", ["0000:3B:00.0", "00000000:3b:00.0", "", "0000:3b:00", "3b:00.0"])
def test_bus_ids_must_have_the_upstream_form(scratch: Path, bad: str) -> None:
    with pytest.raises(TopologyError, match="not a PCI bus id"):
        TopologyReader(scratch).pcie_root(bad)


def test_unreadable_attribute_is_a_problem_not_a_crash(scratch: Path) -> None:
    folder = add(scratch, ["pci0000:00", "0000:00:06.0"], None)
    (folder / "numa_node").unlink()
    (folder / "numa_node").mkdir()  # reading a directory fails even for root
    topo = TopologyReader(scratch).lookup("0000:00:06.0")
    assert topo.pcie_root == "pci0000:00"
    assert topo.numa_node == -1
    assert any("numa_node" in p and "Is a directory" in p for p in topo.problems)


def test_nvml_bus_ids_are_normalised() -> None:
    assert normalize_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_bus_id("0001:AF:1F.7") == "0001:af:1f.7"
    with pytest.raises(TopologyError):
        normalize_bus_id("GPU-1234")
    with pytest.raises(TopologyError):
        normalize_bus_id("00010000:3b:00.0")


def test_device_names_derive_from_the_address() -> None:
    assert device_name("gpu", "0000:3b:00.0") == "gpu-0000-3b-00-0"
