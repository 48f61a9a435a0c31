"""The first moments of a claim's MPS control daemon: `python -m backends.nvidia.mps_launch PIDFILE SHM PROGRAM`.

Run by `backends.nvidia.mps` in a session of its own, this process writes its own pid to PIDFILE (so the agent knows
the daemon's pid even when it crashes right after starting it: the pid stays the same through `exec`), moves into a
cgroup of the claim's own when the agent runs in a pod's (`mps_cgroup`: so that the daemon outlives the pod), into a
private mount namespace with the claim's SHM folder bound at /dev/shm (the MPS server and its clients, the claim's
containers, which get the same folder at /dev/shm, meet in shared memory there; not when the daemon's own files
lie below /dev/shm, which the folder would hide), and becomes PROGRAM
(`nvidia-cuda-mps-control -f`) with the environment it was given. Failing, it says why on standard error, which
the daemon's output file keeps, and exits with 1.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

from backends.nvidia.mps_cgroup import CGROUPS_RECORD, leave_pod_cgroup, unshare_mounts

__all__ = ["SHM_KEPT", "main"]

_MS_BIND = 0x1000
_SHM = "/dev/shm"
SHM_KEPT = "the claim's shm folder is not bound at /dev/shm"


def _check(result: int, what: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")


def bind_shm(shm: str) -> None:
    """`shm` at /dev/shm, in this process's own mount namespace (`unshare_mounts`)."""
    libc = ctypes.CDLL(None, use_errno=True)
    _check(libc.mount(shm.encode(), _SHM.encode(), None, _MS_BIND, None), f"cannot bind {shm} at {_SHM}")


def _below_shm(*paths: str) -> str | None:
    """The first of `paths` that lies below /dev/shm (symbolic links followed)."""
    shm = os.path.realpath(_SHM) + "/"
    return next((p for p in paths if p and os.path.realpath(p).startswith(shm)), None)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m backends.nvidia.mps_launch PIDFILE SHM PROGRAM", file=sys.stderr)
        return 2
    pidfile, shm, program = argv
    os.umask(0o022)  # the daemon's pipes open to the claim's containers whatever the agent's own umask
    temp = f"{pidfile}.tmp"
    with open(temp, "w") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(temp, pidfile)
    folder = Path(pidfile).parent
    try:
        # Nothing mounted from here on goes back to the agent's namespace.
        unshare_mounts()
        try:
            leave_pod_cgroup(folder.name, folder / CGROUPS_RECORD)
        except OSError as e:
            raise OSError(e.errno, f"cannot leave the agent pod's cgroup: {e.strerror}") from None
        hidden = _below_shm(program, os.environ.get("CUDA_MPS_PIPE_DIRECTORY", ""),
                            os.environ.get("CUDA_MPS_LOG_DIRECTORY", ""))
        if hidden:
            # Covering /dev/shm would hide them from the daemon: it keeps the host's (a test or demo node kept in
            # RAM; the agent's state is not below /dev/shm on a real node).
            print(f"{SHM_KEPT}: {hidden} lies below it", file=sys.stderr, flush=True)
        else:
            bind_shm(shm)
        os.execv(program, [program, "-f"])
    except OSError as e:
        print(f"MPS control daemon not started: {e.strerror or e}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
