"""Link changes from rtnetlink: the message parser, the monitor on the event loop, a real kernel's messages, and
the SR-IOV backend reading a PF's link again when rtnetlink (not udev) tells it went down or up."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import struct
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import structlog

from agent.node.link_monitor import (
    IFF_LOWER_UP,
    IFF_UP,
    IFLA_IFNAME,
    RTM_DELLINK,
    RTM_NEWLINK,
    LinkChange,
    LinkMonitor,
    link_changes,
    open_link_monitor,
)
from backends.contract import BackendContext, Health, HealthEvent
from backends.sriov.backend import SriovNicBackend
from backends.topology import TopologyReader, device_name
from simulator.node.node import SimulatedNode
from tests.support.timing import scaled

RTM_NEWADDR = 20


def message(kind: int, index: int, flags: int, name: str | None) -> bytes:
    """One rtnetlink message as the kernel writes it: nlmsghdr, ifinfomsg, then attributes, 4-byte aligned."""
    body = struct.pack("=BxHiII", socket.AF_UNSPEC, 1, index, flags, 0xFFFFFFFF)
    attributes = struct.pack("=HH", 4 + 4, 4) + struct.pack("=I", 1500)  # IFLA_MTU first, to be skipped
    if name is not None:
        raw = name.encode() + b"\0"
        attribute = struct.pack("=HH", 4 + len(raw), IFLA_IFNAME) + raw
        attributes += attribute + b"\0" * (-len(attribute) % 4)
    payload = body + attributes
    return struct.pack("=IHHII", 16 + len(payload), kind, 0, 0, 0) + payload


def test_link_messages_are_parsed_and_others_skipped() -> None:
    up = IFF_UP | IFF_LOWER_UP
    data = (message(RTM_NEWLINK, 7, up, "enp25s0f0np0") + message(RTM_NEWADDR, 7, 0, "enp25s0f0np0")
            + message(RTM_NEWLINK, 8, IFF_UP, "eth1") + message(RTM_NEWLINK, 9, 0, None)
            + message(RTM_DELLINK, 10, 0, "veth0"))
    assert link_changes(data) == [
        LinkChange(7, "enp25s0f0np0", up=True),
        LinkChange(8, "eth1", up=False),  # administratively up, no carrier
        LinkChange(10, "veth0", up=False, removed=True),
    ]


@pytest.mark.parametrize("cut", [3, 17, 40])
def test_truncated_messages_do_not_raise(cut: int) -> None:
    data = message(RTM_NEWLINK, 7, IFF_UP, "eth0") + message(RTM_NEWLINK, 8, IFF_UP, "eth1")
    assert link_changes(data[:cut]) == []
    assert link_changes(data[: len(data) - cut])[:1] == [LinkChange(7, "eth0", up=False)]


async def test_the_monitor_tells_changes_of_state_only() -> None:
    ours, kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    ours.setblocking(False)
    monitor = LinkMonitor(ours)
    heard: list[str] = []
    def broken(name: str) -> None:
        raise RuntimeError(f"a broken subscriber, told of {name}")

    monitor.subscribe(broken)
    unsubscribe = monitor.subscribe(heard.append)
    monitor.start()
    try:
        up = IFF_UP | IFF_LOWER_UP
        for data in (message(RTM_NEWLINK, 3, up, "pf0"),  # first news of it
                     message(RTM_NEWLINK, 3, up, "pf0"),  # MTU, statistics, ...: nothing for us
                     message(RTM_NEWLINK, 3, IFF_UP, "pf0"),  # carrier lost
                     message(RTM_NEWLINK, 4, 0, "pf1"),
                     message(RTM_DELLINK, 4, 0, "pf1")):
            kernel.send(data)
        await wait_for(lambda: len(heard) == 4)
        assert heard == ["pf0", "pf0", "pf1", "pf1"]
        unsubscribe()
        kernel.send(message(RTM_NEWLINK, 3, up, "pf0"))
        await asyncio.sleep(scaled(0.05))  # a window in which nothing may be heard
        assert len(heard) == 4
    finally:
        monitor.close()
        kernel.close()


async def test_a_real_link_going_up_and_down_is_heard() -> None:
    """A veth pair in this machine's kernel: its carrier follows the peer, as a NIC's follows the cable."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create a veth pair")
    name, peer = f"drat{uuid.uuid4().hex[:6]}", f"drap{uuid.uuid4().hex[:6]}"
    status, error = await ip("link", "add", name, "type", "veth", "peer", "name", peer)
    if status != 0:
        pytest.skip(f"cannot create a veth pair here: {error}")
    monitor = open_link_monitor()
    assert monitor is not None
    heard: list[str] = []
    monitor.subscribe(heard.append)
    monitor.start()
    try:
        assert await ip("link", "set", name, "up") == (0, "")
        assert await ip("link", "set", peer, "up") == (0, "")  # carrier on both ends now
        # Heard twice: set up without carrier, then the carrier. The kernel reports a carrier change late (its
        # link watch runs batched), so a cable pulled before that report would undo the change unheard.
        await wait_for(lambda: heard.count(name) >= 2, timeout=scaled(5))
        count = heard.count(name)
        assert await ip("link", "set", peer, "down") == (0, "")  # the cable is pulled
        await wait_for(lambda: heard.count(name) > count, timeout=scaled(5))
    finally:
        monitor.close()
        await ip("link", "del", name)


async def ip(*args: str) -> tuple[int, str]:
    """Run iproute2's `ip`; its exit status and error output."""
    process = await asyncio.create_subprocess_exec("ip", *args, stdout=asyncio.subprocess.DEVNULL,
                                                   stderr=asyncio.subprocess.PIPE)
    _, error = await process.communicate()
    return process.returncode or 0, error.decode().strip()


class Links:
    """A LinkEvents the test drives by hand."""

    def __init__(self) -> None:
        self.handlers: list[Callable[[str], None]] = []

    def subscribe(self, handler: Callable[[str], None]) -> Callable[[], None]:
        self.handlers.append(handler)
        return lambda: self.handlers.remove(handler)

    def tell(self, name: str) -> None:
        for handler in list(self.handlers):
            handler(name)


async def test_sriov_reads_the_link_again_when_rtnetlink_says_so(sim_node: Callable[[str], SimulatedNode]) -> None:
    node = sim_node("mixed")
    nic = node.plan.nics[0]
    links = Links()
    backend = SriovNicBackend()
    ctx = BackendContext(node.sysfs, node.dev, node.root, TopologyReader(node.sysfs), {},
                         structlog.get_logger("sriov-nic"), links=links, driver_root=node.driver_root)
    await backend.start(ctx)
    vfs = sorted(device_name("vf", vf.bus_id) for vf in nic.vfs)
    assert len(vfs) == 4 and set(vfs) <= {d.name for d in (await backend.discover()).devices}
    events: asyncio.Queue[object] = asyncio.Queue()

    async def follow() -> None:
        async for item in backend.health():
            events.put_nowait(item)

    task = asyncio.create_task(follow())
    try:
        # Subscribed, and the links read once (what a PF's netdev is named is known from that first read).
        await wait_for(lambda: len(links.handlers) == 1 and nic.netdev in backend._netdevs)
        interface = Path(node.sysfs, "class/net", nic.netdev)
        # As the kernel does when the cable is pulled: sysfs changes, and no uevent is sent.
        interface.joinpath("operstate").write_text("down\n")
        interface.joinpath("carrier").write_text("0\n")
        links.tell("eth-of-someone-else")
        links.tell(nic.netdev)
        down = [await asyncio.wait_for(events.get(), scaled(5)) for _ in vfs]
        assert all(isinstance(e, HealthEvent) and e.health is Health.UNHEALTHY and e.cause == "link-down"
                   for e in down)
        assert sorted(e.device for e in down if isinstance(e, HealthEvent)) == vfs
        interface.joinpath("operstate").write_text("up\n")
        interface.joinpath("carrier").write_text("1\n")
        links.tell(nic.netdev)
        up = [await asyncio.wait_for(events.get(), scaled(5)) for _ in vfs]
        assert all(isinstance(e, HealthEvent) and e.health is Health.HEALTHY for e in up)
    finally:
        await backend.stop()
        await asyncio.wait_for(task, scaled(5))
    assert links.handlers == [], "unsubscribed when health() ends"


async def wait_for(condition: Callable[[], bool], timeout: float = scaled(2)) -> None:
    async with asyncio.timeout(timeout):
        while not condition():  # noqa: ASYNC110 - the condition is set by callbacks of the code under test
            await asyncio.sleep(0.01)
