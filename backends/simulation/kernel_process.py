"""The simulated node's kernel side (`node_services`: sysfs reactions, the NVML server, the control channel) in a
process of its own, as `dra-agent run` on a simulated node uses it: a real kernel and driver work outside the
agent's process, on other CPUs, and never hold the agent's interpreter lock. In threads of the agent (as tests
that open a node in their own process use it), their work would compete with the agent's for the lock, and the
agent would look slower than it is.

    python -m backends.simulation.kernel_process ROOT    (the node's profile as one JSON line on stdin)

The parent writes the profile, then reads "ready" once the kernel watches the node, and keeps stdin open: the
process ends when stdin closes, so it never outlives its parent, even one killed with SIGKILL.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
from pathlib import Path
from types import TracebackType

from backends.simulation.node_services import NodeServices
from backends.simulation.profile import NodeProfile

__all__ = ["KernelProcess", "KernelProcessError"]

_READY = b"ready\n"


class KernelProcessError(Exception):
    """The kernel process did not start."""


class KernelProcess:
    """`SimulatedKernel` for the node at `root`, run by a child process between `start()` and `stop()`."""

    def __init__(self, root: Path, profile: NodeProfile, timeout: float = 60.0) -> None:
        self.root = root
        self.profile = profile
        self.timeout = timeout
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> KernelProcess:
        # Not under umockdev's preload: the kernel changes the node's files themselves, as the kernel does sysfs.
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "UMOCKDEV_DIR")}
        process = self._process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(self.root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=env, close_fds=True)
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(self.profile.model_dump_json().encode() + b"\n")
        process.stdin.flush()
        ready, _, _ = select.select([process.stdout], [], [], self.timeout)
        answer = os.read(process.stdout.fileno(), len(_READY)) if ready else b""
        if answer != _READY:
            self.stop()
            raise KernelProcessError(f"the simulated kernel for {self.root} did not start within {self.timeout:g} s"
                                     if not ready else f"the simulated kernel for {self.root} failed to start")
        return self

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        assert process.stdin is not None and process.stdout is not None
        process.stdin.close()  # its signal to stop
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()

    def __enter__(self) -> KernelProcess:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()


def main(argv: list[str]) -> int:
    from backends.simulation.node import SimulatedNode  # which starts processes of this module

    root = Path(argv[0])
    profile = NodeProfile.model_validate_json(sys.stdin.buffer.readline())
    node = SimulatedNode.existing(profile, root)
    with NodeServices(root, node.plan, node.nvml):
        sys.stdout.buffer.write(_READY)
        sys.stdout.buffer.flush()
        while sys.stdin.buffer.read(4096):  # until the parent closes stdin or is gone
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
