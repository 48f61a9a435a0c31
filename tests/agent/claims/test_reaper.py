"""The stale-claim reaper: a prepared claim whose ResourceClaim is gone, replaced or no longer allocated to this
node is unprepared after a grace period, every change undone; an API error never reaps anything."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from agent.claims.reaper import Reaper, gone_reason
from agent.claims.records import ClaimRecord, DeviceRecord
from agent.metrics import Metrics
from simulator.apiserver.server import TestApiServer
from simulator.kubelet import KubeletSimulator
from simulator.node.node import SimulatedNode
from tests.support.agent_env import (
    AgentProcess,
    allocate,
    free_port,
    metrics_of,
    plugin_after_restart,
    served_metrics,
    settings_for,
    wait_until,
)
from tests.support.prepare_env import NODE, PrepareEnv, prepare_env
from tests.support.timing import scaled

GPU, NIC = "gpu.nvidia.com", "sriov.dra-agent.io"
UID = "6f1d5c1e-3a43-4c52-9a57-3d1c8e4b7a10"
RECORD = ClaimRecord(UID, "default", "train", "completed", "boot", (DeviceRecord("gpu-0", "nvidia-gpu"),))


def claim(uid: str = UID, results: list[dict[str, Any]] | None = None, allocated: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {"metadata": {"name": "train", "namespace": "default", "uid": uid}}
    if allocated:
        body["status"] = {"allocation": {"devices": {"results": results if results is not None else [
            {"request": "gpu", "driver": GPU, "pool": NODE, "device": "gpu-0"}]}}}
    return body


@pytest.mark.parametrize(("answer", "reason"), [
    (claim(), None),
    (None, "the ResourceClaim is gone"),
    (claim(uid="0b7c8c5e-6f0a-4b8e-9d2a-1c3e5f7a9b0d"),
     "the ResourceClaim was deleted and created again (now UID 0b7c8c5e-6f0a-4b8e-9d2a-1c3e5f7a9b0d)"),
    (claim(allocated=False), "the ResourceClaim is no longer allocated"),
    (claim(results=[{"request": "gpu", "driver": GPU, "pool": "node-b", "device": "gpu-0"}]),
     "the ResourceClaim is no longer allocated to this node"),
    (claim(results=[{"request": "nic", "driver": NIC, "pool": NODE, "device": "vf-1"}]),
     "the ResourceClaim is no longer allocated to this node"),
    (claim(results=[{"request": "gpu", "driver": GPU, "pool": NODE, "device": "gpu-1"}]), None),
    ({"metadata": "junk"}, "the ResourceClaim was deleted and created again (now UID None)"),
])
def test_what_counts_as_gone(answer: dict[str, Any] | None, reason: str | None) -> None:
    assert gone_reason(answer, RECORD, GPU, NODE) == reason


@pytest.fixture
async def env(sim_node: Callable[[str], SimulatedNode], scratch: Path) -> AsyncIterator[PrepareEnv]:
    environment = await prepare_env(sim_node("dgx-h100"), scratch)
    yield environment
    await environment.close()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_gone_claim_is_unprepared_only_after_its_grace_period(env: PrepareEnv) -> None:
    gpus = env.devices(GPU)
    gone, kept = env.claims.add("gone", [("gpu", GPU, gpus[0])]), env.claims.add("kept", [("gpu", GPU, gpus[1])])
    preparer = env.preparer(GPU)
    await preparer.prepare([gone, kept])
    metrics, clock = Metrics(), Clock()
    reaper = Reaper(preparer, env.claims, metrics, interval=60, grace=30, clock=clock)
    del env.claims.claims[("default", "gone")]
    assert await reaper.sweep() == [], "a suspect at first"
    clock.now += 29
    assert await reaper.sweep() == []
    env.claims.failing = "connection refused"
    clock.now += 100
    assert await reaper.sweep() == [], "an API error confirms nothing"
    assert metrics.api_errors.labels("get_resourceclaim")._value.get() == 2
    env.claims.failing = None
    assert await reaper.sweep() == [gone.uid]
    assert set(preparer.checkpoint.claims) == {kept.uid}
    assert not (env.cdi_dir / f"k8s.{GPU}-claim_{gone.uid}.json").exists()
    assert metrics.reaped_claims.labels(GPU, "not-found")._value.get() == 1
    again = env.claims.add("again", [("gpu", GPU, gpus[0])])
    assert (await preparer.prepare([again]))[again.uid].error == "", "its device is free again"


async def test_a_claim_that_comes_back_within_the_grace_period_is_kept(env: PrepareEnv) -> None:
    ref = env.claims.add("flaky", [("gpu", GPU, env.devices(GPU)[0])])
    preparer = env.preparer(GPU)
    await preparer.prepare([ref])
    clock = Clock()
    reaper = Reaper(preparer, env.claims, Metrics(), interval=60, grace=30, clock=clock)
    stored = env.claims.claims.pop(("default", "flaky"))
    await reaper.sweep()
    env.claims.claims[("default", "flaky")] = stored  # a stale read, e.g. from a lagging cache
    clock.now += 20
    await reaper.sweep()
    del env.claims.claims[("default", "flaky")]
    clock.now += 20
    assert await reaper.sweep() == [], "the grace period starts again"
    clock.now += 30
    assert await reaper.sweep() == [ref.uid]


def reaped_events(server: TestApiServer) -> list[dict[str, Any]]:
    return [e for e in server.events() if e.get("reason") == "ClaimReaped"]


def driver_of(sim_root: Path, bus_id: str) -> str | None:
    link = sim_root / "sys/bus/pci/devices" / bus_id / "driver"
    return os.path.basename(os.readlink(link)) if link.is_symlink() else None


def compute_mode(sim_root: Path, bus_id: str) -> int:
    state = json.loads((sim_root / ".sim/nvml-mig.json").read_text())
    mode: int = next(g for g in state if g["bus_id"] == bus_id)["compute_mode"]
    return mode


VFIO = {"apiVersion": "dra-agent.io/v1alpha1", "kind": "VfioConfig"}
EXCLUSIVE = {"apiVersion": "dra-agent.io/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "ExclusiveProcess"}}


def config(driver: str, parameters: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"source": "FromClaim", "requests": ["dev"], "opaque": {"driver": driver, "parameters": parameters}}]


async def test_claims_deleted_while_the_agent_was_down_are_reaped_with_every_change_undone(scratch: Path) -> None:
    async with TestApiServer() as server:
        server.add_node(NODE)
        settings = settings_for(scratch, server.write_kubeconfig(scratch / "kubeconfig"), "dgx-h100",
                                backends=("nvidia-gpu", "sriov-nic"), metrics_address=f"127.0.0.1:{free_port()}",
                                reap_interval=scaled(0.3), reap_grace=scaled(1.5))
        first, second = AgentProcess(settings), AgentProcess(settings)
        sim = settings.sim_root
        assert sim is not None
        try:
            await first.start()
            async with KubeletSimulator(settings.registry_dir) as kubelet:
                gpu_plugin = await kubelet.wait_for_plugin(GPU, timeout=scaled(30))
                nic_plugin = await kubelet.wait_for_plugin(NIC, timeout=scaled(30))
                deleted = allocate(server, "deleted", [("dev", NIC, "vf-0000-19-00-1")], config(NIC, VFIO))
                replaced = allocate(server, "replaced", [("dev", GPU, "gpu-0000-18-00-0")], config(GPU, EXCLUSIVE))
                moved = allocate(server, "moved", [("dev", GPU, "gpu-0000-1c-00-0")])
                kept = allocate(server, "kept", [("dev", GPU, "gpu-0000-3a-00-0")])
                await nic_plugin.prepare_or_raise([deleted])
                await gpu_plugin.prepare_or_raise([replaced, moved, kept])
                assert driver_of(sim, "0000:19:00.1") == "vfio-pci"
                assert compute_mode(sim, "0000:18:00.0") == 3  # EXCLUSIVE_PROCESS
                await first.signal(signal.SIGKILL)
                await first.wait()

                # Meanwhile in the cluster: one claim deleted, one deleted and created again, one deallocated.
                server.delete_object("resourceclaims", "deleted")
                allocate(server, "replaced", [("dev", GPU, "gpu-0000-18-00-0")])
                unallocated = server.get_object("resourceclaims", "moved")
                assert unallocated is not None
                del unallocated["status"]
                server.put_claim(unallocated)
                # ... and the API server answers every claim read with an error for a while.
                server.fail("GET", "/apis/resource.k8s.io/v1/namespaces/*/resourceclaims/*", 500, times=None)

                await second.start()
                await plugin_after_restart(kubelet, gpu_plugin)
                address = str(settings.metrics_address)
                await wait_until(lambda: served_metrics(address).get(
                    'dra_agent_api_errors_total{operation="get_resourceclaim"}', 0) >= 8, timeout=scaled(30))
                assert driver_of(sim, "0000:19:00.1") == "vfio-pci", "API errors reap nothing"
                assert len(list(settings.cdi_dir.iterdir())) == 4

                server.clear_faults()
                specs = settings.cdi_dir
                await wait_until(lambda: sorted(p.name for p in specs.iterdir()) == [
                    f"k8s.{GPU}-claim_{kept.uid}.json"], timeout=scaled(30))
                assert driver_of(sim, "0000:19:00.1") == "mlx5_core"
                assert compute_mode(sim, "0000:18:00.0") == 0, "the replaced claim's compute mode was undone"
                samples = metrics_of(address)
                assert samples[f'dra_agent_reaped_claims_total{{driver="{GPU}",reason="replaced"}}'] == 1
                assert samples[f'dra_agent_reaped_claims_total{{driver="{GPU}",reason="not-allocated"}}'] == 1
                assert samples[f'dra_agent_reaped_claims_total{{driver="{NIC}",reason="not-found"}}'] == 1
                assert second.output().count("unprepared a claim the API server no longer has for this node") == 3
                await wait_until(lambda: len(reaped_events(server)) == 3, timeout=scaled(10))
                notes = sorted(e["note"] for e in reaped_events(server))
                assert f"Claim default/deleted ({deleted.uid}) of driver {NIC}" in notes[0]
                assert all(e["regarding"]["kind"] == "Node" and e["type"] == "Normal" for e in reaped_events(server))
        finally:
            await first.stop()
            await second.stop()
