"""The node's CNI plugin (cluster/cni_dummy.py) run as containerd runs it, through the wrapper the node installs,
against a network namespace the test makes: ADD gives the namespace an `eth0` with the pod's address and answers
the previous plugin's result with it; CHECK, DEL (also of what is gone), VERSION; errors as the CNI specification
words them. The machine's own links are never touched."""

from __future__ import annotations

import ipaddress
import json
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.cni_dummy import POD_NETWORK, pod_address
from cluster.runtime import Containerd
from tests.support.netns_env import Namespaces, ip, made_namespaces
from tests.support.timing import scaled

SANDBOX = "0123456789abcdef" * 4
LOOPBACK_RESULT: dict[str, Any] = {"cniVersion": "1.0.0", "interfaces": [{"name": "lo", "mac": "00:00:00:00:00:00"}],
                                   "ips": [{"interface": 0, "address": "127.0.0.1/8"}], "dns": {}}
"""What Debian's `loopback` plugin answers before this plugin runs in the node's list."""


@pytest.fixture
def plugin(tmp_path: Path) -> Path:
    """The plugin's executable as the node installs it for containerd."""
    containerd = Containerd(tmp_path / "containerd", tmp_path / "bin", tmp_path / "cdi", "pause", tmp_path)
    containerd.write_cni()
    [conflist] = (tmp_path / "containerd/cni").iterdir()
    types: list[str] = [p["type"] for p in json.loads(conflist.read_text())["plugins"] if p["type"] != "loopback"]
    [plugin_type] = types
    return containerd.cni_bin / plugin_type


@pytest.fixture
def namespaces() -> Iterator[Namespaces]:
    with made_namespaces() as made:
        yield made


def call(plugin: Path, command: str, netns: Path | None, config: dict[str, Any] | str,
         **env: str) -> tuple[int, dict[str, Any] | None]:
    """Run the plugin as a runtime does; its exit status and its answer (None when it printed nothing)."""
    variables = {"CNI_COMMAND": command, "CNI_CONTAINERID": SANDBOX, "CNI_IFNAME": "eth0",
                 "CNI_PATH": str(plugin.parent), **({"CNI_NETNS": str(netns)} if netns else {}), **env}
    stdin = config if isinstance(config, str) else json.dumps(config)
    done = subprocess.run([str(plugin)], input=stdin, capture_output=True, text=True, env=variables, timeout=scaled(60),
                          check=False)
    return done.returncode, json.loads(done.stdout) if done.stdout.strip() else None


def conf(**extra: Any) -> dict[str, Any]:
    return {"cniVersion": "1.0.0", "name": "dra-node", "type": "dra-node-dummy", **extra}


def test_add_check_and_del_in_a_pods_namespace(plugin: Path, namespaces: Namespaces) -> None:
    host_links = socket.if_nameindex()
    pod = namespaces.pod
    status, result = call(plugin, "ADD", pod, conf(prevResult=LOOPBACK_RESULT))
    assert status == 0, result
    assert result is not None
    address = pod_address(SANDBOX)
    # The previous plugin's answer, and this plugin's link and address after it.
    assert result["interfaces"][0] == LOOPBACK_RESULT["interfaces"][0]
    eth0 = result["interfaces"][1]
    assert (eth0["name"], eth0["sandbox"]) == ("eth0", str(pod))
    assert result["ips"] == [*LOOPBACK_RESULT["ips"], {"address": f"{address}/32", "interface": 1}]
    assert result["cniVersion"] == "1.0.0"
    shown = ip("-n", namespaces.pod_name, "-j", "addr", "show", "eth0")
    [link] = json.loads(shown.stdout)
    assert link["address"] == eth0["mac"] and "UP" in link["flags"], link
    assert [a["local"] for a in link["addr_info"] if a["family"] == "inet"] == [str(address)], link
    assert socket.if_nameindex() == host_links, "the machine's links changed"

    assert call(plugin, "CHECK", pod, conf(prevResult=result)) == (0, None)
    assert call(plugin, "DEL", pod, conf(prevResult=result)) == (0, None)
    assert ip("-n", namespaces.pod_name, "link", "show", "eth0").returncode != 0
    status, error = call(plugin, "CHECK", pod, conf(prevResult=result))
    assert status != 0 and error is not None and "eth0 is missing" in error["msg"], error
    # DEL again, and DEL of a namespace that is gone, succeed: the runtime may repeat it.
    assert call(plugin, "DEL", pod, conf()) == (0, None)
    assert call(plugin, "DEL", pod.parent / "dra-gone-namespace", conf()) == (0, None)
    assert call(plugin, "DEL", None, conf()) == (0, None)


def test_version_and_errors_as_the_specification_words_them(plugin: Path, namespaces: Namespaces) -> None:
    status, answer = call(plugin, "VERSION", None, "")
    assert status == 0 and answer is not None and "1.0.0" in answer["supportedVersions"], answer
    status, answer = call(plugin, "ADD", namespaces.pod, conf(cniVersion="0.3.1"))
    assert status != 0 and answer is not None and answer["code"] == 1, answer
    status, answer = call(plugin, "ADD", namespaces.pod, "{not json")
    assert status != 0 and answer is not None and answer["code"] == 7, answer
    status, answer = call(plugin, "ADD", None, conf())
    assert status != 0 and answer is not None and answer["code"] == 4 and "CNI_NETNS" in answer["msg"], answer
    assert ip("-n", namespaces.pod_name, "link", "show", "eth0").returncode != 0, "a failed ADD made nothing"


@given(st.text(min_size=1, max_size=80))
def test_the_pods_address_is_a_host_of_the_pod_network(sandbox: str) -> None:
    address = pod_address(sandbox)
    assert address in POD_NETWORK
    assert address not in (POD_NETWORK.network_address, POD_NETWORK.broadcast_address)
    assert address.is_loopback and address != ipaddress.IPv4Address("127.0.0.1")
    assert pod_address(sandbox) == address
