"""The node's CNI plugin for pods in a network namespace of their own: an `eth0` that is a `dummy` link.

containerd wants the network configuration's answer for a pod to name an `eth0` with an address, and refuses the
pod's sandbox otherwise ("failed to find network info for sandbox"). Debian's plugins that make one (bridge, ptp,
macvlan, ipvlan) all join the pod to the machine's network; its version of the plugins has no `dummy`. This plugin
makes the pod's `eth0` a `dummy` link inside the pod's namespace: a link that drops whatever is sent through it, so
nothing a pod sends leaves its namespace, and nothing on the machine changes. A kernel built without dummy links
(CONFIG_DUMMY unset, as on the project's machines) gets an `ifb` link instead, which drops likewise whatever is sent
to it rather than redirected to it by a traffic-control filter (`add_dropping_link`). Its address is in 127.100.0.0/16,
picked from the sandbox's ID (`pod_address`): the API server takes a loopback address as a pod IP, and no address
of the machine's network, pod range or Service range is used. Two pods may get the same address; neither can reach
anything through it, so nothing depends on it being unique.

It follows the CNI specification 1.0.0 (and answers 1.1.0's STATUS and GC), run by containerd as an executable
(`CNI_COMMAND` and the other `CNI_*` variables, the network configuration on stdin, the answer on stdout):

- ADD makes the link named `CNI_IFNAME` in `CNI_NETNS`, gives it the address (a /32: it routes nothing), sets it
  up, and answers with the previous plugin's result (the node's list runs Debian's `loopback` first) plus the
  link and its address;
- DEL deletes the link; a namespace or link already gone is not an error (DEL must succeed on what is gone);
- CHECK fails unless the link is there with its address; VERSION names the versions above; STATUS and GC succeed
  (the plugin keeps no state: the address comes from the ID, and a link dies with its namespace).

Errors are answered as the specification asks: a JSON object with `code` (4: a `CNI_*` variable is missing; 7:
the configuration cannot be read; 1: a version this plugin does not speak; 100 and up: this plugin's) and `msg`,
and a non-zero exit. `cluster.runtime` installs it, through a small wrapper script, in a plugin folder of the
node's own.
"""

from __future__ import annotations

import errno
import hashlib
import ipaddress
import json
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

__all__ = ["DROPPING_KINDS", "PLUGIN", "POD_NETWORK", "SUPPORTED_VERSIONS", "CniError", "add_dropping_link", "main",
           "pod_address", "run"]

PLUGIN = "dra-node-dummy"
"""The plugin's name: its executable's file name and its `type` in the network configuration."""
POD_NETWORK = ipaddress.IPv4Network("127.100.0.0/16")
SUPPORTED_VERSIONS = ("1.0.0", "1.1.0")
DROPPING_KINDS = ("dummy", "ifb")
"""Link kinds that drop what is sent through them, the first this kernel has is used."""

_INCOMPATIBLE_VERSION, _INVALID_ENVIRONMENT, _INVALID_CONFIG = 1, 4, 7
_LINK_FAILED, _NOT_AS_ADDED = 100, 101
Result = dict[str, Any]


class CniError(Exception):
    """A failure answered to the runtime: a CNI error code and a short message."""

    def __init__(self, code: int, message: str, details: str = "") -> None:
        super().__init__(message)
        self.code, self.message, self.details = code, message, details


def pod_address(container_id: str) -> ipaddress.IPv4Address:
    """The pod's address: a host of `POD_NETWORK` chosen by the sandbox's ID (never the network's first or last)."""
    hosts = POD_NETWORK.num_addresses - 2
    digest = int.from_bytes(hashlib.sha256(container_id.encode()).digest()[:8], "big")
    return POD_NETWORK.network_address + 1 + digest % hosts


def add_dropping_link(ipr: IPRoute, ifname: str, mac: str | None = None) -> int:
    """Make a link named `ifname` (with the hardware address `mac`, else the kernel's pick) of the first of
    `DROPPING_KINDS` the kernel has, in the namespace of `ipr`; its index. The address is given at creation: an
    `ifb` link's cannot be changed afterwards."""
    extra = {"address": mac} if mac else {}
    for kind in DROPPING_KINDS:
        try:
            ipr.link("add", ifname=ifname, kind=kind, **extra)
        except NetlinkError as e:
            if e.code == errno.EOPNOTSUPP and kind != DROPPING_KINDS[-1]:
                continue  # a kernel built without this kind
            raise
        break
    [index] = ipr.link_lookup(ifname=ifname)
    return int(index)


def _required(env: Mapping[str, str], *names: str) -> list[str]:
    missing = [n for n in names if not env.get(n)]
    if missing:
        raise CniError(_INVALID_ENVIRONMENT, f"{', '.join(missing)} not set")
    return [env[n] for n in names]


def _in_netns(netns: str, work: Callable[[IPRoute], Result | None]) -> Result | None:
    """`work` with an rtnetlink socket in the namespace at `netns` (never made here when it is missing)."""
    with IPRoute(netns=netns, flags=0) as ipr:
        return work(ipr)


def _add(config: Result, env: Mapping[str, str]) -> Result:
    container_id, netns, ifname = _required(env, "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME")
    address = pod_address(container_id)

    def make(ipr: IPRoute) -> Result:
        index = add_dropping_link(ipr, ifname)
        ipr.addr("add", index=index, address=str(address), prefixlen=32)
        ipr.link("set", index=index, state="up")
        [link] = ipr.get_links(index)
        return {"mac": link.get_attr("IFLA_ADDRESS")}

    try:
        made = _in_netns(netns, make)
    except (NetlinkError, OSError) as e:
        raise CniError(_LINK_FAILED, f"cannot make {ifname} in {netns}", str(e)) from None
    assert made is not None
    result: Result = dict(config.get("prevResult") or {})
    interfaces = [*result.get("interfaces", []), {"name": ifname, "mac": made["mac"], "sandbox": netns}]
    ips = [*result.get("ips", []), {"address": f"{address}/32", "interface": len(interfaces) - 1}]
    return {**result, "cniVersion": config["cniVersion"], "interfaces": interfaces, "ips": ips}


def _delete(env: Mapping[str, str]) -> None:
    [ifname] = _required(env, "CNI_IFNAME")
    netns = env.get("CNI_NETNS", "")
    if not netns or not Path(netns).exists():
        return  # the namespace is gone, and the link with it

    def remove(ipr: IPRoute) -> None:
        for index in ipr.link_lookup(ifname=ifname):
            ipr.link("del", index=index)
        return None

    try:
        _in_netns(netns, remove)
    except (NetlinkError, OSError) as e:
        if Path(netns).exists():  # not merely gone meanwhile
            raise CniError(_LINK_FAILED, f"cannot delete {ifname} in {netns}", str(e)) from None


def _check(env: Mapping[str, str]) -> None:
    container_id, netns, ifname = _required(env, "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME")
    address = str(pod_address(container_id))

    def addresses(ipr: IPRoute) -> Result:
        found = ipr.link_lookup(ifname=ifname)
        if not found:
            return {"addresses": None}
        return {"addresses": [a.get_attr("IFA_ADDRESS") for a in ipr.get_addr(index=found[0])]}

    try:
        seen = _in_netns(netns, addresses)
    except (NetlinkError, OSError) as e:
        raise CniError(_NOT_AS_ADDED, f"cannot read {ifname} in {netns}", str(e)) from None
    assert seen is not None
    if seen["addresses"] is None:
        raise CniError(_NOT_AS_ADDED, f"{ifname} is missing in {netns}")
    if address not in seen["addresses"]:
        raise CniError(_NOT_AS_ADDED, f"{ifname} in {netns} lacks its address {address}")


def run(command: str, config_text: str, env: Mapping[str, str]) -> Result | None:
    """What the plugin answers to `command` given the configuration on stdin: a result to print, or None (nothing
    to print); CniError when it fails."""
    if command == "VERSION":
        return {"cniVersion": SUPPORTED_VERSIONS[-1], "supportedVersions": list(SUPPORTED_VERSIONS)}
    try:
        config = json.loads(config_text)
    except ValueError as e:
        raise CniError(_INVALID_CONFIG, "the network configuration is not JSON", str(e)) from None
    if not isinstance(config, dict):
        raise CniError(_INVALID_CONFIG, "the network configuration is not a JSON object")
    version = config.get("cniVersion")
    if version not in SUPPORTED_VERSIONS:
        raise CniError(_INCOMPATIBLE_VERSION, f"CNI version {version!r} is not supported",
                       f"supported: {', '.join(SUPPORTED_VERSIONS)}")
    if command == "ADD":
        return _add(config, env)
    if command == "DEL":
        _delete(env)
    elif command == "CHECK":
        _check(env)
    elif command not in ("STATUS", "GC"):
        raise CniError(_INVALID_ENVIRONMENT, f"unknown CNI_COMMAND {command!r}")
    return None


def main() -> int:
    """The executable: the answer on stdout, the exit status for the runtime."""
    env = dict(os.environ)
    try:
        [command] = _required(env, "CNI_COMMAND")
        result = run(command, sys.stdin.read(), env)
    except CniError as e:
        answer = {"cniVersion": SUPPORTED_VERSIONS[0], "code": e.code, "msg": e.message}
        if e.details:
            answer["details"] = e.details
        print(json.dumps(answer))
        return 1
    if result is not None:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
