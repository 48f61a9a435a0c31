"""The node's network links as rtnetlink reports them, read on the event loop from one netlink socket.

The kernel sends no uevent when a link goes down or up (carrier lost, interface set down): it says so only over
rtnetlink (RTM_NEWLINK to the RTMGRP_LINK group). This monitor hands each such change to the backends that
subscribed, by interface name; they read the state itself from sysfs. A socket sees the links of the network
namespace it was created in: the agent opens it in the host's (agent/node/host_netns.py), so that a pod with a
namespace of its own sees the host's links as the agent under systemd does (see docs/deploy.md).

The socket and the messages are handled here rather than through pyroute2: three fixed kernel structures
(nlmsghdr, ifinfomsg, rtattr) of a stable ABI, read for two fields. pyroute2 would add 69 ms and 8.7 MB to every
start-up (its package imports all its netlink families; 33 ms for `IPRoute` alone), and decodes a link message in
117 µs against 1.8 µs here, every attribute of it: docs/performance.md, "Libraries instead of hand-written code".
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.logs import get_logger
from agent.node.host_netns import NetnsError, in_netns

__all__ = ["LinkChange", "LinkMonitor", "link_changes", "open_link_monitor"]

RTMGRP_LINK = 0x1
RTM_NEWLINK, RTM_DELLINK = 16, 17
IFLA_IFNAME = 3
IFF_UP, IFF_LOWER_UP = 0x1, 0x10000

_NLMSGHDR = struct.Struct("=IHHII")  # length, type, flags, sequence, port id
_IFINFOMSG = struct.Struct("=BxHiII")  # family, (pad), device type, index, flags, change mask
_RTATTR = struct.Struct("=HH")  # length, type
_RECEIVE_BUFFER = 4 * 1024 * 1024  # a burst of 64 VFs' links changing at once must fit

LinkHandler = Callable[[str], None]


@dataclass(frozen=True)
class LinkChange:
    """One link as a message described it: its index and name, whether it carries traffic (administratively up
    with carrier), or that it is gone."""

    index: int
    name: str
    up: bool
    removed: bool = False


def _align(n: int) -> int:
    return (n + 3) & ~3


def link_changes(data: bytes) -> list[LinkChange]:
    """The link messages in one datagram from an rtnetlink socket; other messages and malformed parts are
    skipped."""
    changes: list[LinkChange] = []
    offset = 0
    while offset + _NLMSGHDR.size <= len(data):
        length, kind, _, _, _ = _NLMSGHDR.unpack_from(data, offset)
        if length < _NLMSGHDR.size or offset + length > len(data):
            break
        body = offset + _NLMSGHDR.size
        if kind in (RTM_NEWLINK, RTM_DELLINK) and length >= _NLMSGHDR.size + _IFINFOMSG.size:
            _, _, index, flags, _ = _IFINFOMSG.unpack_from(data, body)
            name = _attribute(data, body + _IFINFOMSG.size, offset + length, IFLA_IFNAME)
            if name is not None:
                up = flags & IFF_UP != 0 and flags & IFF_LOWER_UP != 0
                changes.append(LinkChange(index, name.rstrip(b"\0").decode(errors="replace"), up,
                                          removed=kind == RTM_DELLINK))
        offset += _align(length)
    return changes


def _attribute(data: bytes, start: int, end: int, wanted: int) -> bytes | None:
    while start + _RTATTR.size <= end:
        length, kind = _RTATTR.unpack_from(data, start)
        if length < _RTATTR.size or start + length > end:
            return None
        if kind == wanted:
            return data[start + _RTATTR.size : start + length]
        start += _align(length)
    return None


class LinkMonitor:
    """An rtnetlink socket read on the asyncio loop; implements `backends.contract.LinkEvents`.

    Handlers hear of a link when it appears, goes, or its up state changes; the many other link messages (MTU,
    statistics, promiscuity, ...) are dropped here.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock: socket.socket | None = sock
        self._handlers: list[LinkHandler] = []
        self._known: dict[int, LinkChange] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._log = get_logger("links")

    def subscribe(self, handler: LinkHandler) -> Callable[[], None]:
        """Call `handler(interface name)` on the loop for every link that appears, goes, or goes down or up."""
        self._handlers.append(handler)

        def unsubscribe() -> None:
            if handler in self._handlers:
                self._handlers.remove(handler)

        return unsubscribe

    def start(self) -> None:
        """Read messages on the running loop from now on."""
        if self._sock is None:
            raise RuntimeError("link monitor used after close()")
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._sock.fileno(), self._drain)

    def close(self) -> None:
        if self._sock is None:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self._sock, self._loop = None, None
        self._handlers.clear()

    def _drain(self) -> None:
        while self._sock is not None:
            try:
                data = self._sock.recv(65536)
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno == errno.ENOBUFS:
                    # Changes were lost: tell every subscriber about every link it may care for.
                    self._log.warning("link messages were lost: the receive buffer overflowed")
                    self._tell_all()
                    continue
                self._log.warning("cannot read a link message", error=str(e))
                return
            for change in link_changes(data):
                self._on_change(change)

    def _on_change(self, change: LinkChange) -> None:
        before = self._known.pop(change.index, None)
        if not change.removed:
            self._known[change.index] = change
        if before is not None and before.up == change.up and before.name == change.name and not change.removed:
            return  # nothing a subscriber cares for changed
        self._log.debug("link", name=change.name, up=change.up, removed=change.removed)
        self._tell(change.name)

    def _tell_all(self) -> None:
        for change in list(self._known.values()):
            self._tell(change.name)

    def _tell(self, name: str) -> None:
        for handler in list(self._handlers):
            try:
                handler(name)
            except Exception as e:  # one subscriber's bug must not starve the others
                self._log.error("link event handler failed", link=name, error=f"{type(e).__name__}: {e}",
                                exc_info=True)


def open_link_monitor(netns: Path | None = None) -> LinkMonitor | None:
    """A monitor of the links of the network namespace whose file is `netns` (this process's when None),
    receiving already; None, after a warning, where rtnetlink cannot be opened (then link changes are seen at the
    next uevent or rediscovery).

    Where `netns` cannot be entered, a warning says so and the monitor watches this process's namespace instead.
    """
    log = get_logger("links")
    try:
        try:
            sock = in_netns(netns, _open_socket)
        except NetnsError as e:
            log.warning("the host's links going down or up will not be seen (an SR-IOV PF's link is read at start "
                        "and at each rediscovery only): cannot enter the host's network namespace", error=str(e))
            sock = _open_socket()
    except (AttributeError, OSError) as e:  # AttributeError: no AF_NETLINK on this platform
        log.warning("no link events: cannot open rtnetlink", error=f"{type(e).__name__}: {e}")
        return None
    with contextlib.suppress(OSError):  # the default buffer still works for ordinary rates
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RECEIVE_BUFFER)
    return LinkMonitor(sock)


def _open_socket() -> socket.socket:
    """An rtnetlink socket of the calling thread's network namespace, bound to link changes."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
                         socket.NETLINK_ROUTE)
    try:
        sock.bind((0, RTMGRP_LINK))
    except OSError:
        sock.close()
        raise
    return sock
