"""The agent as the kubelet sees it: registration, DRA v1 and v1beta1 on one socket, per-claim results, health,
published slices, clean shutdown. Real unix sockets, the test API server, the simulated node."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from agent.kubelet.services import HEALTH_SERVICES, SUPPORTED_VERSIONS, HealthStatus, PluginInfo, watch_health
from backends.contract import ClaimRef
from simulator.kubelet import KubeletSimulator
from tests.support.agent_env import NODE, InProcess, agent_in_process, allocate
from tests.support.slice_checks import assert_valid_slices

GPU, NIC = "gpu.nvidia.com", "sriov.dra-agent.io"


@pytest.fixture
async def running(scratch: Path) -> AsyncIterator[InProcess]:
    async with agent_in_process(scratch) as env:
        yield env


def gpus(env: InProcess) -> list[str]:
    return [d.name for d in env.agent.drivers[GPU].pool.devices]


async def test_registration_answers_exactly(running: InProcess) -> None:
    settings = running.settings
    async with KubeletSimulator(settings.registry_dir) as kubelet:
        plugin = await kubelet.wait_for_plugin(GPU)
        dra_socket = settings.plugins_dir / GPU / "dra.sock"
        assert plugin.info == PluginInfo("DRAPlugin", GPU, str(dra_socket.absolute()), SUPPORTED_VERSIONS)
        assert SUPPORTED_VERSIONS == ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth",
                                      "v1alpha1.DRAResourceHealth")
        assert plugin.health_service == "v1.DRAResourceHealth", "a 1.37 kubelet prefers v1"
        assert plugin.version == "v1"
        await kubelet.wait_for_plugin(NIC)
    registration = settings.registry_dir / f"{GPU}-reg.sock"
    for sock in (dra_socket, registration):
        assert stat.S_ISSOCK(os.stat(sock).st_mode) and stat.S_IMODE(os.stat(sock).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(dra_socket.parent).st_mode) == 0o750
    gpu_plugin = running.agent.drivers[GPU].plugin
    assert gpu_plugin is not None and gpu_plugin.registered.is_set()


async def test_v1_and_v1beta1_prepare_on_one_socket(running: InProcess) -> None:
    ref = allocate(running.server, "train", [("gpu", GPU, gpus(running)[0])])
    async with KubeletSimulator(running.settings.registry_dir) as new_kubelet, \
            KubeletSimulator(running.settings.registry_dir, dra_versions=("v1beta1.DRAPlugin",)) as old_kubelet:
        v1 = await new_kubelet.wait_for_plugin(GPU)
        v1beta1 = await old_kubelet.wait_for_plugin(GPU)
        assert (v1.version, v1beta1.version) == ("v1", "v1beta1")
        first = await v1.prepare_or_raise([ref])
        assert await v1beta1.prepare_or_raise([ref]) == first, "same answer in both versions, and idempotent"
        (device,) = first[ref.uid].devices
        assert device.device == gpus(running)[0] and device.pool == NODE and device.request_names == ("gpu",)
        assert device.cdi_device_ids == (f"k8s.gpu.nvidia.com/claim={ref.uid}-{device.device}",)
        assert await v1beta1.unprepare([ref]) == {ref.uid: ""}
        assert await v1.unprepare([ref]) == {ref.uid: ""}, "unprepare of an unknown claim succeeds"
        assert list(running.settings.cdi_dir.iterdir()) == []


async def test_one_batch_many_outcomes(running: InProcess) -> None:
    good = allocate(running.server, "good", [("gpu", GPU, gpus(running)[1])])
    other = allocate(running.server, "nic", [("nic", NIC, running.agent.drivers[NIC].pool.devices[0].name)])
    invalid = allocate(running.server, "bad", [("gpu", GPU, gpus(running)[2])], configs=[
        {"source": "FromClaim", "requests": [],
         "opaque": {"driver": GPU, "parameters": {"apiVersion": "dra-agent.io/v1alpha1", "kind": "Bogus"}}}])
    missing = ClaimRef("0b7c8c5e-6f0a-4b8e-9d2a-1c3e5f7a9b0d", "default", "missing")
    async with KubeletSimulator(running.settings.registry_dir) as kubelet:
        plugin = await kubelet.wait_for_plugin(GPU)
        assert await plugin.prepare([]) == {}
        results = await plugin.prepare([good, other, invalid, missing])
    assert results[good.uid].error == "" and len(results[good.uid].devices) == 1
    assert "no device allocated by driver gpu.nvidia.com" in results[other.uid].error
    assert 'does not accept apiVersion "dra-agent.io/v1alpha1" kind "Bogus"' in results[invalid.uid].error
    assert results[missing.uid].error == "claim default/missing not found"


async def test_health_stream_lists_every_device(running: InProcess) -> None:
    async with KubeletSimulator(running.settings.registry_dir) as kubelet:
        plugin = await kubelet.wait_for_plugin(GPU)
        reports = await anext(aiter(plugin.health()))
    assert sorted(r.device for r in reports) == sorted(gpus(running))
    assert {(r.pool, r.health, r.timeout_seconds) for r in reports} == {(NODE, HealthStatus.HEALTHY, 30)}


async def test_both_health_services_stream_the_same_devices(running: InProcess) -> None:
    """v1 for a 1.37 kubelet, v1alpha1 for the kubelets before it: one source, the same lists."""
    dra_socket = running.settings.plugins_dir / GPU / "dra.sock"
    async with grpc.aio.insecure_channel(f"unix:{dra_socket}") as channel:
        lists = {}
        for service in HEALTH_SERVICES:
            async with contextlib.aclosing(watch_health(channel, service)) as stream:
                lists[service] = sorted((r.device, r.health) for r in await anext(aiter(stream)))
    assert set(lists) == {"v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"}
    assert lists["v1.DRAResourceHealth"] == lists["v1alpha1.DRAResourceHealth"] != []


async def test_slices_are_published_and_owned_by_the_node(running: InProcess) -> None:
    for driver in running.agent.drivers.values():
        if driver.active:
            await driver.published.wait()
    slices = running.server.objects("resourceslices")
    assert_valid_slices(slices)
    assert {s["spec"]["driver"] for s in slices} == {GPU, NIC}
    node = running.server.get_object("nodes", NODE)
    assert node is not None
    node_uid = node["metadata"]["uid"]
    for obj in slices:
        assert obj["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": node_uid, "controller": True}]
    assert sum(len(s["spec"].get("devices", [])) for s in slices) == 8 + 64
    assert running.agent.ready


async def test_stop_removes_own_sockets_only(scratch: Path) -> None:
    foreign = scratch / "reg" / "other.example.com-reg.sock"
    async with agent_in_process(scratch) as env:
        import socket as socket_module

        with socket_module.socket(socket_module.AF_UNIX) as other:
            other.bind(str(foreign))
            plugins = [d.plugin for d in env.agent.drivers.values() if d.plugin is not None]
            sockets = [p.registration_socket for p in plugins] + [p.dra_socket for p in plugins]
            assert all(s.exists() for s in sockets)
        await env.agent.stop()
        assert not any(s.exists() for s in sockets)
        assert foreign.exists()


async def test_stale_socket_from_a_killed_agent_is_replaced(scratch: Path) -> None:
    import socket as socket_module

    stale = scratch / "plugins" / GPU / "dra.sock"
    stale.parent.mkdir(parents=True)
    with socket_module.socket(socket_module.AF_UNIX) as dead:
        dead.bind(str(stale))  # bound, never listening: what a SIGKILL leaves behind
    async with agent_in_process(scratch) as env, KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await kubelet.wait_for_plugin(GPU)
        assert await plugin.prepare([]) == {}


async def test_rolling_update_instances_have_their_own_sockets(scratch: Path) -> None:
    pod = "3f8e4c1a-5b2d-4e6f-8a9b-0c1d2e3f4a5b"
    async with agent_in_process(scratch, pod_uid=pod, backends=("nvidia-gpu",)) as env:
        driver = env.agent.drivers[GPU]
        assert driver.plugin is not None
        assert driver.plugin.dra_socket.name == f"dra-{pod}.sock"
        assert driver.plugin.registration_socket.name == f"{GPU}-{pod}-reg.sock"
        ref = allocate(env.server, "train", [("gpu", GPU, driver.pool.devices[0].name)])
        async with KubeletSimulator(env.settings.registry_dir) as kubelet:
            plugin = await kubelet.wait_for_plugin(GPU)
            assert (await plugin.prepare([ref]))[ref.uid].error == ""
        assert (env.settings.plugins_dir / GPU / "serialize.lock").exists()



def test_proxy_comes_from_the_environment_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.kube.client import _environment_proxy

    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example.com:3128")
    monkeypatch.setenv("NO_PROXY", "10.0.0.1,.svc")
    assert _environment_proxy("https://api.example.com:6443") == "http://proxy.example.com:3128"
    assert _environment_proxy("https://10.0.0.1:6443") is None
    assert _environment_proxy("https://kubernetes.default.svc") is None
    assert _environment_proxy("http://127.0.0.1:8080") is None, "no HTTP_PROXY set"


async def test_metrics_and_probes(scratch: Path) -> None:
    import aiohttp

    async with agent_in_process(scratch, "gke-g2-l4", metrics_address="127.0.0.1:0") as env:
        server = env.agent._metrics_server
        assert server is not None
        base = f"http://127.0.0.1:{server.port}"
        gpu = env.agent.drivers[GPU].pool.devices[0].name
        ref = allocate(env.server, "train", [("gpu", GPU, gpu)])
        async with KubeletSimulator(env.settings.registry_dir) as kubelet, aiohttp.ClientSession() as http:
            plugin = await kubelet.wait_for_plugin(GPU)
            await env.agent.drivers[GPU].published.wait()
            await plugin.prepare_or_raise([ref])
            async with http.get(f"{base}/healthz") as health, http.get(f"{base}/readyz") as ready:
                assert (health.status, ready.status) == (200, 200)
            async with http.get(f"{base}/metrics") as response:
                text = await response.text()
    assert 'dra_agent_node_requests_total{driver="gpu.nvidia.com",operation="prepare",outcome="ok"} 1.0' in text
    assert 'dra_agent_prepared_claims{driver="gpu.nvidia.com"} 1.0' in text
    assert 'dra_agent_published_devices{driver="gpu.nvidia.com"} 1.0' in text
    assert "dra_agent_node_request_seconds_bucket" in text
