"""What an uninstall leaves on a node, as docs/deploy.md lists it: a node drained of claims (each unprepared, as the
kubelet does when their pods go) and its agent stopped keeps no CDI spec, no socket, no vfio-pci binding, no MIG
device and no changed compute mode; what stays is the agent's state directory (journals with no claim in them),
the kubelet plugin folders with their lock files, and the VF counts the agent set."""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Mapping
from pathlib import Path

from agent.claims.checkpoint import Checkpoint
from simulator.apiserver.server import TestApiServer
from simulator.kubelet import KubeletSimulator
from tests.support.agent_env import NODE, AgentProcess, allocate, journal_entries, settings_for
from tests.support.mig_env import dgx_h100_in_mig_mode
from tests.support.timing import scaled

GPU, SRIOV = "gpu.nvidia.com", "sriov.dra-agent.io"
VFIO = {"apiVersion": "dra-agent.io/v1alpha1", "kind": "VfioConfig"}
EXCLUSIVE = {"apiVersion": "dra-agent.io/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "ExclusiveProcess"}}
PF, VF = "0000:19:00.0", "0000:19:00.1"


def config(driver: str, parameters: Mapping[str, object]) -> list[dict[str, object]]:
    return [{"source": "FromClaim", "requests": ["dev"], "opaque": {"driver": driver, "parameters": parameters}}]


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir())


def driver_of(sim: Path, bus_id: str) -> str:
    return os.path.basename(os.readlink(sim / "sys/bus/pci/devices" / bus_id / "driver"))


async def test_a_drained_node_keeps_only_the_agents_records_and_vf_counts(scratch: Path) -> None:
    profile = dgx_h100_in_mig_mode(scratch)
    async with TestApiServer() as server:
        server.add_node(NODE)
        settings = settings_for(scratch, server.write_kubeconfig(scratch / "kubeconfig"), str(profile))
        sim = settings.sim_root
        assert sim is not None
        backend_config = {"nvidia-mig": {"mode": "dynamic"}, "sriov-nic": {"numVfs": [{"pf": PF, "count": 4}]}}
        agent = AgentProcess(settings, {"DRA_AGENT_BACKEND_CONFIG": json.dumps(backend_config)})
        await agent.start()
        try:
            async with KubeletSimulator(settings.registry_dir) as kubelet:
                gpu = await kubelet.wait_for_plugin(GPU, timeout=scaled(60))
                nic = await kubelet.wait_for_plugin(SRIOV, timeout=scaled(60))
                claims = [
                    (gpu, allocate(server, "mig", [("dev", GPU, "gpu-0000-18-00-0-mig-1g10gb-19-0")])),
                    # A whole GPU taken out of MIG mode, in compute mode Exclusive Process.
                    (gpu, allocate(server, "whole", [("dev", GPU, "gpu-0000-1c-00-0")], config(GPU, EXCLUSIVE))),
                    (nic, allocate(server, "vm", [("dev", SRIOV, "vf-0000-19-00-1")], config(SRIOV, VFIO))),
                ]
                for plugin, claim in claims:
                    assert (await plugin.prepare([claim]))[claim.uid].error == "", claim
                assert driver_of(sim, VF) == "vfio-pci"
                # The drain: every pod gone, the kubelet unprepares its claims.
                for plugin, claim in claims:
                    assert (await plugin.unprepare([claim]))[claim.uid] == ""
            await agent.signal(signal.SIGTERM)
            assert await agent.wait() == 0, agent.output()
        finally:
            await agent.stop()
    assert files(settings.cdi_dir) == [], "no CDI spec"
    assert files(settings.registry_dir) == [], "no registration socket"
    assert files(settings.plugins_dir) == [f"{GPU}/serialize.lock", f"{SRIOV}/serialize.lock"]
    state = files(settings.state_dir)
    assert {f"{GPU}/checkpoint.journal", f"{SRIOV}/checkpoint.journal"} <= set(state)
    for driver in (GPU, SRIOV):
        journal = Checkpoint(settings.state_dir / driver / "checkpoint.journal", "boot")
        journal.load()
        assert journal.claims == {}, f"{driver}: no claim left prepared"
    for name in state:
        if name.startswith("backends/"):
            assert journal_entries(settings.state_dir / name) == {}, f"{name}: nothing left to undo"
    # docs/deploy.md's list: the drivers' journals, the instance registry, the backends' journals and their locks.
    layout = re.compile(r"[a-z.-]+/checkpoint\.journal|instances/\.register|backends/[a-z-]+/\.?[a-z-]+\.json(\.lock)?")
    assert [name for name in state if not layout.fullmatch(name)] == []
    assert driver_of(sim, VF) == "mlx5_core", "back on its driver"
    gpus = json.loads((sim / ".sim/nvml-mig.json").read_text())  # the simulated GPUs' state, kept across runs
    assert [g["gpu_instances"] for g in gpus] == [[]] * 8, "no MIG device left"
    assert [(g["mig_enabled"], g["compute_mode"]) for g in gpus] == [(True, 0)] * 8, "MIG modes and compute modes back"
    assert (sim / "sys/bus/pci/devices" / PF / "sriov_numvfs").read_text().strip() == "4", \
        "the VF count the agent set stays"
    # docs/deploy.md's list: the drivers' journals, the instance registry, the backends' journals and their locks.
    layout = re.compile(r"[a-z.-]+/checkpoint\.journal|instances/\.register|backends/[a-z-]+/\.?[a-z-]+\.json(\.lock)?")
    assert [name for name in state if not layout.fullmatch(name)] == []
