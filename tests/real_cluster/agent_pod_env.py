"""deploy/'s DaemonSet running the agent's own image on the node whose kubelet and containerd run pods: the
agent as operators run it, in its pod (`cluster.agent_daemonset` makes the overlay, `cluster.agent_image` the
image).

The pod sees the simulated node only at its boundary, as it would see a real one: its sysfs at /sys, its /dev,
and its root at /host with the driver's files, the simulated NVML library among them. The image has no simulator;
the simulated kernel (its reactions to sysfs writes, the NVML server the library calls) is served by this process,
on the host, for as long as the DaemonSet runs, as a real kernel serves the node's pods.

The stand-in of the node's other tests (node_env) carries the DaemonSet's labels; it is set aside while the
DaemonSet runs, or the DaemonSet controller would adopt it as an old pod of its own and delete it.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cluster.agent_daemonset import NodeFolders, write_overlay
from cluster.agent_image import AgentImage
from cluster.mounts import unmount_below
from simulator.node.node import simulated_node
from simulator.node.variants import with_char_devices
from tests.real_cluster.cluster_env import AGENT_NAMESPACE, NODE, KubectlError, RealCluster, poll
from tests.real_cluster.node_env import stand_in_aside
from tests.support.agent_env import free_port
from tests.support.checkpoint_journal import journal_histories
from tests.support.timing import scaled

__all__ = ["AgentDaemonSet", "agent_daemonset"]

_SELECTOR = "app.kubernetes.io/name=dra-agent"
_CANNOT_START = {"CreateContainerError", "CreateContainerConfigError", "ErrImageNeverPull", "CrashLoopBackOff",
                 "RunContainerError"}
"""A container waiting for one of these reasons will not start by waiting longer."""


@dataclass
class AgentDaemonSet:
    """deploy/'s DaemonSet on the node, and the host folders its pod uses."""

    cluster: RealCluster
    folders: NodeFolders
    metrics_port: int

    def pods(self) -> list[dict[str, Any]]:
        """The DaemonSet's pods on the node, those being deleted among them."""
        found = self.cluster.kubectl.get("pods", "", "-n", AGENT_NAMESPACE, "-l", _SELECTOR) or {}
        return [p for p in found.get("items", []) if p["spec"].get("nodeName") == NODE]

    async def ready_pod(self, *, not_named: str = "", timeout: float = scaled(180)) -> dict[str, Any]:
        """The DaemonSet's pod once the kubelet counts it Ready (its /readyz: sockets up, slices published);
        with `not_named`, another pod than that one."""
        def ready() -> dict[str, Any] | None:
            for pod in self.pods():
                for status in pod.get("status", {}).get("containerStatuses", []):
                    waiting = status.get("state", {}).get("waiting", {})
                    assert waiting.get("reason") not in _CANNOT_START, (pod["metadata"]["name"], waiting)
                conditions = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions", [])}
                if pod["metadata"]["name"] != not_named and conditions.get("Ready") == "True":
                    return pod
            return None
        pod: dict[str, Any] = await poll(ready, timeout=timeout, what="the agent's pod Ready", interval=1.0)
        self._watch_loopback(pod)
        return pod

    def _watch_loopback(self, pod: dict[str, Any]) -> None:
        """The agent's process in `pod` joins the tier's check that nothing is sent or bound off loopback."""
        worker = self.cluster.worker
        assert worker is not None and worker.containerd is not None
        [status] = pod["status"]["containerStatuses"]
        container = status["containerID"].partition("://")[2]
        info = json.loads(worker.containerd.crictl("inspect", container).stdout)["info"]
        self.cluster.loopback.watch([int(info["pid"])])

    def log(self, pod: str) -> list[dict[str, Any]]:
        """The agent's log lines (JSON) in pod `pod`, as `kubectl logs` shows them."""
        text = self.cluster.kubectl.run("logs", pod, "-n", AGENT_NAMESPACE)
        lines = []
        for line in text.splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue
        return lines

    def histories(self, driver: str) -> dict[str, list[str]]:
        """What the driver's checkpoint (in the state folder on the host) recorded of each claim."""
        return journal_histories(self.folders.state_dir, driver)

    def specs(self, uid: str) -> list[str]:
        """The CDI specs of claim `uid` in the folder containerd reads."""
        return sorted(p.name for p in self.folders.cdi_dir.glob(f"*{uid}*"))

    async def roll(self, annotation: str) -> None:
        """Start a rolling update: a changed annotation of the pod template, as `kubectl rollout restart` does."""
        patch = {"spec": {"template": {"metadata": {"annotations": {"dra-agent.io/test-rollout": annotation}}}}}
        await self.cluster.run("patch", "daemonset", "dra-agent", "-n", AGENT_NAMESPACE, "--type=merge",
                               "-p", json.dumps(patch))


def import_agent_image(cluster: RealCluster, image: AgentImage) -> None:
    """The agent's image imported into the node's containerd, as the node's other images are."""
    assert cluster.worker is not None and cluster.worker.containerd is not None
    cluster.worker.containerd.import_image(image.archive)


_KERNEL_NODES = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9), "tty": (5, 0)}
"""The device nodes every Linux host's /dev has, whatever its hardware: the pod mounts the node's /dev as its own,
and the agent's gRPC library reads /dev/urandom (without it, it aborts: "Failed to open /dev/urandom")."""


def _kernel_device_nodes(dev: Path) -> None:
    """The simulated node's /dev completed with the kernel's own character devices (the simulator lays out the
    hardware's only)."""
    for name, (major, minor) in _KERNEL_NODES.items():
        if not (dev / name).exists():
            os.mknod(dev / name, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
            os.chmod(dev / name, 0o666)


@contextmanager
def _served_node(root: Path, profile: str) -> Iterator[Path]:
    """The simulated node at `root / "node"` (character devices, as containerd needs them), its kernel served from
    a process of its own on the host; its root.

    The root is a shared mount, bound onto itself, as a host's / is where systemd runs: the DaemonSet mounts it
    with `mountPropagation: HostToContainer`, which containerd refuses for a folder on a private mount ("is
    mounted on ... but it is not a shared or slave mount"), and this machine mounts everything private."""
    sim_root = root / "node"
    sim_root.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--bind", str(sim_root), str(sim_root)], check=True, capture_output=True)
    try:
        subprocess.run(["mount", "--make-rshared", str(sim_root)], check=True, capture_output=True)
        char_profile = with_char_devices(profile, root)
        with simulated_node(str(char_profile), sim_root, kernel_process=True) as node:
            _kernel_device_nodes(node.dev)
            yield node.root
    finally:
        unmount_below(sim_root)


@asynccontextmanager
async def agent_daemonset(cluster: RealCluster, root: Path, image: AgentImage, profile: str = "dgx-h100", *,
                          env: dict[str, str] | None = None) -> AsyncIterator[AgentDaemonSet]:
    """deploy/'s DaemonSet applied through the node's overlay (`env` added to the agent's environment), on a
    simulated node under `root` served from here; returns once its pod is Ready. Deleted at the end, with its
    pod."""
    worker = cluster.worker
    assert worker is not None and worker.kubelet is not None, "the cluster's node runs no kubelet"
    await asyncio.to_thread(root.mkdir, parents=True, exist_ok=True)
    kubectl = cluster.kubectl
    with _served_node(root, profile) as sim_root, stand_in_aside(kubectl):
        # The state in the simulated node's /var/lib/dra-agent, as deploy/ mounts the host's: an MPS daemon's
        # folders, which its claim's CDI spec names, are below the node's root as the runtime expects.
        folders = NodeFolders(sim_root, worker.kubelet.registry_dir, worker.kubelet.plugins_dir, worker.cdi_dir,
                              sim_root / "var/lib/dra-agent")
        daemonset = AgentDaemonSet(cluster, folders, free_port())
        overlay = write_overlay(root / "overlay", image.name, folders, daemonset.metrics_port, extra_env=env)
        rendered = yaml.safe_load_all(await cluster.run("kustomize", str(overlay)))
        await cluster.apply([o for o in rendered if o and o["kind"] == "DaemonSet"])
        try:
            yield daemonset
        except BaseException:
            for pod in daemonset.pods():
                print(await cluster.run("describe", "pod", pod["metadata"]["name"], "-n", AGENT_NAMESPACE))
                try:
                    print(await cluster.run("logs", pod["metadata"]["name"], "-n", AGENT_NAMESPACE))
                except KubectlError as e:  # the container never started
                    print(f"no log: {e}")
            raise
        finally:
            await cluster.run("delete", "daemonset", "dra-agent", "-n", AGENT_NAMESPACE, "--cascade=foreground",
                              "--wait=true", f"--timeout={scaled(120):.0f}s")
            await poll(lambda: not daemonset.pods() or None, timeout=scaled(120), what="the agent's pods gone")
