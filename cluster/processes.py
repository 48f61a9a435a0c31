"""Starting, watching and stopping the cluster's component processes, and waiting for their health endpoints.

Each component runs as a plain child process in a process group of its own, with its output in a log file under
the cluster's folder. Stopping sends SIGTERM, then SIGKILL to the whole group after a grace period, so nothing a
component started outlives the cluster. Waiting for readiness polls an HTTPS endpoint on loopback, trusting the
cluster's CA, and fails with the end of the component's log when the process dies or the deadline passes.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Component", "ComponentFailed", "free_port", "get"]


class ComponentFailed(RuntimeError):
    """A component exited or never became ready; the message ends with the last lines of its log."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel picks it; the caller binds it soon)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def get(url: str, *, ca: Path | None = None, cert: tuple[Path, Path] | None = None,
        timeout: float = 5.0) -> tuple[int, bytes]:
    """One GET on loopback over HTTP or HTTPS: the status and the body. Connection errors raise OSError."""
    scheme, _, rest = url.partition("://")
    hostport, _, path = rest.partition("/")
    host, _, port = hostport.rpartition(":")
    if scheme == "https":
        context = ssl.create_default_context(cafile=str(ca) if ca else None)
        if ca is None:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if cert is not None:
            context.load_cert_chain(str(cert[0]), str(cert[1]))
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(host, int(port), context=context,
                                                                        timeout=timeout)
    else:
        conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("GET", "/" + path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@dataclass
class Component:
    """One component process: its command line, its log, and the process while it runs."""

    name: str
    argv: Sequence[str]
    log: Path
    env: Mapping[str, str] | None = None
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                list(self.argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=None if self.env is None else dict(self.env), start_new_session=True)

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def failed(self, why: str) -> ComponentFailed:
        return ComponentFailed(f"{self.name} {why}; the end of {self.log}:\n{self.tail()}")

    def wait_ready(self, url: str, *, timeout: float, ca: Path | None = None,
                   cert: tuple[Path, Path] | None = None) -> None:
        """Poll `url` until it answers 200 "ok"-ish; raise ComponentFailed if the process exits first or the
        deadline passes."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            if not self.running():
                code = None if self.process is None else self.process.returncode
                raise self.failed(f"exited with status {code} before {url} was ready")
            try:
                status, body = get(url, ca=ca, cert=cert, timeout=2.0)
                if status == 200:
                    return
                last = f"{status}: {body.decode(errors='replace')[-400:]}"
            except (OSError, ssl.SSLError, http.client.HTTPException) as e:
                last = str(e)
            if time.monotonic() > deadline:
                raise self.failed(f"was not ready at {url} within {timeout:.0f} s (last answer: {last})")
            time.sleep(0.2)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to the process group, SIGKILL after `grace` seconds; reaps the process."""
        if self.process is None:
            return
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(grace)
        # Whatever the component left in its group (a child it started) goes too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
