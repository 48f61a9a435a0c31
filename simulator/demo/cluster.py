"""The demo's cluster: the test API server, `dra-agent run` processes on simulated nodes, a kubelet simulator per
node and the structured allocator, with the few operations a scenario needs (make a claim, allocate it, prepare
it on its node, read its CDI spec, inject a device fault, release it).

Everything runs for real: the agents are child processes on their own simulated nodes, the kubelet simulator
talks gRPC to them over unix sockets, and the allocator and the agents talk HTTP to the API server.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from agent.claims.results import ClaimResult
from backends.contract import ClaimRef
from backends.nvidia.config import GpuConfig
from backends.sriov.vf_config import VfConfig
from backends.vfio import VfioConfig
from simulator.apiserver.server import TestApiServer
from simulator.kubelet import KubeletSimulator
from simulator.kubelet_connection import Plugin
from simulator.nvml.control import request as nvml_request
from simulator.scheduler.allocation import Allocation
from simulator.scheduler.allocator import Allocator
from simulator.timing import scaled

JsonObject = dict[str, Any]
START_TIMEOUT = scaled(60.0)
"""Seconds an agent of the demo may take to start: generous on an idle machine, stretched by the time factor."""


class DemoError(Exception):
    """The simulated cluster could not do what a scenario asked (an agent did not start, a call failed)."""


@dataclass
class DemoNode:
    """One simulated node: its `dra-agent run` process, its files and the kubelet simulator watching it."""

    name: str
    profile: str
    root: Path
    backend_config: Mapping[str, Any]
    settings: Mapping[str, str] = field(default_factory=dict)  # agent settings as DRA_AGENT_* variables
    process: asyncio.subprocess.Process | None = None
    kubelet: KubeletSimulator | None = None
    started_at: float = 0.0
    launched_at: float = 0.0
    """When the process was launched, by the wall clock its log's timestamps use."""
    ready_drivers: list[str] = field(default_factory=list)
    ready_after: float | None = None
    """Seconds from the launch to every pool complete and registered with the kubelet."""
    set_up: float | None = None
    """Seconds from the launch to the agent's start-up line: the interpreter, and building the simulated node (on
    this machine's first run, compiling the simulated NVML library too). What follows is the agent's own start."""

    @property
    def agent_start(self) -> float | None:
        """Seconds from the agent's start-up line to ready: what a real node's agent takes."""
        if self.ready_after is None or self.set_up is None:
            return None
        return self.ready_after - self.set_up

    @property
    def sim_root(self) -> Path:
        return self.root / "node"

    @property
    def cdi_dir(self) -> Path:
        return self.root / "cdi"

    @property
    def log(self) -> Path:
        return self.root / "agent.log"

    def flags(self, kubeconfig: Path) -> list[str]:
        return ["--node-name", self.name, "--simulate", self.profile, "--sim-root", str(self.sim_root),
                "--kubeconfig", str(kubeconfig), "--registry-dir", str(self.root / "registry"),
                "--plugins-dir", str(self.root / "plugins"), "--cdi-dir", str(self.cdi_dir),
                "--state-dir", str(self.root / "state"), "--log-format", "json", "--log-level", "info",
                # The demo shows every reconfiguration (passthrough, sharing, a VF's interface in the pod): its
                # nodes allow them all, as an operator of a cluster of one tenant might.
                "--allowed-configs", ",".join(r.name for kind in (GpuConfig, VfioConfig, VfConfig)
                                              for r in kind.RECONFIGURATIONS)]

    def log_events(self) -> list[JsonObject]:
        events = []
        for line in self.log.read_text().splitlines() if self.log.exists() else ():
            try:
                events.append(json.loads(line))
            except ValueError:  # the preload or Python may print plain lines
                continue
        return events

    def plugin(self, driver: str) -> Plugin:
        assert self.kubelet is not None
        return self.kubelet.plugin(driver)

    def cdi_files(self, claim_uid: str) -> list[Path]:
        """The CDI specs the agent wrote for a claim: one per driver."""
        return sorted(self.cdi_dir.glob(f"*{claim_uid}*"))

    def read_cdi(self, path: Path) -> JsonObject:
        spec: JsonObject = json.loads(path.read_text()) if path.suffix == ".json" else _yaml(path)
        return spec

    def cdi_nodes(self, claim_uid: str) -> set[str]:
        """Every device node the claim's CDI specs give a container."""
        nodes = set()
        for path in self.cdi_files(claim_uid):
            spec = self.read_cdi(path)
            edits = [d.get("containerEdits") or {} for d in spec.get("devices") or ()]
            edits.append(spec.get("containerEdits") or {})
            nodes |= {n["path"] for e in edits for n in e.get("deviceNodes") or ()}
        return nodes

    async def nvml(self, op: str, **fields: Any) -> JsonObject:
        """A request to the node's simulated NVML (inject an Xid, reset a GPU, list GPUs)."""
        return await asyncio.to_thread(nvml_request, self.sim_root, {"op": op, **fields})

    def driver_of(self, bus_id: str) -> str | None:
        """The kernel driver a simulated PCI device is bound to."""
        link = self.sim_root / "sys/bus/pci/devices" / bus_id / "driver"
        return os.path.basename(os.readlink(link)) if link.is_symlink() else None


def _yaml(path: Path) -> JsonObject:
    import yaml

    loaded: JsonObject = yaml.safe_load(path.read_text())
    return loaded


class DemoCluster:
    """The API server, the allocator and the nodes; `DemoCluster.open()` starts and stops them."""

    def __init__(self, server: TestApiServer, allocator: Allocator, workdir: Path, kubeconfig: Path, *,
                 kept: bool = False) -> None:
        self.server = server
        self.allocator = allocator
        self.workdir = workdir
        self.kept = kept
        """Whether the workdir outlives the demo (--keep): only then may a message point to a file in it."""
        self.kubeconfig = kubeconfig
        self.nodes: dict[str, DemoNode] = {}
        self._stack = AsyncExitStack()

    @classmethod
    @asynccontextmanager
    async def open(cls, workdir: Path | None = None) -> AsyncIterator[DemoCluster]:
        with _workdir(workdir) as folder:
            async with AsyncExitStack() as stack:
                server = await stack.enter_async_context(TestApiServer())
                kubeconfig = server.write_kubeconfig(folder / "kubeconfig")
                allocator = await Allocator.connect(kubeconfig)
                stack.push_async_callback(allocator.close)
                cluster = cls(server, allocator, folder, kubeconfig, kept=workdir is not None)
                stack.push_async_callback(cluster._stop_nodes)
                yield cluster

    async def add_nodes(self, nodes: Sequence[tuple[str, str, Mapping[str, Any]]],
                        settings: Mapping[str, Mapping[str, str]] | None = None) -> list[DemoNode]:
        """Start `dra-agent run` on new simulated nodes (name, profile, backend config) and wait until each is
        ready: every driver's slices complete in the API server and its plugin registered with the kubelet.
        `settings` gives a node agent settings of its own, as DRA_AGENT_* environment variables."""
        made = [self._node(name, profile, config) for name, profile, config in nodes]
        for node in made:
            node.settings = dict((settings or {}).get(node.name, {}))
        await asyncio.gather(*(self._start(node) for node in made))
        return made

    def _node(self, name: str, profile: str, config: Mapping[str, Any]) -> DemoNode:
        if name in self.nodes:
            raise DemoError(f"node {name} exists already")
        node = self.nodes[name] = DemoNode(name, profile, self.workdir / name, config)
        node.root.mkdir(parents=True)
        self.server.add_node(name)
        return node

    async def _start(self, node: DemoNode) -> None:
        env = {**os.environ, **node.settings, "DRA_AGENT_BACKEND_CONFIG": json.dumps(node.backend_config)}
        with node.log.open("ab") as log:
            node.started_at, node.launched_at = time.monotonic(), time.time()
            node.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "agent", "run", *node.flags(self.kubeconfig), env=env,
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log)
        node.kubelet = await self._stack.enter_async_context(KubeletSimulator(node.root / "registry"))
        try:
            async with asyncio.timeout(START_TIMEOUT):
                node.ready_drivers = await self._ready(node)
                for driver in node.ready_drivers:
                    await node.kubelet.wait_for_plugin(driver, timeout=START_TIMEOUT)
        except TimeoutError:
            raise DemoError(f"the agent on node {node.name} was not ready within {START_TIMEOUT:g} s; "
                            + self._log_of(node)) from None

    async def _ready(self, node: DemoNode) -> list[str]:
        """The drivers the agent said it serves, once their pools are complete in the API server."""
        while True:
            assert node.process is not None
            if node.process.returncode is not None:
                raise DemoError(f"the agent on node {node.name} exited with {node.process.returncode}; "
                                + self._log_of(node))
            ready = [e for e in node.log_events() if e.get("event") == "ready"]
            if ready:
                drivers: list[str] = ready[0].get("drivers") or []
                if all(self.pool_complete(node.name, d) for d in drivers):
                    node.ready_after = time.monotonic() - node.started_at
                    node.set_up = _set_up(node)
                    return drivers
            # The agent's log is a file it appends to: nothing to wait on but time.
            await asyncio.sleep(0.02)

    def _log_of(self, node: DemoNode) -> str:
        """The end of a node's agent log, and where the whole of it stays when it does (a temporary workdir is
        removed when the demo ends, before anyone could read it)."""
        where = (f"its log: {node.log}" if self.kept
                 else "the end of its log (run with --keep DIR to keep the whole of it)")
        return f"{where}\n{_tail(node.log)}"

    async def _stop_nodes(self) -> None:
        for node in self.nodes.values():
            if node.process is not None and node.process.returncode is None:
                node.process.terminate()
        for node in self.nodes.values():
            if node.process is not None:
                try:
                    async with asyncio.timeout(scaled(15)):
                        await node.process.wait()
                except TimeoutError:
                    node.process.kill()
                    await node.process.wait()
        await self._stack.aclose()

    # --- what the API server holds ------------------------------------------------------------------------

    def slices(self, node: str, driver: str | None = None) -> list[JsonObject]:
        return sorted((s for s in self.server.objects("resourceslices")
                       if s["spec"].get("nodeName") == node and (driver is None or s["spec"]["driver"] == driver)),
                      key=lambda s: s["metadata"]["name"])

    def devices(self, node: str, driver: str | None = None) -> list[JsonObject]:
        return [d for s in self.slices(node, driver) for d in s["spec"].get("devices") or ()]

    def pool_complete(self, node: str, driver: str) -> bool:
        """Every slice of the pool's newest generation is there, as many as each says the pool has."""
        slices = self.slices(node, driver)
        if not slices:
            return False
        newest = max(s["spec"]["pool"]["generation"] for s in slices)
        current = [s for s in slices if s["spec"]["pool"]["generation"] == newest]
        return all(s["spec"]["pool"]["resourceSliceCount"] == len(current) for s in current)

    def apply_classes(self, classes: Sequence[JsonObject]) -> None:
        for device_class in classes:
            self.server.put_object("deviceclasses", device_class)

    # --- claims -------------------------------------------------------------------------------------------

    def create_claim(self, name: str, spec: JsonObject, namespace: str = "default") -> JsonObject:
        claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                 "metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4())}, "spec": spec}
        stored: JsonObject = self.server.put_claim(claim)
        return stored

    def claim(self, name: str, namespace: str = "default") -> JsonObject:
        found = self.server.get_object("resourceclaims", name, namespace)
        if found is None:
            raise DemoError(f"no ResourceClaim {namespace}/{name}")
        return found

    async def allocate(self, name: str, node: str, namespace: str = "default") -> Allocation:
        return await self.allocator.allocate(namespace, name, node=node)

    async def prepare(self, name: str, node: str, namespace: str = "default") -> dict[str, ClaimResult]:
        """NodePrepareResources for the claim on its node, one call per driver of its allocation, as the kubelet
        does; the answer per driver."""
        claim = self.claim(name, namespace)
        ref = _ref(claim)
        answers = {}
        for driver in _drivers(claim):
            answers[driver] = (await self.nodes[node].plugin(driver).prepare([ref]))[ref.uid]
        return answers

    async def unprepare(self, name: str, node: str, namespace: str = "default") -> dict[str, str]:
        claim = self.claim(name, namespace)
        ref = _ref(claim)
        return {driver: (await self.nodes[node].plugin(driver).unprepare([ref]))[ref.uid]
                for driver in _drivers(claim)}

    async def release(self, name: str, namespace: str = "default") -> None:
        """The claim's pod is gone: its allocation is cleared and the claim deleted."""
        await self.allocator.deallocate(namespace, name)
        self.server.delete_object("resourceclaims", name, namespace)


def _ref(claim: Mapping[str, Any]) -> ClaimRef:
    meta = claim["metadata"]
    return ClaimRef(meta["uid"], meta["namespace"], meta["name"])


def _drivers(claim: Mapping[str, Any]) -> list[str]:
    results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or ()
    return sorted({r["driver"] for r in results})


def _set_up(node: DemoNode) -> float | None:
    """Seconds from the node's launch to its agent's start-up line, by the line's timestamp."""
    for event in node.log_events():
        if event.get("event") == "starting" and "timestamp" in event:
            stamp = datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()
            return max(0.0, stamp - node.launched_at)
    return None


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


class _workdir:
    """The demo's folder: the one given (kept), or a fresh one removed at the end. A fresh one is placed in RAM
    when it can be (creating a node's thousands of sysfs files is slow on some disks) and reached through a link
    below /tmp: udev simulation cannot watch a node reached through /dev."""

    def __init__(self, given: Path | None) -> None:
        self.given = given
        self.made: list[Path] = []

    def __enter__(self) -> Path:
        if self.given is not None:
            self.given.mkdir(parents=True, exist_ok=True)
            return self.given
        if os.access("/dev/shm", os.W_OK):
            real = Path(tempfile.mkdtemp(prefix="dra-demo-", dir="/dev/shm"))
            link = Path(tempfile.gettempdir()) / real.name
            link.symlink_to(real)
            self.made = [link, real]
            return link
        real = Path(tempfile.mkdtemp(prefix="dra-demo-"))
        self.made = [real]
        return real

    def __exit__(self, *exc: object) -> None:
        for path in self.made:
            if path.is_symlink():
                path.unlink()
            else:
                shutil.rmtree(path, ignore_errors=True)
