"""The simulated node's `nvidia-cuda-mps-control`: the CUDA MPS control program, for what the agent uses of it.

Installed as a copy of this file (with this Python as its interpreter) in the driver root's usr/bin, so it is found
as NVIDIA's is, and runs with the standard library only. As NVIDIA's program:

- `nvidia-cuda-mps-control -d` starts the control daemon in the background (it detaches: own session, parent
  exits once the daemon listens); `-f` runs it in the foreground. The daemon listens on `control` in the pipe
  directory (`CUDA_MPS_PIPE_DIRECTORY`, default /tmp/nvidia-mps) and logs to `control.log` in the log directory
  (`CUDA_MPS_LOG_DIRECTORY`, default /var/log/nvidia-mps), one line per event, `[time Control pid] text`.
- Without options it is a client: it sends each line of its standard input to the daemon as a command and prints
  the answers; without a daemon it says so on standard error and exits with 1.
- Commands: `set_default_active_thread_percentage P`, `get_default_active_thread_percentage`,
  `set_default_device_pinned_mem_limit DEV LIMIT` (LIMIT a number with M or G), `get_default_device_pinned_mem_limit
  DEV`, `get_server_list`, `quit` (the daemon removes its socket and exits). SIGTERM ends it the same way.

It starts no MPS server: no process on the simulated node runs CUDA.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

CONTROL = "control"
LOG = "control.log"
_DEFAULT_PIPE, _DEFAULT_LOG = "/tmp/nvidia-mps", "/var/log/nvidia-mps"
_LIMIT = re.compile(r"[0-9]+[MG]")
_CONNECTION_TIMEOUT = 5.0


def _directories() -> tuple[Path, Path]:
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or _DEFAULT_PIPE).absolute()
    log = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY") or _DEFAULT_LOG).absolute()
    return pipe, log


class Daemon:
    """The control daemon's state: its settings and its log."""

    def __init__(self, pipe: Path, log: Path) -> None:
        self.pipe, self.log_path = pipe, log
        self.percentage = 100.0
        self.pinned: dict[str, str] = {}
        self.running = True

    def log(self, text: str) -> None:
        now = time.time()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
        with open(self.log_path / LOG, "a") as f:
            f.write(f"[{stamp} Control {os.getpid()}] {text}\n")

    def command(self, line: str) -> str:
        """The answer to one command line."""
        words = line.split()
        if not words:
            return ""
        name, args = words[0], words[1:]
        if name == "set_default_active_thread_percentage" and len(args) == 1:
            try:
                value = float(args[0])
            except ValueError:
                return f"Invalid percentage {args[0]}"
            if not 0 < value <= 100:
                return f"Invalid percentage {args[0]}"
            self.percentage = value
            return f"{value:.1f}"
        if name == "get_default_active_thread_percentage" and not args:
            return f"{self.percentage:.1f}"
        if name == "set_default_device_pinned_mem_limit" and len(args) == 2:
            if _LIMIT.fullmatch(args[1]) is None:
                return f"Invalid memory limit {args[1]}"
            self.pinned[args[0]] = args[1]
            return ""
        if name == "get_default_device_pinned_mem_limit" and len(args) == 1:
            return self.pinned.get(args[0], "0M")
        if name == "get_server_list" and not args:
            return ""
        if name == "quit" and not args:
            self.running = False
            return ""
        return f"Unrecognized command {line.strip()}"

    def serve(self, listener: socket.socket) -> None:
        while self.running:
            try:
                connection, _ = listener.accept()
            except InterruptedError:
                continue
            except OSError:
                break  # closed by SIGTERM
            with connection:
                self.log("Accepting connection...")
                self.log("NEW UI")
                connection.settimeout(_CONNECTION_TIMEOUT)
                with contextlib.suppress(OSError):  # a client gone or silent: the next one is served
                    self._session(connection)
                self.log("UI closed")
        self.stop(listener)

    def _session(self, connection: socket.socket) -> None:
        pending = b""
        while self.running:
            data = connection.recv(4096)
            if not data:
                return
            pending += data
            while b"\n" in pending and self.running:
                raw, pending = pending.split(b"\n", 1)
                line = raw.decode(errors="replace").strip()
                self.log(f"Cmd:{line}")
                answer = self.command(line)
                if answer:
                    self.log(answer)
                connection.sendall(answer.encode() + b"\n")

    def stop(self, listener: socket.socket) -> None:
        listener.close()
        (self.pipe / CONTROL).unlink(missing_ok=True)
        self.log("Exit")


def run_daemon(background: bool) -> int:
    pipe, log = _directories()
    pipe.mkdir(parents=True, exist_ok=True)
    log.mkdir(parents=True, exist_ok=True)
    ready: int | None = None  # where the daemon tells the caller of -d that it listens
    if background:
        ready_read, ready = os.pipe()
        if os.fork() > 0:  # the caller's process: wait until the daemon listens
            os.close(ready)
            started = os.read(ready_read, 1)
            return 0 if started == b"1" else 1
        os.close(ready_read)
        os.setsid()
        if os.fork() > 0:
            os._exit(0)
    daemon = Daemon(pipe, log)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    os.chdir(pipe)  # a relative socket name: the pipe directory's path may be longer than a socket path may be
    try:
        Path(CONTROL).unlink(missing_ok=True)
        listener.bind(CONTROL)
        listener.listen(8)
    except OSError as e:
        print(f"An instance of this daemon is already running or cannot listen: {e.strerror}", file=sys.stderr)
        if ready is not None:
            os.write(ready, b"0")
        return 1
    signal.signal(signal.SIGTERM, lambda *_: _stop_on_signal(daemon, listener))
    daemon.log(f"Starting control daemon using socket {pipe / CONTROL}")
    daemon.log(f"To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY={pipe}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        daemon.log(f"Devices: CUDA_VISIBLE_DEVICES={visible}")
    if ready is not None:
        os.write(ready, b"1")
        os.close(ready)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
    daemon.serve(listener)
    return 0


def _stop_on_signal(daemon: Daemon, listener: socket.socket) -> None:
    daemon.running = False
    listener.close()


def run_client() -> int:
    pipe, _ = _directories()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.chdir(pipe)
        client.connect(CONTROL)
    except OSError:
        print("Cannot find MPS control daemon process", file=sys.stderr)
        return 1
    commands = [line for line in sys.stdin.read().splitlines() if line.strip()]
    with client:
        client.settimeout(_CONNECTION_TIMEOUT)
        for line in commands:
            client.sendall(line.encode() + b"\n")
            answer = b""
            while not answer.endswith(b"\n"):
                data = client.recv(4096)
                if not data:
                    return 0 if line.split()[0] == "quit" else 1
                answer += data
            text = answer.decode(errors="replace").rstrip("\n")
            if text:
                print(text)
    return 0


def main(argv: list[str]) -> int:
    if argv in (["-d"], ["-f"]):
        return run_daemon(background=argv == ["-d"])
    if argv:
        print(f"Usage: nvidia-cuda-mps-control [-d | -f]; unknown arguments {' '.join(argv)}", file=sys.stderr)
        return 1
    return run_client()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
