"""`VfConfig.netDevice`, without an agent: the interface name rules, the configuration's conflicts, what the host's
sysfs and procfs say of a VF's interface, the refusals, and the CDI edit with its spec version and schema."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.claims.opaque import effective_config
from agent.claims.read import ClaimError, OpaqueEntry
from backends.contract import Allocated, PrepareError
from backends.host_net import interface_addresses, interface_routes
from backends.sriov.vf_config import NetDeviceRequest, VfConfig, interface_name_problem
from backends.sriov.vf_netdev import duplicate_names, hand_over, net_device_requests, read_vf_interface
from backends.vfio import VfioConfig
from cdi.names import validate_spec
from cdi.spec import ContainerEdits, Device, NetDevice, Spec
from tests.support.cdi_schema import cdi_schema_errors

API = "dra-agent.io/v1alpha1"
VF_CONFIG = {"apiVersion": API, "kind": "VfConfig", "netDevice": {"name": "net1"}}
VFIO = {"apiVersion": API, "kind": "VfioConfig"}
TYPES = (VfioConfig, VfConfig)


@pytest.mark.parametrize("name", [
    "net1", "eth0", "net%d", "a" * 15, "ü" * 7, "ü" * 7 + "a", "vf-0_1.x", "%d", "a%dz", "...",
    "\u2003x", "a\u3000b", "a\x1cb", "a\x85b", "a\u2028b", "é\x7f",  # no byte of these is whitespace to the kernel
])
def test_names_the_kernel_takes_are_accepted(name: str) -> None:
    assert interface_name_problem(name) is None
    assert NetDeviceRequest(name=name).name == name


@pytest.mark.parametrize(("name", "why"), [
    ("", "cannot be empty"),
    ("a" * 16, "at most 15 bytes"),
    ("ü" * 8, "at most 15 bytes"),  # 16 bytes in 8 characters
    ("a" * 14 + "ü", "'aaaaaaaaaaaaaaü' has 16"),
    (".", "'.' and '..' stand for folders"),
    ("..", "'.' and '..' stand for folders"),
    ("net/1", "cannot contain '/'"),
    ("net:1", "cannot contain ':'"),
    ("a\0b", "cannot contain NUL"),
    ("net 1", "' ' (byte 0x20)"),
    ("net\t1", "'\\t' (byte 0x09)"),
    ("a\rb", "'\\r' (byte 0x0d)"),
    ("netà", "'à' (bytes c3 a0)"),
    ("a\u00a0b", "'\\xa0' (bytes c2 a0)"),
    ("a†b", "'†' (bytes e2 80 a0)"),
    ("\u0420x", "'\u0420' (bytes d0 a0)"),
    ("net%d%d", "one `%d`"),
    ("net%s", "one `%d`"),
    ("%", "one `%d`"),
    ("net%", "one `%d`"),
    ("lo", "the loopback interface"),
    ("a\ud800", "is not text"),  # a lone surrogate has no UTF-8
])
def test_names_the_kernel_refuses_are_refused(name: str, why: str) -> None:
    problem = interface_name_problem(name)
    assert problem is not None and why in problem
    with pytest.raises(ValueError, match="netDevice"):
        VfConfig.model_validate({**VF_CONFIG, "netDevice": {"name": name}})


def test_a_refusal_names_the_field_and_says_what_is_wrong_in_words() -> None:
    with pytest.raises(ClaimError) as caught:
        effective_config(_entries({**VF_CONFIG, "netDevice": {"name": "netà"}}), TYPES, "sriov-nic")
    assert str(caught.value).endswith(
        "VfConfig.netDevice.name: an interface name cannot contain whitespace as the kernel reads it, byte by byte "
        "(bytes 0x09 to 0x0d, 0x20 and 0xa0): 'netà' has 'à' (bytes c3 a0)")
    with pytest.raises(ClaimError) as caught:
        effective_config(_entries({**VF_CONFIG, "netDevice": {"name": "lo"}}), TYPES, "sriov-nic")
    assert "VfConfig.netDevice.name: 'lo' is the loopback interface, which every network namespace has: " in str(
        caught.value)
    assert "File exists" in str(caught.value)
    for name in ("lo", "netà", "a\ud800", "{x}/", "x" * 70):
        with pytest.raises(ClaimError) as caught:
            effective_config(_entries({**VF_CONFIG, "netDevice": {"name": name}}), TYPES, "sriov-nic")
        assert "Value error" not in str(caught.value) and "codec" not in str(caught.value), str(caught.value)


# The kernel's isspace() (include/linux/ctype.h, lib/ctype.c), on each byte of the name.
KERNEL_SPACE = b"\t\n\x0b\x0c\r \xa0"


@given(st.text(max_size=20))
def test_every_accepted_name_fits_the_kernels_rules(name: str) -> None:
    if interface_name_problem(name) is None:
        raw = name.encode()
        assert 0 < len(raw) <= 15
        assert name not in (".", "..", "lo") and not any(b in b"/:\0" + KERNEL_SPACE for b in raw)
        assert name.count("%") == name.count("%d") <= 1


@given(st.text(st.characters(codec="utf-8"), min_size=1, max_size=7))
def test_every_name_the_kernels_rules_allow_is_accepted(name: str) -> None:
    raw = name.encode()
    if len(raw) <= 15 and name not in (".", "..", "lo") and not any(b in b"/:%\0" + KERNEL_SPACE for b in raw):
        assert interface_name_problem(name) is None


def _entries(*parameters: dict[str, Any]) -> list[OpaqueEntry]:
    sources = ["FromClass"] + ["FromClaim"] * (len(parameters) - 1)
    return [OpaqueEntry(i, source, (), p) for i, (source, p) in enumerate(zip(sources, parameters, strict=True))]


def test_the_claims_vf_config_is_read_with_its_field_paths_in_errors() -> None:
    config = effective_config(_entries(VF_CONFIG), TYPES, "sriov-nic")
    assert isinstance(config, VfConfig) and config.net_device == NetDeviceRequest(name="net1")
    with pytest.raises(ClaimError, match=r"VfConfig\.netDevice\.mtu: Extra inputs are not permitted"):
        effective_config(_entries({**VF_CONFIG, "netDevice": {"name": "net1", "mtu": 9000}}), TYPES, "sriov-nic")
    with pytest.raises(ClaimError, match=r"VfConfig\.netDevice\.name: an interface name has at most"):
        effective_config(_entries({**VF_CONFIG, "netDevice": {"name": "x" * 16}}), TYPES, "sriov-nic")


@pytest.mark.parametrize("order", ["vfio-then-netdevice", "netdevice-then-vfio"])
def test_vfio_and_a_net_device_for_the_same_vf_fail_the_claim(order: str) -> None:
    pair = (VFIO, VF_CONFIG) if order == "vfio-then-netdevice" else (VF_CONFIG, VFIO)
    with pytest.raises(ClaimError, match=r"VfConfig\.netDevice hands the VF's network interface to the pod, and "
                                         r"VfioConfig binds the VF to vfio-pci") as caught:
        effective_config(_entries(*pair), TYPES, "sriov-nic")
    assert "opaque config #1 (from the claim, all requests) and opaque config #0 (from the device class" in str(
        caught.value)


def test_a_vf_config_without_net_device_yields_to_vfio_as_before() -> None:
    plain = {"apiVersion": API, "kind": "VfConfig"}
    assert isinstance(effective_config(_entries(plain, VFIO), TYPES, "sriov-nic"), VfioConfig)
    assert isinstance(effective_config(_entries(VFIO, plain), TYPES, "sriov-nic"), VfConfig)


def _allocated(device: str, name: str | None, admin: bool = False) -> Allocated:
    config = VfConfig.model_validate({**VF_CONFIG, "netDevice": {"name": name}}) if name else None
    return Allocated(device, "nic", config, admin_access=admin)


def test_one_claim_cannot_ask_for_the_same_name_twice() -> None:
    assert net_device_requests([_allocated("vf-a", "net1"), _allocated("vf-b", "net2"), _allocated("vf-c", None)]) \
        == {"vf-a": NetDeviceRequest(name="net1"), "vf-b": NetDeviceRequest(name="net2")}
    with pytest.raises(PrepareError, match="same interface name in the pod more than once: 'net1' for vf-a and vf-b"):
        net_device_requests([_allocated("vf-a", "net1"), _allocated("vf-b", "net1")])
    assert duplicate_names({"vf-a": NetDeviceRequest(name="net%d"), "vf-b": NetDeviceRequest(name="net%d")}) is None


def _names(*asked: str | None) -> dict[str, str]:
    moves = net_device_requests([_allocated(f"vf-{i}", name) for i, name in enumerate(asked)])
    return {device: request.name for device, request in moves.items()}


def test_templates_get_the_numbers_the_kernel_would_pick_in_the_pod() -> None:
    """The smallest number free in the pod's namespace, which holds `lo`, the pod's `eth0` and the claim's other
    names; each template of the claim gets its own."""
    assert _names("net%d", "net%d") == {"vf-0": "net0", "vf-1": "net1"}
    assert _names("net%d", "net1", None, "net%d", "eth%d") == {"vf-0": "net0", "vf-1": "net1", "vf-3": "net2",
                                                               "vf-4": "eth1"}
    assert _names("%d", "x%dy", "x%dy") == {"vf-0": "0", "vf-1": "x0y", "vf-2": "x1y"}
    assert _names("lo%d", "net0", "net%d") == {"vf-0": "lo0", "vf-1": "net0", "vf-2": "net1"}
    # The same claim prepared again (a restart, the kubelet's retry) gets the same names.
    assert _names("net%d", "net%d") == _names("net%d", "net%d")


def test_a_template_with_no_room_left_for_its_number_is_refused() -> None:
    asked = ["abcdefghijklm%d"] * 101  # 13 bytes and the number: 0 to 99 fit in 15
    assert list(_names(*asked[:100]).values())[-1] == "abcdefghijklm99"
    with pytest.raises(PrepareError, match=r"vf-100: VfConfig\.netDevice\.name 'abcdefghijklm%d' has no room left for "
                                           r"a number: 'abcdefghijklm100', the next free name, has 16 bytes"):
        _names(*asked)


def test_admin_access_never_moves_an_interface() -> None:
    with pytest.raises(PrepareError, match="admin access, which never reconfigures a device"):
        net_device_requests([_allocated("vf-a", "net1", admin=True)])


# The host's procfs, in the kernel's formats (as read on a real machine).
ROUTE = """Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0
eth0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
vf0\t0033A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
vf1\t0000090A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0
vf2\t0000140A\t0100000A\t0003\t0\t0\t0\t0000FFFF\t0\t0\t0
"""
FIB_TRIE = """Main:
  +-- 0.0.0.0/0 3 0 5
     |-- 192.0.2.2
        /32 host LOCAL
     |-- 192.168.51.7
        /32 host LOCAL
Local:
  +-- 127.0.0.0/8 2 0 2
     |-- 127.0.0.1
        /32 host LOCAL
"""
_Z = "0" * 32


def _v6route(dest: str, plen: str, hop: str, flags: str, dev: str) -> str:
    return f"{dest} {plen} {_Z} 00 {hop} 00000100 00000001 00000000 {flags} {dev:>8}\n"


IPV6_ROUTE = "".join([
    _v6route("20010db8000000000000000000000000", "40", _Z, "00000001", "vf0"),  # the subnet of its address
    _v6route("fe800000000000000000000000000000", "40", _Z, "00000001", "vf0"),
    _v6route("20010db8000000000000000000000005", "80", _Z, "80200001", "vf0"),  # local
    _v6route("ff000000000000000000000000000000", "08", _Z, "00000001", "vf0"),
    _v6route(_Z, "00", "fd000000000000000000000000000001", "00000003", "vf3"),  # a default route
    _v6route("fd990000000000000000000000000000", "40", _Z, "00000001", "vf4"),  # a prefix without an address
])
IF_INET6 = """20010db8000000000000000000000005 07 40 00 80      vf0
20010db8000000000000000000000006 07 40 00 00      vf0
fe800000000000000000000000000001 07 40 20 80      vf0
00000000000000000000000000000001 01 80 10 80       lo
"""


@pytest.fixture
def host(tmp_path: Path) -> Path:
    net = tmp_path / "proc/1/net"
    net.mkdir(parents=True)
    for name, text in (("route", ROUTE), ("fib_trie", FIB_TRIE), ("ipv6_route", IPV6_ROUTE), ("if_inet6", IF_INET6)):
        (net / name).write_text(text)
    return tmp_path


def test_routes_of_an_interface_leave_out_what_the_kernel_keeps_for_its_addresses(host: Path) -> None:
    assert interface_routes(host, "vf0") == [], "connected subnets, link-local, local and multicast entries"
    assert interface_routes(host, "eth0") == ["default via 192.0.2.1"]
    assert interface_routes(host, "vf1") == ["10.9.0.0/16"], "a route to a subnet without an address of the host"
    assert interface_routes(host, "vf2") == ["10.20.0.0/16 via 10.0.0.1"]
    assert interface_routes(host, "vf3") == ["default via fd00::1"]
    assert interface_routes(host, "vf4") == ["fd99::/64"]
    assert interface_routes(host / "nothing", "eth0") == []


def test_addresses_of_an_interface_are_its_global_permanent_ones_in_canonical_cidr(host: Path) -> None:
    # 2001:db8::6 is not permanent (flags 00: a SLAAC or DHCPv6 address the runtime leaves behind).
    assert interface_addresses(host, "vf0") == ("192.168.51.7/24", "2001:db8::5/64")
    assert interface_addresses(host, "eth0") == ("192.0.2.2/24",)
    assert interface_addresses(host, "vf1") == ()


def _vf(tmp_path: Path, netdev: str | None, net_folder: bool = True, driver: str = "mlx5_core") -> Path:
    """A VF's `bus/pci/devices/<BDF>` folder as the host's sysfs shows it."""
    folder = tmp_path / "sys/0000:19:00.1"
    (tmp_path / "sys/0000:19:00.0/net/pf0").mkdir(parents=True)
    folder.mkdir(parents=True)
    (folder / "physfn").symlink_to("../0000:19:00.0")
    (folder / "driver").symlink_to(f"../../bus/pci/drivers/{driver}")
    if net_folder:
        (folder / "net").mkdir()
    if netdev:
        (folder / "net" / netdev).mkdir()
        (folder / "net" / netdev / "address").write_text("02:00:00:00:19:01\n")
    return folder


def test_an_interface_in_the_hosts_namespace_is_handed_over_with_its_mac_and_addresses(tmp_path: Path,
                                                                                        host: Path) -> None:
    vf = read_vf_interface(_vf(tmp_path, "vf0"), "0000:19:00.1")
    assert vf.facts() == {"resource.kubernetes.io/pciBusID": "0000:19:00.1", "pfName": "pf0", "netdev": "vf0",
                          "macAddress": "02:00:00:00:19:01"}
    net, network = hand_over("vf-0000-19-00-1", vf, NetDeviceRequest(name="net1"), host)
    assert net == NetDevice(host_interface_name="vf0", name="net1")
    assert (network.interface_name, network.hardware_address) == ("net1", "02:00:00:00:19:01")
    assert network.ips == ("192.168.51.7/24", "2001:db8::5/64")


def test_an_interface_in_another_namespace_is_not_back_yet(tmp_path: Path, host: Path) -> None:
    vf = read_vf_interface(_vf(tmp_path, None), "0000:19:00.1")
    assert vf.elsewhere and vf.name is None
    assert vf.facts() == {"resource.kubernetes.io/pciBusID": "0000:19:00.1", "pfName": "pf0"}
    with pytest.raises(PrepareError, match="not back in the host's network namespace yet"):
        hand_over("vf-x", vf, NetDeviceRequest(name="net1"), host)


def test_a_vf_without_interface_or_on_vfio_pci_is_refused(tmp_path: Path, host: Path) -> None:
    vfio = read_vf_interface(_vf(tmp_path / "a", None, net_folder=False, driver="vfio-pci"), "0000:19:00.1")
    with pytest.raises(PrepareError, match="bound to vfio-pci and has no network interface"):
        hand_over("vf-x", vfio, NetDeviceRequest(name="net1"), host)
    none = read_vf_interface(_vf(tmp_path / "b", None, net_folder=False, driver="idxd"), "0000:19:00.1")
    assert not none.elsewhere
    with pytest.raises(PrepareError, match=r"has no network interface to move into the pod \(its driver idxd"):
        hand_over("vf-x", none, NetDeviceRequest(name="net1"), host)


@pytest.mark.parametrize("interface", ["eth0", "vf1", "vf2"])
def test_an_interface_carrying_host_routes_is_left_to_the_host(tmp_path: Path, host: Path, interface: str) -> None:
    vf = read_vf_interface(_vf(tmp_path, interface), "0000:19:00.1")
    with pytest.raises(PrepareError, match=f"its interface {interface} carries routes of the host"):
        hand_over("vf-x", vf, NetDeviceRequest(name="net1"), host)


def test_the_cdi_spec_of_a_net_device_is_version_1_1_0_and_valid() -> None:
    edits = ContainerEdits(net_devices=(NetDevice(host_interface_name="enp25s0f0v0", name="net1"),))
    spec = Spec(kind="k8s.sriov.dra-agent.io/claim", devices=(Device(name="uid-vf", container_edits=edits),))
    document = spec.to_dict()
    assert document["cdiVersion"] == "1.1.0"
    assert document["devices"][0]["containerEdits"]["netDevices"] == [
        {"hostInterfaceName": "enp25s0f0v0", "name": "net1"}]
    assert cdi_schema_errors(document) == []
    assert Spec.from_dict(document).devices == spec.devices
    assert validate_spec(spec) == []


def test_the_agents_own_spec_check_refuses_what_the_cdi_library_refuses() -> None:
    twice = ContainerEdits(net_devices=(NetDevice("a", "n"), NetDevice("b", "n"), NetDevice("a", "m"),
                                        NetDevice("", "")))
    problems = validate_spec(Spec(kind="example.com/nic", devices=(Device(name="x", container_edits=twice),)))
    assert problems == ["devices[0].containerEdits.netDevices[1].name 'n' is used twice",
                        "devices[0].containerEdits.netDevices[2].hostInterfaceName 'a' is used twice",
                        "devices[0].containerEdits.netDevices[3].hostInterfaceName '' is not a valid network "
                        "interface name: an interface name cannot be empty",
                        "devices[0].containerEdits.netDevices[3].name '' is not a valid network interface name: an "
                        "interface name cannot be empty"]
    # The kernel's rule, not Python's idea of whitespace: U+2003 is no whitespace to the kernel, `à` (c3 a0) is.
    wide = ContainerEdits(net_devices=(NetDevice("vf0", "\u2003x"), NetDevice("vf1", "netà")))
    assert validate_spec(Spec(kind="example.com/nic", devices=(Device(name="x", container_edits=wide),))) == [
        "devices[0].containerEdits.netDevices[1].name 'netà' is not a valid network interface name: an interface "
        "name cannot contain whitespace as the kernel reads it, byte by byte (bytes 0x09 to 0x0d, 0x20 and 0xa0): "
        "'netà' has 'à' (bytes c3 a0)"]


@pytest.mark.parametrize(("edits", "version", "error"), [
    ([{"hostInterfaceName": "a"}], "1.1.0", "'name' is a required property"),
    ([{"hostInterfaceName": "", "name": "n"}], "1.1.0", "hostInterfaceName: empty"),
    ([{"hostInterfaceName": "a", "name": 1}], "1.1.0", "name: 1 is not a string"),
    ([{"hostInterfaceName": "a", "name": "n"}, {"hostInterfaceName": "b", "name": "n"}], "1.1.0",
     "netDevices/1/name: duplicate 'n'"),
    ([{"hostInterfaceName": "a", "name": "n"}, {"hostInterfaceName": "a", "name": "m"}], "1.1.0",
     "netDevices/1/hostInterfaceName: duplicate 'a'"),
    ([{"hostInterfaceName": "a", "name": "n"}], "1.0.0", "netDevices need 1.1.0 or later"),
])
def test_the_schema_check_refuses_bad_net_devices(edits: list[dict[str, Any]], version: str, error: str) -> None:
    document = {"cdiVersion": version, "kind": "example.com/nic",
                "devices": [{"name": "x", "containerEdits": {"netDevices": edits}}]}
    assert any(error in e for e in cdi_schema_errors(document)), cdi_schema_errors(document)
