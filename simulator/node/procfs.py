"""The host's network namespace as procfs shows it through the host's PID 1: `proc/1/net/` of a simulated node.

A real host has these files whatever its interfaces; the agent reads them (through `<host_root>/proc/1/net`) to
keep its hands off interfaces that carry the host's traffic. A simulated node starts as a host whose only
addresses and routes are the loopback's, in the kernel's own formats:

- `route`: the header line (the main IPv4 table; loopback routes live in the local table, which it does not show);
- `ipv6_route`: `::1/128` (local) and the `::/0` reject route, both on `lo`;
- `if_inet6`: `::1/128` on `lo`, host scope, permanent;
- `fib_trie`: the loopback's `127.0.0.1` leaf in the main and local tries.

Tests and operators add their own routes and addresses by appending rows in the same formats. When an interface
leaves the host's namespace the kernel drops its routes and addresses: `forget_interface` does the same here.
`proc/1/net/dev` is not written (it would have to follow every interface the simulated kernel makes and removes).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["HOST_NET", "ROUTE_HEADER", "forget_interface", "write_host_net"]

HOST_NET = "proc/1/net"
"""The host's network namespace files, below the node's root."""

ROUTE_HEADER = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT"

_ZERO6 = "0" * 32
_LOOPBACK6 = "0" * 31 + "1"
_IPV6_ROUTE = (
    f"{_LOOPBACK6} 80 {_ZERO6} 00 {_ZERO6} 00000000 00000001 00000000 80200001       lo\n"
    f"{_ZERO6} 00 {_ZERO6} 00 {_ZERO6} ffffffff 00000001 00000000 00200200       lo\n"
)
_IF_INET6 = f"{_LOOPBACK6} 01 80 10 80       lo\n"
_FIB_TRIE = "".join(
    f"{table}:\n"
    "  +-- 127.0.0.0/8 2 0 2\n"
    "     +-- 127.0.0.0/31 1 0 0\n"
    "        |-- 127.0.0.0\n"
    "           /8 host LOCAL\n"
    "        |-- 127.0.0.1\n"
    "           /32 host LOCAL\n"
    "     |-- 127.255.255.255\n"
    "        /32 link BROADCAST\n"
    for table in ("Main", "Local")
)


def write_host_net(root: Path) -> None:
    """The host's `proc/1/net` files below the node's `root`, as a host with only its loopback configured has."""
    net = root / HOST_NET
    net.mkdir(parents=True, exist_ok=True)
    for name, text in (("route", ROUTE_HEADER + "\n"), ("ipv6_route", _IPV6_ROUTE), ("if_inet6", _IF_INET6),
                       ("fib_trie", _FIB_TRIE)):
        (net / name).write_text(text)


def forget_interface(root: Path, interface: str) -> None:
    """Drop the interface's routes and addresses from the host's files, as the kernel does when the interface
    leaves the host's namespace (`route` names it first, `ipv6_route` and `if_inet6` last)."""
    net = root / HOST_NET
    for name, column in (("route", 0), ("ipv6_route", -1), ("if_inet6", -1)):
        path = net / name
        try:
            lines = path.read_text().splitlines(keepends=True)
        except FileNotFoundError:
            continue
        header = lines[:1] if name == "route" else []
        kept = [line for line in lines[len(header):] if not line.split() or line.split()[column] != interface]
        path.write_text("".join(header + kept))
