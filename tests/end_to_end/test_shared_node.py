"""Two `dra-agent run` processes on one simulated node root, as the old and the new pod of a DaemonSet update share
one host: one simulated kernel and one GPU state serve both, and the kernel outlives the agent that started it
while the other is attached."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest

from simulator.node.variants import in_mig_mode
from simulator.nvml.control import request
from tests.support.agent_env import AgentProcess, allocate, wait_until
from tests.support.surge_env import kernels, made_on_node, surge
from tests.support.timing import scaled

GPU = "gpu.nvidia.com"
START = 60.0  # seconds two agent processes get to start on a loaded machine


async def test_one_kernel_and_one_gpu_state_serve_both_agents_and_outlive_the_first(scratch: Path) -> None:
    profile = in_mig_mode("dgx-h100", scratch)
    dynamic = {"DRA_AGENT_BACKEND_CONFIG": json.dumps({"nvidia-mig": {"mode": "dynamic"}})}
    async with surge(scratch, str(profile), dynamic, backends=("nvidia-mig",)) as (run, plugins):
        serving = kernels(run.root)
        assert len(serving) == 1, "the second agent attached to the first one's kernel"
        old, new = plugins[GPU]
        small = allocate(run.server, "small", [("mig", GPU, "gpu-0000-18-00-0-mig-1g10gb-19-2")])
        assert (await old.prepare([small]))[small.uid].error == ""
        assert made_on_node(run.root, "0000:18:00.0") == [("1g.10gb", 2, 1)]
        # The new agent's NVML is the same: the memory slices the old one took are taken for it too.
        overlapping = allocate(run.server, "overlap", [("mig", GPU, "gpu-0000-18-00-0-mig-2g20gb-14-2")])
        error = (await new.prepare([overlapping]))[overlapping.uid].error
        assert "overlaps a MIG device that exists" in error, error  # NVML's INSUFFICIENT_RESOURCES

        await run.old.signal(signal.SIGKILL)  # no clean-up of any kind
        assert await run.old.wait() == -signal.SIGKILL
        await asyncio.sleep(scaled(0.5))  # a window in which the kernel must not end: kept, and stretched
        assert kernels(run.root) == serving, "the kernel serves the new agent on"
        beside = allocate(run.server, "beside", [("mig", GPU, "gpu-0000-18-00-0-mig-1g10gb-19-3")])
        assert (await new.prepare([beside]))[beside.uid].error == ""
        assert made_on_node(run.root, "0000:18:00.0") == [("1g.10gb", 2, 1), ("1g.10gb", 3, 1)]
        retry = (await new.prepare([overlapping]))[overlapping.uid].error
        assert "overlaps a MIG device that exists" in retry, "what the old agent made is still there"

        await run.new.signal(signal.SIGTERM)
        assert await run.new.wait() == 0
        await wait_until(lambda: not kernels(run.root), timeout=scaled(15))  # nobody attached: it ended


async def test_an_injected_xid_reaches_the_event_sets_of_both_agents(scratch: Path) -> None:
    async with surge(scratch, "gke-n1-t4x2", backends=("nvidia-gpu",)) as (run, _):
        # Each agent's health watcher registers its own event set for every GPU.
        def both_watching() -> bool:
            delivered: int = request(run.root, {"op": "xid", "gpu": "0", "xid": 13})["delivered"]
            return delivered == 2

        await wait_until(both_watching, timeout=START)
        assert request(run.root, {"op": "xid", "gpu": "0", "xid": 48})["delivered"] == 2

        def saw_xid_48(agent: AgentProcess) -> bool:
            return any('"xid"' in line and '"48"' in line and "health changed" in line
                       for line in agent.output().splitlines())

        await wait_until(lambda: saw_xid_48(run.old) and saw_xid_48(run.new), timeout=START)


@pytest.mark.parametrize("agents", [1, 2])
async def test_a_sysfs_write_is_applied_once(scratch: Path, agents: int) -> None:
    """A VF bound to vfio-pci by a claim and given back: with a second agent attached, the same single kernel."""
    async with surge(scratch, "dgx-h100", backends=("sriov-nic", "nvidia-gpu")) as (run, _):
        if agents == 1:
            await run.new.signal(signal.SIGTERM)
            await run.new.wait()
        assert len(kernels(run.root)) == 1
        nics = [s for s in run.server.objects("resourceslices") if s["spec"]["driver"] == "sriov.dra-agent.io"]
        vf = next(d["name"] for s in nics for d in s["spec"]["devices"] if "vf" in d["name"])
        plugin = await run.kubelet.wait_for_plugin("sriov.dra-agent.io", timeout=START)
        vfio = {"source": "FromClaim", "requests": ["nic"], "opaque": {"driver": "sriov.dra-agent.io", "parameters": {
            "apiVersion": "dra-agent.io/v1alpha1", "kind": "VfioConfig"}}}
        claim = allocate(run.server, "pass", [("nic", "sriov.dra-agent.io", vf)], [vfio])
        assert (await plugin.prepare([claim]))[claim.uid].error == ""
        bus_id = vf.removeprefix("vf-").replace("-", ":", 1).replace("-", ":", 1).replace("-", ".")
        link = run.root / "sys/bus/pci/devices" / bus_id / "driver"
        assert os.path.basename(os.readlink(link)) == "vfio-pci"
        assert (await plugin.unprepare([claim]))[claim.uid] == ""
        assert os.path.basename(os.readlink(link)) == "mlx5_core"
