"""CUDA MPS for claims whose `GpuConfig.sharing` is `strategy: MPS`: one MPS control daemon per claim, run from the
driver root's `nvidia-cuda-mps-control`, with the claim's limits, and what its containers need to reach it.

Each claim's daemon has a folder of its own, `<state_dir>/mps/<claim UID>/`, holding its pipe directory (`pipe/`,
`CUDA_MPS_PIPE_DIRECTORY`), its log directory (`log/`, `CUDA_MPS_LOG_DIRECTORY`, with NVIDIA's control.log and the
daemon's own output), and the folder its MPS server and clients share as /dev/shm (`shm/`). Every container of the
claim gets the three at NVIDIA's default places (/tmp/nvidia-mps, /var/log/nvidia-mps, /dev/shm) and the two
variables set to them.

The daemon is a process of its own session (and, when the agent runs in a pod, of a cgroup of its own:
`mps_cgroup`), not tied to the agent's: it outlives a restart or upgrade of the agent, which finds it again by its
pid (recorded by the launcher before anything else, `mps_launch`) and checks it is still the claim's daemon by its
environment (its pipe directory names the claim). Stopping it asks it to quit through its pipe, and signals it
after `QUIT_SECONDS`.

Crash safety: the claim's entry in the journal `<state_dir>/mps-daemons.json` is written before the daemon starts
(the intent), so unprepare, the rollback of a prepare a crash cut short and `reconcile` at start always know of a
daemon that may run. Not synced: no daemon outlives a reboot. Blocking (processes, files): call from a worker thread.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from structlog.typing import FilteringBoundLogger

from backends.contract import PrepareError
from backends.failpoints import failpoint
from backends.journal import Journal
from backends.nvidia.config import MpsConfig
from backends.nvidia.driver_root import DriverRoot
from backends.nvidia.mps_cgroup import CGROUPS_RECORD, in_own_pid_namespace, remove_cgroups
from cdi.spec import ContainerEdits, Mount

__all__ = ["CONTROL_PROGRAM", "MpsDaemons", "MpsGpu", "control_program", "daemon_pid"]

CONTROL_PROGRAM = "nvidia-cuda-mps-control"
PIPE, LOG, SHM = "/tmp/nvidia-mps", "/var/log/nvidia-mps", "/dev/shm"
"""Where a container finds the daemon's pipe and log directories (NVIDIA's defaults) and the shared memory."""
READY_SECONDS = 20.0
QUIT_SECONDS = 5.0
_TERM_SECONDS = 2.0
_MIB = 2**20
_RW = ("rw", "nosuid", "nodev", "bind")


@dataclass(frozen=True)
class MpsGpu:
    """A full GPU of the claim that MPS serves: its device name, UUID and memory in bytes."""

    device: str
    uuid: str
    memory: int


def control_program(driver_root: DriverRoot) -> Path:
    """The driver's `nvidia-cuda-mps-control`, as the agent sees it; PrepareError when the driver root has none."""
    program = driver_root.find_program(CONTROL_PROGRAM)
    if program is None:
        raise PrepareError(f"sharing strategy MPS needs {CONTROL_PROGRAM} from the NVIDIA driver, and the driver root "
                           f"{driver_root.root} has none in its program folders")
    return program


def daemon_pid(pipe: Path) -> int | None:
    """The pid of the live process whose MPS pipe directory is `pipe`, found from the pid file beside it."""
    try:
        pid = int((pipe.parent / "daemon.pid").read_text())
    except (OSError, ValueError):
        return None
    return pid if _serves(pid, pipe) else None


def _serves(pid: int, pipe: Path) -> bool:
    """Whether process `pid` lives (not a zombie) and is the daemon of pipe directory `pipe`."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    if stat.rpartition(")")[2].split()[0] in ("Z", "X"):
        return False
    return f"CUDA_MPS_PIPE_DIRECTORY={pipe}".encode() in environ.split(b"\0")


def commands(config: MpsConfig, gpus: Sequence[MpsGpu]) -> list[str]:
    """The control commands that give the claim's daemon its limits; PrepareError for limits no GPU can have."""
    try:
        limits = config.pinned_limits({g.device: g.uuid for g in gpus})
    except ValueError as e:
        raise PrepareError(f"GpuConfig.sharing.mpsConfig: {e}") from None
    lines = []
    if config.default_active_thread_percentage is not None:
        lines.append(f"set_default_active_thread_percentage {config.default_active_thread_percentage}")
    for gpu in gpus:
        limit = limits.get(gpu.device)
        if limit is None:
            continue
        if limit > gpu.memory:
            raise PrepareError(f"{gpu.device}: GpuConfig.sharing.mpsConfig: a pinned device memory limit of {limit} "
                               f"bytes is more than the GPU's memory ({gpu.memory} bytes)")
        if limit < _MIB:
            raise PrepareError(f"{gpu.device}: GpuConfig.sharing.mpsConfig: a pinned device memory limit of {limit} "
                               "bytes is less than 1Mi, the smallest limit MPS takes")
        lines.append(f"set_default_device_pinned_mem_limit {gpu.uuid} {limit // _MIB}M")
    return lines


class MpsDaemons:
    """The MPS control daemons one backend runs for claims, and its journal of them."""

    def __init__(self, state_dir: Path | None, log: FilteringBoundLogger) -> None:
        self._journal = Journal(state_dir / "mps-daemons.json", durable=False) if state_dir is not None else None
        self.root = state_dir / "mps" if state_dir is not None else None
        self._log = log
        self._children: set[int] = set()  # pids of the daemons this process started: it reaps them
        self._lock = threading.Lock()  # the journal has one user at a time; worker threads share it
        self._warned = False

    def folder(self, claim: str) -> Path:
        assert self.root is not None
        return self.root / claim

    def claims(self) -> dict[str, dict[str, Any]]:
        """The claims with a daemon (or the intent of one), with their journal entries."""
        if self._journal is None:
            return {}
        with self._lock:
            return dict(self._journal)

    def _entry(self, claim: str) -> dict[str, Any] | None:
        if self._journal is None:
            return None
        with self._lock:
            return self._journal.get(claim)

    def edits(self, claim: str) -> ContainerEdits:
        """What every container of the claim gets to reach its daemon."""
        folder = self.folder(claim)
        return ContainerEdits(
            env=(f"CUDA_MPS_PIPE_DIRECTORY={PIPE}", f"CUDA_MPS_LOG_DIRECTORY={LOG}"),
            mounts=(Mount(str(folder / "pipe"), PIPE, _RW), Mount(str(folder / "log"), LOG),
                    Mount(str(folder / "shm"), SHM, _RW)))

    def start(self, claim: str, gpus: Sequence[MpsGpu], config: MpsConfig, program: Path,
              library_dir: Path | None) -> ContainerEdits:
        """The claim's daemon running with its limits (started unless it runs already), ready: its pipe answers."""
        if self._journal is None:
            raise PrepareError("MPS is run only by `dra-agent run`, which keeps the records to stop its daemons")
        lines = commands(config, gpus)
        entry = {"claim": claim, "devices": [g.device for g in gpus], "uuids": [g.uuid for g in gpus],
                 "commands": lines, "program": str(program),
                 "libraryDir": str(library_dir) if library_dir is not None else None}
        if not self._warned and in_own_pid_namespace():
            self._warned = True
            self._log.warning("MPS control daemons run in the agent's PID namespace and end with it: give the agent's "
                              "pod hostPID so that they outlive it", claim=claim)
        with self._lock:
            self._journal.put(claim, entry)  # the intent: from here on a daemon may run
        failpoint("mps-after-intent")
        self.ensure(claim, entry)
        self._log.info("MPS control daemon serving", claim=claim, devices=entry["devices"], pid=self.pid(claim))
        return self.edits(claim)

    def ensure(self, claim: str, entry: Mapping[str, Any]) -> None:
        """Start the claim's daemon unless it runs (serialised with another agent instance doing the same), wait
        until its pipe answers, and give it its limits."""
        folder = self.folder(claim)
        program = Path(entry["program"])
        with _locked(folder):
            if self._journal is not None and self._entry(claim) is None:
                # Stopped by the claim's unprepare (perhaps by the other agent instance) while this call waited.
                shutil.rmtree(folder, ignore_errors=True)
                _lock_file(folder).unlink(missing_ok=True)
                return
            child = self._spawn(folder, entry) if self.pid(claim) is None else None
            failpoint("mps-after-spawn")
            self._wait_ready(claim, program, child)
            if entry["commands"]:
                answer = self._control(folder, program, entry["commands"])
                if answer is not None:
                    raise PrepareError(f"the MPS control daemon refused the claim's limits: {answer}")

    def pid(self, claim: str) -> int | None:
        """The pid of the claim's live daemon, if one runs."""
        self._reap()
        return daemon_pid(self.folder(claim) / "pipe")

    def _reap(self) -> None:
        """Collect the exit of daemons this process started (a zombie of ours would otherwise look alive)."""
        for pid in list(self._children):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                self._children.discard(pid)

    def _spawn(self, folder: Path, entry: Mapping[str, Any]) -> int:
        for part in ("pipe", "log", "shm"):
            (folder / part).mkdir(parents=True, exist_ok=True)
            (folder / part).chmod(0o1777 if part == "shm" else 0o755)
        (folder / "daemon.pid").unlink(missing_ok=True)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe"),
               "CUDA_MPS_LOG_DIRECTORY": str(folder / "log"), "CUDA_VISIBLE_DEVICES": ",".join(entry["uuids"])}
        if entry.get("libraryDir"):
            env["LD_LIBRARY_PATH"] = entry["libraryDir"]  # the driver's libcuda, not one of the agent's image
        if "PYTHONPATH" in os.environ:
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        output = str(folder / "log" / "daemon-output.log")
        append = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        pid = os.posix_spawn(
            sys.executable,
            [sys.executable, "-m", "backends.nvidia.mps_launch", str(folder / "daemon.pid"), str(folder / "shm"),
             entry["program"]],
            env,
            file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                          (os.POSIX_SPAWN_OPEN, 1, output, append, 0o644), (os.POSIX_SPAWN_DUP2, 1, 2)],
            setsid=True)  # not in the agent's session: signals to the agent's group do not reach it
        self._children.add(pid)
        return pid

    def _wait_ready(self, claim: str, program: Path, child: int | None) -> None:
        """Until the daemon answers on its pipe; PrepareError when it ended (`child`: just started by this call)
        or does not answer within READY_SECONDS."""
        folder = self.folder(claim)
        deadline = time.monotonic() + READY_SECONDS
        while True:
            if self._control(folder, program, ["get_default_active_thread_percentage"]) is None:
                return
            self._reap()
            ended = child not in self._children if child is not None else self.pid(claim) is None
            if ended:
                raise PrepareError(f"the MPS control daemon of the claim did not start: {_tail(folder)}")
            if time.monotonic() > deadline:
                raise PrepareError(f"the MPS control daemon of the claim does not answer on its pipe after "
                                   f"{READY_SECONDS:.0f} s: {_tail(folder)}")
            time.sleep(0.05)

    @staticmethod
    def _control(folder: Path, program: Path, lines: Sequence[str]) -> str | None:
        """Send control commands through the daemon's pipe; None when it took them all, else what went wrong."""
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe"),
               "CUDA_MPS_LOG_DIRECTORY": str(folder / "log")}
        try:
            done = subprocess.run([str(program)], input="".join(f"{line}\n" for line in lines).encode(), env=env,
                                  capture_output=True, timeout=QUIT_SECONDS, check=False)
        except subprocess.TimeoutExpired:
            return f"{CONTROL_PROGRAM} did not answer within {QUIT_SECONDS:.0f} s"
        except OSError as e:
            return f"cannot run {program}: {e.strerror}"
        bad = [line for line in done.stdout.decode(errors="replace").splitlines()
               if line.startswith(("Invalid", "Unrecognized"))]
        if done.returncode != 0 or bad:
            return "; ".join(bad) or done.stderr.decode(errors="replace").strip() or f"exit status {done.returncode}"
        return None

    def stop(self, claim: str) -> None:
        """Stop the claim's daemon (quit through its pipe, then SIGTERM, then SIGKILL), remove its folder and entry;
        nothing to do for a claim without one."""
        entry = self._entry(claim)
        folder = self.folder(claim) if self.root is not None else None
        if folder is None or (entry is None and not folder.exists()):
            return
        with _locked(folder):
            pid = self.pid(claim)
            program = Path(entry["program"]) if entry is not None else None
            if program is not None and (pid is not None or (folder / "pipe").exists()):
                self._control(folder, program, ["quit"])
                failpoint("mps-after-quit")
            if pid is not None and not self._ended(claim, QUIT_SECONDS):
                self._log.warning("MPS control daemon did not quit; terminating it", claim=claim, pid=pid)
                for signum in (signal.SIGTERM, signal.SIGKILL):
                    _signal(pid, signum)
                    if self._ended(claim, _TERM_SECONDS):
                        break
            shutil.rmtree(folder / "pipe", ignore_errors=True)
            shutil.rmtree(folder / "shm", ignore_errors=True)
            shutil.rmtree(folder / "log", ignore_errors=True)
            remove_cgroups(folder / CGROUPS_RECORD)
            (folder / "daemon.pid").unlink(missing_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
        _lock_file(folder).unlink(missing_ok=True)
        if self._journal is not None:
            with self._lock:
                self._journal.remove(claim)
        self._log.info("MPS control daemon stopped", claim=claim)

    def _ended(self, claim: str, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while self.pid(claim) is not None:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def reconcile(self, held: Mapping[str, Sequence[str]]) -> None:
        """Stop the daemons of claims the core no longer holds, and remove folders no entry names."""
        for claim, entry in self.claims().items():
            if not set(entry["devices"]) & set(held.get(claim, ())):
                self._log.warning("stopping the MPS control daemon of a claim no longer prepared", claim=claim)
                self.stop(claim)
        if self.root is not None and self.root.is_dir():
            known = self.claims()
            for folder in self.root.iterdir():
                if folder.is_dir() and folder.name not in known:
                    self._log.warning("removing the folder of an MPS control daemon no claim has", folder=str(folder))
                    self._stop_unknown(folder)

    def _stop_unknown(self, folder: Path) -> None:
        pid = daemon_pid(folder / "pipe")
        if pid is not None:
            for signum in (signal.SIGTERM, signal.SIGKILL):
                _signal(pid, signum)
                deadline = time.monotonic() + _TERM_SECONDS
                while daemon_pid(folder / "pipe") is not None and time.monotonic() < deadline:
                    time.sleep(0.02)
        remove_cgroups(folder / CGROUPS_RECORD)
        shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()


def _signal(pid: int, signum: int) -> None:
    with suppress(ProcessLookupError):
        os.kill(pid, signum)


def _tail(folder: Path) -> str:
    """The last line the daemon (or its launcher) wrote, for the claim's error."""
    try:
        lines = (folder / "log" / "daemon-output.log").read_text(errors="replace").strip().splitlines()
    except OSError:
        lines = []
    return lines[-1] if lines else "it wrote nothing"


def _lock_file(folder: Path) -> Path:
    return folder.parent / f".{folder.name}.lock"


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One agent instance at a time starts or stops the daemon in `folder` (two run side by side in an upgrade)."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(_lock_file(folder), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
