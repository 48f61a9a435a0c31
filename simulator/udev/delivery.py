"""Delivering uevents to the processes that watch a simulated node through umockdev's preload library.

Under `libumockdev-preload` with `UMOCKDEV_DIR` set to the node's root, libudev's netlink monitor socket is a
unix datagram socket bound at `<root>/event<fd>`; umockdev's own sender connects to each and writes one message
in libudev's wire format. This module writes the same message, so a monitor (pyudev's, in the agent) receives
it exactly as it would receive an event from udevd.
"""

from __future__ import annotations

import errno
import glob
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["STATE_DIR", "Uevent", "send"]

STATE_DIR = ".sim/udev"
"""Folder below the node's root for what injecting events needs to remember (sequence numbers, removed devices)."""

_MAGIC = 0xFEEDCAFE
_HEADER_SIZE = 40  # "libudev\0", magic, header size, properties offset and length, four filter words
_MASK = 0xFFFFFFFF


@dataclass(frozen=True)
class Uevent:
    """One uevent: what happened (`action`), to which device (`devpath` below /sys), and its properties."""

    action: str
    devpath: str
    subsystem: str
    properties: Mapping[str, str] = field(default_factory=dict)

    def encode(self, seqnum: int) -> bytes:
        """The message as libudev's monitor receives it: header, then NUL-terminated KEY=value strings."""
        env = {"ACTION": self.action, "DEVPATH": self.devpath, "SUBSYSTEM": self.subsystem, "SEQNUM": str(seqnum)}
        env.update((k, v) for k, v in self.properties.items() if k not in env)
        body = b"".join(f"{key}={value}".encode() + b"\0" for key, value in env.items())
        devtype = self.properties.get("DEVTYPE")
        # libudev keeps the magic and the filter words in network byte order (its socket filter reads them) and
        # the sizes in host order. The tag bloom filter stays empty, as in umockdev's sender.
        filters = (_murmur2(self.subsystem), _murmur2(devtype) if devtype else 0, 0, 0)
        head = (b"libudev\0" + struct.pack("!I", _MAGIC) + struct.pack("=III", _HEADER_SIZE, _HEADER_SIZE, len(body))
                + struct.pack("!IIII", *filters))
        return head + body


def send(root: Path, events: list[Uevent]) -> int:
    """Deliver the events, in order, to every monitor watching the node at `root`; the number of monitors reached.

    A socket left behind by a process that has gone refuses the connection and is removed, as umockdev does. A
    process that goes while its events are sent (killed, or closing its monitor) misses the rest of them; the
    others get theirs all the same.
    """
    listeners = sorted(glob.glob(os.path.join(glob.escape(str(root)), "event[0-9]*")))
    reached = 0
    for path in listeners:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            try:
                sock.connect(path)
            except OSError as e:
                if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
                    Path(path).unlink(missing_ok=True)
                    continue
                raise
            try:
                for event in events:
                    sock.send(event.encode(_next_seqnum(root)))
            except OSError as e:
                # The monitor closed after the connect. Its socket file is left to the next send: by then a new
                # monitor may be bound at the same path.
                if e.errno != errno.ECONNREFUSED:
                    raise
                continue
            reached += 1
    return reached


def _next_seqnum(root: Path) -> int:
    """Increasing sequence numbers per node, as the kernel's (libudev drops an event without one); kept in a file
    since every injection may come from another process."""
    counter = root / STATE_DIR / "seqnum"
    counter.parent.mkdir(parents=True, exist_ok=True)
    try:
        value = int(counter.read_text()) + 1
    except (FileNotFoundError, ValueError):
        value = 1
    counter.write_text(str(value))
    return value


def _murmur2(text: str) -> int:
    """MurmurHash2 as libudev computes it for its in-kernel socket filters (subsystem and device type)."""
    data = text.encode()
    m, length = 0x5BD1E995, len(data)
    h = length & _MASK
    end = length - length % 4
    for i in range(0, end, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * m) & _MASK
        k ^= k >> 24
        k = (k * m) & _MASK
        h = ((h * m) & _MASK) ^ k
    tail = data[end:]
    if len(tail) == 3:
        h ^= tail[2] << 16
    if len(tail) >= 2:
        h ^= tail[1] << 8
    if tail:
        h ^= tail[0]
        h = (h * m) & _MASK
    h ^= h >> 13
    h = (h * m) & _MASK
    h ^= h >> 15
    return h
