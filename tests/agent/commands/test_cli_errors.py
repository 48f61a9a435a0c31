"""The command line fails early and clearly: each mistake a newcomer makes gets a message that names what is wrong
and the exit status docs/configuration.md documents (2 for bad input), before anything is started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.commands.cli import main
from agent.node.simulated import PROFILES
from simulator.node.profile import builtin_profiles
from tests.support.timing import scaled

BAD_INPUT = 2


def dra_agent(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`dra-agent ARGS` as a process, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True, text=True, env=env,
                          timeout=scaled(60))


def test_a_missing_kubeconfig_is_named_before_anything_starts(scratch: Path) -> None:
    missing = scratch / "nonexistent"
    done = dra_agent("run", "--simulate", "gke-g2-l4", "--kubeconfig", str(missing), "--log-format", "json",
                     "--state-dir", str(scratch / "state"))
    assert done.returncode == BAD_INPUT, done.stderr
    assert f"kubeconfig {missing} does not exist" in done.stderr
    assert "current-context" not in done.stderr
    assert not (scratch / "state").exists(), "nothing was started"


def test_no_credentials_at_all_says_where_they_were_looked_for(scratch: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("KUBECONFIG", "DRA_AGENT_KUBECONFIG", "KUBERNETES_SERVICE_HOST")} | {"HOME": str(scratch)}
    done = dra_agent("run", "--simulate", "gke-g2-l4", "--log-format", "json", env=env)
    assert done.returncode == BAD_INPUT, done.stderr
    assert (f"no Kubernetes credentials: not in a cluster (no service account token) and no kubeconfig at "
            f"{scratch}/.kube/config; give --kubeconfig FILE or set KUBECONFIG") in done.stderr


def test_an_invalid_kubeconfig_says_what_is_wrong_with_it(scratch: Path) -> None:
    kubeconfig = scratch / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\nclusters: []\n")
    done = dra_agent("run", "--simulate", "gke-g2-l4", "--kubeconfig", str(kubeconfig), "--log-format", "json")
    assert done.returncode == BAD_INPUT, done.stderr
    assert f"kubeconfig {kubeconfig} is not usable" in done.stderr
    assert "current-context" in done.stderr  # the client's own words for what the file lacks


@pytest.mark.parametrize("command", ["backends", "discover", "run"])
def test_an_unknown_backend_fails_naming_it_and_the_installed_ones(command: str) -> None:
    done = dra_agent(command, "--simulate", "gke-g2-l4", "--backends", "nvidia-gpu,foo")
    assert done.returncode == BAD_INPUT, done.stdout + done.stderr
    assert "unknown backend(s) foo; installed backends: nvidia-gpu, nvidia-mig, sriov-nic, tpu" in done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize("command", ["discover", "backends", "run", "demo"])
def test_an_unknown_flag_prints_the_usage_of_its_command(command: str) -> None:
    done = dra_agent(command, "--bogus")
    assert done.returncode == BAD_INPUT
    assert done.stderr.startswith(f"usage: dra-agent {command} ")
    assert f"dra-agent {command}: error: unrecognized arguments: --bogus" in done.stderr


def test_an_unknown_demo_profile_fails_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--profile", "nope", "--color", "never"]) == BAD_INPUT
    out, err = capsys.readouterr()
    assert out == "", "no story begun, no agent started"
    assert "unknown profile 'nope'; built-in profiles: a2-highgpu-1g, dgx-h100" in err
    assert "log" not in err


def test_an_invalid_demo_profile_file_fails_before_anything_starts(
        scratch: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = scratch / "node.yaml"
    profile.write_text("name: Not_A_Name\nroot_complexes: []\n")
    assert main(["demo", "--profile", str(profile), "--color", "never"]) == BAD_INPUT
    out, err = capsys.readouterr()
    assert out == ""
    assert str(profile) in err and "root_complexes" in err


def test_the_help_lists_the_built_in_profiles(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("discover", "demo"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert ", ".join(builtin_profiles()) in text


def test_the_static_profile_list_is_the_simulators() -> None:
    """The CLI names the profiles without loading the simulator; they must be the ones it ships."""
    assert list(PROFILES) == builtin_profiles()
