"""The command line's last words: a reader that goes away early (`dra-agent discover | head`) ends a command quietly,
with the status a shell gives a command stopped by SIGPIPE; a bug is reported in one line that names no Python
exception."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Callable

import pytest

from tests.support.cli_env import CliResult
from tests.support.timing import scaled

SIGPIPE_STATUS = 128 + signal.SIGPIPE
PYTHON_INTERNALS = re.compile(r"\w*(Error|Exception)\b|Traceback|Errno|Exception ignored")


@pytest.mark.parametrize("args", [
    ["discover", "--simulate", "dgx-h100"],
    ["discover", "--simulate", "dgx-h100", "-o", "json"],
    ["discover", "--simulate", "dgx-h100", "-o", "table"],
    ["backends", "--simulate", "dgx-h100"],
    ["backends", "--simulate", "dgx-h100", "-o", "json"],
    ["backends", "--simulate", "gke-g2-l4", "--check"],
    ["demo", "--profile", "gke-g2-l4", "--scenario", "tour", "--color", "never"],
    ["--help"],
    ["discover", "--help"],
])  # fmt: skip
@pytest.mark.parametrize("read", [0, 100], ids=["closed-at-once", "closed-after-100-bytes"])
def test_a_reader_that_goes_away_ends_the_command_quietly(args: list[str], read: int) -> None:
    with subprocess.Popen([sys.executable, "-m", "agent", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as command:
        assert command.stdout is not None and command.stderr is not None
        command.stdout.read(read)
        command.stdout.close()  # as `| head` does once it has what it wants
        err = command.stderr.read().decode()
        code = command.wait(timeout=scaled(60))
    assert code in (0, SIGPIPE_STATUS), err
    assert not PYTHON_INTERNALS.search(err), err
    assert "internal error" not in err


def test_a_closed_pipe_is_told_by_the_status(tmp_path: object) -> None:
    """With all of its output unread, the command says so as a shell expects: 141, as after SIGPIPE."""
    command = subprocess.run(f"{sys.executable} -m agent discover --simulate dgx-h100 -o json | head -c 1 >/dev/null;"
                             " echo ${PIPESTATUS[0]}", shell=True, executable="/bin/bash", capture_output=True,
                             text=True, timeout=scaled(60), check=True)
    assert command.stdout.strip() == str(SIGPIPE_STATUS), command.stderr
    assert command.stderr == ""


def test_a_bug_is_reported_in_one_line_without_python_internals(run_cli: Callable[..., CliResult],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(*_: object) -> int:
        counts: dict[str, int] = {}
        return counts["missing"]

    monkeypatch.setattr("agent.commands.handlers.backends_command", broken)
    result = run_cli("backends", "--simulate", "gke-g2-l4")
    assert result.code == 1
    assert result.err.count("\n") == 1 and result.err.startswith("dra-agent: internal error"), result.err
    assert "--log-level debug" in result.err
    assert not PYTHON_INTERNALS.search(result.err) and "missing" not in result.err, result.err
