"""`.ci/run --help` says what the CI entry point does and does nothing else (it deletes and rebuilds .venv, installs
packages): run from a copy of the script, with apt-get a stand-in that records a call, its .venv is untouched."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.repository import ROOT
from tests.support.timing import scaled


def run_copy(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci/run", tmp_path / ".ci/run")
    sentinel = tmp_path / ".venv" / "kept"
    sentinel.parent.mkdir()
    sentinel.write_text("")
    stubs, called = tmp_path / "stubs", tmp_path / "apt-get-called"
    stubs.mkdir()
    for tool in ("apt-get", "go"):
        stub = stubs / tool
        stub.write_text(f"#!/bin/sh\ntouch {called}\nexit 1\n")
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}:/usr/bin:/bin"}
    done = subprocess.run(["bash", str(tmp_path / ".ci/run"), *args], capture_output=True, text=True, env=env,
                          timeout=scaled(30))
    return done, sentinel, called


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_usage_and_touches_nothing(tmp_path: Path, flag: str) -> None:
    done, sentinel, called = run_copy(tmp_path, flag)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: .ci/run\n")
    assert "removes .venv" in done.stdout.replace("\n", " ")
    assert sentinel.exists() and not called.exists()


def test_an_argument_it_does_not_take_is_refused_and_touches_nothing(tmp_path: Path) -> None:
    done, sentinel, called = run_copy(tmp_path, "--fast")
    assert done.returncode == 2
    assert ".ci/run: unknown argument --fast" in done.stderr and "usage: .ci/run" in done.stderr
    assert sentinel.exists() and not called.exists()
