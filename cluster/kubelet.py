"""The kubelet of the node: its configuration, its process, and the kernel settings it changes.

Its files are under the node's folder: `--root-dir` (so its plugin watcher's folder is `<root>/plugins_registry`
and the DRA drivers' is `<root>/plugins`, where the agent must put its sockets), the pods' logs (`podLogsDir`), the
FlexVolume plugins' folder it makes and watches (`volumePluginDir`), its certificates and kubeconfig. What differs
from the kubelet's defaults, and why:

- `failCgroupV1: false`: the project's machines mount cgroups in hybrid mode (v1 controllers, the unified hierarchy
  beside them), which the kubelet counts as v1; since 1.35 it refuses to start there unless told so;
- `cgroupDriver: cgroupfs` (no systemd runs here; containerd's runc options agree, and the kubelet takes the
  driver from the runtime anyway) and `cgroupRoot`: a cgroup of this node's own (`cluster.cgroups`), so pods of two
  clusters on one machine never share the cgroup under which each kubelet removes what it does not know;
- every listener on 127.0.0.1 (`address`, `healthzBindAddress`) on ports picked at start; no read-only port;
- serving certificate signed by the cluster's server CA, which the API server checks
  (`--kubelet-certificate-authority`); clients authenticated by the cluster's client CA or a token, and authorized
  by the API server (webhook), as upstream's local-up-cluster sets it up;
- node name `127.0.0.1` (`--hostname-override`): the API server reaches the kubelet by it
  (`--kubelet-preferred-address-types=Hostname`), and it is the node's InternalIP too (a node IP may not be given
  as a loopback address, a host name that is an address may);
- `imageGCHighThresholdPercent: 100` turns image garbage collection off: the images were imported, not pulled, and
  none could be pulled again; `evictionHard` at 1 % of the disk (and 100Mi of memory): the machines' disks are
  shared and may run fuller than the default 10-15 % thresholds allow, which would evict every pod.

Left at their defaults: swap (none on these machines), `cgroupsPerQOS`, feature gates (every DRA gate the agent
uses is on by default in 1.37).

The kubelet sets six kernel settings at start (vm.overcommit_memory, vm.panic_on_oom, kernel.panic,
kernel.panic_on_oops, kernel.keys.root_maxkeys, kernel.keys.root_maxbytes) to what it expects, or refuses to
start when told to protect them. They are not per namespace: their values before the start are kept and put back
when the kubelet stops.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cluster.pki import Pair, write_kubeconfig
from cluster.processes import Component, free_port

__all__ = ["KERNEL_SETTINGS", "Kubelet"]

KERNEL_SETTINGS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
                   "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")
"""The settings under /proc/sys the kubelet changes (its setupKernelTunables)."""


@dataclass
class Kubelet:
    """The kubelet of node `name`, with its files under `folder`, talking to the API server at `server` with the
    node's client certificate and to the container runtime at `runtime_endpoint`; its log goes to
    `logs`/kubelet.log."""

    folder: Path
    binaries: Path
    name: str
    server: str
    server_ca: Path
    client_ca: Path
    client: Pair
    serving: Pair
    runtime_endpoint: str
    cgroup_root: str
    logs: Path
    verbosity: int = 1
    port: int = 0
    healthz_port: int = 0
    component: Component | None = field(default=None, repr=False)
    kernel_settings: dict[str, str] = field(default_factory=dict)

    root: Path | None = None
    """The kubelet's root folder (`--root-dir`); `<folder>/root` unless given."""

    @property
    def root_dir(self) -> Path:
        return self.root if self.root is not None else self.folder / "root"

    @property
    def registry_dir(self) -> Path:
        """The plugin watcher's folder, where a DRA driver puts its registration socket."""
        return self.root_dir / "plugins_registry"

    @property
    def plugins_dir(self) -> Path:
        """The DRA drivers' folder, where a driver puts its DRA socket (in a folder named after the driver)."""
        return self.root_dir / "plugins"

    @property
    def log(self) -> Path:
        return self.logs / "kubelet.log"

    def config(self) -> dict[str, Any]:
        """The KubeletConfiguration (see the module's description for each setting that is not a default)."""
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": "127.0.0.1", "port": self.port, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": self.healthz_port,
            "tlsCertFile": str(self.serving.cert), "tlsPrivateKeyFile": str(self.serving.key),
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(self.client_ca)}},
            "authorization": {"mode": "Webhook"},
            "containerRuntimeEndpoint": self.runtime_endpoint,
            "cgroupDriver": "cgroupfs", "cgroupRoot": f"/{self.cgroup_root}", "failCgroupV1": False,
            "podLogsDir": str(self.folder / "pod-logs"),
            "volumePluginDir": str(self.folder / "volume-plugins"),
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "nodefs.inodesFree": "1%",
                             "imagefs.available": "1%", "imagefs.inodesFree": "1%"},
            "resolvConf": "/etc/resolv.conf",
        }

    def start(self) -> None:
        """Write the configuration and start the kubelet; `wait_healthy` waits for it."""
        for folder in (self.folder, self.root_dir):
            folder.mkdir(parents=True, exist_ok=True)
        if not self.port:  # a restarted kubelet listens where it did, as it would with its settings unchanged
            self.port, self.healthz_port = free_port(), free_port()
        config = self.folder / "kubelet.yaml"
        config.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        kubeconfig = write_kubeconfig(self.folder / "kubelet.kubeconfig", self.server, self.server_ca,
                                      client=self.client, user=f"system:node:{self.name}")
        self.kernel_settings = {key: _read_setting(key) for key in KERNEL_SETTINGS}
        self.component = Component("kubelet", [
            str(self.binaries / "kubelet"), f"--v={self.verbosity}", f"--config={config}",
            f"--kubeconfig={kubeconfig}", f"--root-dir={self.root_dir}", f"--cert-dir={self.folder / 'pki'}",
            f"--hostname-override={self.name}",
        ], self.log)
        self.component.start()

    def wait_healthy(self, timeout: float) -> None:
        assert self.component is not None
        self.component.wait_ready(f"http://127.0.0.1:{self.healthz_port}/healthz", timeout=timeout)

    def pids(self) -> list[int]:
        return [self.component.pid] if self.component and self.component.pid and self.component.running() else []

    def stop(self) -> None:
        """Stop the kubelet and put back the kernel settings it changed."""
        if self.component is not None:
            self.component.stop()
        for key, value in self.kernel_settings.items():
            if _read_setting(key) != value:
                with contextlib.suppress(OSError):
                    Path("/proc/sys", key).write_text(value + "\n")


def _read_setting(key: str) -> str:
    return Path("/proc/sys", key).read_text().strip()
