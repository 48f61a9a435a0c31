"""`dra-agent run` as a process: systemd notifications, graceful and forced stops."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from simulator.apiserver.server import TestApiServer
from simulator.kubelet import KubeletSimulator
from tests.support.agent_env import NODE, AgentProcess, allocate, settings_for, wait_until
from tests.support.timing import scaled

GPU = "gpu.nvidia.com"


@pytest.fixture
async def server() -> AsyncIterator[TestApiServer]:
    async with TestApiServer() as api:
        api.add_node(NODE)
        yield api


class NotifySocket:
    """A service manager's notification socket."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.path = path
        self.messages: list[str] = []

    async def wait_for(self, field: str, timeout: float = scaled(20)) -> float:
        """Receive until a message holds `field`; the time it arrived."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout):
            while True:
                data = await loop.sock_recv(self.sock, 4096)
                self.messages.append(data.decode())
                if field in data.decode().split("\n"):
                    return time.monotonic()

    def close(self) -> None:
        self.sock.close()


async def test_notify_ready_watchdog_and_stopping(server: TestApiServer, scratch: Path) -> None:
    notify = NotifySocket(scratch / "notify.sock")
    settings = settings_for(scratch, server.write_kubeconfig(scratch / "kubeconfig"), "gke-n1-t4x2")
    watchdog = scaled(1.0)  # WatchdogSec: the test times the keep-alives, so it stretches with the time factor
    agent = AgentProcess(settings, {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": str(int(watchdog * 1e6))})
    try:
        await agent.start()
        await notify.wait_for("READY=1")
        ready = next(m for m in notify.messages if "READY=1" in m)
        assert "STATUS=serving 1 driver(s) on node node-a" in ready
        assert server.objects("resourceslices"), "READY only once the slices are published"
        assert (settings.registry_dir / f"{GPU}-reg.sock").exists(), "READY only once the sockets are up"
        first = await notify.wait_for("WATCHDOG=1")
        second = await notify.wait_for("WATCHDOG=1")
        assert 0.3 * watchdog < second - first < 1.5 * watchdog, "keep-alives every half WatchdogSec"
        await agent.signal(signal.SIGTERM)
        started = time.monotonic()
        await notify.wait_for("STOPPING=1")
        assert await agent.wait(timeout=scaled(10)) == 0
        assert time.monotonic() - started < scaled(10)
        assert not (settings.registry_dir / f"{GPU}-reg.sock").exists()
    finally:
        await agent.stop()
        notify.close()


async def test_second_signal_exits_at_once(server: TestApiServer, scratch: Path) -> None:
    notify = NotifySocket(scratch / "notify.sock")
    settings = settings_for(scratch, server.write_kubeconfig(scratch / "kubeconfig"), "gke-g2-l4")
    agent = AgentProcess(settings, {"NOTIFY_SOCKET": str(notify.path)})
    try:
        await agent.start()
        async with KubeletSimulator(settings.registry_dir) as kubelet:
            plugin = await kubelet.wait_for_plugin(GPU, timeout=scaled(20))
            await wait_until(lambda: server.objects("resourceslices"))
            gpu = server.objects("resourceslices")[0]["spec"]["devices"][0]["name"]
            ref = allocate(server, "slow", [("gpu", GPU, gpu)])
            claim = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/slow"
            server.delay("GET", claim, scaled(30))
            call = asyncio.create_task(plugin.prepare([ref]))
            await wait_until(lambda: server.find_requests("GET", claim))  # the prepare is in flight, held there
            await agent.signal(signal.SIGTERM)
            await notify.wait_for("STOPPING=1")  # the first signal has begun the graceful stop
            await asyncio.sleep(scaled(0.3))  # a window in which the in-flight call holds the stop up
            assert agent.process is not None and agent.process.returncode is None, agent.output()
            await agent.signal(signal.SIGINT)
            started = time.monotonic()
            assert await agent.wait(timeout=scaled(5)) == 128 + signal.SIGINT
            assert time.monotonic() - started < scaled(1)
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
    finally:
        await agent.stop()
        notify.close()


async def test_unreachable_api_server_at_start_is_reported(scratch: Path) -> None:
    kubeconfig = scratch / "kubeconfig"
    async with TestApiServer() as gone:
        gone.write_kubeconfig(kubeconfig)
    settings = settings_for(scratch, kubeconfig, "gke-g2-l4")
    agent = AgentProcess(settings)
    try:
        await agent.start()
        async with KubeletSimulator(settings.registry_dir) as kubelet:
            # The kubelet can still prepare from local state while the API server is away; the agent keeps
            # retrying the publication in the background instead of exiting.
            await kubelet.wait_for_plugin(GPU, timeout=scaled(20))
        await wait_until(lambda: "publishing slices failed; retrying" in agent.output())
        await asyncio.sleep(scaled(1))  # a window in which the agent must not exit
        assert agent.process is not None and agent.process.returncode is None
        assert "publishing slices failed; retrying" in agent.output()
    finally:
        await agent.stop()


async def test_ready_without_devices(server: TestApiServer, scratch: Path) -> None:
    notify = NotifySocket(scratch / "notify.sock")
    settings = settings_for(scratch, server.write_kubeconfig(scratch / "kubeconfig"), "gke-g2-l4",
                            backends=("tpu",))
    agent = AgentProcess(settings, {"NOTIFY_SOCKET": str(notify.path)})
    try:
        await agent.start()
        await notify.wait_for("READY=1")
        assert "STATUS=serving 0 driver(s) on node node-a" in notify.messages[-1]
        assert not settings.registry_dir.exists() or not list(settings.registry_dir.iterdir())
    finally:
        await agent.stop()
        notify.close()
