"""Which interfaces carry the host's traffic, from the host's procfs: default routes and addresses in use."""

from __future__ import annotations

from pathlib import Path

from backends.host_net import read_host_network

ROUTE = """Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eno1\t00000000\t0100000A\t0003\t0\t0\t100\t00000000\t0\t0\t0
eno1\t0000000A\t00000000\t0001\t0\t0\t100\t00FFFFFF\t0\t0\t0
enp25s0f0np0\t0010A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
enp29s0f0np0\t0011A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
"""
FIB_TRIE = """Main:
  +-- 0.0.0.0/0 3 0 5
     |-- 10.0.0.5
        /32 host LOCAL
     |-- 192.168.16.7
        /32 host LOCAL
Local:
  +-- 0.0.0.0/0 3 0 5
     |-- 127.0.0.1
        /32 host LOCAL
"""
IF_INET6 = """fe800000000000000000000000000001 03 40 20 80 enp29s0f0np0
20010db8000000000000000000000002 04 40 00 80 enp59s0f0np0
00000000000000000000000000000001 01 80 10 80 lo
"""
IPV6_ROUTE = " ".join(["0" * 32, "00", "0" * 32, "00", "fe80" + "0" * 27 + "1", "00000400", "00000001", "00000000",
                       "00000003", "enp94s0f0np0"]) + "\n"


def test_default_routes_and_addresses_make_an_interface_busy(tmp_path: Path) -> None:
    net = tmp_path / "proc/1/net"
    net.mkdir(parents=True)
    (net / "route").write_text(ROUTE)
    (net / "fib_trie").write_text(FIB_TRIE)
    (net / "if_inet6").write_text(IF_INET6)
    (net / "ipv6_route").write_text(IPV6_ROUTE)
    host = read_host_network(tmp_path)
    assert host.busy("eno1") == "eno1 carries the host's default route"
    assert host.busy("enp25s0f0np0") == "enp25s0f0np0 has the host's address 192.168.16.7"
    assert host.busy("enp29s0f0np0") is None, "a route without an address of ours, and a link-local address"
    assert host.busy("enp59s0f0np0") == "enp59s0f0np0 has the host's address 2001:db8::2"
    assert host.busy("enp94s0f0np0") == "enp94s0f0np0 carries the host's default IPv6 route"
    assert host.busy("lo") is None


def test_unreadable_files_claim_nothing(tmp_path: Path) -> None:
    assert read_host_network(tmp_path).reasons == {}


def test_this_machines_default_route_interface_is_busy() -> None:
    lines = Path("/proc/1/net/route").read_text().splitlines()[1:]
    defaults = {f[0] for f in (line.split() for line in lines) if f[1] == "00000000" and f[7] == "00000000"}
    host = read_host_network(Path("/"))
    assert all(host.busy(interface) for interface in defaults)
