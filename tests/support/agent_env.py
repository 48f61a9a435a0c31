"""Running the whole agent for tests: in this process, or as a `dra-agent run` process that can be killed.

Both talk to a TestApiServer through a kubeconfig and serve the kubelet simulator over real unix sockets, on
a simulated node kept in `root/node` so a restarted agent finds the same hardware.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.daemon import Agent
from agent.kube.client import KubeClient
from agent.node.host import open_host
from agent.settings import Settings
from backends.contract import ClaimRef
from simulator.apiserver.server import TestApiServer
from simulator.kernel.services import served_nvml
from simulator.kubelet import KubeletSimulator
from simulator.kubelet_connection import Plugin
from simulator.nvml.api import SimulatedNvml
from tests.support.timing import scaled

NODE = "node-a"


@contextmanager
def memory_dir(prefix: str) -> Iterator[Path]:
    """A short-named empty directory in RAM when possible (this machine's disk makes file creation slow), named
    by a link below /tmp: umockdev's preload takes every path below /dev for a device node, so a simulated node
    watched through it must not be reached through /dev/shm."""
    if not os.access("/dev/shm", os.W_OK):
        path = Path(tempfile.mkdtemp(prefix=prefix))
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)
        return
    real = Path(tempfile.mkdtemp(prefix=prefix, dir="/dev/shm"))
    link = Path(tempfile.gettempdir()) / real.name
    try:
        link.symlink_to(real)
        yield link
    finally:
        link.unlink(missing_ok=True)
        shutil.rmtree(real, ignore_errors=True)


ALL_RECONFIGURATIONS = ("VfioConfig", "GpuConfig.sharing.TimeSlicing", "GpuConfig.sharing.ExclusiveProcess",
                        "GpuConfig.sharing.MPS", "VfConfig.netDevice")
"""Every reconfiguration the built-in backends know: the tests of the reconfigurations themselves run on nodes that
allow them (tests/agent/claims/test_allowed_configs.py shows a node that does not)."""


def settings_for(root: Path, kubeconfig: Path, profile: str, **extra: Any) -> Settings:
    values: dict[str, Any] = {
        "node_name": NODE, "simulate": profile, "sim_root": root / "node", "kubeconfig": kubeconfig,
        "registry_dir": root / "reg", "plugins_dir": root / "plugins", "cdi_dir": root / "cdi",
        "state_dir": root / "state", "log_level": "warning", "allowed_configs": ALL_RECONFIGURATIONS,
    }
    return Settings(**(values | extra))


def flags_for(settings: Settings) -> list[str]:
    """The command line that gives `dra-agent run` these settings."""
    flags = ["--node-name", str(settings.node_name), "--simulate", str(settings.simulate),
             "--sim-root", str(settings.sim_root), "--kubeconfig", str(settings.kubeconfig),
             "--registry-dir", str(settings.registry_dir), "--plugins-dir", str(settings.plugins_dir),
             "--cdi-dir", str(settings.cdi_dir), "--state-dir", str(settings.state_dir),
             "--log-format", "json", "--log-level", settings.log_level]
    if settings.pod_uid:
        flags += ["--pod-uid", settings.pod_uid]
    if settings.backends:
        flags += ["--backends", ",".join(settings.backends)]
    if settings.metrics_address:
        flags += ["--metrics-address", settings.metrics_address]
    if settings.cdi_host_root != Path("/"):
        flags += ["--cdi-host-root", str(settings.cdi_host_root)]
    for name in ("reap_interval", "reap_grace"):
        value = getattr(settings, name)
        if value != Settings.model_fields[name].default:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    if settings.driver_root:
        flags += ["--driver-root", str(settings.driver_root)]
    if not settings.claim_status:
        flags += ["--no-claim-status"]
    if settings.device_metadata:
        flags += ["--device-metadata"]
    if settings.allowed_configs:
        flags += ["--allowed-configs", ",".join(settings.allowed_configs)]
    return flags


def allocate(server: TestApiServer, name: str, results: list[tuple[str, str, str]],
             configs: list[dict[str, Any]] | None = None, namespace: str = "default", admin: bool = False) -> ClaimRef:
    """Store an allocated claim in the API server, as the scheduler would leave it; the kubelet's reference. With
    `admin` every request asks for (and every result has) admin access."""
    uid = str(uuid.uuid4())
    access = {"adminAccess": True} if admin else {}
    server.put_claim({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": uid},
        "spec": {"devices": {"requests": [{"name": r, "exactly": {"deviceClassName": d, **access}}
                                          for r, d, _ in results]}},
        "status": {"allocation": {"devices": {
            "results": [{"request": r, "driver": d, "pool": NODE, "device": dev, **access} for r, d, dev in results],
            "config": configs or [],
        }}},
    })
    return ClaimRef(uid, namespace, name)


@dataclass
class InProcess:
    agent: Agent
    server: TestApiServer
    settings: Settings


@asynccontextmanager
async def agent_in_process(root: Path, profile: str = "dgx-h100", **extra: Any) -> AsyncIterator[InProcess]:
    async with AsyncExitStack() as stack:
        server = await stack.enter_async_context(TestApiServer())
        server.add_node(NODE)
        settings = settings_for(root, server.write_kubeconfig(root / "kubeconfig"), profile, **extra)
        host = stack.enter_context(open_host(settings))
        kube = await KubeClient.connect(settings.kubeconfig)
        stack.push_async_callback(kube.close)
        agent = Agent(settings, host, kube)
        stack.push_async_callback(agent.stop)
        await agent.start()
        yield InProcess(agent, server, settings)


@dataclass
class TwoAgents:
    """A node served by one `dra-agent run` process, then by a second on the same state, files and hardware,
    after the first crashed or was killed; the kubelet simulator watches both."""

    server: TestApiServer
    settings: Settings
    first: AgentProcess
    second: AgentProcess
    kubelet: KubeletSimulator


@asynccontextmanager
async def two_agents(root: Path, profile: str, *, env: dict[str, str] | None = None, failpoint: str | None = None,
                     **extra: Any) -> AsyncIterator[TwoAgents]:
    """The first agent started (crashing at `failpoint`, if given) and the kubelet simulator watching; the test
    starts the second. Both are stopped at the end."""
    async with TestApiServer() as server:
        server.add_node(NODE)
        settings = settings_for(root, server.write_kubeconfig(root / "kubeconfig"), profile, **extra)
        crash = {"DRA_AGENT_FAILPOINTS": failpoint} if failpoint else {}
        first, second = AgentProcess(settings, {**(env or {}), **crash}), AgentProcess(settings, env)
        try:
            await first.start()
            async with KubeletSimulator(settings.registry_dir) as kubelet:
                yield TwoAgents(server, settings, first, second, kubelet)
        finally:
            await first.stop()
            await second.stop()


class AgentProcess:
    """`dra-agent run` as a child process."""

    def __init__(self, settings: Settings, env: dict[str, str] | None = None) -> None:
        self.settings = settings
        self.env = {**os.environ, **(env or {})}
        self.process: asyncio.subprocess.Process | None = None
        self.log = Path(str(settings.state_dir) + ".log")

    async def start(self) -> None:
        self.settings.state_dir.parent.mkdir(parents=True, exist_ok=True)
        log = self.log.open("ab")
        try:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "agent", "run", *flags_for(self.settings), env=self.env,
                stdout=log, stderr=log,
            )
        finally:
            log.close()

    async def signal(self, signum: int = signal.SIGTERM) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    async def wait(self, timeout: float = scaled(15)) -> int:
        assert self.process is not None
        async with asyncio.timeout(timeout):
            return await self.process.wait()

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


async def wait_until(predicate: Any, timeout: float = scaled(10), interval: float = 0.02) -> None:
    """Poll a condition of the outside world (files, API objects) until it holds."""
    async with asyncio.timeout(timeout):
        while not predicate():  # noqa: ASYNC110 - nothing to wait on: the condition is outside this process
            await asyncio.sleep(interval)


async def plugin_after_restart(kubelet: KubeletSimulator, before: Plugin) -> Plugin:
    """The restarted agent's registration (its socket re-created; a fast restart may replace the old one between
    two scans of the registry, so "deregistered" alone could be missed)."""
    async with asyncio.timeout(scaled(30)):
        # The simulator polls the registry: there is no event to wait on but its next scan.
        while (plugin := await kubelet.wait_for_plugin(before.driver, timeout=scaled(30))) is before:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    return plugin


def simulated_nvml(env: InProcess) -> SimulatedNvml:
    """The NVML state of the node an in-process agent runs on (served from this process)."""
    return served_nvml(env.agent.host.host_root)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def metrics_of(address: str) -> dict[str, float]:
    """An agent's /metrics samples, by their text form (`name{labels}`)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=scaled(5)) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def served_metrics(address: str) -> dict[str, float]:
    """`metrics_of`, or nothing while the agent does not serve its metrics yet (it starts serving them once its
    drivers have started, so after they registered with the kubelet)."""
    try:
        return metrics_of(address)
    except urllib.error.URLError:
        return {}


def lose_claims(settings: Settings, driver: str) -> None:
    """Every record of the driver's prepared claims gone, checkpoint and CDI specs alike (a wiped state directory and
    CDI tmpfs): what a backend made on the hardware for them is known only from the backend's own records."""
    (settings.state_dir / driver / "checkpoint.journal").unlink()
    for spec in settings.cdi_dir.glob(f"k8s.{driver}-claim_*"):
        spec.unlink()


def metadata_file(settings: Settings, driver: str, namespace: str, claim: str, request: str) -> Path:
    """Where an agent with `device_metadata` on writes a claim request's device metadata file on the host."""
    return settings.plugins_dir / driver / "dra-device-metadata" / f"{namespace}_{claim}" / request / "metadata.json"


def metadata_spec(settings: Settings, driver: str, claim_uid: str, request: str) -> Path:
    """The CDI spec that mounts a claim request's device metadata file into its containers."""
    return settings.cdi_dir / f"{driver}_metadata_{claim_uid}_{request}.json"


def journal_entries(path: Path) -> dict[str, Any]:
    """A backend journal (backends/journal.py) replayed read-only, as a test looks at it: key → entry."""
    entries: dict[str, Any] = {}
    for line in path.read_text().splitlines() if path.exists() else ():
        record = json.loads(line)
        if "put" in record:
            entries[record["put"][0]] = record["put"][1]
        else:
            entries.pop(record["remove"], None)
    return entries


@dataclass
class ServedNode:
    """`dra-agent run` serving a simulated node's GPUs, with the test API server, the kubelet simulator's connection
    to its GPU driver and its metrics address."""

    server: TestApiServer
    agent: AgentProcess
    kubelet: KubeletSimulator
    plugin: Plugin
    metrics_address: str

    def gpu(self) -> str:
        """The first GPU the agent published."""
        name: str = self.server.objects("resourceslices")[0]["spec"]["devices"][0]["name"]
        return name

    def claim_events(self, claim: str) -> list[dict[str, Any]]:
        return [e for e in self.server.events() if e["regarding"].get("name") == claim]

    def metric(self, sample: str) -> float:
        return metrics_of(self.metrics_address).get(sample, 0.0)


@asynccontextmanager
async def served_node(root: Path, profile: str = "gke-g2-l4", driver: str = "gpu.nvidia.com",
                      wait: float = scaled(30.0), **extra: Any) -> AsyncIterator[ServedNode]:
    """An agent process on `profile` (`extra` settings added), registered for `driver` with the kubelet simulator
    and its slices published; stopped at the end. Its output is printed when the start fails."""
    async with AsyncExitStack() as stack:
        server = await stack.enter_async_context(TestApiServer())
        server.add_node(NODE)
        settings = settings_for(root, server.write_kubeconfig(root / "kubeconfig"), profile,
                                log_level="info", metrics_address=f"127.0.0.1:{free_port()}", **extra)
        agent = AgentProcess(settings)
        await agent.start()
        stack.push_async_callback(agent.stop)
        kubelet = await stack.enter_async_context(KubeletSimulator(settings.registry_dir))
        try:
            plugin = await kubelet.wait_for_plugin(driver, timeout=wait)
            await wait_until(lambda: server.objects("resourceslices"), timeout=wait)
        except BaseException:
            print(agent.output())
            raise
        yield ServedNode(server, agent, kubelet, plugin, str(settings.metrics_address))
