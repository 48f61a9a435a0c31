"""The agent as operators run it: deploy/'s DaemonSet with the agent's own image, its pod run by the node's real
kubelet and containerd. The pod becomes Ready, registers with the kubelet through its plugin registry, publishes
the node's slices, prepares a pod's GPU claim and unprepares it when the pod goes; a rolling update hands the node
to the new pod, which unprepares a claim the old one prepared; a claim's MPS control daemon keeps serving through a
rolling update, outside the old pod's PID namespace and cgroup, and the new pod stops it when the claim goes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from agent.kubelet.plugin import socket_paths
from cluster.agent_image import AgentImage
from tests.real_cluster.agent_pod_env import AgentDaemonSet, agent_daemonset
from tests.real_cluster.cluster_env import GPU, NODE, RealCluster, every_reconfiguration_allowed, poll
from tests.real_cluster.node_env import reported, reporter
from tests.real_cluster.objects import claim, exactly
from tests.support.mps_env import ask, folder, mps_config
from tests.support.timing import scaled

pytestmark = pytest.mark.xdist_group("real-node")

LIST_GPUS = "ls -l /dev/nvidia*"


def gpu_nodes(log: str) -> list[str]:
    """The GPU device nodes (character devices) a pod's `ls -l /dev/nvidia*` shows."""
    return re.findall(r"^c\S+ .* (/dev/nvidia\d+)$", log, re.MULTILINE)


def claims_logged(daemonset: AgentDaemonSet, pod: str, event: str) -> list[str]:
    """The uids of the claims the agent in `pod` logged `event` ("prepared claim", "unprepared claim") for."""
    return [line["claim"].rpartition(":")[2] for line in daemonset.log(pod)
            if line.get("event") == event and line.get("driver") == GPU]


async def gpu_pod(cluster: RealCluster, namespace: str, name: str) -> tuple[str, str]:
    """A pod with a one-GPU claim that lists its GPU, running; the claim's uid and the pod's listing."""
    await cluster.apply([claim(namespace, name, [exactly("gpu", GPU)]),
                         reporter(cluster, namespace, name, {"gpu": name}, LIST_GPUS)])
    log = await reported(cluster, namespace, name, timeout=scaled(180))
    uid: str = (await cluster.allocated(namespace, name))["metadata"]["uid"]
    return uid, log


async def delete_pod(cluster: RealCluster, namespace: str, name: str) -> None:
    await cluster.run("delete", "pod", name, "-n", namespace, "--wait=true", f"--timeout={scaled(120):.0f}s")


def registered(kubelet_log: str, endpoint: Path) -> bool:
    """The kubelet's log says it registered the GPU driver's plugin at `endpoint`."""
    return any('"Registered DRA plugin"' in line and f'driverName="{GPU}"' in line and f'endpoint="{endpoint}"' in line
               for line in kubelet_log.splitlines())


def published_devices(cluster: RealCluster) -> list[str]:
    slices: dict[str, Any] = cluster.kubectl.get(
        "resourceslices", "", f"--field-selector=spec.driver={GPU},spec.nodeName={NODE}") or {}
    return sorted(d["name"] for s in slices.get("items", []) for d in s["spec"].get("devices", []))


async def test_the_daemonsets_pod_serves_the_node(real_node: RealCluster, agent_image: AgentImage,
                                                  node_root: Path) -> None:
    assert real_node.worker is not None and real_node.worker.kubelet is not None
    kubelet = real_node.worker.kubelet
    # The slices other tests' agents left are gone: those found later are the pod's.
    await real_node.run("delete", "resourceslices", f"--field-selector=spec.driver={GPU},spec.nodeName={NODE}")
    before = kubelet.log.stat().st_size
    async with agent_daemonset(real_node, node_root, agent_image) as daemonset:
        pod = await daemonset.ready_pod()
        name, uid = pod["metadata"]["name"], pod["metadata"]["uid"]
        [container] = pod["status"]["containerStatuses"]
        assert container["image"] == agent_image.name and container["ready"], container
        # Registered through the plugin registry, its sockets named after its pod; the kubelet dials the DRA
        # socket below its plugins folder.
        dra, registration = socket_paths(GPU, kubelet.plugins_dir, kubelet.registry_dir, uid)
        assert registration.is_socket() and dra.is_socket(), sorted(map(str, kubelet.registry_dir.iterdir()))
        assert registered(kubelet.log.read_text(errors="replace")[before:], dra)
        assert GPU in {line.get("driver") for line in daemonset.log(name)
                       if line.get("event") == "registered with the kubelet"}
        # The node's eight GPUs published (dgx-h100), read from the simulated node's sysfs and NVML library.
        assert len(await poll(lambda: published_devices(real_node) or None, timeout=scaled(60),
                              what="the node's slices")) == 8

        ns = await real_node.namespace("agent-pod")
        claim_uid, listing = await gpu_pod(real_node, ns, "gpu")
        assert len(gpu_nodes(listing)) == 1, listing
        assert daemonset.specs(claim_uid), "no CDI spec of the claim"
        assert daemonset.histories(GPU) == {claim_uid: ["started", "completed"]}
        assert claims_logged(daemonset, name, "prepared claim") == [claim_uid]

        await delete_pod(real_node, ns, "gpu")
        assert daemonset.specs(claim_uid) == []
        assert daemonset.histories(GPU) == {claim_uid: ["started", "completed", "removed"]}
        assert claims_logged(daemonset, name, "unprepared claim") == [claim_uid]


async def test_a_rolling_update_hands_the_node_to_the_new_pod(real_node: RealCluster, agent_image: AgentImage,
                                                              node_root: Path) -> None:
    assert real_node.worker is not None and real_node.worker.kubelet is not None
    kubelet = real_node.worker.kubelet
    async with agent_daemonset(real_node, node_root, agent_image) as daemonset:
        old = (await daemonset.ready_pod())["metadata"]["name"]
        ns = await real_node.namespace("agent-pod-update")
        before_uid, listing = await gpu_pod(real_node, ns, "before")
        assert len(gpu_nodes(listing)) == 1, listing
        assert claims_logged(daemonset, old, "prepared claim") == [before_uid]

        log_size = kubelet.log.stat().st_size
        await daemonset.roll("1")
        new_pod = await daemonset.ready_pod(not_named=old)
        new = new_pod["metadata"]["name"]
        # The old pod gone, the new one serving (on this node one after the other: cluster.agent_daemonset says
        # why).
        await poll(lambda: [p["metadata"]["name"] for p in daemonset.pods()] == [new] or None,
                   timeout=scaled(120), what="the old agent pod gone")
        dra, _ = socket_paths(GPU, kubelet.plugins_dir, kubelet.registry_dir, new_pod["metadata"]["uid"])
        assert registered(kubelet.log.read_text(errors="replace")[log_size:], dra)

        # The claim the old pod prepared is unprepared by the new one, and a new claim prepared by it.
        after_uid, listing = await gpu_pod(real_node, ns, "after")
        assert len(gpu_nodes(listing)) == 1, listing
        assert claims_logged(daemonset, new, "prepared claim") == [after_uid]
        await delete_pod(real_node, ns, "before")
        assert daemonset.specs(before_uid) == []
        assert claims_logged(daemonset, new, "unprepared claim") == [before_uid]
        assert daemonset.histories(GPU)[before_uid] == ["started", "completed", "removed"]
        assert daemonset.histories(GPU)[after_uid] == ["started", "completed"]
        # Nothing left for the kubelet to unprepare once the DaemonSet is gone.
        await delete_pod(real_node, ns, "after")
        assert daemonset.specs(after_uid) == []
        assert daemonset.histories(GPU)[after_uid] == ["started", "completed", "removed"]


def _cgroups(pid: int) -> set[str]:
    """The cgroups of process `pid`, one per hierarchy."""
    return {line.split(":", 2)[2] for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()}


def _daemons(claim_uid: str) -> list[tuple[int, int]]:
    """The live MPS control daemons of claim `claim_uid` on the machine, whatever PID namespace they are in: each
    as (pid here, start time), which names one process even if the pid is used again."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except (OSError, ValueError):
            continue
        pipe = next((v for v in environ if v.startswith(b"CUDA_MPS_PIPE_DIRECTORY=")), b"")
        if (any(a.endswith(b"/nvidia-cuda-mps-control") for a in argv) and b"-f" in argv
                and pipe.endswith(f"/mps/{claim_uid}/pipe".encode()) and fields[0] not in ("Z", "X")):
            found.append((int(entry.name), int(fields[19])))
    return found


def _cgroups_left(cgroup: str) -> list[str]:
    """Where `cgroup` still exists among the machine's hierarchies."""
    return [str(top / cgroup) for top in Path("/sys/fs/cgroup").iterdir() if (top / cgroup).exists()]


async def test_an_mps_daemon_keeps_serving_through_a_rolling_update(real_node: RealCluster, agent_image: AgentImage,
                                                                    node_root: Path) -> None:
    assert real_node.worker is not None
    config = [{k: v for k, v in item.items() if k != "source"} for item in mps_config(defaultActiveThreadPercentage=40)]
    with every_reconfiguration_allowed(real_node.kubectl):
        async with agent_daemonset(real_node, node_root, agent_image,
                                   env={"DRA_AGENT_ALLOWED_CONFIGS": "GpuConfig.sharing.MPS"}) as daemonset:
            old = (await daemonset.ready_pod())["metadata"]["name"]
            ns = await real_node.namespace("agent-pod-mps")
            await real_node.apply([claim(ns, "mps", [exactly("gpu", GPU)], config=config),
                                   reporter(real_node, ns, "mps", {"gpu": "mps"},
                                            'echo "pipe=$CUDA_MPS_PIPE_DIRECTORY"; ls /tmp/nvidia-mps')])
            log = await reported(real_node, ns, "mps", timeout=scaled(180))
            uid = (await real_node.allocated(ns, "mps"))["metadata"]["uid"]
            # The container reaches the claim's daemon: the variable and the daemon's pipe directory are there.
            assert "pipe=/tmp/nvidia-mps" in log.splitlines() and "control" in log.split(), log
            state, sim_root = daemonset.folders.state_dir, daemonset.folders.sim_root
            daemon = folder(state, uid)
            [(pid, started)] = _daemons(uid)
            assert ask(sim_root, state, uid, "get_default_active_thread_percentage") == ["40.0"]
            # Out of the pod's cgroup (the runtime kills what is left there when the pod ends), into the claim's own.
            node_cgroup = real_node.worker.cgroup
            assert _cgroups(pid) <= {f"/{node_cgroup}/dra-agent-mps/{uid}", "/"}, _cgroups(pid)

            await daemonset.roll("mps")
            new = (await daemonset.ready_pod(not_named=old))["metadata"]["name"]
            await poll(lambda: [p["metadata"]["name"] for p in daemonset.pods()] == [new] or None,
                       timeout=scaled(120), what="the old agent pod gone")
            # The same daemon serves, with its limits: the old pod's end did not reach it, the new pod adopted it
            # and started none.
            assert _daemons(uid) == [(pid, started)]
            assert ask(sim_root, state, uid, "get_default_active_thread_percentage") == ["40.0"]

            # The new pod stops the daemon when the claim goes, and removes its folder and cgroups.
            await delete_pod(real_node, ns, "mps")
            await poll(lambda: not _daemons(uid) or None, timeout=scaled(30), what="the daemon stopped")
            assert not daemon.exists()
            assert claims_logged(daemonset, new, "unprepared claim") == [uid]
            assert _cgroups_left(f"{node_cgroup}/dra-agent-mps/{uid}") == []
