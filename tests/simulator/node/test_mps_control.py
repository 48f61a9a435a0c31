"""The simulated node's `nvidia-cuda-mps-control`: daemon and client modes, the commands the agent uses, its log,
its pipe and log directories from the environment, and its place in the simulated driver root."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from simulator.node.driver_install import MPS_CONTROL, install_mps_control
from simulator.node.node import SimulatedNode
from tests.support.timing import scaled


class Mps:
    """The program in a driver root, run with one pipe and log directory."""

    def __init__(self, droot: Path, pipe: Path, log: Path) -> None:
        self.program = droot / "usr/bin" / MPS_CONTROL
        self.pipe, self.log = pipe, log
        self.env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(log)}

    def run(self, *args: str, commands: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.program), *args], input=commands, env=self.env, capture_output=True,
                              text=True, timeout=scaled(10), check=False)

    def control_log(self) -> str:
        return (self.log / "control.log").read_text()


@pytest.fixture
def mps(tmp_path: Path) -> Iterator[Mps]:
    droot = tmp_path / "driver"
    (droot / "usr/bin").mkdir(parents=True)
    install_mps_control(droot)
    # Longer than a unix socket path may be: the daemon must still listen in it.
    pipe = tmp_path / ("p" * 60) / ("q" * 60) / "pipe"
    made = Mps(droot, pipe, tmp_path / "log")
    yield made
    made.run(commands="quit\n")


def test_the_daemon_serves_its_pipe_takes_the_limits_and_quits(mps: Mps) -> None:
    started = mps.run("-d")
    assert started.returncode == 0, started.stderr
    assert (mps.pipe / "control").exists(), "the daemon listens once -d returns"
    answers = mps.run(commands="set_default_active_thread_percentage 40\nget_default_active_thread_percentage\n"
                               "set_default_device_pinned_mem_limit GPU-1 2048M\n"
                               "get_default_device_pinned_mem_limit GPU-1\nget_default_device_pinned_mem_limit 0\n")
    assert answers.returncode == 0, answers.stderr
    assert answers.stdout.split("\n") == ["40.0", "40.0", "2048M", "0M", ""]
    log = mps.control_log()
    assert f"Starting control daemon using socket {mps.pipe}/control" in log
    assert "] Cmd:set_default_active_thread_percentage 40\n" in log
    assert "] Cmd:set_default_device_pinned_mem_limit GPU-1 2048M\n" in log
    assert mps.run(commands="quit\n").returncode == 0
    deadline = time.monotonic() + scaled(5)
    while (mps.pipe / "control").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not (mps.pipe / "control").exists()
    assert mps.control_log().endswith("] Exit\n")
    gone = mps.run(commands="get_default_active_thread_percentage\n")
    assert gone.returncode == 1 and "Cannot find MPS control daemon process" in gone.stderr


def test_bad_commands_are_answered_not_obeyed(mps: Mps) -> None:
    assert mps.run("-d").returncode == 0
    answers = mps.run(commands="set_default_active_thread_percentage 0\nset_default_device_pinned_mem_limit 0 2Gi\n"
                               "launch_rockets\nget_default_active_thread_percentage\n")
    assert answers.stdout.split("\n")[:4] == ["Invalid percentage 0", "Invalid memory limit 2Gi",
                                              "Unrecognized command launch_rockets", "100.0"]


def test_in_the_foreground_sigterm_ends_it(mps: Mps) -> None:
    process = subprocess.Popen([str(mps.program), "-f"], env=mps.env)
    try:
        deadline = time.monotonic() + scaled(10)
        while not (mps.pipe / "control").exists():
            assert time.monotonic() < deadline, "the daemon never listened"
            time.sleep(0.02)
        assert mps.run(commands="get_default_active_thread_percentage\n").stdout == "100.0\n"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=scaled(5)) == 0
        assert not (mps.pipe / "control").exists()
    finally:
        process.kill()
        process.wait()


def test_the_simulated_driver_root_ships_it(sim_node: Callable[[str], SimulatedNode]) -> None:
    node = sim_node("dgx-h100")
    program = node.driver_root / "usr/bin" / MPS_CONTROL
    assert os.access(program, os.X_OK)
    assert program.read_text().startswith("#!/") and "def run_daemon" in program.read_text()
