"""The simulated host's network namespace: its `proc/1/net` files in the kernel's formats, and a VF's interface
leaving for another namespace and coming back (`simulator.udev.netns_moves`), as the host's sysfs and procfs show
them."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from backends.host_net import interface_addresses, interface_routes, read_host_network
from simulator.node.hardware import SimulatedNode
from simulator.udev.hotplug import InjectionError, UdevInjector
from simulator.udev.netns_moves import main, netns_leave, netns_return

VF, NETDEV, OTHER = "0000:19:00.1", "enp25s0f0v0", "enp25s0f0v1"


def test_a_new_node_has_the_procfs_of_a_host_with_only_its_loopback(sim_node: Callable[[str], SimulatedNode]) -> None:
    root = sim_node("dgx-h100").root
    net = root / "proc/1/net"
    assert sorted(os.listdir(net)) == ["fib_trie", "if_inet6", "ipv6_route", "route"]
    assert net.joinpath("route").read_text().splitlines()[0].split() == [
        "Iface", "Destination", "Gateway", "Flags", "RefCnt", "Use", "Metric", "Mask", "MTU", "Window", "IRTT"]
    assert read_host_network(root).reasons == {}, "the loopback carries nothing the agent must leave alone"
    assert interface_routes(root, "lo") == [] and interface_addresses(root, "lo") == ()


def test_an_interface_leaves_and_comes_back_under_its_pod_name(sim_node: Callable[[str], SimulatedNode]) -> None:
    root = sim_node("dgx-h100").root
    sys = root / "sys"
    function = sys / "bus/pci/devices" / VF
    mac = (function / "net" / NETDEV / "address").read_text()
    with (root / "proc/1/net/route").open("a") as f:
        f.write(f"{NETDEV}\t0000090A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0\n")
    injector = UdevInjector(root)
    left = netns_leave(injector, NETDEV)
    assert [(e.action, e.subsystem, os.path.basename(e.devpath)) for e in left.events] == [("remove", "net", NETDEV)]
    assert (function / "net").is_dir() and os.listdir(function / "net") == []
    assert not (sys / "class/net" / NETDEV).exists()
    assert interface_routes(root, NETDEV) == [], "the kernel drops the routes of an interface that leaves"
    with pytest.raises(InjectionError, match="in another network namespace already"):
        netns_leave(injector, VF)

    back = netns_return(injector, VF, "net1")
    assert [(e.action, os.path.basename(e.devpath)) for e in back.events] == [("add", "net1")]
    assert os.listdir(function / "net") == ["net1"]
    assert (function / "net/net1/address").read_text() == mac
    assert "INTERFACE=net1" in (function / "net/net1/uevent").read_text()
    assert (sys / "class/net/net1").resolve() == (function / "net/net1").resolve()
    with pytest.raises(InjectionError, match="is not in another network namespace"):
        netns_return(injector, VF)


def test_a_name_the_host_has_makes_the_kernel_pick_dev_n(sim_node: Callable[[str], SimulatedNode],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    root: Path = sim_node("dgx-h100").root
    assert main(["--sim-root", str(root), "leave", NETDEV]) == 0
    assert main(["--sim-root", str(root), "return", VF, "--name", OTHER]) == 0
    assert "add net dev0" in capsys.readouterr().out
    assert os.listdir(root / "sys/bus/pci/devices" / VF / "net") == ["dev0"]
    assert main(["--sim-root", str(root), "return", VF]) == 2
