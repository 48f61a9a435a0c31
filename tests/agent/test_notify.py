"""systemd's notification protocol as the agent speaks it (agent/notify.py): datagrams on a path or an abstract
socket, the watchdog's interval, and nothing at all outside systemd. (Through `dra-agent run`:
tests/end_to_end/test_run_process.py.)"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from agent.notify import Notifier


def test_notifier_sends_datagrams(scratch: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as manager:
        manager.bind(str(scratch / "notify"))
        notifier = Notifier({"NOTIFY_SOCKET": str(scratch / "notify"), "WATCHDOG_USEC": "30000000"})
        assert notifier.watchdog_interval == 15.0
        notifier.ready("serving")
        notifier.stopping()
        assert manager.recv(100) == b"READY=1\nSTATUS=serving"
        assert manager.recv(100) == b"STOPPING=1"


def test_notifier_abstract_socket_and_absence() -> None:
    name = f"dra-agent-test-{id(object())}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as manager:
        manager.bind("\0" + name)
        Notifier({"NOTIFY_SOCKET": "@" + name}).send("STATUS=x")
        assert manager.recv(100) == b"STATUS=x"
    silent = Notifier({})
    assert not silent.enabled and silent.watchdog_interval is None
    silent.ready()  # nothing to talk to: no error


@pytest.mark.parametrize("env", [{"WATCHDOG_USEC": "0"}, {"WATCHDOG_USEC": "5", "WATCHDOG_PID": "1"}])
def test_watchdog_only_for_this_process(env: dict[str, str]) -> None:
    assert Notifier(env).watchdog_interval is None
