"""The simulated node's kernel side (`simulator.kernel.services`: sysfs reactions, the NVML server, the control
channel) in a process of its own, as `dra-agent run` on a simulated node uses it: a real kernel and driver work
outside the agent's process, on other CPUs, and never hold the agent's interpreter lock. In threads of the agent
(as tests that open a node in their own process use it), their work would compete with the agent's for the lock,
and the agent would look slower than it is.

    python -m simulator.kernel.process ROOT    (the node's profile as one JSON line on stdin)

The process that starts it (holding the node's lock, see `simulator.kernel.attach`) writes the profile, reads
"ready" once the kernel serves the node, and keeps stdin open. Other processes that open the node attach to this
kernel instead of starting their own. The kernel ends once its starter has closed stdin (or died: SIGKILL closes
it too) and no process is attached any more; it answers the closed stdin with "staying" when others still are, so
the starter does not wait for it. It runs in a session of its own, away from the terminal's signals to its
starter.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
from contextlib import suppress
from pathlib import Path
from types import TracebackType

from simulator.kernel.attach import node_lock
from simulator.kernel.services import NodeServices
from simulator.node.hardware import SimulatedNode
from simulator.node.profile import NodeProfile
from simulator.timing import scaled

__all__ = ["KernelProcess", "KernelProcessError"]

_READY = b"ready\n"
_STAYING = b"staying\n"


class KernelProcessError(Exception):
    """The kernel process did not start."""


class KernelProcess:
    """The kernel side of the node at `root`, run by a child process from `start()`; `stop()` detaches this process,
    and the kernel ends unless other processes are attached."""

    def __init__(self, root: Path, profile: NodeProfile, timeout: float | None = None) -> None:
        self.root = root
        self.profile = profile
        self.timeout = scaled(60.0) if timeout is None else timeout
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> KernelProcess:
        # Not under umockdev's preload: the kernel changes the node's files themselves, as the kernel does sysfs.
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "UMOCKDEV_DIR")}
        process = self._process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(self.root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=env, close_fds=True, start_new_session=True)
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

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        assert process.stdin is not None and process.stdout is not None
        process.stdin.close()  # its signal to stop, unless others are attached
        ready, _, _ = select.select([process.stdout], [], [], self.timeout)
        answer = os.read(process.stdout.fileno(), len(_STAYING)) if ready else b""
        process.stdout.close()
        if answer == _STAYING:
            # It serves other processes on: reaped when it ends (by init, should this process end first).
            threading.Thread(target=process.wait, name="simulated-kernel-reaper", daemon=True).start()
            return
        try:
            process.wait(timeout=scaled(10))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> KernelProcess:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()


def main(argv: list[str]) -> int:
    root = Path(argv[0])
    profile = NodeProfile.model_validate_json(sys.stdin.buffer.readline())
    node = SimulatedNode.existing(profile, root)
    services = NodeServices(root, node.plan, node.nvml).start()  # its starter holds the node's lock meanwhile
    _say(_READY)
    while sys.stdin.buffer.read(4096):  # until the starter closes stdin or is gone
        pass
    told = False
    while True:
        with node_lock(root, create=False):  # no process attaches while the kernel decides to end
            if not services.attachments.attached:
                services.stop()
                return 0
        if not told:
            told = True
            _say(_STAYING)
            with suppress(OSError):
                sys.stdout.close()
        services.attachments.wait_until_none()


def _say(line: bytes) -> None:
    with suppress(OSError):  # the starter may be gone
        sys.stdout.buffer.write(line)
        sys.stdout.buffer.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
