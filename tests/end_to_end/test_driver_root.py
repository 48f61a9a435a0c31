"""`dra-agent run` on a simulated node laid out as deploy/base/20-daemonset.yaml mounts the host: the host's root
seen at one folder (the node's root), the NVIDIA driver either installed there or in a GPU operator's driver container
(`--driver-root <host root>/run/nvidia/driver`). NVML is found through the driver root's ld.so.cache, CDI specs
name the paths the container runtime on the host sees, and GPUs whose NVML cannot be used are an error the
operator sees (log, metric, /readyz) while the other backends serve on, until the driver is there."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from simulator.apiserver.server import TestApiServer
from simulator.kubelet import KubeletSimulator
from simulator.node.driver_install import install_driver
from simulator.node.layout import plan_node
from simulator.node.profile import load_profile
from simulator.nvml.control import request
from tests.support.agent_env import NODE, AgentProcess, allocate, free_port, settings_for, wait_until
from tests.support.cdi_schema import cdi_schema_errors
from tests.support.timing import scaled

GPU, NIC = "gpu.nvidia.com", "sriov.dra-agent.io"
START = scaled(60.0)  # seconds an agent process gets to start and publish on a loaded machine
VERSION = "580.95.05"
LIBRARIES = "/usr/lib/x86_64-linux-gnu"
RETRY = {"DRA_AGENT_BACKEND_CONFIG": json.dumps({"nvidia-gpu": {"nvmlRetrySeconds": 1}})}


def profile_file(folder: Path, **nvidia: Any) -> Path:
    """A node with one T4 GPU and a ConnectX-6 Dx NIC with two VFs; `nvidia` sets the driver's layout and state."""
    path = folder / "node.yaml"
    path.write_text(yaml.safe_dump({
        "name": "gpu-and-nic", "nvidia": {"driver_version": VERSION, **nvidia},
        "root_complexes": [{"numa_node": 0, "ports": [
            {"gpu": "Tesla-T4"}, {"nic": {"model": "ConnectX-6Dx", "sriov": {"total_vfs": 8, "num_vfs": 2}}}]}],
    }))
    return path


@dataclass
class Run:
    server: TestApiServer
    agent: AgentProcess
    kubelet: KubeletSimulator
    root: Path
    metrics: str

    async def get(self, path: str) -> tuple[int, str]:
        """GET from the agent's metrics endpoint, once it serves (it starts serving after its drivers start)."""
        async with asyncio.timeout(scaled(30)):
            while True:
                try:
                    async with aiohttp.ClientSession() as http, http.get(f"{self.metrics}{path}") as response:
                        return response.status, await response.text()
                except aiohttp.ClientConnectorError:
                    await asyncio.sleep(0.05)

    def slices(self, driver: str) -> list[dict[str, Any]]:
        return [s for s in self.server.objects("resourceslices") if s["spec"]["driver"] == driver]

    def errors(self) -> list[dict[str, Any]]:
        lines = (json.loads(line) for line in self.agent.output().splitlines() if line.startswith("{"))
        return [line for line in lines if line.get("level") == "error"]


@asynccontextmanager
async def agent_on(scratch: Path, profile: Path, layout: str) -> AsyncIterator[Run]:
    """`dra-agent run` with the node's root as its host root and, for the container layout, the driver container's
    root as its driver root, as the DaemonSet's --host-root=/host --driver-root=/host/run/nvidia/driver."""
    async with TestApiServer() as server:
        server.add_node(NODE)
        root = scratch / "node"
        driver_root = root / "run/nvidia/driver" if layout == "container" else None
        metrics = f"127.0.0.1:{free_port()}"
        settings = settings_for(scratch, server.write_kubeconfig(scratch / "kubeconfig"), str(profile),
                                backends=("nvidia-gpu", "sriov-nic"), driver_root=driver_root,
                                metrics_address=metrics)
        agent = AgentProcess(settings, RETRY)
        try:
            await agent.start()
            async with KubeletSimulator(settings.registry_dir) as kubelet:
                try:
                    await kubelet.wait_for_plugin(NIC, timeout=START)
                except TimeoutError:
                    raise AssertionError(agent.output()) from None
                yield Run(server, agent, kubelet, root, f"http://{metrics}")
        finally:
            await agent.stop()


def _device_node(layout: str, name: str) -> dict[str, str]:
    if layout == "host":
        return {"path": f"/dev/{name}"}
    return {"path": f"/dev/{name}", "hostPath": f"/run/nvidia/driver/dev/{name}"}


@pytest.mark.parametrize("layout", ["host", "container"])
async def test_gpus_are_found_through_the_driver_root_and_specs_name_host_paths(scratch: Path, layout: str) -> None:
    async with agent_on(scratch, profile_file(scratch, layout=layout), layout) as run:
        plugin = await run.kubelet.wait_for_plugin(GPU, timeout=START)
        await wait_until(lambda: run.slices(GPU), timeout=START)
        gpu = run.slices(GPU)[0]["spec"]["devices"][0]
        assert gpu["attributes"]["driverVersion"] == {"version": "580.95.5"}, "NVML answered through the library"
        claim = allocate(run.server, "train", [("gpu", GPU, gpu["name"])])
        assert (await plugin.prepare([claim]))[claim.uid].error == ""
        spec = json.loads(next((scratch / "cdi").glob(f"*{claim.uid}*")).read_text())
        assert cdi_schema_errors(spec) == []
        prefix = "/run/nvidia/driver" if layout == "container" else ""
        mounts = {(m["hostPath"], m["containerPath"]) for m in spec["containerEdits"]["mounts"]}
        for library in ("libcuda.so", "libnvidia-ml.so"):
            versioned = f"{LIBRARIES}/{library}.{VERSION}"
            assert (prefix + versioned, versioned) in mounts
            assert (prefix + versioned, f"{LIBRARIES}/{library}.1") in mounts
        assert (f"{prefix}/usr/bin/nvidia-smi", "/usr/bin/nvidia-smi") in mounts
        assert all((run.root / host.lstrip("/")).exists() for host, _ in mounts), "the host has every file named"
        assert spec["containerEdits"]["deviceNodes"] == [_device_node(layout, n)
                                                         for n in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")]
        assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [_device_node(layout, "nvidia0")]
        assert await run.get("/readyz") == (200, "ready\n")


HOSTILE = {
    # A driver container that has not come up: its root is not there at all.
    "driver root missing": ({"layout": "container", "installed": False}, "container"),
    # A host whose driver is not installed where the agent was told to look.
    "library missing": ({"layout": "host", "installed": False}, "host"),
    # The library is there, the kernel module is not loaded: nvmlInit fails.
    "driver not loaded": ({"layout": "host", "loaded": False}, "host"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
async def test_gpus_without_usable_nvml_are_an_error_the_operator_sees_until_nvml_can_be_used(
        scratch: Path, case: str) -> None:
    nvidia, layout = HOSTILE[case]
    profile = profile_file(scratch, **nvidia)
    async with agent_on(scratch, profile, layout) as run:
        await wait_until(lambda: run.slices(NIC), timeout=START)  # the NIC backend serves on
        await wait_until(lambda: any(e["event"] == "devices cannot be served" for e in run.errors()), timeout=START)
        error = next(e for e in run.errors() if e["event"] == "devices cannot be served")
        droot = run.root / "run/nvidia/driver" if layout == "container" else run.root
        gpus = [g.bus_id for g in plan_node(load_profile(str(profile))).gpus]
        assert (error["backend"], error["devices"]) == ("nvidia-gpu", gpus)
        reason = error["reason"]
        if case == "driver not loaded":
            assert "nvmlInit failed: Driver Not Loaded" in reason
            assert f"{droot}{LIBRARIES}/libnvidia-ml.so.{VERSION}: loaded" in reason
        else:
            assert f"no loadable libnvidia-ml.so.1 in the driver root {droot}" in reason
            assert f"{droot}/etc/ld.so.cache: No such file or directory" in reason
            for folder in ("usr/lib64", "usr/lib/x86_64-linux-gnu", "lib64", "lib/x86_64-linux-gnu", "usr/lib",
                           "lib"):
                assert f"{droot}/{folder}/libnvidia-ml.so.1: not found" in reason
        status, body = await run.get("/readyz")
        assert status == 503 and "gpu.nvidia.com: 1 device(s) cannot be served" in body and reason in body
        _, metrics = await run.get("/metrics")
        assert 'dra_agent_unserved_devices{backend="nvidia-gpu",driver="gpu.nvidia.com"} 1.0' in metrics
        assert not run.slices(GPU)

        # The driver comes: a driver container starts, the driver is installed, the module is loaded.
        if case == "driver not loaded":
            request(run.root, {"op": "driver", "loaded": True})
        else:
            install_driver(run.root, load_profile(str(profile)).nvidia, [0])
        await wait_until(lambda: run.slices(GPU), timeout=START)
        await run.kubelet.wait_for_plugin(GPU, timeout=START)
        async with asyncio.timeout(scaled(10)):  # the readiness follows the publication
            while (await run.get("/readyz"))[0] != 200:  # noqa: ASYNC110 - another process: poll its endpoint
                await asyncio.sleep(0.05)
        assert await run.get("/readyz") == (200, "ready\n")
        _, metrics = await run.get("/metrics")
        assert 'dra_agent_unserved_devices{backend="nvidia-gpu",driver="gpu.nvidia.com"} 0.0' in metrics
