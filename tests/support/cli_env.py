"""What `dra-agent` run in-process by the `run_cli` fixture (tests/conftest.py) returns: its exit status and
what it printed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CliResult:
    code: int
    out: str
    err: str
