"""Shared fixtures: scratch directories in memory, simulated nodes, and the CLI run in-process."""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from agent.commands.cli import main
from backends.nvidia.driver_root import DriverRoot
from backends.nvidia.nvml import use_driver_root
from simulator.node.node import SimulatedNode, simulated_node
from tests.support.agent_env import memory_dir
from tests.support.cli_env import CliResult


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A short-named empty directory in RAM when possible (see `memory_dir`)."""
    with memory_dir("dra-t-") as path:
        yield path


@pytest.fixture
def sim_node(scratch: Path) -> Iterator[Callable[[str], SimulatedNode]]:
    """Build simulated nodes by profile name or path, served from this process until the end of the test. NVML
    is loaded from the driver root of the last one built, as an NVIDIA backend started on it would load it."""
    with ExitStack() as stack:

        def build(profile: str) -> SimulatedNode:
            root = scratch / f"node{len(os.listdir(scratch))}"
            node = stack.enter_context(simulated_node(profile, root))
            use_driver_root(DriverRoot(node.root, node.driver_root, node.dev))
            return node

        yield build


@pytest.fixture
def run_cli(monkeypatch: pytest.MonkeyPatch) -> Callable[..., CliResult]:
    """Run `dra-agent` in this process with captured stdout/stderr and a clean DRA_AGENT_* environment."""
    for key in list(os.environ):
        if key.startswith("DRA_AGENT_") or key in ("NODE_NAME", "KUBECONFIG"):
            monkeypatch.delenv(key)

    def run(*args: str) -> CliResult:
        out, err = io.StringIO(), io.StringIO()
        monkeypatch.setattr("sys.stdout", out)
        monkeypatch.setattr("sys.stderr", err)
        code = main(list(args))
        return CliResult(code, out.getvalue(), err.getvalue())

    return run
