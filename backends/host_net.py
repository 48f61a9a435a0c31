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

`interface_addresses` and `interface_routes` read the same files for one interface that is to be handed to a pod:
what addresses it takes along, and which of the host's routes go through it.
"""

from __future__ import annotations

import ipaddress
import itertools
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HostNetwork", "interface_addresses", "interface_routes", "read_host_network"]


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


# ipv6_route flags (include/uapi/linux/ipv6_route.h, route.h): routes the kernel keeps for an interface's own
# addresses (local, anycast), cached ones, and reject routes (which send nothing anywhere).
_RTF_GATEWAY, _RTF_REJECT = 0x2, 0x0200
_RTF_LOCAL, _RTF_ANYCAST, _RTF_CACHE = 0x80000000, 0x00100000, 0x01000000
_IFA_F_PERMANENT = 0x80
_SCOPE_GLOBAL = 0x00
_LINK_LOCAL6 = ipaddress.IPv6Network("fe80::/10")
_MULTICAST6 = ipaddress.IPv6Network("ff00::/8")


def _ipv4_routes(net: Path) -> list[tuple[str, ipaddress.IPv4Network, ipaddress.IPv4Address | None]]:
    """(interface, destination, gateway or None) of every row of `route` (the main table)."""
    found = []
    for fields in _rows(net / "route", skip_header=True):
        if len(fields) < 8:
            continue
        try:
            network = ipaddress.IPv4Network(f"{_hex_ipv4(fields[1])}/{_hex_ipv4(fields[7])}", strict=False)
            gateway = _hex_ipv4(fields[2]) if int(fields[3], 16) & _RTF_GATEWAY else None
        except ValueError:
            continue
        found.append((fields[0], network, gateway))
    return found


def _ipv6(hex_text: str) -> ipaddress.IPv6Address:
    return ipaddress.IPv6Address(bytes.fromhex(hex_text))


def _ipv6_addresses(net: Path, interface: str) -> list[tuple[ipaddress.IPv6Interface, int, int]]:
    """(address/prefix, scope, flags) of the interface's IPv6 addresses in `if_inet6`."""
    found = []
    for fields in _rows(net / "if_inet6"):
        if len(fields) >= 6 and fields[5] == interface:
            try:
                address = ipaddress.IPv6Interface(f"{_ipv6(fields[0])}/{int(fields[2], 16)}")
                found.append((address, int(fields[3], 16), int(fields[4], 16)))
            except ValueError:
                continue
    return found


def interface_addresses(host_root: Path, interface: str) -> tuple[str, ...]:
    """The interface's permanent global addresses in canonical CIDR form (`192.0.2.5/24`, `2001:db8::5/64`): those
    a container runtime keeps when it moves the interface into a pod.

    IPv6 ones from `if_inet6`, global scope with the permanent flag. procfs does not list IPv4 addresses by
    interface, nor their flags: an IPv4 address is a `/32 host LOCAL` leaf of `fib_trie` inside a subnet the
    interface's own (gateway-less) route covers, and is taken as permanent (an address a DHCP client keeps renewing
    is not, and the runtime leaves it behind)."""
    net = host_root / "proc/1/net"
    found: list[str] = []
    local = _local_ipv4(net / "fib_trie")
    for name, network, gateway in _ipv4_routes(net):
        if name != interface or gateway is not None or network.prefixlen == 0:
            continue
        found.extend(f"{a}/{network.prefixlen}" for a in local if a in network and not a.is_loopback)
    for address, scope, flags in _ipv6_addresses(net, interface):
        if scope == _SCOPE_GLOBAL and flags & _IFA_F_PERMANENT:
            found.append(str(address))
    return tuple(dict.fromkeys(found))


def interface_routes(host_root: Path, interface: str) -> list[str]:
    """The routes of the host through `interface` other than those the kernel keeps for the interface's own
    addresses (the subnet of each address, IPv6 link-local and multicast routes, local and anycast entries), each
    as `ip route` would name it (`default via 192.0.2.1`, `10.9.0.0/16`). Moving the interface out of the host's
    namespace would take these routes away from the host."""
    net = host_root / "proc/1/net"
    local = _local_ipv4(net / "fib_trie")
    found: list[str] = []
    for name, network, gateway in _ipv4_routes(net):
        if name != interface:
            continue
        if gateway is None and network.prefixlen > 0 and any(a in network for a in local):
            continue  # the subnet of one of its addresses
        found.append(_route_text(network, gateway))
    own = [address for address, _, _ in _ipv6_addresses(net, interface)]
    for fields in _rows(net / "ipv6_route"):
        if len(fields) < 10 or fields[9] != interface:
            continue
        try:
            network6 = ipaddress.IPv6Network(f"{_ipv6(fields[0])}/{int(fields[1], 16)}")
            flags = int(fields[8], 16)
            gateway6 = _ipv6(fields[4]) if flags & _RTF_GATEWAY else None
        except ValueError:
            continue
        if flags & (_RTF_LOCAL | _RTF_ANYCAST | _RTF_CACHE | _RTF_REJECT):
            continue
        if gateway6 is None and (network6.subnet_of(_LINK_LOCAL6) or network6 == _MULTICAST6
                                 or any(a.network == network6 for a in own)):
            continue
        found.append(_route_text(network6, gateway6))
    return found


def _route_text(network: ipaddress.IPv4Network | ipaddress.IPv6Network,
                gateway: ipaddress.IPv4Address | ipaddress.IPv6Address | None) -> str:
    where = "default" if network.prefixlen == 0 else str(network)
    return where if gateway is None else f"{where} via {gateway}"
