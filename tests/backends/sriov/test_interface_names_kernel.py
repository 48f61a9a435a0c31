"""`VfConfig.netDevice.name` against the machine's real kernel: the agent accepts exactly the interface names the
kernel takes (`lo` apart, which the kernel refuses only because every namespace has it), and the names it writes
for a claim's `%d` templates move into a pod's namespace the way a container runtime moves them.

Each case runs in a network (and mount) namespace of its own, made for it with util-linux's `unshare`: a veth is
renamed there with pyroute2 (rtnetlink, as the runtimes do it), and the answers come back as JSON.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from backends.contract import Allocated
from backends.sriov.vf_config import VfConfig, interface_name_problem
from backends.sriov.vf_netdev import net_device_requests
from tests.support.repository import ROOT

# Renames a veth to each name read from stdin (a JSON list) and tells what the kernel made of it: its errno, or the
# name the interface has afterwards (which is not always the one asked: the kernel numbers a `%d` template, cuts
# a name at a NUL, and keeps the old name when asked for an empty one). Last, `lo` once more after the loopback
# interface was renamed away.
_RENAMES = """
import json, sys
from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError
answers = []
with IPRoute() as ip:
    ip.link("add", ifname="probe", kind="veth", peer="probe-peer")
    (index,) = ip.link_lookup(ifname="probe")

    def rename(name):
        try:
            ip.link("set", index=index, ifname=name)
        except NetlinkError as e:
            return {"errno": e.code}
        became = ip.get_links(index)[0].get_attr("IFLA_IFNAME")
        ip.link("set", index=index, ifname="probe")
        return {"became": became}

    answers = [rename(name) for name in json.load(sys.stdin)]
    (loopback,) = ip.link_lookup(ifname="lo")
    ip.link("set", index=loopback, ifname="loopback")
    answers.append(rename("lo"))
print(json.dumps(answers))
"""

# Moves interfaces into a pod's network namespace as runc and crun do (one RTM_NEWLINK with the new name and the
# namespace), then looks each up in the pod by the name it was moved under, as they do next to set it up. The pod's
# namespace (bind-mounted at argv[1]) holds `lo` and a CNI's `eth0`. stdin: the names, one move each.
_MOVES = """
import json, sys
from pyroute2 import IPRoute, netns
from pyroute2.netlink.exceptions import NetlinkError
pod_path, names = sys.argv[1], json.load(sys.stdin)
netns.create(pod_path)
answers = []
with IPRoute() as host, IPRoute(netns=pod_path) as pod:
    host.link("add", ifname="eth0", kind="veth", peer="cni-peer")
    host.link("set", index=host.link_lookup(ifname="eth0")[0], net_ns_fd=pod_path)
    for i, name in enumerate(names):
        host.link("add", ifname=f"vf{i}", kind="veth", peer=f"vf{i}-peer")
        (index,) = host.link_lookup(ifname=f"vf{i}")
        try:
            host.link("set", index=index, net_ns_fd=pod_path, ifname=name)
        except NetlinkError as e:
            answers.append({"errno": e.code})
            continue
        answers.append({"found": bool(pod.link_lookup(ifname=name))})
    answers.append({"pod": sorted(link.get_attr("IFLA_IFNAME") for link in pod.get_links())})
print(json.dumps(answers))
"""


def _in_a_namespace_of_its_own(script: str, stdin: Any, *args: str) -> Any:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("network namespaces of its own need root and util-linux's unshare")
    child = subprocess.run(
        ["unshare", "--net", "--mount", "--propagation", "private", sys.executable, "-c", script, *args],
        input=json.dumps(stdin), capture_output=True, text=True, cwd=ROOT, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    if child.returncode != 0 and "Operation not permitted" in child.stderr:
        pytest.skip(f"cannot make a network namespace here: {child.stderr.strip()[-200:]}")
    if child.returncode != 0 and "veth" in child.stderr and "Operation not supported" in child.stderr:
        pytest.skip("this kernel has no veth")
    assert child.returncode == 0, child.stderr
    return json.loads(child.stdout)


def _kernel_takes(name: str, answer: dict[str, Any]) -> bool:
    """Whether the kernel gave the interface the name asked for (a `%d` template: with a number in its place)."""
    if "errno" in answer:
        return False
    if "%d" in name:
        before, _, after = name.partition("%d")
        return re.fullmatch(re.escape(before) + r"[0-9]+" + re.escape(after), answer["became"]) is not None
    return bool(answer["became"] == name)


# The names of the table, with what the kernel answers for each (the agent's verdict follows the kernel's, but for
# `lo`). The kernel's whitespace is its isspace() on each byte: 0x09-0x0d, 0x20 and 0xa0 (lib/ctype.c).
TABLE: dict[str, str] = {
    "net1": "taken",
    "netà": "EINVAL",  # UTF-8 c3 a0
    "\u2003x": "taken",  # EM SPACE, e2 80 83: no byte of it is whitespace to the kernel
    "a b": "EINVAL",
    "a\tb": "EINVAL",
    "a\nb": "EINVAL",
    "a\x0bb": "EINVAL",
    "a\x0cb": "EINVAL",
    "a\rb": "EINVAL",
    "a\xa0b": "EINVAL",  # NO-BREAK SPACE, c2 a0
    "a\x1cb": "taken",  # Python's isspace() says whitespace, the kernel's does not
    "a\x85b": "taken",  # NEXT LINE, c2 85
    "a\u3000b": "taken",  # IDEOGRAPHIC SPACE, e3 80 80
    "a†b": "EINVAL",  # e2 80 a0
    "\u0420b": "EINVAL",  # CYRILLIC CAPITAL ER, d0 a0
    "a\U0001f4a0": "EINVAL",  # f0 9f 92 a0
    "a" * 15: "taken",
    "a" * 16: "ERANGE",  # rtnetlink refuses an IFLA_IFNAME longer than 15 bytes before dev_valid_name sees it
    "ü" * 7 + "a": "taken",  # 15 bytes
    "a" * 14 + "ü": "ERANGE",  # the last character crosses byte 15
    "ü" * 8: "ERANGE",
    ".": "EINVAL",
    "..": "EINVAL",
    "...": "taken",
    "a/b": "EINVAL",
    "a:b": "EINVAL",
    "net%d": "taken",
    "%d": "taken",
    "a%dz": "taken",
    "net%d%d": "EINVAL",
    "%s": "EINVAL",
    "%": "EINVAL",
    "net%": "EINVAL",
    "%%d": "EINVAL",
    "lo": "EEXIST",
    "": "kept its name",  # rtnetlink reads an empty IFLA_IFNAME as "no new name"
    "a\0b": "became 'a'",  # the kernel reads the name up to the NUL
}


def _answer_in_words(answer: dict[str, Any]) -> str:
    if "errno" in answer:
        return errno.errorcode[answer["errno"]]
    return f"became {answer['became']!r}"


def test_the_agent_takes_exactly_the_names_the_kernel_takes() -> None:
    names = list(TABLE)
    *answers, lo_again = _in_a_namespace_of_its_own(_RENAMES, names)
    for name, answer in zip(names, answers, strict=True):
        expected = TABLE[name]
        kernel = _kernel_takes(name, answer)
        assert (expected == "taken") == kernel, (name, _answer_in_words(answer))
        if not kernel and expected not in ("kept its name",):
            assert _answer_in_words(answer) == expected, name
        problem = interface_name_problem(name)
        if name == "lo":
            assert problem is not None and "loopback" in problem and "File exists" in problem
            continue
        assert (problem is None) == kernel, (name, _answer_in_words(answer), problem)
    # `lo` is a valid name to the kernel: with the loopback interface renamed away, the veth takes it.
    assert lo_again == {"became": "lo"}


def test_every_character_up_to_u07ff_and_some_beyond_get_the_kernels_verdict() -> None:
    """Every character of one and two bytes in UTF-8, and characters of three and four bytes with and without a
    byte 0xa0, in the middle of a name."""
    wide = "\u0800\u0820\u1680\u2000\u2020\u2028\u202f\u3000\u4e20\ufeff\uffe0\U00010020\U0001f600\U00020000"
    names = [f"n{chr(code)}1" for code in range(0x800)] + [f"n{c}1" for c in wide]
    answers = _in_a_namespace_of_its_own(_RENAMES, names)[:-1]
    differ = [(name, _answer_in_words(answer), interface_name_problem(name))
              for name, answer in zip(names, answers, strict=True)
              if (interface_name_problem(name) is None) != _kernel_takes(name, answer)]
    assert differ == []
    refused = [n[1] for n, a in zip(names, answers, strict=True) if not _kernel_takes(n, a)]
    assert refused[:10] == ["\0", "\t", "\n", "\x0b", "\x0c", "\r", " ", "%", "/", ":"]
    assert all(0xa0 in c.encode() for c in refused[10:]), "beyond ASCII, only characters with a byte 0xa0"


def _claim_names(*names: str) -> list[str]:
    """The names the agent writes into the CDI spec for one claim whose devices ask for `names`, in order."""
    devices = [Allocated(f"vf-{i}", "nic", VfConfig.model_validate(
        {"apiVersion": "dra-agent.io/v1alpha1", "kind": "VfConfig", "netDevice": {"name": name}}))
        for i, name in enumerate(names)]
    moves = net_device_requests(devices)
    return [moves[f"vf-{i}"].name for i in range(len(names))]


def test_the_names_written_for_templates_move_into_a_pod_and_are_found_there(tmp_path: Path) -> None:
    names = _claim_names("net%d", "net%d", "eth%d", "net1")
    assert names == ["net0", "net2", "eth1", "net1"]
    *moves, pod = _in_a_namespace_of_its_own(_MOVES, names, str(tmp_path / "pod"))
    assert moves == [{"found": True}] * 4
    assert pod == {"pod": sorted(["lo", "eth0", "net0", "net1", "net2", "eth1"])}


def test_a_template_itself_moves_in_but_the_runtime_cannot_find_it_by_that_name(tmp_path: Path) -> None:
    """Why the agent numbers templates itself: the kernel numbers `net%d`, but runc and crun then look the interface
    up by the name they asked for, find none, and fail the container. And `lo` is never free in a pod: the kernel
    moves the interface in under its host name, then refuses the new name, and the runtime fails the container."""
    *moves, pod = _in_a_namespace_of_its_own(_MOVES, ["net%d", "net%d", "lo"], str(tmp_path / "pod"))
    assert moves == [{"found": False}, {"found": False}, {"errno": errno.EEXIST}]
    assert pod == {"pod": ["eth0", "lo", "net0", "net1", "vf2"]}
