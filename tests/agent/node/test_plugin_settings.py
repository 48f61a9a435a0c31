"""A mistake in the settings stops the start with exit status 2, naming where the value came from: a misspelt field
in a backend's section, a section for a backend that is not installed, a reconfiguration no backend knows; a
misspelt DRA_AGENT_ variable is named in a warning. Shown through `dra-agent run` as an operator runs it."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from simulator.apiserver.server import TestApiServer
from tests.support.agent_env import NODE, AgentProcess, free_port, settings_for
from tests.support.cli_env import CliResult
from tests.support.timing import scaled

BAD_INPUT = 2


def readyz(address: str) -> str:
    try:
        with urllib.request.urlopen(f"http://{address}/readyz", timeout=scaled(5)) as response:
            return f"{response.status} {response.read().decode()}"
    except urllib.error.HTTPError as e:
        return f"{e.code} {e.read().decode()}"
    except urllib.error.URLError as e:
        return f"not served: {e.reason}"


async def test_a_misspelt_field_in_a_backend_section_stops_run(scratch: Path) -> None:
    config = scratch / "config.yaml"
    config.write_text("backend_config:\n  nvidia-gpu:\n    ignoredXid: [13, 31, 43]\n")
    async with TestApiServer() as server:
        server.add_node(NODE)
        address = f"127.0.0.1:{free_port()}"
        settings = settings_for(scratch, server.write_kubeconfig(scratch / "kubeconfig"), "dgx-h100",
                                metrics_address=address)
        agent = AgentProcess(settings, {"DRA_AGENT_CONFIG": str(config)})
        await agent.start()
        try:
            code = await agent.wait(scaled(20))
        except TimeoutError:
            pytest.fail(f"dra-agent run kept running; /readyz: {readyz(address)}\n{agent.output()[-1500:]}")
        finally:
            await agent.stop()
    assert code == BAD_INPUT, agent.output()
    assert (f"backend_config.nvidia-gpu.ignoredXid (from config file {config}): unknown field of backend nvidia-gpu "
            "(did you mean ignoredXids?); its fields: ignoredXids, recheckSeconds, nvmlRetrySeconds, sharing"
            ) in agent.output()
    assert not (settings.state_dir).exists(), "nothing was started"
    assert not server.objects("resourceslices"), "nothing was published"


def test_a_section_for_a_backend_that_is_not_installed_is_named(run_cli: Callable[..., CliResult],
                                                                scratch: Path) -> None:
    config = scratch / "config.yaml"
    config.write_text("backend_config:\n  nvidia-gpus:\n    ignoredXids: [13]\n")
    done = run_cli("discover", "--simulate", "gke-g2-l4", "--config", str(config))
    assert done.code == BAD_INPUT and done.out == ""
    assert done.err == (
        "dra-agent: invalid settings:\n"
        f"  backend_config.nvidia-gpus (from config file {config}): no installed backend is named nvidia-gpus (did "
        "you mean nvidia-gpu?); installed backends: nvidia-gpu, nvidia-mig, sriov-nic, tpu\n")


def test_every_wrong_field_is_named_with_its_path_and_the_variable_it_came_from(
        run_cli: Callable[..., CliResult], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRA_AGENT_BACKEND_CONFIG", json.dumps({
        "sriov-nic": {"numVfs": [{"pf": "enp1s0f0", "cnt": 4}]},
        "nvidia-gpu": {"recheckSeconds": 0, "sharing": {"byMemry": True}},
    }))
    done = run_cli("backends", "--simulate", "gke-g2-l4")
    assert done.code == BAD_INPUT and done.out == ""
    where = "(from environment DRA_AGENT_BACKEND_CONFIG)"
    assert done.err.splitlines()[1:] == [
        f"  backend_config.sriov-nic.numVfs.0.count {where}: Field required",
        f"  backend_config.sriov-nic.numVfs.0.cnt {where}: unknown field of backend sriov-nic (did you mean count?); "
        "its fields: pf, count",
        f"  backend_config.nvidia-gpu.recheckSeconds = 0 {where}: Input should be greater than 0",
        f"  backend_config.nvidia-gpu.sharing.byMemry {where}: unknown field of backend nvidia-gpu (did you mean "
        "byMemory?); its fields: byMemory, memoryStep",
    ]


def test_a_section_of_an_installed_backend_left_out_of_backends_is_not_read(run_cli: Callable[..., CliResult],
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """One ConfigMap for nodes that run different backends: a node without nvidia-mig ignores its section."""
    monkeypatch.setenv("DRA_AGENT_BACKEND_CONFIG", json.dumps({"nvidia-mig": {"mode": "dynamic", "future": 1}}))
    done = run_cli("discover", "--simulate", "gke-g2-l4", "--backends", "nvidia-gpu", "-o", "json")
    assert done.code == 0, done.err


def test_an_unknown_reconfiguration_is_named_with_the_known_ones(run_cli: Callable[..., CliResult]) -> None:
    done = run_cli("run", "--simulate", "gke-g2-l4", "--allowed-configs", "VfioConfg,VfConfig.netDevice")
    assert done.code == BAD_INPUT
    assert done.err == (
        "dra-agent: invalid settings:\n"
        "  allowed_configs = VfioConfg (from flag --allowed-configs): no installed backend's claim parameters ask for "
        "this; known reconfigurations: GpuConfig.sharing.ExclusiveProcess, GpuConfig.sharing.MPS, "
        "GpuConfig.sharing.TimeSlicing, "
        "VfConfig.netDevice, VfioConfig\n")


def test_a_reconfiguration_of_a_backend_left_out_is_accepted(run_cli: Callable[..., CliResult],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """One settings file for nodes that run different backends: a NIC-only node takes the GPUs' allowances."""
    monkeypatch.setenv("DRA_AGENT_ALLOWED_CONFIGS", "GpuConfig.sharing.TimeSlicing")
    done = run_cli("discover", "--simulate", "gke-g2-l4", "--backends", "tpu", "-o", "json")
    assert done.code == 0, done.err


def test_a_misspelt_variable_is_named_in_a_warning(run_cli: Callable[..., CliResult],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRA_AGENT_LOGLEVEL", "debug")
    monkeypatch.setenv("DRA_AGENT_HOST_NET_NS", "off")
    monkeypatch.setenv("DRA_AGENT_CONFIG", "")  # the config file's variable is no setting, and no mistake
    done = run_cli("discover", "--simulate", "gke-g2-l4", "-o", "json", "--log-format", "json")
    assert done.code == 0, done.err
    warnings = [json.loads(line) for line in done.err.splitlines() if "environment variable ignored" in line]
    assert [(w["variable"], w["did_you_mean"], w["level"]) for w in warnings] == [
        ("DRA_AGENT_HOST_NET_NS", "DRA_AGENT_HOST_NETNS", "warning"),
        ("DRA_AGENT_LOGLEVEL", "DRA_AGENT_LOG_LEVEL", "warning"),
    ]
