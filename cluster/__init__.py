"""The real Kubernetes components on one machine, for the real-cluster test tier and for trying the agent by hand.

`go.mod` pins the release; `build.sh` builds its binaries into a cache keyed by the pins; the Python modules here
start them on 127.0.0.1 only (etcd, kube-apiserver, kube-controller-manager, kube-scheduler), register the
simulated node and stop everything again. `python -m cluster --help` has the commands. The product never imports
this package.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["HERE", "binaries", "build"]

HERE = Path(__file__).resolve().parent


def binaries() -> Path | None:
    """The folder of the built binaries for the pinned versions, or None when they are not built yet."""
    done = subprocess.run([str(HERE / "build.sh"), "--print"], capture_output=True, text=True, check=False)
    return Path(done.stdout.strip()) if done.returncode == 0 else None


def build() -> Path:
    """Build the binaries (a no-op when they are cached) and return their folder."""
    done = subprocess.run([str(HERE / "build.sh")], stdout=subprocess.PIPE, text=True, check=True)
    return Path(done.stdout.strip().splitlines()[-1])
