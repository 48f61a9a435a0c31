"""Whether a network interface carries the host's own traffic: its default route, or an address in use.

The agent must never take such an interface away from the host (binding its function to vfio-pci, changing its
PF's VF count): the node would drop off the network. Read from the host's network namespace through procfs of the
host's PID 1 (`<host_root>/proc/1/net/...`), which is the host's view under systemd and from a DaemonSet that
mounts the host's root (the agent's own `/proc/net` would show its pod's namespace):

- `route`: IPv4 routes; a destination of 00000000 with mask 00000000 is a default route, by interface;
- `ipv6_route`: IPv6 routes; a ::/0 destination is a default route (the last field names the interface);
- `fib_trie`: the IPv4 addresses; a `/32 host LOCAL` leaf is a local address, and `route` tells which interface's
  subnet holds it;
- `if_inet6`: IPv6 addresses by interface (link-local ones are ignored: every interface that is up has one).
"""

from __future__ import annotations

import ipaddress
import itertools
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HostNetwork", "read_host_network"]


@dataclass(frozen=True)
class HostNetwork:
    """Interfaces that carry the host's traffic, and why."""

    reasons: dict[str, str]

    def busy(self, interface: str) -> str | None:
        """Why `interface` must be left alone, or None."""
        return self.reasons.get(interface)


def _hex_ipv4(value: str) -> ipaddress.IPv4Address:
    return ipaddress.IPv4Address(struct.unpack("<I", bytes.fromhex(value))[0])


def read_host_network(host_root: Path) -> HostNetwork:
    """What the host's network namespace says now; files that cannot be read are skipped (nothing is claimed
    busy from them)."""
    net = host_root / "proc/1/net"
    reasons: dict[str, str] = {}
    subnets: list[tuple[str, ipaddress.IPv4Network]] = []
    for fields in _rows(net / "route", skip_header=True):
        if len(fields) < 8:
            continue
        interface, destination, mask = fields[0], fields[1], fields[7]
        try:
            network = ipaddress.IPv4Network(f"{_hex_ipv4(destination)}/{_hex_ipv4(mask)}", strict=False)
        except ValueError:
            continue
        if network.prefixlen == 0:
            reasons.setdefault(interface, f"{interface} carries the host's default route")
        else:
            subnets.append((interface, network))
    for fields in _rows(net / "ipv6_route"):
        if len(fields) >= 10 and fields[0] == "0" * 32 and fields[1] == "00" and fields[9] != "lo":
            reasons.setdefault(fields[9], f"{fields[9]} carries the host's default IPv6 route")
    for address in _local_ipv4(net / "fib_trie"):
        if address.is_loopback:
            continue
        for interface, network in subnets:
            if address in network:
                reasons.setdefault(interface, f"{interface} has the host's address {address}")
    for fields in _rows(net / "if_inet6"):
        if len(fields) >= 6 and fields[5] != "lo":
            address6 = ipaddress.IPv6Address(socket.inet_ntop(socket.AF_INET6, bytes.fromhex(fields[0])))
            if not address6.is_link_local:
                reasons.setdefault(fields[5], f"{fields[5]} has the host's address {address6}")
    return HostNetwork(reasons)


def _rows(path: Path, skip_header: bool = False) -> list[list[str]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    return [line.split() for line in lines[1 if skip_header else 0:] if line.strip()]


def _local_ipv4(path: Path) -> list[ipaddress.IPv4Address]:
    """The `/32 host LOCAL` leaves of fib_trie: the addresses configured on this host."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    found: list[ipaddress.IPv4Address] = []
    for previous, line in itertools.pairwise(lines):
        if line.strip() == "/32 host LOCAL":
            candidate = previous.strip().removeprefix("|-- ").removeprefix("+-- ")
            try:
                found.append(ipaddress.IPv4Address(candidate))
            except ValueError:
                continue
    return sorted(set(found))
