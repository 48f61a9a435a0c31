"""The agent's kernel event sources opened in the host's network namespace from a pod's: entering a namespace,
choosing it (`host_netns`), the monitors as `Agent.start` opens them, a VF's health following a link of the
"host" end to end, what happens without the privilege to enter, and the check of the sysfs the agent reads."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from agent.commands.cli import build_parser
from agent.daemon import Agent, open_kernel_events
from agent.kube.client import KubeClient
from agent.node.host import Host, open_host
from agent.node.host_netns import HOST_NETNS_FILE, NetnsError, in_netns, resolve_host_netns, sysfs_netdevs_problem
from agent.settings import Settings, SettingsError, load_settings
from backends.sriov.backend import SriovNicBackend
from simulator.apiserver.server import TestApiServer
from tests.support.agent_env import NODE, settings_for
from tests.support.netns_env import EVENT_TIMEOUT, QUIET, Namespaces, ip, made_namespaces, netns_inode
from tests.support.repository import ROOT
from tests.support.timing import scaled

SIOCGSKNS = 0x894C  # ioctl: a file of the network namespace a socket belongs to
PUBLISH_TIMEOUT = scaled(15.0)
"""Seconds for the agent to start and publish, or to publish a health change, on a loaded machine."""

# The "mixed" node's first NIC: the PF's interface name, and its four VFs.
PF_NETDEV = "enp4s0f0np0"
PF_VFS = {f"vf-0000-04-00-{f}" for f in range(1, 5)}
NIC_DRIVER = "sriov.dra-agent.io"


@pytest.fixture
def namespaces() -> Iterator[Namespaces]:
    with made_namespaces() as made:
        yield made


def socket_netns(fd: int) -> int:
    """The inode of the network namespace the socket `fd` was created in."""
    netns = fcntl.ioctl(fd, SIOCGSKNS)
    try:
        return os.fstat(netns).st_ino
    finally:
        os.close(netns)


def host_root_for(folder: Path, netns: Path | str) -> Path:
    """A host root whose PID 1 lives in `netns`, as /host shows the host's in the DaemonSet."""
    link = folder / HOST_NETNS_FILE
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(netns)
    return folder


def in_the_pod(namespaces: Namespaces, scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run `scenario` on an event loop of a thread inside the "pod" namespace, as the agent runs in its pod."""

    async def checked() -> None:
        assert netns_inode("/proc/thread-self/ns/net") == netns_inode(namespaces.pod)
        await scenario()

    in_netns(namespaces.pod, lambda: asyncio.run(checked()))


# ---------------------------------------------------------------------------------------------------------------
# The setting


def test_host_netns_is_auto_off_or_an_absolute_file() -> None:
    assert load_settings({}, {}).host_netns == "auto"
    assert load_settings({}, {"DRA_AGENT_HOST_NETNS": "off"}).host_netns == "off"
    assert load_settings({"host_netns": "/run/netns/node"}, {"DRA_AGENT_HOST_NETNS": "off"}).host_netns == \
        "/run/netns/node"
    args = build_parser().parse_args(["run", "--host-netns", "/host/proc/1/ns/net"])
    assert args.host_netns == "/host/proc/1/ns/net"
    for bad in ("proc/1/ns/net", "", "Auto", "on"):
        with pytest.raises(SettingsError, match=r"host_netns .*from environment DRA_AGENT_HOST_NETNS.*absolute path"):
            load_settings({}, {"DRA_AGENT_HOST_NETNS": bad})


# ---------------------------------------------------------------------------------------------------------------
# Entering a namespace


def test_work_runs_in_the_namespace_and_the_caller_stays(namespaces: Namespaces) -> None:
    before = netns_inode("/proc/thread-self/ns/net")
    inside = in_netns(namespaces.host, lambda: (netns_inode("/proc/thread-self/ns/net"), threading.get_ident()))
    assert inside[0] == netns_inode(namespaces.host) != before
    assert inside[1] != threading.get_ident(), "a thread of its own entered"
    assert netns_inode("/proc/thread-self/ns/net") == before
    assert in_netns(None, threading.get_ident) == threading.get_ident()

    def broken() -> None:
        raise ValueError("the work's own error")

    with pytest.raises(ValueError, match="the work's own error"):
        in_netns(namespaces.host, broken)


def test_what_is_not_a_network_namespace_is_refused(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_text("")
    ran: list[bool] = []
    for path, reason in ((plain, "not a network namespace"), (Path("/proc/self/ns/mnt"), "not a network namespace"),
                         (tmp_path / "missing", "cannot open the network namespace")):
        with pytest.raises(NetnsError, match=reason) as caught:
            in_netns(path, lambda: ran.append(True))
        assert str(path) in str(caught.value)
    assert ran == [], "nothing runs where the namespace could not be entered"


# ---------------------------------------------------------------------------------------------------------------
# Choosing the namespace


def test_auto_enters_the_host_namespace_only_when_it_is_another(namespaces: Namespaces, tmp_path: Path) -> None:
    elsewhere = host_root_for(tmp_path / "elsewhere", namespaces.host)
    here = host_root_for(tmp_path / "here", "/proc/self/ns/net")
    with capture_logs() as logs:
        assert resolve_host_netns("auto", elsewhere) == elsewhere / HOST_NETNS_FILE
        assert resolve_host_netns("auto", here) is None
        assert resolve_host_netns("off", elsewhere) is None
        assert resolve_host_netns(str(namespaces.host), here) == namespaces.host
    # Debug lines are left out: whether they are logged at all depends on the log level configured last.
    assert [(log["log_level"], log["event"]) for log in logs if log["log_level"] != "debug"] == [
        ("info", "kernel event sockets opened in the host's network namespace"),
        ("info", "kernel event sockets opened in the agent's own network namespace"),
        ("info", "kernel event sockets opened in the host's network namespace"),
    ]


def test_a_host_namespace_that_cannot_be_read_is_a_warning(tmp_path: Path) -> None:
    with capture_logs() as logs:
        assert resolve_host_netns("auto", tmp_path, simulated=True) is None  # a simulated node has none
        assert logs == []
        assert resolve_host_netns("auto", tmp_path) is None
        assert resolve_host_netns(str(tmp_path / "netns"), tmp_path, simulated=True) is None
    assert len(logs) == 2
    for log, path in zip(logs, (tmp_path / HOST_NETNS_FILE, tmp_path / "netns"), strict=True):
        assert log["log_level"] == "warning" and log["netns"] == str(path)
        assert "link changes and the uevents of the host's network devices will not be seen" in log["event"]


# ---------------------------------------------------------------------------------------------------------------
# The monitors, as Agent.start opens them


def test_monitors_opened_from_the_pod_hear_the_hosts_links(namespaces: Namespaces, tmp_path: Path) -> None:
    settings = Settings(host_root=host_root_for(tmp_path, namespaces.host))

    async def scenario() -> None:
        host = Host(Path("/sys"), Path("/dev"), settings.host_root, driver_root=settings.host_root)
        udev, links = open_kernel_events(settings, host)
        assert udev is not None and links is not None
        try:
            assert socket_netns(udev._monitor.fileno()) == netns_inode(namespaces.host)  # type: ignore[union-attr]
            assert socket_netns(links._sock.fileno()) == netns_inode(namespaces.host)  # type: ignore[union-attr]
            heard_links: list[str] = []
            heard_devices: list[tuple[str, str]] = []
            links.subscribe(heard_links.append)
            udev.subscribe("net", lambda device: heard_devices.append((device.action, device.sys_name)))
            udev.start()
            links.start()
            namespaces.veth("pf0", "cable0")
            await wait_until(lambda: ("add", "pf0") in heard_devices and "pf0" in heard_links)
            count = heard_links.count("pf0")
            assert ip("-n", namespaces.host_name, "link", "set", "cable0", "down").returncode == 0
            await wait_until(lambda: heard_links.count("pf0") > count)  # the link went down: rtnetlink only
            assert ip("-n", namespaces.host_name, "link", "del", "pf0").returncode == 0
            await wait_until(lambda: ("remove", "pf0") in heard_devices)
        finally:
            udev.close()
            links.close()

    in_the_pod(namespaces, scenario)


def test_monitors_left_in_the_pod_hear_only_the_pods_links(namespaces: Namespaces, tmp_path: Path) -> None:
    """The same with `host_netns: off`: what a pod's agent heard before, nothing of the host's links."""
    settings = Settings(host_root=host_root_for(tmp_path, namespaces.host), host_netns="off")

    async def scenario() -> None:
        host = Host(Path("/sys"), Path("/dev"), settings.host_root, driver_root=settings.host_root)
        udev, links = open_kernel_events(settings, host)
        assert udev is not None and links is not None
        try:
            assert socket_netns(links._sock.fileno()) == netns_inode(namespaces.pod)  # type: ignore[union-attr]
            heard_links: list[str] = []
            heard_devices: list[str] = []
            links.subscribe(heard_links.append)
            udev.subscribe("net", lambda device: heard_devices.append(device.sys_name))
            udev.start()
            links.start()
            namespaces.veth("pf0", "cable0")
            assert ip("-n", namespaces.pod_name, "link", "add", "own0", "type", "veth", "peer", "name",
                      "own1").returncode == 0
            await wait_until(lambda: "own0" in heard_links and "own0" in heard_devices)
            await asyncio.sleep(QUIET)
            assert "pf0" not in heard_links and "pf0" not in heard_devices
        finally:
            udev.close()
            links.close()

    in_the_pod(namespaces, scenario)


# Without CAP_SYS_ADMIN (dropped before the interpreter starts): the monitors, their warnings, and the namespace
# their sockets ended up in. argv: the namespace file.
_UNPRIVILEGED_CHILD = """
import fcntl, json, os, sys
from pathlib import Path
from structlog.testing import capture_logs
from agent.node.host import Host
from agent.node.link_monitor import open_link_monitor
from agent.node.udev import open_udev_monitor

def netns(fd):
    found = fcntl.ioctl(fd, 0x894C)
    return os.fstat(found).st_ino

with capture_logs() as logs:
    links = open_link_monitor(Path(sys.argv[1]))
    udev = open_udev_monitor(Host(Path("/sys"), Path("/dev"), driver_root=Path("/")), netns=Path(sys.argv[1]))
print(json.dumps({"links": netns(links._sock.fileno()) if links else None,
                  "udev": netns(udev._monitor.fileno()) if udev else None,
                  "own": os.stat("/proc/self/ns/net").st_ino,
                  "logs": [{k: str(v) for k, v in log.items()} for log in logs]}))
"""


def test_without_the_privilege_to_enter_the_monitors_warn_and_stay(namespaces: Namespaces) -> None:
    child = subprocess.run(
        ["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin", sys.executable, "-c", _UNPRIVILEGED_CHILD,
         str(namespaces.host)],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    if child.returncode != 0 and "setpriv" in child.stderr:
        pytest.skip(f"cannot drop a capability here: {child.stderr.strip()[-200:]}")
    assert child.returncode == 0, child.stderr
    found = json.loads(child.stdout)
    assert found["links"] == found["udev"] == found["own"], "both opened in the agent's own namespace"
    warnings = {log["event"]: log for log in found["logs"] if log["log_level"] == "warning"}
    assert set(warnings) == {
        "the host's links going down or up will not be seen (an SR-IOV PF's link is read at start and at each "
        "rediscovery only): cannot enter the host's network namespace",
        "the host's network devices coming, going or being renamed will not be seen (PCI and other devices' events "
        "still arrive): cannot enter the host's network namespace",
    }
    for log in warnings.values():
        assert log["error"] == f"cannot enter the network namespace {namespaces.host}: not permitted: entering a " \
                               "namespace needs CAP_SYS_ADMIN"


# ---------------------------------------------------------------------------------------------------------------
# End to end: the agent in the pod, a VF's health following the host's link


def test_a_vf_follows_its_pfs_link_in_the_host_namespace(namespaces: Namespaces, scratch: Path) -> None:
    """The whole agent in the "pod" on the simulated "mixed" node, whose root has the "host" namespace as its PID
    1's (the DaemonSet's /host). The PF's interface is a veth in the "host" namespace: its carrier is lost, the
    simulated sysfs says so as the kernel's would, and only rtnetlink (no uevent) tells the agent."""
    namespaces.veth(PF_NETDEV, "cable0")

    async def scenario() -> None:
        async with TestApiServer() as server:
            server.add_node(NODE)
            settings = settings_for(scratch, server.write_kubeconfig(scratch / "kubeconfig"), "mixed",
                                    backends=("sriov-nic",))
            with open_host(settings) as host:
                host_root_for(host.host_root, namespaces.host)
                kube = await KubeClient.connect(settings.kubeconfig)
                agent = Agent(settings, host, kube)
                try:
                    await agent.start()
                    assert agent._links is not None
                    assert socket_netns(agent._links._sock.fileno()) == netns_inode(namespaces.host)  # type: ignore[union-attr]

                    def link_down_taints() -> set[str]:
                        return {d["name"] for s in server.objects("resourceslices") if s["spec"]["driver"] == NIC_DRIVER
                                for d in s["spec"].get("devices", ())
                                if any(t["key"] == f"{NIC_DRIVER}/link-down" for t in d.get("taints", ()))}

                    (nic,) = [p.backend for p in agent._plugins if isinstance(p.backend, SriovNicBackend)]
                    # Published, and the links read once by the health loop (which then waits for events).
                    await wait_until(lambda: agent.ready and PF_NETDEV in nic._netdevs, PUBLISH_TIMEOUT)
                    assert link_down_taints() == set()
                    interface = host.sysfs_root / "class/net" / PF_NETDEV
                    interface.joinpath("operstate").write_text("down\n")
                    interface.joinpath("carrier").write_text("0\n")
                    await asyncio.sleep(QUIET)
                    assert link_down_taints() == set(), "sysfs alone is not read again: the link event tells"
                    assert ip("-n", namespaces.host_name, "link", "set", "cable0", "down").returncode == 0
                    await wait_until(lambda: link_down_taints() == PF_VFS, PUBLISH_TIMEOUT)
                    interface.joinpath("operstate").write_text("up\n")
                    interface.joinpath("carrier").write_text("1\n")
                    assert ip("-n", namespaces.host_name, "link", "set", "cable0", "up").returncode == 0
                    await wait_until(lambda: link_down_taints() == set(), PUBLISH_TIMEOUT)
                finally:
                    await agent.stop()
                    await kube.close()

    in_the_pod(namespaces, scenario)


# ---------------------------------------------------------------------------------------------------------------
# The sysfs the agent reads


def _fake_host(folder: Path, sysfs_devices: list[str], host_devices: list[str] | None) -> tuple[Path, Path]:
    sysfs, host = folder / "sys", folder / "host"
    (sysfs / "class/net").mkdir(parents=True)
    for name in sysfs_devices:
        (sysfs / "class/net" / name).mkdir()
    if host_devices is not None:
        (host / "proc/1/net").mkdir(parents=True)
        rows = "".join(f"{name:>6}: 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n" for name in host_devices)
        (host / "proc/1/net/dev").write_text("Inter-|   Receive  |  Transmit\n face |bytes packets|bytes\n" + rows)
    return sysfs, host


def test_a_sysfs_showing_the_hosts_devices_passes(tmp_path: Path) -> None:
    assert sysfs_netdevs_problem(*_fake_host(tmp_path, ["lo", "eth0", "enp4s0f0np0"],
                                             ["lo", "eth0", "enp4s0f0np0"])) is None


def test_a_sysfs_of_another_namespace_is_named(tmp_path: Path) -> None:
    problem = sysfs_netdevs_problem(*_fake_host(tmp_path, ["lo", "eth0"], ["lo", "eth0", "enp4s0f0np0", "eno1"]))
    assert problem is not None
    assert problem.startswith(f"the sysfs at {tmp_path / 'sys'} does not show the host's network devices "
                              "(missing the host's eno1, enp4s0f0np0)")
    assert "mount the host's /sys there" in problem
    extra = sysfs_netdevs_problem(*_fake_host(tmp_path / "b", ["lo", "eth0", "veth9"], ["lo", "eth0"]))
    assert extra is not None and "showing veth9, which the host does not have" in extra


def test_the_sysfs_check_says_nothing_without_the_hosts_list(tmp_path: Path) -> None:
    assert sysfs_netdevs_problem(*_fake_host(tmp_path, ["lo"], None)) is None
    sysfs, host = _fake_host(tmp_path / "b", [], ["lo"])
    (host / "proc/1/net/dev").write_text("garbage\n\n\0\nno colon here\n")
    assert sysfs_netdevs_problem(sysfs, host) is None
    (sysfs / "class/net").rmdir()
    (host / "proc/1/net/dev").write_text("h\nh\n lo: 0\n")
    problem = sysfs_netdevs_problem(sysfs, host)
    assert problem is not None and "class/net cannot be read" in problem


async def test_the_agent_warns_at_start_when_its_sysfs_hides_the_hosts_devices(tmp_path: Path) -> None:
    sysfs, host_root = _fake_host(tmp_path, ["lo", "eth0"], ["lo", "eth0", "enp4s0f0np0"])
    async with TestApiServer() as server:
        server.add_node(NODE)
        settings = settings_for(tmp_path, server.write_kubeconfig(tmp_path / "kubeconfig"), "unused",
                                simulate=None, sysfs_root=sysfs, dev_root=tmp_path / "dev", host_root=host_root,
                                backends=("sriov-nic",))
        kube = await KubeClient.connect(settings.kubeconfig)
        agent = Agent(settings, Host(sysfs, tmp_path / "dev", host_root, driver_root=host_root), kube)
        try:
            with capture_logs() as logs:
                await agent.start()
        finally:
            await agent.stop()
            await kube.close()
    warnings = [log["event"] for log in logs if log["log_level"] == "warning"]
    assert any(w.startswith(f"the sysfs at {sysfs} does not show the host's network devices (missing the host's "
                            "enp4s0f0np0)") for w in warnings), warnings


async def wait_until(condition: Callable[[], bool], timeout: float = EVENT_TIMEOUT) -> None:
    async with asyncio.timeout(timeout):
        while not condition():  # noqa: ASYNC110 - the condition is set by callbacks or by another process
            await asyncio.sleep(0.01)

