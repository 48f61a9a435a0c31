"""The node of a cluster as the kubelet runs it: containerd with the node's images, and the kubelet, registered as
node `127.0.0.1` of a control plane started with `with_kubelet=True`.

Everything is under `<control plane folder>/node`: containerd's files (`containerd/`), the kubelet's (`kubelet/`),
the image archives, and `cdi/`, the one folder containerd reads CDI specs from, where the agent on the node writes
them; but for the kubelet's root folder with its plugin folders, `<control plane folder>/k` (`kubelet_root` says
why). Outside them the node uses: its own cgroup in each hierarchy (removed
at the end, `cluster.cgroups`), the kernel settings the kubelet changes (put back at the end, `cluster.kubelet`),
and two folders whose paths are fixed in the kubelet, no setting moves them: /var/log/containers (a link to each
container's log) and /var/lib/kubelet/device-plugins (the device-plugin manager's socket and checkpoint). The
links into this node's folder are removed at the end, and either folder too when this node made it.

Start order: the images are made, containerd starts and imports them, the objects the node needs go into the API
(`cluster.incluster`), the kubelet starts and registers the node, and `start` returns once the node is Ready.
Stop order is the reverse; pods still running are stopped by containerd's stop, and the folder's mounts go.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from cluster.cgroups import make_cgroup, remove_cgroup
from cluster.controlplane import ControlPlane, wait_for
from cluster.images import busybox_image, pause_image, write_archive
from cluster.incluster import node_objects
from cluster.kubectl import Kubectl
from cluster.kubelet import Kubelet
from cluster.leftovers import CGROUP_PREFIX
from cluster.mounts import unmount_below
from cluster.runtime import Containerd

__all__ = ["WorkerNode"]

_CONTAINER_LOGS = Path("/var/log/containers")
_FIXED_HOST_FOLDERS = (Path("/var/lib/kubelet"), _CONTAINER_LOGS)
_KUBELET_VERBOSITY = 3
"""The kubelet's least log level: from 3 on it logs each DRA plugin it registers and the service it chose."""


@dataclass
class WorkerNode:
    """containerd and the kubelet of the control plane's node, with the binaries of `cluster/build.sh`'s node part
    (`node_binaries`) and its Kubernetes part (the control plane's)."""

    plane: ControlPlane
    node_binaries: Path
    containerd: Containerd | None = field(default=None, repr=False)
    kubelet: Kubelet | None = field(default=None, repr=False)
    pause: str = ""
    """The sandbox image's name, once made."""
    busybox: str = ""
    """The test image's name (Debian's busybox-static), once made."""
    made_on_host: list[Path] = field(default_factory=list)
    """The kubelet's fixed host folders that did not exist before this node started."""

    @property
    def name(self) -> str:
        return self.plane.node_name

    @property
    def folder(self) -> Path:
        return self.plane.folder / "node"

    @property
    def kubelet_root(self) -> Path:
        """The kubelet's root folder, `<control plane folder>/k`: short, as the DRA sockets below it carry a pod UID
        during a rolling update (`plugins_registry/<driver>-<pod UID>-reg.sock`), and a unix socket's path may
        not exceed 107 bytes; under `node/kubelet/` it would."""
        return self.plane.folder / "k"

    @property
    def cdi_dir(self) -> Path:
        """Where containerd reads CDI specs: the agent on this node writes its specs here (`--cdi-dir`)."""
        return self.folder / "cdi"

    @property
    def cgroup(self) -> str:
        return f"{CGROUP_PREFIX}{self.plane.folder.name}"

    def start(self, *, timeout: float = 120.0) -> None:
        """Start containerd and the kubelet; return once the node is Ready."""
        assert self.plane.with_kubelet and self.plane.pki is not None, "the control plane runs without a kubelet"
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> None:
        pki = self.plane.pki
        assert pki is not None
        images = self.folder / "images"
        images.mkdir(parents=True, exist_ok=True)
        version = _pause_version(self.node_binaries / "pause")
        pause, busybox = pause_image(self.node_binaries / "pause", version), busybox_image()
        self.pause, self.busybox = pause.name, busybox.name
        logs = self.plane.folder / "logs"
        self.containerd = Containerd(self.folder / "containerd", self.node_binaries, self.cdi_dir, pause.name, logs,
                                     verbosity=self.plane.verbosity)
        make_cgroup(self.cgroup)
        self.containerd.start(timeout=timeout)
        for image in (pause, busybox):
            self.containerd.import_image(write_archive(image, images / f"{image.name.rpartition('/')[2]}.tar"))
        kubectl = self.kubectl()
        kubectl.apply(node_objects(self.plane.api_port))
        self.made_on_host = [p for p in _FIXED_HOST_FOLDERS if not p.exists()]
        self.kubelet = Kubelet(
            self.folder / "kubelet", self.plane.binaries, self.name, self.plane.server, pki.server_ca.cert,
            pki.client_ca.cert, pki.clients[f"kubelet-{self.name}"], pki.kubelet_serving[self.name],
            self.containerd.endpoint, self.cgroup, logs, verbosity=max(self.plane.verbosity, _KUBELET_VERBOSITY),
            root=self.kubelet_root)
        self.kubelet.start()
        self.kubelet.wait_healthy(timeout)
        wait_for(lambda: self.ready(kubectl), timeout=timeout, what=f"node {self.name} Ready")

    def restart_kubelet(self, *, timeout: float = 120.0) -> None:
        """Stop the kubelet and start it again with the same settings, as after a node agent update; the pods keep
        running in containerd meanwhile. Returns once it is healthy and the node Ready."""
        assert self.kubelet is not None, "the node runs no kubelet"
        self.kubelet.stop()
        self.kubelet.start()
        self.kubelet.wait_healthy(timeout)
        kubectl = self.kubectl()
        wait_for(lambda: self.ready(kubectl), timeout=timeout, what=f"node {self.name} Ready")

    def kubectl(self) -> Kubectl:
        return Kubectl(self.plane.binaries / "kubectl", self.plane.admin_kubeconfig)

    def ready(self, kubectl: Kubectl) -> bool:
        """The node's Ready condition is True (and the kubelet and containerd still run)."""
        for part in (self.kubelet, self.containerd):
            if part is not None and part.component is not None and not part.component.running():
                raise part.component.failed("exited")
        node = kubectl.get("node", self.name)
        conditions = (node or {}).get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def pids(self) -> list[int]:
        return [*(self.containerd.pids() if self.containerd else []), *(self.kubelet.pids() if self.kubelet else [])]

    def stop(self) -> None:
        """Stop the kubelet, then containerd (and every pod with it); remove the cgroup and the folder's mounts."""
        if self.kubelet is not None:
            self.kubelet.stop()
            self.kubelet = None
        if self.containerd is not None:
            self.containerd.stop()
            self.containerd = None
        remove_cgroup(self.cgroup)
        unmount_below(self.folder)
        unmount_below(self.kubelet_root)
        self._clean_host()

    def _clean_host(self) -> None:
        """Remove the container log links into this node's folder, and the fixed folders this node made."""
        with contextlib.suppress(OSError):
            for link in _CONTAINER_LOGS.iterdir():
                if link.is_symlink() and os.readlink(link).startswith(f"{self.folder}/"):
                    link.unlink()
        for folder in self.made_on_host:
            shutil.rmtree(folder, ignore_errors=True)


def _pause_version(pause: Path) -> str:
    """The version the pause program was built as (`pause -v` prints "pause.c v3.10.2")."""
    printed = subprocess.run([str(pause), "-v"], capture_output=True, text=True, check=True).stdout.split()
    return printed[-1].lstrip("v") if printed else "unknown"
