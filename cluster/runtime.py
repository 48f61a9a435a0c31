"""containerd on the node: its configuration, its process, the images it runs, and leaving nothing behind.

Every file containerd keeps is under the node's folder (its root and state, the shims' sockets, runc's state, the
network namespaces' mounts, its `opt` folder), named by the configuration below rather than the host's
/var/lib/containerd, /run/containerd and /opt; nothing is read from /etc/containerd. What differs from containerd's
defaults, and why:

- `cdi_spec_dirs` is the agent's CDI folder only: the host's /etc/cdi and /var/run/cdi hold no spec of this node;
- the sandbox (pause) image is the one made here (`cluster.images`), pinned, so the image garbage collector of the
  kubelet keeps it; no registry is configured and none is reachable;
- runc and the shim are the ones `cluster/build.sh` built, named by path; cgroups by cgroupfs (no systemd here);
- CNI: one configuration, Debian's `loopback` (/usr/lib/cni) and then the node's own plugin (`cluster.cni_dummy`,
  run by a wrapper script in the plugin folder `cni-bin` below the node's folder, with this Python). A configuration
  is what makes containerd report NetworkReady, which the kubelet waits for. A pod with `hostNetwork` uses the
  host's network, for which containerd runs no plugin; a pod in a network namespace of its own gets `lo` up and an
  `eth0` that is a `dummy` (or `ifb`) link with an address in 127.100.0.0/16: containerd refuses a sandbox whose
  plugins' answer names no `eth0` with an address. The link drops what it is sent, so such a pod reaches nothing
  and nothing reaches it, and nothing changes in the machine's network namespace; runc can move a host interface
  into it (CDI `netDevices`), which it cannot into a host-network pod;
- `restrict_oom_score_adj`: the project's machines run every process without CAP_SYS_RESOURCE, so none may lower
  its OOM score adjustment below what it inherited; runc would fail to start the sandbox, to which the kubelet
  gives -998 ("failed to update /proc/self/oom_score_adj: Permission denied"). containerd then raises any lower
  adjustment to its own, as it does for a rootless containerd;
- NRI is off (it would open a socket under /var/run/nri), as is everything that listens on TCP; the streaming
  server for `kubectl exec` listens on 127.0.0.1, on a port the kernel picks.

Stopping removes every pod sandbox through the CRI first (stopping their containers and unmounting their root file
systems), then stops containerd, then ends any shim of this containerd that is still there and unmounts whatever is
still mounted under the folder: a shim outlives containerd by design.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster import HERE
from cluster.cni_dummy import PLUGIN
from cluster.mounts import unmount_below
from cluster.processes import Component, ComponentFailed

__all__ = ["CNI_PLUGINS", "Containerd"]

CNI_PLUGINS = Path("/usr/lib/cni")
"""Where Debian's containernetworking-plugins package puts the plugins."""

_CNI_CONFIG = {"cniVersion": "1.0.0", "name": "dra-node", "plugins": [{"type": "loopback"}, {"type": PLUGIN}]}
_CNI_CONFIG_FILE = "10-dra-node.conflist"


def _plugin_wrapper() -> str:
    """The node's CNI plugin as an executable: this Python (which has pyroute2) running `cluster.cni_dummy` from
    this checkout, with containerd's environment (the `CNI_*` variables) and stdin."""
    return (f"#!/bin/sh\nPYTHONPATH={shlex.quote(str(HERE.parent))} exec {shlex.quote(sys.executable)} "
            f"-m cluster.cni_dummy \"$@\"\n")


def _toml_string(value: str | Path) -> str:
    return json.dumps(str(value))  # a JSON string is a TOML basic string for the paths and names used here


@dataclass
class Containerd:
    """containerd with its files under `folder`, the binaries of `binaries`, CDI specs read from `cdi_dir`, and
    `sandbox_image` as the pods' sandbox; its log goes to `logs`/containerd.log."""

    folder: Path
    binaries: Path
    cdi_dir: Path
    sandbox_image: str
    logs: Path
    verbosity: int = 1
    component: Component | None = field(default=None, repr=False)

    @property
    def socket(self) -> Path:
        return self.folder / "containerd.sock"

    @property
    def endpoint(self) -> str:
        """The CRI endpoint, as the kubelet and crictl name it."""
        return f"unix://{self.socket}"

    @property
    def cni_bin(self) -> Path:
        """The plugin folder of the node's own CNI plugin."""
        return self.folder / "cni-bin"

    @property
    def log(self) -> Path:
        return self.logs / "containerd.log"

    def config(self) -> str:
        """containerd's configuration file (version 4, containerd 2.x)."""
        f, b = self.folder, self.binaries
        level = "debug" if self.verbosity >= 4 else "info"
        return f"""version = 4
root = {_toml_string(f / "root")}
state = {_toml_string(f / "state")}
imports = []

[debug]
  level = "{level}"

[plugins.'io.containerd.server.v1.grpc']
  address = {_toml_string(self.socket)}
[plugins.'io.containerd.server.v1.ttrpc']
  address = {_toml_string(f / "containerd.sock.ttrpc")}
[plugins.'io.containerd.server.v1.debug']
  address = ""
[plugins.'io.containerd.server.v1.metrics']
  address = ""
[plugins.'io.containerd.shim.v1.manager']
  socket_dir = {_toml_string(f / "s")}
[plugins.'io.containerd.internal.v1.opt']
  path = {_toml_string(f / "opt")}
[plugins.'io.containerd.image-verifier.v1.bindir']
  bin_dir = {_toml_string(f / "image-verifier")}
[plugins.'io.containerd.nri.v1.nri']
  disable = true

[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = {_toml_string(self.sandbox_image)}

[plugins.'io.containerd.cri.v1.runtime']
  cdi_spec_dirs = [{_toml_string(self.cdi_dir)}]
  netns_mounts_under_state_dir = true
  restrict_oom_score_adj = true
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  runtime_path = {_toml_string(b / "containerd-shim-runc-v2")}
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  BinaryName = {_toml_string(b / "runc")}
  Root = {_toml_string(f / "runc")}
  SystemdCgroup = false
[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = [{_toml_string(self.cni_bin)}, {_toml_string(CNI_PLUGINS)}]
  conf_dir = {_toml_string(f / "cni")}

[plugins.'io.containerd.grpc.v1.cri']
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""

    def start(self, *, timeout: float) -> None:
        """Write the configuration and the CNI configuration, start containerd, and wait until the CRI reports the
        runtime and the network ready."""
        if not (CNI_PLUGINS / "loopback").is_file():
            raise ComponentFailed(f"containerd: no CNI plugins in {CNI_PLUGINS} (Debian: containernetworking-plugins)")
        for sub in ("s", "opt", "runc"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        self.cdi_dir.mkdir(parents=True, exist_ok=True)
        self.write_cni()
        config = self.folder / "config.toml"
        config.write_text(self.config())
        # The shim finds runc by the configured path; PATH names the built binaries for anything else it runs.
        env = {**os.environ, "PATH": f"{self.binaries}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
        self.component = Component("containerd", [str(self.binaries / "containerd"), f"--config={config}"],
                                   self.log, env=env)
        self.component.start()
        self._wait_ready(timeout)

    def write_cni(self) -> None:
        """The network configuration and the node's own plugin, as containerd finds them (`cni` and `cni-bin` below
        the folder)."""
        for folder in (self.folder / "cni", self.cni_bin):
            folder.mkdir(parents=True, exist_ok=True)
        plugin = self.cni_bin / PLUGIN
        plugin.write_text(_plugin_wrapper())
        plugin.chmod(0o755)
        (self.folder / "cni" / _CNI_CONFIG_FILE).write_text(json.dumps(_CNI_CONFIG))

    def _wait_ready(self, timeout: float) -> None:
        assert self.component is not None
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            if not self.component.running():
                raise self.component.failed("exited before its CRI was ready")
            if self.socket.exists():
                done = self.crictl("info", check=False)
                if done.returncode == 0:
                    conditions = {c["type"]: c for c in json.loads(done.stdout)["status"]["conditions"]}
                    if all(conditions.get(t, {}).get("status") for t in ("RuntimeReady", "NetworkReady")):
                        return
                    last = json.dumps(conditions)
                else:
                    last = done.stderr.strip()
            if time.monotonic() > deadline:
                raise self.component.failed(f"was not ready within {timeout:.0f} s (last answer: {last})")
            time.sleep(0.2)

    def crictl(self, *argv: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run the built crictl against this containerd."""
        return subprocess.run(
            [str(self.binaries / "crictl"), f"--runtime-endpoint={self.endpoint}", f"--image-endpoint={self.endpoint}",
             "--timeout=30s", *argv], capture_output=True, text=True, timeout=timeout, check=check)

    def ctr(self, *argv: str, timeout: float = 120.0) -> str:
        """Run the built ctr against this containerd, in the CRI's namespace (k8s.io); its output."""
        done = subprocess.run([str(self.binaries / "ctr"), f"--address={self.socket}", "--namespace=k8s.io", *argv],
                              capture_output=True, text=True, timeout=timeout, check=False)
        if done.returncode != 0:
            raise ComponentFailed(f"ctr {' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def import_image(self, archive: Path) -> None:
        """Import an OCI image archive and unpack it for the CRI's snapshotter."""
        self.ctr("images", "import", str(archive))

    def images(self) -> list[dict[str, Any]]:
        """The images the CRI sees (crictl images)."""
        found: list[dict[str, Any]] = json.loads(self.crictl("images", "-o", "json").stdout)["images"]
        return found

    def pids(self) -> list[int]:
        return [self.component.pid] if self.component and self.component.pid and self.component.running() else []

    def stop(self) -> None:
        """Remove every pod sandbox, stop containerd, end its remaining shims, unmount what is left."""
        if self.component is not None and self.component.running():
            # Stops each pod's containers and removes them with the sandbox (their root file systems unmounted).
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                self.crictl("rmp", "--all", "--force", check=False, timeout=120)
        if self.component is not None:
            self.component.stop()
        self._end_shims()
        unmount_below(self.folder)

    def _end_shims(self) -> None:
        """SIGKILL every shim started by this containerd (its command line names this containerd's socket)."""
        needle = str(self.socket).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"containerd-shim" in cmdline and needle in cmdline.split(b"\0"):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(entry.name), signal.SIGKILL)
