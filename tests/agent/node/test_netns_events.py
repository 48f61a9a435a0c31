"""Which of the kernel's event sources reach a process in a network namespace other than the host's (a pod without
`hostNetwork`), on this machine's real kernel.

Two namespaces stand for the node's and a pod's; sockets are opened in each from a thread inside it, links are
changed in the "host" one, and the tests assert what arrives where. The findings, on which agent/node/host_netns.py
rests:

- rtnetlink link messages: only in the link's namespace;
- uevents of network devices (tagged with their namespace): only in the device's namespace; and a link going
  down or up sends no uevent at all;
- uevents of other devices, virtual and PCI alike (untagged): in every namespace;
- udevd's re-sent events (multicast group 2, sent from user space): only in the sender's namespace;
- sysfs mounted in a namespace shows only that namespace's network devices.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.node.link_monitor import link_changes
from tests.support.netns_env import (
    NETLINK_KOBJECT_UEVENT,
    QUIET,
    RTMGRP_LINK,
    UEVENT_KERNEL,
    UEVENT_UDEV,
    Listener,
    Namespaces,
    ip,
    made_namespaces,
    netns_inode,
    uevent,
)
from tests.support.repository import ROOT


@pytest.fixture
def namespaces() -> Iterator[Namespaces]:
    with made_namespaces() as made:
        yield made


def _names(messages: list[bytes]) -> set[str]:
    return {change.name for message in messages for change in link_changes(message)}


def test_link_messages_reach_only_the_links_namespace(namespaces: Namespaces) -> None:
    host = Listener(namespaces.host, socket.NETLINK_ROUTE, RTMGRP_LINK)
    pod = Listener(namespaces.pod, socket.NETLINK_ROUTE, RTMGRP_LINK)
    try:
        namespaces.veth("pf0", "cable0")
        assert ip("-n", namespaces.host_name, "link", "set", "cable0", "down").returncode == 0
        down = host.wait_for(lambda m: any(c.name == "pf0" and not c.up for c in link_changes(m)))
        assert down is not None, "the host's namespace hears its link go down"
        assert _names(host.drain()) >= {"pf0", "cable0"}
        pod.wait_for(lambda m: True, QUIET)
        assert _names(pod.drain()) == set(), "the pod hears none of the host's links"
    finally:
        host.close()
        pod.close()


def test_uevents_of_network_devices_reach_only_their_namespace(namespaces: Namespaces) -> None:
    host = Listener(namespaces.host, NETLINK_KOBJECT_UEVENT, UEVENT_KERNEL)
    pod = Listener(namespaces.pod, NETLINK_KOBJECT_UEVENT, UEVENT_KERNEL)

    try:
        namespaces.veth("pf0", "cable0")
        added = host.wait_for(lambda m: uevent(m).get("INTERFACE") == "pf0" and uevent(m).get("ACTION") == "add")
        assert added is not None and uevent(added)["SUBSYSTEM"] == "net"
        # A link going down or up is no uevent: rtnetlink is the only news of it.
        before = len(host.drain())
        assert ip("-n", namespaces.host_name, "link", "set", "cable0", "down").returncode == 0
        host.wait_for(lambda m: uevent(m).get("INTERFACE") in ("pf0", "cable0"), QUIET)
        assert not any(uevent(m).get("INTERFACE") in ("pf0", "cable0") for m in host.drain()[before:])
        assert ip("-n", namespaces.host_name, "link", "del", "pf0").returncode == 0
        assert host.wait_for(lambda m: uevent(m).get("INTERFACE") == "pf0" and uevent(m).get("ACTION") == "remove")
        pod.wait_for(lambda m: uevent(m).get("SUBSYSTEM") == "net", QUIET)
        assert [m for m in pod.drain() if uevent(m).get("SUBSYSTEM") == "net"] == [], \
            "the pod hears none of the host's network devices"
    finally:
        host.close()
        pod.close()


def _untagged_devices() -> list[Path]:
    found = [Path("/sys/devices/virtual/mem/null")]
    pci = sorted(Path("/sys/bus/pci/devices").glob("*"))
    if pci:
        found.append(pci[0].resolve())
    return found


@pytest.mark.parametrize("device", _untagged_devices(), ids=lambda p: "virtual" if "virtual" in str(p) else "pci")
def test_uevents_of_other_devices_reach_every_namespace(namespaces: Namespaces, device: Path) -> None:
    """A synthetic `change` (what writing to a device's `uevent` file makes the kernel send), marked with a UUID of
    this test's own so that other events on the machine do not count."""
    if not (device / "uevent").exists():
        pytest.skip(f"{device} is not on this machine")
    listeners = {where: Listener(path, NETLINK_KOBJECT_UEVENT, UEVENT_KERNEL)
                 for where, path in (("host", namespaces.host), ("pod", namespaces.pod), ("this process", None))}
    mark = str(uuid.uuid4())
    try:
        try:
            (device / "uevent").write_text(f"change {mark}")
        except OSError as e:
            pytest.skip(f"cannot make {device} send a uevent here: {e.strerror}")
        for where, listener in listeners.items():
            heard = listener.wait_for(lambda m: uevent(m).get("SYNTH_UUID") == mark)
            assert heard is not None, f"{where} did not hear the uevent of {device}"
            assert uevent(heard)["ACTION"] == "change"
            assert uevent(heard)["DEVPATH"] == "/" + str(device.relative_to("/sys"))
    finally:
        for listener in listeners.values():
            listener.close()


def test_udev_messages_stay_in_the_senders_namespace(namespaces: Namespaces) -> None:
    """udevd re-sends each event after its rules to multicast group 2 from its own namespace, the host's. This
    sends such a message from the "host" namespace, as udevd would: the kernel delivers it only there."""
    host = Listener(namespaces.host, NETLINK_KOBJECT_UEVENT, UEVENT_UDEV)
    pod = Listener(namespaces.pod, NETLINK_KOBJECT_UEVENT, UEVENT_UDEV)
    mark = uuid.uuid4().hex.encode()
    sender = Listener(namespaces.host, NETLINK_KOBJECT_UEVENT, 0)
    try:
        sender.sock.sendto(b"libudev\0" + mark, (0, UEVENT_UDEV))
        assert host.wait_for(lambda m: mark in m) is not None
        assert pod.wait_for(lambda m: mark in m, QUIET) is None, "udevd's messages reach only its namespace"
    finally:
        for listener in (host, pod, sender):
            listener.close()


def _udevd_here() -> int | None:
    """The pid of a udevd running in this process's network namespace, if any."""
    own = netns_inode("/proc/self/ns/net")
    for entry in Path("/proc").iterdir():
        try:
            if (entry.name.isdigit() and (entry / "comm").read_text().strip() in ("systemd-udevd", "udevd")
                    and netns_inode(entry / "ns/net") == own):
                return int(entry.name)
        except OSError:
            continue
    return None


def test_udevd_events_reach_only_udevds_namespace(namespaces: Namespaces) -> None:
    """With a real udevd, where one runs: its event for an untagged device reaches its namespace, not the pod's."""
    if _udevd_here() is None:
        pytest.skip("no udevd runs in this machine's network namespace: its events cannot be observed here")
    device = Path("/sys/devices/virtual/mem/null")
    ours = Listener(None, NETLINK_KOBJECT_UEVENT, UEVENT_UDEV)
    pod = Listener(namespaces.pod, NETLINK_KOBJECT_UEVENT, UEVENT_UDEV)
    mark = str(uuid.uuid4())
    try:
        (device / "uevent").write_text(f"change {mark}")
        assert ours.wait_for(lambda m: mark.encode() in m) is not None, "udevd re-sent the event"
        assert pod.wait_for(lambda m: mark.encode() in m, QUIET) is None
    finally:
        ours.close()
        pod.close()


# Run in a mount namespace of its own (the mounts vanish with it): sysfs mounted from the "pod" and the "host"
# namespaces, what each shows, and what the agent's check says of them. argv: pod, host, folder.
_SYSFS_CHILD = """
import json, os, subprocess, sys
from pathlib import Path
from agent.node.host_netns import sysfs_netdevs_problem
pod, host, folder = sys.argv[1:4]
shown = {}
for name, netns in (("pod", pod), ("host", host)):
    where = Path(folder, name)
    where.mkdir()
    subprocess.run(["nsenter", f"--net={netns}", "mount", "-t", "sysfs", "sysfs", str(where)], check=True)
    shown[name] = sorted(os.listdir(where / "class/net"))
# A PCI function with a network device in this machine's own sysfs: its net/ folder, seen from the pod's sysfs.
pci = {}
for function in Path("/sys/bus/pci/devices").iterdir():
    for net in function.resolve().rglob("net"):
        if net.is_dir() and os.listdir(net):
            inside = Path(folder, "pod", net.relative_to("/sys"))
            pci[str(net.relative_to("/sys"))] = {"here": sorted(os.listdir(net)),
                                                 "pod": sorted(os.listdir(inside)) if inside.is_dir() else None}
print(json.dumps({"shown": shown, "pci": pci,
                  "pod_problem": sysfs_netdevs_problem(Path(folder, "pod"), Path("/")),
                  "own_problem": sysfs_netdevs_problem(Path("/sys"), Path("/"))}))
"""


def test_sysfs_mounted_in_a_pod_namespace_hides_the_hosts_network_devices(namespaces: Namespaces,
                                                                            tmp_path: Path) -> None:
    """What the DaemonSet's hostPath /sys avoids: a sysfs mounted in the pod's namespace lists only the pod's
    network devices, in class/net and in PCI functions' net/ folders; the agent's check says so."""
    namespaces.veth("pf0", "cable0")
    child = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", _SYSFS_CHILD,
         str(namespaces.pod), str(namespaces.host), str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    if child.returncode != 0 and ("Operation not permitted" in child.stderr or "Permission denied" in child.stderr):
        pytest.skip(f"cannot mount sysfs in a namespace of its own here: {child.stderr.strip()[-200:]}")
    assert child.returncode == 0, child.stderr
    found = json.loads(child.stdout)
    assert found["shown"]["host"] == ["cable0", "lo", "pf0"]
    assert found["shown"]["pod"] == ["lo"], "the host's devices are hidden from the pod's sysfs"
    for folder, seen in found["pci"].items():
        assert seen["pod"] == [], f"{folder} shows {seen['here']} here and nothing in the pod's sysfs"
    # This machine's own namespace stands for the host in the agent's check (`<host_root>/proc/1/net/dev`).
    assert found["own_problem"] is None
    assert found["pod_problem"] is not None and "does not show the host's network devices" in found["pod_problem"]
