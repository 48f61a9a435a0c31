"""`dra-agent run` on a node that is not simulated (no `--simulate`: the agent is only told where the host's sysfs,
/dev and driver files are) serves every backend without loading a single module of the `simulator` package.

The node is still one the simulator lays out, served from this test process, but the agent cannot tell it from a
real host: it reads its trees and loads its NVML library as it would on a GPU node. Which modules the agent loaded
comes from the interpreter itself (`python -X importtime`), not from the agent's cooperation.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

from simulator.apiserver.server import TestApiServer
from simulator.kubelet import KubeletSimulator
from simulator.node.node import simulated_node
from tests.support.agent_env import NODE, wait_until
from tests.support.timing import scaled

GPU, NIC = "gpu.nvidia.com", "sriov.dra-agent.io"


def nvidia_gpus(sysfs: Path) -> set[str]:
    """PCI addresses of the node's NVIDIA GPUs (vendor 0x10de, display class), as sysfs lists them."""
    return {f.name for f in (sysfs / "bus/pci/devices").iterdir()
            if (f / "vendor").read_text().strip() == "0x10de" and (f / "class").read_text().startswith("0x03")}


def published(server: TestApiServer) -> set[str]:
    """PCI addresses of the GPUs in the node's ResourceSlices."""
    return {d["attributes"]["resource.kubernetes.io/pciBusID"]["string"]
            for s in server.objects("resourceslices") if s["spec"]["driver"] == GPU
            for d in s["spec"].get("devices", [])}


def imported_modules(stderr: str) -> set[str]:
    """Module names from `-X importtime` lines ("import time: self | cumulative | name")."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")
            and "|" in line} - {"imported package"}


async def test_a_real_run_serves_every_backend_and_loads_none_of_the_simulator(scratch: Path) -> None:
    root = scratch / "node"
    with simulated_node("dgx-h100", root) as node:
        async with TestApiServer() as server:
            server.add_node(NODE)
            kubeconfig = server.write_kubeconfig(scratch / "kubeconfig")
            log = scratch / "agent.err"
            with log.open("wb") as err:
                agent = await asyncio.create_subprocess_exec(
                    sys.executable, "-X", "importtime", "-m", "agent", "run", "--node-name", NODE,
                    "--sysfs-root", str(node.sysfs), "--dev-root", str(node.dev), "--host-root", str(node.root),
                    "--kubeconfig", str(kubeconfig), "--registry-dir", str(scratch / "reg"),
                    "--plugins-dir", str(scratch / "plugins"), "--cdi-dir", str(scratch / "cdi"),
                    "--state-dir", str(scratch / "state"), "--log-format", "json", "--log-level", "warning",
                    stdout=err, stderr=err,
                )
            try:
                async with KubeletSimulator(scratch / "reg") as kubelet:
                    try:
                        for driver in (GPU, NIC):
                            await kubelet.wait_for_plugin(driver, timeout=scaled(60))
                    except TimeoutError:
                        raise AssertionError(log.read_text()) from None
                expected = nvidia_gpus(node.sysfs)
                try:
                    await wait_until(lambda: published(server) == expected, timeout=scaled(30))
                except TimeoutError:
                    raise AssertionError(f"GPUs published {published(server)}, not {expected}") from None
                agent.send_signal(signal.SIGTERM)
                async with asyncio.timeout(scaled(30)):
                    assert await agent.wait() == 0, log.read_text()
            finally:
                if agent.returncode is None:
                    agent.kill()
                    await agent.wait()
    loaded = imported_modules(log.read_text())
    assert {"agent.daemon", "agent.claims.preparer", "backends.nvidia.nvml", "pynvml"} <= loaded, \
        "the import log covers the whole run"
    assert not {m for m in loaded if m == "simulator" or m.startswith("simulator.")}, sorted(
        m for m in loaded if m.startswith("simulator"))
