"""What MPS tests look at from outside the agent: a claim's MPS control daemon (its folder, its pid, what it answers
on its pipe, its log) and the claims that ask for MPS."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.nvidia.mps import daemon_pid
from simulator.node.driver_install import MPS_CONTROL
from tests.support.timing import scaled

GPU = "gpu.nvidia.com"
FIRST, SECOND = ("gpu-0000-18-00-0", "0000:18:00.0"), ("gpu-0000-1c-00-0", "0000:1c:00.0")


def mps_config(**limits: Any) -> list[dict[str, Any]]:
    """The claim's configuration asking for MPS with `limits` (mpsConfig fields)."""
    parameters = {"apiVersion": "dra-agent.io/v1alpha1", "kind": "GpuConfig",
                  "sharing": {"strategy": "MPS", "mpsConfig": limits}}
    return [{"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": GPU, "parameters": parameters}}]


def folder(state_dir: Path, claim: str) -> Path:
    return state_dir / "backends" / "nvidia-gpu" / "mps" / claim


def pid_of(state_dir: Path, claim: str) -> int | None:
    """The pid of the claim's live daemon."""
    return daemon_pid(folder(state_dir, claim) / "pipe")


def ask(sim_root: Path, state_dir: Path, claim: str, *commands: str) -> list[str]:
    """The claim's daemon's answers to control commands, as an operator's `nvidia-cuda-mps-control` gets them."""
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(folder(state_dir, claim) / "pipe")}
    done = subprocess.run([str(sim_root / "usr/bin" / MPS_CONTROL)], input="".join(f"{c}\n" for c in commands),
                          env=env, capture_output=True, text=True, timeout=scaled(10), check=True)
    return done.stdout.splitlines()


def answers(sim_root: Path, state_dir: Path, claim: str, *commands: str) -> list[str] | None:
    """As `ask`, or None while no daemon answers on the claim's pipe (one quitting or not yet listening): for
    waiting until a daemon serves."""
    try:
        return ask(sim_root, state_dir, claim, *commands)
    except subprocess.CalledProcessError:
        return None


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name the same file or folder (for `/proc/<pid>/root/...`: as that process sees it)."""
    one, two = os.stat(a), os.stat(b)
    return (one.st_dev, one.st_ino) == (two.st_dev, two.st_ino)


def control_log(state_dir: Path, claim: str) -> str:
    return (folder(state_dir, claim) / "log" / "control.log").read_text()


def daemons_of(sim_root: Path) -> list[int]:
    """The pids of every live simulated MPS control daemon whose program is the node's (leak detector)."""
    program = str(sim_root / "usr/bin" / MPS_CONTROL).encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if program in argv and "-f" in [a.decode(errors="replace") for a in argv] and state not in ("Z", "X"):
            found.append(int(entry))
    return found


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A short-named empty directory outside /dev/shm: a claim's MPS daemon sees its own folder at /dev/shm, so a
    node or state directory kept below the host's /dev/shm would be hidden from it."""
    path = Path(tempfile.mkdtemp(prefix="dra-m-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
