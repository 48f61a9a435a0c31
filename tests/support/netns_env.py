"""Network namespaces for tests: a "host" and a "pod" made with `ip netns add`, and raw netlink sockets opened in
either, to see which kernel messages reach which namespace.

The tests need root and iproute2; where the machine cannot make namespaces or veth pairs, they skip and say why.
"""

from __future__ import annotations

import os
import select
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.node.host_netns import in_netns
from tests.support.timing import scaled

EVENT_TIMEOUT = scaled(5.0)
"""Seconds a message the kernel (or udevd) sends may take to arrive."""
QUIET = scaled(0.2)
"""Seconds a socket is watched to show nothing arrives, after the same message reached another namespace (the
window is the point: it is kept, and stretched with the time factor)."""

NETLINK_KOBJECT_UEVENT = 15
UEVENT_KERNEL, UEVENT_UDEV = 1, 2  # the multicast groups of the kernel's uevents and of udevd's
RTMGRP_LINK = 1


def ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=False)


@dataclass(frozen=True)
class Namespaces:
    """Two network namespaces standing for a node's and a pod's; `veth(...)` makes links in the host's."""

    host: Path
    pod: Path

    @property
    def host_name(self) -> str:
        return self.host.name

    @property
    def pod_name(self) -> str:
        return self.pod.name

    def veth(self, name: str, peer: str) -> None:
        """A veth pair in the host's namespace, both ends up: each end's carrier follows the other's state."""
        for args in (("link", "add", name, "type", "veth", "peer", "name", peer),
                     ("link", "set", name, "up"), ("link", "set", peer, "up")):
            done = ip("-n", self.host_name, *args)
            assert done.returncode == 0, done.stderr


@contextmanager
def made_namespaces() -> Iterator[Namespaces]:
    """A fresh "host" and "pod" namespace, loopback up in the pod (a test's API server may listen there); removed
    afterwards with everything in them. Skips the test where they cannot be made."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("network namespaces are made with iproute2's ip, which is not installed")
    tag = uuid.uuid4().hex[:8]
    names = [f"dra-host-{tag}", f"dra-pod-{tag}"]
    made: list[str] = []
    try:
        for name in names:
            done = ip("netns", "add", name)
            if done.returncode != 0:
                pytest.skip(f"cannot make a network namespace here: {done.stderr.strip()}")
            made.append(name)
        probe = ip("-n", names[0], "link", "add", "probe0", "type", "veth", "peer", "name", "probe1")
        if probe.returncode != 0:
            pytest.skip(f"cannot make a veth pair here: {probe.stderr.strip()}")
        ip("-n", names[0], "link", "del", "probe0")
        assert ip("-n", names[1], "link", "set", "lo", "up").returncode == 0
        yield Namespaces(Path("/run/netns", names[0]), Path("/run/netns", names[1]))
    finally:
        for name in made:
            ip("netns", "del", name)


def netns_inode(path: Path | str) -> int:
    return os.stat(path).st_ino


class Listener:
    """A netlink socket bound to one multicast group, opened in a given namespace, with what it has received."""

    def __init__(self, netns: Path | None, protocol: int, group: int) -> None:
        def open_socket() -> socket.socket:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK, protocol)
            sock.bind((0, group))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            return sock

        self.sock = in_netns(netns, open_socket)
        self.received: list[bytes] = []

    def close(self) -> None:
        self.sock.close()

    def drain(self) -> list[bytes]:
        while True:
            try:
                self.received.append(self.sock.recv(65536))
            except BlockingIOError:
                return self.received

    def wait_for(self, wanted: Callable[[bytes], bool], timeout: float = EVENT_TIMEOUT) -> bytes | None:
        """The first message received (now or within `timeout`) that `wanted` accepts; None if none came."""
        deadline = time.monotonic() + timeout
        while True:
            for message in self.drain():
                if wanted(message):
                    return message
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            select.select([self.sock], [], [], left)


def uevent(message: bytes) -> dict[str, str]:
    """A kernel uevent's properties (`ACTION@DEVPATH` header, then `KEY=value` strings); {} for anything else."""
    header, *fields = message.split(b"\0")
    if b"@" not in header or header.startswith(b"libudev"):
        return {}
    return dict(field.decode(errors="replace").split("=", 1) for field in fields if b"=" in field)
