"""systemd's notification protocol: READY, STOPPING, STATUS and watchdog keep-alives over $NOTIFY_SOCKET.

Without NOTIFY_SOCKET (not started by systemd with Type=notify) every call does nothing.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Mapping
from contextlib import suppress

__all__ = ["Notifier"]


class Notifier:
    """Sends datagrams to the service manager."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        # An address starting with '@' is in the abstract namespace.
        self._address = "\0" + address[1:] if address.startswith("@") else address
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        watchdog = usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid()))
        self.watchdog_interval = int(usec) / 1e6 / 2 if watchdog else None
        """Seconds between keep-alives: half of WatchdogSec, as systemd recommends; None without a watchdog."""

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def send(self, *fields: str) -> None:
        if not self._address:
            return
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock, suppress(OSError):
            sock.sendto("\n".join(fields).encode(), self._address)  # a vanished manager has nothing to hear

    def ready(self, status: str = "") -> None:
        self.send("READY=1", *((f"STATUS={status}",) if status else ()))

    def stopping(self) -> None:
        self.send("STOPPING=1")

    def status(self, text: str) -> None:
        self.send(f"STATUS={text}")

    async def keep_alive(self) -> None:
        """Send WATCHDOG=1 from the event loop until cancelled: a blocked loop stops them, and systemd restarts
        the agent."""
        if self.watchdog_interval is None:
            return
        while True:
            self.send("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_interval)
