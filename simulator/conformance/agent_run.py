"""The backend inside the whole agent: the agent runs in this process with only the backend under test, against
the test API server, and the kubelet simulator calls it over its real gRPC sockets.

Checks: the pool is published and accepted by the API server; a claim is prepared through the kubelet with a CDI
spec; bad opaque configuration fails its own claim only, with a message naming the problem; after the agent
restarts, the claim is unprepared from the checkpoint and the node is back as it was.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any
from unittest import mock

from agent.node.host import Host
from agent.node.plugin_settings import reconfigurations_of
from agent.node.plugins import FoundPlugin, load_plugins
from agent.settings import Settings
from backends.plugin import ClaimRef
from simulator.apiserver.server import TestApiServer
from simulator.conformance.bench import NODE, CheckFailed, pick
from simulator.conformance.node_state import settled_state
from simulator.conformance.target import BadClaimConfig, Target
from simulator.kubelet import KubeletSimulator
from simulator.kubelet_connection import Plugin
from simulator.node.node import SimulatedNode
from simulator.timing import scaled

__all__ = ["claim_config_errors", "served_by_agent"]

_PUBLISH_SECONDS = scaled(15.0)


class _Cluster:
    """The test API server, the agent's settings, and a way to start (and restart) the agent."""

    def __init__(self, target: Target, plugin: FoundPlugin, node: SimulatedNode, work: Path,
                 server: TestApiServer) -> None:
        self.target, self.plugin, self.node, self.server = target, plugin, node, server
        self.settings = Settings(
            node_name=NODE, kubeconfig=server.write_kubeconfig(work / "kubeconfig"), registry_dir=work / "reg",
            plugins_dir=work / "plugins", cdi_dir=work / "cdi", state_dir=work / "state", log_level="warning",
            backends=(plugin.name,), backend_config={plugin.name: dict(target.config)},
            # The kit's claims may ask for whatever the backend's parameters can ask for.
            allowed_configs=tuple(reconfigurations_of(load_plugins([plugin])[0])),
        )
        self.driver = ""

    @asynccontextmanager
    async def agent(self) -> AsyncIterator[list[str]]:
        """A started agent serving the backend; yields its pool's device names once published."""
        from agent.daemon import Agent  # the agent needs the Kubernetes client and gRPC: only here
        from agent.kube.client import KubeClient

        host = Host(self.node.sysfs, self.node.dev, self.node.root, self.node.profile.name,
                    driver_root=self.node.driver_root)
        async with AsyncExitStack() as stack:
            # The agent finds exactly the backend under test, installed or not.
            stack.enter_context(mock.patch("agent.node.inventory.find_plugins", lambda: ([self.plugin], [])))
            kube = await KubeClient.connect(self.settings.kubeconfig)
            stack.push_async_callback(kube.close)
            agent = Agent(self.settings, host, kube)
            stack.push_async_callback(agent.stop)
            await agent.start()
            drivers = [d for d in agent.drivers.values() if d.pool.devices]
            if not drivers:
                raise CheckFailed(f"the agent found no devices of backend {self.plugin.name} on profile "
                                  f"{self.target.profile}, so it serves nothing; see the discover check")
            driver = drivers[0]
            self.driver = driver.name
            try:
                async with asyncio.timeout(_PUBLISH_SECONDS):
                    await driver.published.wait()
            except TimeoutError:
                raise CheckFailed(f"the agent did not get the pool published within {_PUBLISH_SECONDS:.0f} s; "
                                  "see the discover check") from None
            yield sorted(d.name for d in driver.pool.devices)

    def published(self) -> set[str]:
        return {d["name"] for s in self.server.objects("resourceslices") if s["spec"]["driver"] == self.driver
                for d in s["spec"].get("devices", ())}

    def claim(self, label: str, devices: Sequence[str], parameters: Any = None) -> ClaimRef:
        """An allocated claim in the API server, as the scheduler leaves it."""
        uid, name = str(uuid.uuid4()), f"conformance-{label}"
        config = [] if parameters is None else [
            {"source": "FromClaim", "requests": [], "opaque": {"driver": self.driver, "parameters": parameters}}]
        self.server.put_claim({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default", "uid": uid},
            "spec": {"devices": {"requests": [{"name": "dev", "exactly": {"deviceClassName": "conformance"}}]}},
            "status": {"allocation": {"devices": {
                "results": [{"request": "dev", "driver": self.driver, "pool": NODE, "device": d} for d in devices],
                "config": config,
            }}},
        })
        return ClaimRef(uid, "default", name)


@asynccontextmanager
async def _cluster(target: Target, plugin: FoundPlugin, node: SimulatedNode, work: Path) -> AsyncIterator[_Cluster]:
    async with TestApiServer() as server:
        server.add_node(NODE)
        yield _Cluster(target, plugin, node, work, server)


async def _plugin(kubelet: KubeletSimulator, driver: str) -> Plugin:
    try:
        return await kubelet.wait_for_plugin(driver, timeout=_PUBLISH_SECONDS)
    except Exception as e:
        raise CheckFailed(f"the kubelet could not register the agent's plugin for {driver}: {e}") from None


async def served_by_agent(target: Target, plugin: FoundPlugin, node: SimulatedNode, work: Path) -> list[str]:
    """Published and accepted; prepared through the kubelet; unprepared by a restarted agent from its checkpoint."""
    problems: list[str] = []
    async with _cluster(target, plugin, node, work) as cluster:
        initial = None
        async with cluster.agent() as devices, KubeletSimulator(cluster.settings.registry_dir) as kubelet:
            missing = sorted(set(devices) - cluster.published())
            if missing:
                problems.append(f"the API server holds no device {missing}: the agent left them out of the "
                                "ResourceSlices (the agent's log says why; see the discover check)")
            initial = await settled_state(node)
            served = await _plugin(kubelet, cluster.driver)
            ref = cluster.claim("agent", pick(target, devices), target.claim_config)
            result = (await served.prepare([ref]))[ref.uid]
            if result.error:
                raise CheckFailed(f"NodePrepareResources through the agent failed: {result.error}")
            specs = sorted(p.name for p in cluster.settings.cdi_dir.glob(f"*{ref.uid}*"))
            if not specs or not all(d.cdi_device_ids for d in result.devices):
                problems.append(f"the kubelet got no CDI devices for the claim (CDI specs: {specs})")
        async with cluster.agent(), KubeletSimulator(cluster.settings.registry_dir) as kubelet:
            served = await _plugin(kubelet, cluster.driver)
            errors = await served.unprepare([ref])
            if errors.get(ref.uid):
                problems.append(f"NodeUnprepareResources after the agent restarted failed: {errors[ref.uid]}. The "
                                "backend must undo a preparation from the checkpointed Prepared records alone")
            changes = (await settled_state(node)).changes_since(initial)
            if changes:
                problems.append("after the agent restarted and unprepared the claim the node is still changed: "
                                + "; ".join(changes) + ". Put what undoing needs into Prepared.restore")
    return problems


async def claim_config_errors(target: Target, plugin: FoundPlugin, node: SimulatedNode, work: Path,
                              config_types: Sequence[type[Any]]) -> list[str]:
    """Each bad opaque configuration fails its own claim with a message saying what is wrong, while a good claim in
    the same call is prepared."""
    bad = [BadClaimConfig({"apiVersion": "conformance.example/v1", "kind": "NoSuchKind"}, "NoSuchKind")]
    bad += [BadClaimConfig({"apiVersion": t.API_VERSION, "kind": t.KIND, "conformanceUnknownField": 1},
                           "conformanceUnknownField") for t in config_types]
    bad += list(target.bad_claim_configs)
    problems: list[str] = []
    async with _cluster(target, plugin, node, work) as cluster, cluster.agent() as devices, \
            KubeletSimulator(cluster.settings.registry_dir) as kubelet:
        served = await _plugin(kubelet, cluster.driver)
        chosen = pick(target, devices)
        good = cluster.claim("good", chosen, target.claim_config)
        # Bad claims take other devices where there are enough, so that only their configuration can fail them.
        spare = [d for d in devices if d not in chosen][: len(chosen)]
        refs = [cluster.claim(f"bad-{i}", spare if len(spare) == len(chosen) else chosen, b.parameters)
                for i, b in enumerate(bad)]
        results = await served.prepare([*refs, good])
        if results[good.uid].error:
            problems.append(f"a claim with a valid configuration failed next to claims with invalid ones: "
                            f"{results[good.uid].error}")
        for ref, case in zip(refs, bad, strict=True):
            error = results[ref.uid].error
            if not error:
                problems.append(f"a claim with opaque parameters {dict(case.parameters)} was prepared: refuse "
                                "them (declare the parameters as a pydantic OpaqueConfig in config_types, "
                                "extra fields forbidden, or raise ConfigError from prepare)")
            elif case.expect not in error:
                problems.append(f"the error for opaque parameters {dict(case.parameters)} does not mention "
                                f"{case.expect!r}: {error}")
        await served.unprepare([good, *refs])
    return problems
