"""The real Kubernetes components on one machine, for the real-cluster test tier and for trying the agent by hand.

`go.mod` pins the release, `node-runtime/go.mod` the node's container runtime; `build.sh` builds their binaries
into caches keyed by the pins; the Python modules here start them on 127.0.0.1 only (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler; on the node containerd and the kubelet, or without them the node
registered as a kubelet would register it) and stop everything again. `python -m cluster --help` has the
commands. The product never imports this package.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["HERE", "binaries", "build"]

HERE = Path(__file__).resolve().parent


def binaries(part: str = "kubernetes") -> Path | None:
    """The folder of a part's built binaries for the pinned versions ("kubernetes": the control plane's, kubectl
    and the kubelet; "node": containerd, runc, crictl, pause), or None when they are not built yet."""
    done = subprocess.run([str(HERE / "build.sh"), "--print", part], capture_output=True, text=True, check=False)
    return Path(done.stdout.strip()) if done.returncode == 0 else None


def build() -> list[Path]:
    """Build every part's binaries (a no-op when they are cached) and return their folders."""
    done = subprocess.run([str(HERE / "build.sh")], stdout=subprocess.PIPE, text=True, check=True)
    return [Path(line) for line in done.stdout.split()]
