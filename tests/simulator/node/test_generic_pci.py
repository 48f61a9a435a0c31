"""Generic PCI functions on the simulated node (a third-party backend's hardware): numbered device nodes, the
driver's class devices in sysfs, extra sysfs attributes, and what binding, unbinding and node injections do."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from simulator.node.layout import plan_node
from simulator.node.node import SimulatedNode
from simulator.node.profile import NodeProfile, ProfileError, load_profile
from simulator.udev.hotplug import UdevInjector
from tests.support.agent_env import wait_until
from tests.support.timing import scaled

CARD = {"vendor": 0xACCE, "device": 0x0F01, "driver": "acme_fpga", "dev_nodes": ["acme/fpga{n}"],
        "char_class": "acme_fpga", "sysfs_attributes": {"bitstream": "factory"}}


def profile(**card: object) -> dict[str, object]:
    return {"name": "cards", "root_complexes": [{"numa_node": 0, "ports": [{"pci": CARD | card, "count": 2}]}]}


@pytest.fixture
def cards(sim_node: Callable[[str], SimulatedNode], scratch: Path) -> SimulatedNode:
    import yaml

    path = scratch / "cards.yaml"
    path.write_text(yaml.safe_dump(profile()))
    return sim_node(str(path))


def test_device_nodes_are_numbered_per_vendor_and_device(cards: SimulatedNode) -> None:
    assert sorted(os.listdir(cards.dev / "acme")) == ["fpga0", "fpga1"]
    assert [o.dev_nodes for o in cards.plan.others] == [("acme/fpga0",), ("acme/fpga1",)]


def test_each_node_is_the_drivers_class_device(cards: SimulatedNode) -> None:
    first = cards.plan.others[0].bus_id
    folder = cards.sysfs / "bus/pci/devices" / first / "acme_fpga" / "fpga0"
    assert "DEVNAME=acme/fpga0" in (folder / "uevent").read_text()
    assert (folder / "dev").read_text().strip().endswith(":0")
    assert os.path.realpath(cards.sysfs / "class/acme_fpga/fpga0") == os.path.realpath(folder)
    assert (cards.sysfs / "bus/pci/devices" / first / "bitstream").read_text() == "factory\n"


def test_unbinding_takes_the_class_device_and_node_binding_brings_them_back(cards: SimulatedNode) -> None:
    bus_id = cards.plan.others[1].bus_id
    function = cards.sysfs / "bus/pci/devices" / bus_id
    (function / "driver/unbind").write_text(bus_id)
    wait_until_sync(lambda: not (function / "driver").exists())
    assert not (cards.dev / "acme/fpga1").exists() and not (function / "acme_fpga").exists()
    assert not (cards.sysfs / "class/acme_fpga/fpga1").exists()
    (cards.sysfs / "bus/pci/drivers/acme_fpga/bind").write_text(bus_id)
    wait_until_sync(lambda: (function / "driver").exists())
    assert (cards.dev / "acme/fpga1").exists() and (function / "acme_fpga/fpga1/dev").exists()


def test_node_injections_reach_generic_class_devices(cards: SimulatedNode) -> None:
    bus_id = cards.plan.others[0].bus_id
    injector = UdevInjector(cards.root)
    removed = injector.node_remove(bus_id)
    assert [(e.action, e.subsystem) for e in removed.events] == [("remove", "acme_fpga")]
    assert not (cards.dev / "acme/fpga0").exists()
    injector.node_add(bus_id)
    assert (cards.dev / "acme/fpga0").exists()


@pytest.mark.parametrize(("card", "message"), [
    ({"dev_nodes": ["acme/fpga"]}, "both have device node /dev/acme/fpga; put {n} in dev_nodes"),
    ({"dev_nodes": []}, "char_class needs dev_nodes"),
    ({"driver": None}, "char_class needs a driver"),
    ({"sysfs_attributes": {"vendor": "x"}}, "sysfs_attributes ['vendor'] are files every PCI function has"),
    ({"dev_nodes": ["../etc/passwd"]}, "dev_nodes.0"),
    ({"vendor": 0x10000}, "vendor"),
])
def test_impossible_cards_are_refused(scratch: Path, card: dict[str, object], message: str) -> None:
    import yaml

    path = scratch / "bad.yaml"
    path.write_text(yaml.safe_dump(profile(**card)))
    with pytest.raises(ProfileError, match=None) as refused:
        plan_node(load_profile(str(path)))
    assert message in str(refused.value)


def test_builtin_profiles_are_unchanged_by_generic_functions() -> None:
    assert all(not plan_node(load_profile(name)).others for name in ("dgx-h100", "mixed"))
    assert isinstance(load_profile("mixed"), NodeProfile)


def wait_until_sync(predicate: Callable[[], bool], timeout: float = scaled(5.0)) -> None:
    """The simulated kernel reacts to a write a few milliseconds after it (see docs/simulated-node.md)."""
    import asyncio

    asyncio.run(wait_until(predicate, timeout))
