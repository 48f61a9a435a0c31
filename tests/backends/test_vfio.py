"""vfio-pci passthrough of GPUs and VFs: the IOMMU group bound to vfio-pci with the simulated kernel's real driver
changes, the container given the VFIO nodes, the original drivers back at unprepare, after a crash and at start;
refusals for groups with devices not ours and for interfaces carrying the host's traffic."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pynvml
import pytest
import structlog
import yaml

from backends.contract import Allocated, BackendContext, ClaimRef, Inventory, PrepareError
from backends.failpoints import VFIO_POINTS
from backends.journal import Journal
from backends.nvidia.gpu import NvidiaGpuBackend
from backends.nvidia.nvml import nvml_session
from backends.topology import TopologyReader
from backends.vfio import Passthrough, VfioConfig
from backends.vfio_sysfs import VFIO_PCI, Deadline, Rebinder
from simulator.apiserver.server import TestApiServer
from simulator.kubelet import KubeletSimulator
from simulator.kubelet_connection import KubeletError
from simulator.node import sysfs_tree
from tests.support.agent_env import (
    NODE,
    AgentProcess,
    agent_in_process,
    allocate,
    journal_entries,
    lose_claims,
    plugin_after_restart,
    settings_for,
    two_agents,
    wait_until,
)
from tests.support.timing import scaled
from tests.support.udev_env import preload_env

GPU = "gpu.nvidia.com"
SRIOV = "sriov.dra-agent.io"
GPU_BDF, GPU_GROUP = "0000:18:00.0", 3
VF_BDF, VF_GROUP, VF_NETDEV = "0000:19:00.1", 6, "enp25s0f0v0"
VFIO = {"apiVersion": "dra-agent.io/v1alpha1", "kind": "VfioConfig"}
VFIO_CONFIG = VfioConfig.model_validate(VFIO)


def passthrough(driver: str, request: str = "dev", parameters: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return [{"source": "FromClaim", "requests": [request],
             "opaque": {"driver": driver, "parameters": parameters or VFIO}}]


def driver_of(sim_root: Path, bus_id: str) -> str | None:
    link = sim_root / "sys/bus/pci/devices" / bus_id / "driver"
    return os.path.basename(os.readlink(link)) if link.is_symlink() else None


def override_of(sim_root: Path, bus_id: str) -> str:
    return (sim_root / "sys/bus/pci/devices" / bus_id / "driver_override").read_text().strip()


def cdi_nodes(cdi_dir: Path, uid: str) -> set[str]:
    spec = yaml.safe_load(next(cdi_dir.glob(f"*{uid}*")).read_text())
    edits = [d["containerEdits"] for d in spec["devices"]] + [spec.get("containerEdits") or {}]
    return {n["path"] for e in edits for n in e.get("deviceNodes") or ()}


def ledger(state_dir: Path, backend: str) -> dict[str, Any]:
    """The backend's vfio journal replayed: entry key → entry."""
    path = state_dir / "backends" / backend / "vfio-ledger.json"
    return journal_entries(path)


async def test_a_gpu_passed_through_gets_its_vfio_group_and_goes_back_to_nvidia(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100") as env, KubeletSimulator(env.settings.registry_dir) as kubelet:
        sim = env.settings.sim_root
        assert sim is not None
        plugin = await kubelet.wait_for_plugin(GPU)
        claim = allocate(env.server, "vm", [("dev", GPU, "gpu-0000-18-00-0")], passthrough(GPU))
        result = (await plugin.prepare([claim]))[claim.uid]
        assert result.error == ""
        assert driver_of(sim, GPU_BDF) == "vfio-pci"
        assert (sim / f"dev/vfio/{GPU_GROUP}").exists()
        nodes = cdi_nodes(env.settings.cdi_dir, claim.uid)
        assert nodes == {"/dev/vfio/vfio", f"/dev/vfio/{GPU_GROUP}"}, "no /dev/nvidia* for a GPU in passthrough"
        (entry,) = ledger(env.settings.state_dir, "nvidia-gpu").values()
        assert entry["bound"] and entry["members"] == {GPU_BDF: "nvidia"} and entry["group"] == GPU_GROUP
        assert (await plugin.prepare([claim]))[claim.uid] == result, "prepare is idempotent"

        assert (await plugin.unprepare([claim]))[claim.uid] == ""
        assert driver_of(sim, GPU_BDF) == "nvidia"
        assert override_of(sim, GPU_BDF) == "(null)"
        assert not (sim / f"dev/vfio/{GPU_GROUP}").exists()
        assert ledger(env.settings.state_dir, "nvidia-gpu") == {}
        assert (await plugin.unprepare([claim]))[claim.uid] == "", "unprepare is idempotent"

        plain = allocate(env.server, "plain", [("dev", GPU, "gpu-0000-18-00-0")])
        assert (await plugin.prepare([plain]))[plain.uid].error == ""
        assert "/dev/nvidia0" in cdi_nodes(env.settings.cdi_dir, plain.uid)
        assert driver_of(sim, GPU_BDF) == "nvidia", "without VfioConfig a GPU keeps its driver"


async def test_a_vf_passed_through_goes_back_to_mlx5_core_with_its_netdev(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100") as env, KubeletSimulator(env.settings.registry_dir) as kubelet:
        sim = env.settings.sim_root
        assert sim is not None
        plugin = await kubelet.wait_for_plugin(SRIOV)
        claim = allocate(env.server, "dpdk", [("dev", SRIOV, "vf-0000-19-00-1")], passthrough(SRIOV))
        assert (await plugin.prepare([claim]))[claim.uid].error == ""
        assert driver_of(sim, VF_BDF) == "vfio-pci"
        assert not (sim / f"sys/class/net/{VF_NETDEV}").exists()
        assert cdi_nodes(env.settings.cdi_dir, claim.uid) == {"/dev/vfio/vfio", f"/dev/vfio/{VF_GROUP}"}
        assert (await plugin.unprepare([claim]))[claim.uid] == ""
        assert driver_of(sim, VF_BDF) == "mlx5_core"
        assert (sim / f"sys/bus/pci/devices/{VF_BDF}/net/{VF_NETDEV}").is_dir()


async def test_a_group_holding_a_device_not_ours_is_refused_and_nothing_changes(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100") as env, KubeletSimulator(env.settings.registry_dir) as kubelet:
        sim = env.settings.sim_root
        assert sim is not None
        # Firmware without ACS puts the adapter's PF (not published: its VFs are) in the GPU's group.
        pf = "0000:19:00.0"
        members = sim / f"sys/kernel/iommu_groups/{GPU_GROUP}/devices"
        (members / pf).symlink_to(os.readlink(sim / "sys/bus/pci/devices" / pf))
        plugin = await kubelet.wait_for_plugin(GPU)
        claim = allocate(env.server, "vm", [("dev", GPU, "gpu-0000-18-00-0")], passthrough(GPU))
        error = (await plugin.prepare([claim]))[claim.uid].error
        assert f"IOMMU group {GPU_GROUP} also holds {pf}, which dra-agent does not own" in error
        assert driver_of(sim, GPU_BDF) == "nvidia" and driver_of(sim, pf) == "mlx5_core"
        assert override_of(sim, GPU_BDF) == "(null)"
        assert ledger(env.settings.state_dir, "nvidia-gpu") == {}


async def test_a_vf_whose_interface_carries_the_default_route_is_refused(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100") as env, KubeletSimulator(env.settings.registry_dir) as kubelet:
        sim = env.settings.sim_root
        assert sim is not None
        route = sim / "proc/1/net/route"
        route.parent.mkdir(parents=True, exist_ok=True)
        route.write_text("Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
                         f"{VF_NETDEV}\t00000000\t0101A8C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n")
        plugin = await kubelet.wait_for_plugin(SRIOV)
        claim = allocate(env.server, "dpdk", [("dev", SRIOV, "vf-0000-19-00-1")], passthrough(SRIOV))
        error = (await plugin.prepare([claim]))[claim.uid].error
        assert f"{VF_NETDEV} carries the host's default route" in error
        assert driver_of(sim, VF_BDF) == "mlx5_core"


async def test_an_invalid_vfio_config_fails_the_claim(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100") as env, KubeletSimulator(env.settings.registry_dir) as kubelet:
        sim = env.settings.sim_root
        assert sim is not None
        plugin = await kubelet.wait_for_plugin(GPU)
        claim = allocate(env.server, "vm", [("dev", GPU, "gpu-0000-18-00-0")],
                         passthrough(GPU, parameters={**VFIO, "iommufd": True}))
        error = (await plugin.prepare([claim]))[claim.uid].error
        assert "VfioConfig.iommufd: Extra inputs are not permitted" in error
        assert driver_of(sim, GPU_BDF) == "nvidia"


@pytest.mark.parametrize("point", [*VFIO_POINTS, "prepare-after-backends"])
async def test_a_crash_while_passing_a_gpu_through_is_undone_at_restart(scratch: Path, point: str) -> None:
    async with two_agents(scratch, "dgx-h100", backends=("nvidia-gpu",), failpoint=point) as run:
        server, settings, kubelet = run.server, run.settings, run.kubelet
        crashing, restarted = run.first, run.second
        sim = settings.sim_root
        assert sim is not None
        plugin = await kubelet.wait_for_plugin(GPU, timeout=scaled(30))
        ref = allocate(server, "vm", [("dev", GPU, "gpu-0000-18-00-0")], passthrough(GPU))
        with pytest.raises(KubeletError):
            await plugin.prepare([ref])
        assert await crashing.wait() == -signal.SIGKILL
        # The intent is recorded before any write; after it the override alone is not written yet.
        expected = "nvidia" if point == "vfio-after-intent" else "vfio-pci"
        assert driver_of(sim, GPU_BDF) == expected

        await restarted.start()
        plugin = await plugin_after_restart(kubelet, plugin)
        assert driver_of(sim, GPU_BDF) == "nvidia"
        assert override_of(sim, GPU_BDF) == "(null)"
        result = await plugin.prepare_or_raise([ref])  # the kubelet retries
        assert result[ref.uid].devices[0].device == "gpu-0000-18-00-0"
        assert driver_of(sim, GPU_BDF) == "vfio-pci"
        assert await plugin.unprepare([ref]) == {ref.uid: ""}
        assert driver_of(sim, GPU_BDF) == "nvidia"


async def test_at_start_a_vf_no_claim_holds_any_more_goes_back_to_its_driver(scratch: Path) -> None:
    """The checkpoint is lost while a VF is on vfio-pci: the ledger says the agent bound it, no claim holds it."""
    async with two_agents(scratch, "dgx-h100", backends=("sriov-nic",)) as run:
        server, settings, kubelet = run.server, run.settings, run.kubelet
        first, second = run.first, run.second
        sim = settings.sim_root
        assert sim is not None
        plugin = await kubelet.wait_for_plugin(SRIOV, timeout=scaled(30))
        ref = allocate(server, "dpdk", [("dev", SRIOV, "vf-0000-19-00-1")], passthrough(SRIOV))
        await plugin.prepare_or_raise([ref])
        await first.stop()  # killed
        assert driver_of(sim, VF_BDF) == "vfio-pci"
        lose_claims(settings, SRIOV)
        await second.start()
        await plugin_after_restart(kubelet, plugin)
        assert driver_of(sim, VF_BDF) == "mlx5_core"
        assert "returning a device bound to vfio-pci" in second.output()
        assert ledger(settings.state_dir, "sriov-nic") == {}


async def test_a_lost_journal_keeps_a_vf_passed_through_for_its_claim(scratch: Path) -> None:
    """The checkpoint is lost while a VF is on vfio-pci, the claim's CDI spec is not: the claim is still prepared (its
    VM runs), so the VF stays bound and held until the kubelet unprepares the claim."""
    async with two_agents(scratch, "dgx-h100", backends=("sriov-nic",)) as run:
        server, settings, kubelet = run.server, run.settings, run.kubelet
        sim = settings.sim_root
        assert sim is not None
        plugin = await kubelet.wait_for_plugin(SRIOV, timeout=scaled(30))
        ref = allocate(server, "dpdk", [("dev", SRIOV, "vf-0000-19-00-1")], passthrough(SRIOV))
        await plugin.prepare_or_raise([ref])
        await run.first.stop()  # killed
        (settings.state_dir / SRIOV / "checkpoint.journal").unlink()
        await run.second.start()
        plugin = await plugin_after_restart(kubelet, plugin)
        assert driver_of(sim, VF_BDF) == "vfio-pci"
        assert "CDI spec of a claim the checkpoint does not know" in run.second.output()
        other = allocate(server, "other", [("dev", SRIOV, "vf-0000-19-00-1")])
        error = (await plugin.prepare([other]))[other.uid].error
        assert error.startswith(f"device vf-0000-19-00-1 is already prepared for claim with UID {ref.uid}")
        assert await plugin.unprepare([ref]) == {ref.uid: ""}
        assert driver_of(sim, VF_BDF) == "mlx5_core"
        assert (await plugin.prepare([other]))[other.uid].error == ""


@pytest.mark.parametrize("point", VFIO_POINTS)
async def test_a_gpu_rolled_back_from_vfio_serves_a_claim_without_vfio_at_once(scratch: Path, point: str) -> None:
    """No rediscovery needs to run between the roll-back at start and the next claim (without udev none does)."""
    async with two_agents(scratch, "dgx-h100", backends=("nvidia-gpu",), failpoint=point) as run:
        plugin = await run.kubelet.wait_for_plugin(GPU, timeout=scaled(30))
        ref = allocate(run.server, "vm", [("dev", GPU, "gpu-0000-18-00-0")], passthrough(GPU))
        with pytest.raises(KubeletError):
            await plugin.prepare([ref])
        assert await run.first.wait() == -signal.SIGKILL
        await run.second.start()
        plugin = await plugin_after_restart(run.kubelet, plugin)
        plain = allocate(run.server, "plain", [("dev", GPU, "gpu-0000-18-00-0")])
        result = (await plugin.prepare([plain]))[plain.uid]
        assert result.error == ""
        assert "/dev/nvidia0" in cdi_nodes(run.settings.cdi_dir, plain.uid)


def _bare_function(sysfs: Path, bus_id: str, group: int, driver: str) -> Path:
    """A PCI function in a hand-built sysfs tree, with no kernel behind its control files."""
    folder = sysfs / "devices/pci0000:00" / bus_id
    folder.mkdir(parents=True)
    (folder / "class").write_text("0x030200\n")
    (sysfs / "bus/pci/drivers" / driver).mkdir(parents=True, exist_ok=True)
    (folder / "driver").symlink_to(sysfs / "bus/pci/drivers" / driver)
    members = sysfs / "kernel/iommu_groups" / str(group) / "devices"
    members.mkdir(parents=True)
    (folder / "iommu_group").symlink_to(members.parent)
    (members / bus_id).symlink_to(folder)
    (sysfs / "bus/pci/devices").mkdir(parents=True, exist_ok=True)
    (sysfs / "bus/pci/devices" / bus_id).symlink_to(folder)
    return folder


async def test_a_write_the_kernel_does_not_return_from_fails_the_claim_in_time(scratch: Path) -> None:
    # A FIFO blocks its writer as an unbind blocks in a driver that waits for the device's users to go.
    sysfs = scratch / "sys"
    folder = _bare_function(sysfs, "0000:01:00.0", 5, "nvidia")
    os.mkfifo(folder / "driver_override")
    unbind = sysfs / "bus/pci/drivers/nvidia/unbind"
    unbind.write_text("")
    ctx = BackendContext(sysfs, scratch / "dev", scratch, TopologyReader(sysfs), {}, structlog.get_logger("vfio"),
                         state_dir=scratch / "state", driver_root=scratch)
    vfio = Passthrough(ctx, claim_seconds=0.3)
    started = time.monotonic()
    released = False
    try:
        with pytest.raises(PrepareError, match=r"driver_override did not return within 0\.3 s"):
            await vfio.prepare("uid", [("gpu-0000-01-00-0", "0000:01:00.0")], {"0000:01:00.0"})
        assert time.monotonic() - started < scaled(3), "the claim fails at its deadline, not when the kernel returns"
        assert os.path.basename(os.readlink(folder / "driver")) == "nvidia"
        release(folder / "driver_override")
        released = True
        await asyncio.sleep(scaled(0.2))  # a window in which nothing may happen: kept, and stretched
        assert unbind.read_text() == "", "a change given up on goes no further once the kernel returns"
    finally:
        vfio.close()
        if not released:
            release(folder / "driver_override")


def release(fifo: Path) -> None:
    """Let the writer blocked on a FIFO finish its write: the read end stays open until what it wrote is read."""
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        deadline = time.monotonic() + scaled(5)
        while time.monotonic() < deadline:
            with contextlib.suppress(BlockingIOError):  # opened, not written yet
                if os.read(fd, 4096):
                    return
            time.sleep(0.01)  # not opened yet (an empty read), or not written
    finally:
        os.close(fd)


def test_a_write_stuck_in_the_kernel_does_not_hold_up_the_next_one(tmp_path: Path) -> None:
    rebinder = Rebinder(tmp_path)
    stuck, fine = tmp_path / "unbind", tmp_path / "driver_override"
    os.mkfifo(stuck)
    fine.write_text("")
    try:
        with pytest.raises(PrepareError, match=r"did not return within 0\.2 s"):
            rebinder.write(stuck, "0000:01:00.0", Deadline(0.2))
        rebinder.write(fine, VFIO_PCI, Deadline(scaled(0.5)))  # not queued behind the write still in the kernel
        assert fine.read_text() == VFIO_PCI
        with pytest.raises(PrepareError, match="cannot write"):
            rebinder.write(tmp_path / "missing/bind", "0000:01:00.0", Deadline(scaled(0.5)))
    finally:
        os.close(os.open(stuck, os.O_RDONLY | os.O_NONBLOCK))  # let the abandoned writer finish


def test_the_journal_survives_a_torn_last_line_and_compacts(tmp_path: Path) -> None:
    path = tmp_path / "vfio-ledger.json"
    journal = Journal(path)
    journal.load()
    journal.put("a/gpu", {"members": {GPU_BDF: "nvidia"}})
    journal.put("b/vf", {"members": {VF_BDF: "mlx5_core"}})
    journal.remove("b/vf")
    journal.close()
    with path.open("ab") as f:
        f.write(b'{"put":["c/vf",{"memb')  # a crash in the middle of an append
    again = Journal(path)
    again.load()
    assert list(again) == [("a/gpu", {"members": {GPU_BDF: "nvidia"}})] and again.problems == []
    assert path.read_text().count("\n") == 1, "loading rewrites the journal with the live entries only"
    again.close()


@pytest.mark.parametrize("durable", [True, False])
def test_a_journal_syncs_only_records_of_what_outlives_a_reboot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 durable: bool) -> None:
    journal = Journal(tmp_path / "journal.json", durable=durable)
    journal.load()
    syncs: list[int] = []
    real_sync = os.fdatasync

    def recording_sync(fd: int) -> None:
        syncs.append(fd)
        real_sync(fd)

    monkeypatch.setattr(os, "fdatasync", recording_sync)
    journal.put("a/gpu", {"members": {GPU_BDF: "nvidia"}})
    journal.remove("a/gpu")
    assert len(syncs) == (2 if durable else 0)
    journal.put("b/vf", {"members": {VF_BDF: "mlx5_core"}})
    journal.close()
    again = Journal(tmp_path / "journal.json")  # every written line is read back, synced or not
    again.load()
    assert list(again) == [("b/vf", {"members": {VF_BDF: "mlx5_core"}})]
    again.close()


def test_the_simulated_nvml_lists_only_gpus_the_nvidia_driver_holds(sim_node: Any) -> None:
    node = sim_node("dgx-h100")
    rebinder, other = Rebinder(node.sysfs), node.plan.gpus[1]
    rebinder.to_vfio(GPU_BDF, Deadline(scaled(10)))
    with nvml_session():  # the node's NVML library, loaded from its driver root
        assert pynvml.nvmlDeviceGetCount() == 7
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetHandleByPciBusId(GPU_BDF)
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetHandleByUUID(node.plan.gpus[0].uuid)
        first = pynvml.nvmlDeviceGetHandleByIndex(0)  # NVML numbers the GPUs it lists
        assert pynvml.nvmlDeviceGetUUID(first) == other.uuid and pynvml.nvmlDeviceGetIndex(first) == 0
        rebinder.back_to(GPU_BDF, "nvidia", Deadline(scaled(10)))
        assert pynvml.nvmlDeviceGetCount() == 8
        assert pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0)) == node.plan.gpus[0].uuid


def test_nvml_lists_a_gpu_as_soon_as_its_driver_link_names_nvidia_however_slow_the_kernel(
        sim_node: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rebinder returns once the function's `driver` link names the driver; by then the driver's folder must
    list the function, as the kernel links the driver to the device before the device to the driver. A kernel
    thread that pauses after every link it makes shows any other order at once (the count, else, lags by one)."""
    node = sim_node("dgx-h100")
    made = sysfs_tree._link

    def slow_link(path: str, target: str) -> None:
        made(path, target)
        if threading.current_thread().name.startswith("simulated-kernel"):
            time.sleep(0.05)  # a window between two links, not a wait for anything

    monkeypatch.setattr(sysfs_tree, "_link", slow_link)
    rebinder = Rebinder(node.sysfs)
    with nvml_session():
        for _ in range(3):
            rebinder.to_vfio(GPU_BDF, Deadline(scaled(10)))
            assert pynvml.nvmlDeviceGetCount() == 7
            rebinder.back_to(GPU_BDF, "nvidia", Deadline(scaled(10)))
            assert pynvml.nvmlDeviceGetCount() == 8


def published_gpus(server: TestApiServer) -> dict[str, dict[str, Any]]:
    """The GPUs in the published slices: device name → device (attributes, capacity)."""
    return {d["name"]: d for s in server.objects("resourceslices") if s["spec"]["driver"] == GPU
            for d in s["spec"].get("devices", ())}


def nvml_index(device: dict[str, Any]) -> int:
    index: int = device["attributes"]["index"]["int"]
    return index


async def test_a_gpu_passed_through_stays_published_while_nvml_cannot_see_it(scratch: Path) -> None:
    """Bound to vfio-pci, the GPU is gone from NVML (the other GPUs are numbered again, which rediscovery after the
    bind's uevent shows); it stays published as it was, also after a restart, and comes back from NVML at
    unprepare."""
    async with two_agents(scratch, "dgx-h100", backends=("nvidia-gpu",)) as run:
        server, settings, kubelet = run.server, run.settings, run.kubelet
        first, second = run.first, run.second
        held, neighbour = "gpu-0000-18-00-0", "gpu-0000-1c-00-0"
        plugin = await kubelet.wait_for_plugin(GPU, timeout=scaled(30))
        await wait_until(lambda: len(published_gpus(server)) == 8)
        before = published_gpus(server)
        assert nvml_index(before[neighbour]) == 1
        ref = allocate(server, "vm", [("dev", GPU, held)], passthrough(GPU))
        await plugin.prepare_or_raise([ref])
        await wait_until(lambda: nvml_index(published_gpus(server)[neighbour]) == 0)
        assert published_gpus(server)[held] == before[held], "published as it was"
        assert len(published_gpus(server)) == 8

        await first.stop()  # killed while the GPU is passed through
        for piece in server.objects("resourceslices"):
            server.delete_object("resourceslices", piece["metadata"]["name"], namespace="")
        await second.start()
        plugin = await plugin_after_restart(kubelet, plugin)
        await wait_until(lambda: len(published_gpus(server)) == 8)
        assert published_gpus(server)[held] == before[held], "from the journal after a restart"
        assert nvml_index(published_gpus(server)[neighbour]) == 0, "NVML still does not list it"

        assert await plugin.unprepare([ref]) == {ref.uid: ""}
        assert driver_of(settings.sim_root, GPU_BDF) == "nvidia"  # type: ignore[arg-type]
        await wait_until(lambda: nvml_index(published_gpus(server)[neighbour]) == 1)
        assert published_gpus(server) == before, "found by NVML again"


@pytest.fixture
async def gpu_backend(sim_node: Any, scratch: Path) -> AsyncIterator[tuple[NvidiaGpuBackend, Any]]:
    """nvidia-gpu started in this process on a simulated dgx-h100, with a state directory (passthrough on)."""
    node = sim_node("dgx-h100")
    backend = NvidiaGpuBackend()
    await backend.start(BackendContext(node.sysfs, node.dev, node.root, TopologyReader(node.sysfs), {},
                                       structlog.get_logger("nvidia-gpu"), state_dir=scratch / "state",
                                       driver_root=node.driver_root))
    try:
        yield backend, node
    finally:
        await backend.stop()


def names(inventory: Inventory) -> set[str]:
    return {d.name for d in inventory.devices}


async def test_a_gpu_given_back_during_a_rediscovery_stays_published(
        gpu_backend: tuple[NvidiaGpuBackend, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A rediscovery reads NVML while the GPU is on vfio-pci, and the unprepare finishes (its journal entry gone)
    before the rediscovery is done: the GPU must still be in what it finds, or a prepare of it fails meanwhile."""
    backend, _ = gpu_backend
    device, claim = "gpu-0000-18-00-0", ClaimRef("uid-1", "default", "vm")
    assert device in names(await backend.discover())
    prepared = await backend.prepare(claim, [Allocated(device, "dev", VFIO_CONFIG)])
    assert device in names(await backend.discover()), "on vfio-pci: published from the journal"

    read_nvml, nvml_read, handed_back = backend._discover, threading.Event(), threading.Event()

    def racing() -> Inventory:
        inventory = read_nvml()  # the GPU is on vfio-pci: NVML does not list it
        nvml_read.set()
        assert handed_back.wait(scaled(10))
        return inventory

    monkeypatch.setattr(backend, "_discover", racing)
    discovery = asyncio.create_task(backend.discover())
    assert await asyncio.to_thread(nvml_read.wait, 10)
    await backend.unprepare(claim, prepared)
    handed_back.set()
    assert device in names(await discovery)
    again = await backend.prepare(ClaimRef("uid-2", "default", "vm"), [Allocated(device, "dev", VFIO_CONFIG)])
    assert [p.device for p in again] == [device]
    await backend.unprepare(ClaimRef("uid-2", "default", "vm"), again)


async def test_a_gpu_given_back_stays_published_until_nvml_lists_it(gpu_backend: tuple[NvidiaGpuBackend, Any]
                                                                     ) -> None:
    """The nvidia driver's link is back, but its probe has not finished and NVML does not list the GPU yet (the
    nvidia driver's folder does not name it): published as it was, and preparable, until NVML lists it."""
    backend, node = gpu_backend
    device, claim = "gpu-0000-18-00-0", ClaimRef("uid-1", "default", "vm")
    published = {d.name: d for d in (await backend.discover()).devices}[device]
    prepared = await backend.prepare(claim, [Allocated(device, "dev", VFIO_CONFIG)])
    await backend.unprepare(claim, prepared)
    probed = node.sysfs / "bus/pci/drivers/nvidia" / GPU_BDF
    target = os.readlink(probed)
    probed.unlink()  # the probe still running: NVML does not list the GPU
    inventory = await backend.discover()
    assert {d.name: d for d in inventory.devices}.get(device) == published
    assert any(f"GPU {GPU_BDF}: given back to the nvidia driver" in w for w in inventory.warnings)
    plain = await backend.prepare(ClaimRef("uid-2", "default", "pod"), [Allocated(device, "dev")])
    assert plain[0].edits.device_nodes[0].path == "/dev/nvidia0"
    await backend.unprepare(ClaimRef("uid-2", "default", "pod"), plain)

    probed.symlink_to(target)  # probed: NVML lists it
    assert device in names(await backend.discover())
    probed.unlink()
    assert device not in names(await backend.discover()), "kept only until NVML listed it again"
    probed.symlink_to(target)


async def test_a_node_kept_in_ram_does_not_cost_the_agent_a_descriptor_per_driver_change(scratch: Path) -> None:
    # The scratch node lives in /dev/shm behind a /tmp link. umockdev's preload takes every file opened below /dev
    # for a device node and keeps a socket for it: the simulated kernel must name the node's files by the link.
    async with TestApiServer() as server:
        server.add_node(NODE)
        settings = settings_for(scratch, server.write_kubeconfig(scratch / "kubeconfig"), "dgx-h100",
                                backends=("sriov-nic",))
        assert settings.sim_root is not None
        preload_env(settings.sim_root)  # skips without umockdev
        agent = AgentProcess(settings)
        await agent.start()
        try:
            async with KubeletSimulator(settings.registry_dir) as kubelet:
                plugin = await kubelet.wait_for_plugin(SRIOV, timeout=scaled(30))
                assert agent.process is not None
                pid = agent.process.pid

                def descriptors() -> int:
                    return len(os.listdir(f"/proc/{pid}/fd"))

                before = descriptors()
                for cycle in range(8):
                    ref = allocate(server, f"dpdk-{cycle}", [("dev", SRIOV, "vf-0000-19-00-1")], passthrough(SRIOV))
                    assert (await plugin.prepare([ref]))[ref.uid].error == ""
                    assert (await plugin.unprepare([ref]))[ref.uid] == ""
                assert descriptors() - before < 20, "descriptors grow with every driver change"
        finally:
            await agent.stop()
