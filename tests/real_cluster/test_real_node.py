"""The node as a kubelet runs it: the real kubelet and containerd on node 127.0.0.1, Ready; a pod's output read back
with `kubectl logs`; a pod in a network namespace of its own; the agent registered through the kubelet's plugin
watcher with the DRA service version the kubelet chose; a pod with a GPU claim prepared by the agent, its device
nodes, driver files and CDI environment inside the container."""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from pathlib import Path

import pytest

from cluster.cni_dummy import POD_NETWORK
from tests.real_cluster.cluster_env import GPU, NODE, RealCluster, poll
from tests.real_cluster.node_env import agent_on_real_node, finished_pod_log, node_image
from tests.real_cluster.objects import claim, exactly, pod
from tests.support.timing import scaled

pytestmark = pytest.mark.xdist_group("real-node")

SHARING = {"nvidia-gpu": {"sharing": {"byMemory": True}}}


async def test_the_node_is_ready_with_the_pinned_kubelet_and_containerd(real_node: RealCluster) -> None:
    node = await real_node.get("node", NODE)
    conditions = {c["type"]: c["status"] for c in node["status"]["conditions"]}
    assert conditions["Ready"] == "True", conditions
    info = node["status"]["nodeInfo"]
    assert info["kubeletVersion"] == "v1.37.2"
    assert info["containerRuntimeVersion"] == "containerd://2.4.2"
    assert node["status"]["addresses"] == [{"type": "InternalIP", "address": "127.0.0.1"},
                                           {"type": "Hostname", "address": "127.0.0.1"}]
    assert not node["spec"].get("taints"), "the node lifecycle controller lifted the not-ready taint"
    printed = await real_node.run("get", "nodes")
    assert re.search(r"^127\.0\.0\.1\s+Ready\s", printed, re.MULTILINE), printed


async def test_a_pod_runs_and_its_output_is_read_back(real_node: RealCluster) -> None:
    ns = await real_node.namespace("hello")
    await real_node.apply(pod(ns, "hello", image=node_image(real_node), host_network=True, command=[
        "sh", "-c", 'echo "hello from $(hostname)"; echo "api at $KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT"']))
    phase, log = await finished_pod_log(real_node, ns, "hello")
    assert phase == "Succeeded", log
    assert f"hello from {os.uname().nodename}" in log, log
    # The in-cluster address every pod is given is the API server's on loopback, not the Service's.
    assert f"api at 127.0.0.1:{real_node.plane.api_port}" in log, log


async def test_a_pod_of_its_own_network_namespace_gets_an_eth0_that_reaches_nothing(real_node: RealCluster) -> None:
    """The node's CNI plugin (cluster/cni_dummy.py) gives such a pod `lo` and an `eth0` with an address in
    127.100.0.0/16, which the pod's status reports, and changes nothing in the machine's network namespace."""
    before = set(socket.if_nameindex())
    ns = await real_node.namespace("netns")
    await real_node.apply(pod(ns, "own", image=node_image(real_node), command=[
        "sh", "-c", "echo $(ls /sys/class/net); ip -o -4 addr show eth0; ip -o link show eth0"]))
    phase, log = await finished_pod_log(real_node, ns, "own")
    assert phase == "Succeeded", log
    names, address, link = log.splitlines()[:3]
    assert sorted(names.split()) == ["eth0", "lo"], log
    found = await real_node.get("pod", "own", "-n", ns)
    pod_ip = ipaddress.IPv4Address(found["status"]["podIP"])
    assert pod_ip in POD_NETWORK, found["status"]
    assert f" inet {pod_ip}/32 " in address, log
    assert "UP" in link.split("<")[1].split(">")[0].split(","), log
    assert set(socket.if_nameindex()) == before, "the machine's links changed"


async def test_the_kubelet_registers_the_agent_with_the_newest_services(real_node: RealCluster,
                                                                            node_root: Path) -> None:
    assert real_node.worker is not None and real_node.worker.kubelet is not None
    kubelet_log = real_node.worker.kubelet.log
    before = kubelet_log.stat().st_size
    async with agent_on_real_node(real_node, node_root) as agent:
        registered = [line for line in kubelet_log.read_text(errors="replace")[before:].splitlines()
                      if '"Registered DRA plugin"' in line and f'driverName="{GPU}"' in line]
        assert registered, "the kubelet logged no registration of the agent"
        assert 'chosenService="v1.DRAPlugin"' in registered[-1], registered[-1]
        endpoint = re.search(r'endpoint="([^"]+)"', registered[-1])
        assert endpoint is not None and endpoint.group(1) == str(agent.settings.plugins_dir / GPU / "dra.sock")
        # The kubelet opens the health stream of a plugin that offers one, the newest service both know.
        def streams() -> list[str] | None:
            opened = [line["service"] for line in agent.log()
                      if line.get("event") == "the kubelet opened a health stream" and line.get("driver") == GPU]
            return opened or None
        assert await poll(streams, timeout=scaled(30), what="the kubelet's health stream") == ["v1.DRAResourceHealth"]
        assert 'dra_agent_health_stream_clients{driver="gpu.nvidia.com"} 1.0' in agent.scrape()


async def test_a_pod_gets_its_gpu_through_cdi(real_node: RealCluster, node_root: Path) -> None:
    async with agent_on_real_node(real_node, node_root, backend_config=SHARING):
        ns = await real_node.namespace("gpu")
        await real_node.apply([
            claim(ns, "gpu", [exactly("gpu", GPU, capacity={"memory": "40Gi"})]),
            pod(ns, "gpu", claims={"gpu": "gpu"}, image=node_image(real_node), host_network=True, command=[
                "sh", "-c", "ls -l /dev/nvidia*; grep -o ' /[^ ]*libnvidia-ml[^ ]*' /proc/self/mountinfo; env"]),
        ])
        phase, log = await finished_pod_log(real_node, ns, "gpu")
    assert phase == "Succeeded", log
    # One GPU's node, a character device made in the container by the runtime from the CDI spec (with /dev/null's
    # numbers, as the simulated node has it), and the driver's control node and library.
    gpus = re.findall(r"^(\S+)\s.*\s(\d+),\s+(\d+) .* /dev/nvidia\d+$", log, re.MULTILINE)
    assert len(gpus) == 1 and gpus[0][0].startswith("c") and gpus[0][1:] == ("1", "3"), log
    assert re.search(r"^c\S+ .* /dev/nvidiactl$", log, re.MULTILINE), log
    assert re.search(r"/libnvidia-ml\.so\.1$", log, re.MULTILINE), log
    # The share's size, from the CDI spec's environment (the scheduler records it in bytes).
    assert f"DRA_AGENT_GPU_SHARE_MEMORY={40 * 2**30}" in log, log
