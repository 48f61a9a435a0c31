"""Which addresses the cluster's processes use: every TCP and UDP socket they hold, read from /proc.

The cluster must never send anything off loopback (not to the machine's own address on another interface, not to
a Service range). A socket bound to a wildcard address, or connected to any address outside 127.0.0.0/8 and ::1,
is a breach; `LoopbackWatch` samples the sockets of a set of processes in the background and keeps every breach
it saw, so a test can assert there was none over a whole run.
"""

from __future__ import annotations

import ipaddress
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["LoopbackWatch", "Socket", "breaches", "sockets_of"]

_TCP_LISTEN = "0A"


@dataclass(frozen=True)
class Socket:
    """One socket of a process: protocol, local and remote address, and whether it is a listening socket."""

    pid: int
    protocol: str
    local: str
    remote: str
    listening: bool

    def __str__(self) -> str:
        role = "listening on" if self.listening else f"{self.local} →"
        where = self.local if self.listening else self.remote
        return f"pid {self.pid} {self.protocol} {role} {where}"


def _address(hex_address: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """An address of /proc/net/{tcp,udp}[6]: the IP in the kernel's byte order (32-bit words, host order), a port."""
    ip_hex, port_hex = hex_address.split(":")
    raw = bytes.fromhex(ip_hex)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip, int(port_hex, 16)


def _inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in os.scandir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(fd.path)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def sockets_of(pids: Iterable[int]) -> list[Socket]:
    """The TCP and UDP sockets the processes hold now (each read in its own network namespace)."""
    found = []
    for pid in pids:
        inodes = _inodes(pid)
        if not inodes:
            continue
        for protocol in ("tcp", "tcp6", "udp", "udp6"):
            try:
                lines = Path(f"/proc/{pid}/net/{protocol}").read_text().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                parts = line.split()
                if len(parts) < 10 or parts[9] not in inodes:
                    continue
                local, remote = _address(parts[1]), _address(parts[2])
                listening = (protocol.startswith("tcp") and parts[3] == _TCP_LISTEN) or (
                    protocol.startswith("udp") and remote[1] == 0)
                found.append(Socket(pid, protocol, f"{local[0]}:{local[1]}", f"{remote[0]}:{remote[1]}",
                                    listening))
    return found


def _loopback(address: str) -> bool:
    return ipaddress.ip_address(address.rpartition(":")[0]).is_loopback


def breaches(sockets: Iterable[Socket]) -> list[Socket]:
    """The sockets that are bound to a non-loopback or wildcard address, or connected off loopback."""
    return [s for s in sockets if not _loopback(s.local) or (not s.listening and not _loopback(s.remote))]


@dataclass
class LoopbackWatch:
    """Samples the sockets of the processes it was told to `watch` every `interval` seconds in a thread until
    stopped; `seen` holds every breach (once each) and `samples` counts the rounds."""

    interval: float = 0.5
    pids: set[int] = field(default_factory=set)
    seen: set[Socket] = field(default_factory=set)
    samples: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def watch(self, pids: Iterable[int]) -> None:
        self.pids.update(pids)

    def sample(self) -> None:
        self.seen.update(breaches(sockets_of(list(self.pids))))
        self.samples += 1

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.wait(self.interval):
                self.sample()
        self._thread = threading.Thread(target=loop, name="loopback-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
