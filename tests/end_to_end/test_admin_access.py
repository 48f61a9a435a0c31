"""Admin access (KEP-5018): devices allocated with `adminAccess` are not in use. An admin claim (a monitoring pod) and
workload claims on the same GPU, MIG device or VF prepare and unprepare independently, in any order; an admin claim
never reconfigures a device (compute mode, MIG, vfio-pci), and its unprepare never undoes a workload's setup."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pynvml
import pytest
import yaml

from backends.nvidia.nvml import list_gpus, list_mig_devices, nvml_session
from simulator.kubelet import KubeletSimulator
from simulator.node.variants import in_mig_mode
from tests.support.agent_env import agent_in_process, allocate, simulated_nvml

GPU, NIC = "gpu.nvidia.com", "sriov.dra-agent.io"
DEVICE, BUS_ID = "gpu-0000-18-00-0", "0000:18:00.0"
VF, VF_BUS_ID = "vf-0000-19-00-1", "0000:19:00.1"
EXCLUSIVE = {"apiVersion": "dra-agent.io/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "ExclusiveProcess"}}
VFIO = {"apiVersion": "dra-agent.io/v1alpha1", "kind": "VfioConfig"}


def config(driver: str, parameters: dict[str, Any], request: str = "dev") -> list[dict[str, Any]]:
    return [{"source": "FromClaim", "requests": [request], "opaque": {"driver": driver, "parameters": parameters}}]


def driver_of(sim_root: Path, bus_id: str) -> str | None:
    link = sim_root / "sys/bus/pci/devices" / bus_id / "driver"
    return os.path.basename(os.readlink(link)) if link.is_symlink() else None


def nodes_of(cdi_dir: Path, uid: str) -> set[str]:
    spec = yaml.safe_load(next(cdi_dir.glob(f"*{uid}*")).read_text())
    edits = [d["containerEdits"] for d in spec["devices"]] + [spec.get("containerEdits") or {}]
    return {n["path"] for e in edits for n in e.get("deviceNodes") or ()}


@pytest.mark.parametrize("admin_first", [True, False])
async def test_an_admin_claim_and_a_workload_share_a_gpu_in_either_order(scratch: Path, admin_first: bool) -> None:
    async with agent_in_process(scratch, "dgx-h100", backends=("nvidia-gpu",)) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await kubelet.wait_for_plugin(GPU)
        nvml = simulated_nvml(env)
        # The monitoring pod's class carries a sharing config too: admin access never applies it.
        monitor = allocate(env.server, "monitor", [("dev", GPU, DEVICE)], config(GPU, EXCLUSIVE), admin=True)
        workload = allocate(env.server, "train", [("dev", GPU, DEVICE)], config(GPU, EXCLUSIVE))
        order = [monitor, workload] if admin_first else [workload, monitor]
        for claim in order:
            assert (await plugin.prepare([claim]))[claim.uid].error == ""
        assert nvml.compute_mode(0) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS, "the workload's mode"
        assert "/dev/nvidia0" in nodes_of(env.settings.cdi_dir, monitor.uid)

        assert (await plugin.unprepare([monitor]))[monitor.uid] == ""
        assert nvml.compute_mode(0) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS, "the workload's setup stays"
        again = allocate(env.server, "monitor-2", [("dev", GPU, DEVICE)], admin=True)
        assert (await plugin.prepare([again]))[again.uid].error == ""
        assert (await plugin.unprepare([workload]))[workload.uid] == ""
        assert nvml.compute_mode(0) == pynvml.NVML_COMPUTEMODE_DEFAULT, "the workload's unprepare undoes its mode"
        assert (await plugin.unprepare([again]))[again.uid] == ""
        other = allocate(env.server, "next", [("dev", GPU, DEVICE)])
        assert (await plugin.prepare([other]))[other.uid].error == "", "no admin claim held the GPU"


async def test_two_workloads_on_one_gpu_are_still_refused(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100", backends=("nvidia-gpu",)) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await kubelet.wait_for_plugin(GPU)
        first = allocate(env.server, "first", [("dev", GPU, DEVICE)])
        monitor = allocate(env.server, "monitor", [("dev", GPU, DEVICE)], admin=True)
        second = allocate(env.server, "second", [("dev", GPU, DEVICE)])
        assert (await plugin.prepare([first]))[first.uid].error == ""
        assert (await plugin.prepare([monitor]))[monitor.uid].error == ""
        error = (await plugin.prepare([second]))[second.uid].error
        assert error.startswith(f"device {DEVICE} is already prepared for claim default/first ({first.uid})")


async def test_admin_access_never_passes_a_device_through(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100", backends=("nvidia-gpu", "sriov-nic")) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        sim = env.settings.sim_root
        assert sim is not None
        for driver, device, bus_id, own in ((GPU, DEVICE, BUS_ID, "nvidia"), (NIC, VF, VF_BUS_ID, "mlx5_core")):
            plugin = await kubelet.wait_for_plugin(driver)
            claim = allocate(env.server, f"vm-{driver}", [("dev", driver, device)], config(driver, VFIO), admin=True)
            error = (await plugin.prepare([claim]))[claim.uid].error
            assert error == (f"{device}: allocated with admin access, which never reconfigures a device; "
                             "VfioConfig is not applied to it (use a device class without it)")
            assert driver_of(sim, bus_id) == own


async def test_an_admin_claim_watches_a_vf_passed_through_and_leaves_it_bound(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100", backends=("sriov-nic",)) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        sim = env.settings.sim_root
        assert sim is not None
        plugin = await kubelet.wait_for_plugin(NIC)
        monitor = allocate(env.server, "monitor", [("dev", NIC, VF)], admin=True)
        vm = allocate(env.server, "vm", [("dev", NIC, VF)], config(NIC, VFIO))
        assert (await plugin.prepare([monitor]))[monitor.uid].error == ""
        assert (await plugin.prepare([vm]))[vm.uid].error == "", "an admin claim does not hold the VF"
        assert driver_of(sim, VF_BUS_ID) == "vfio-pci"
        assert (await plugin.unprepare([monitor]))[monitor.uid] == ""
        assert driver_of(sim, VF_BUS_ID) == "vfio-pci", "the admin's unprepare leaves the VM's binding"
        assert (await plugin.unprepare([vm]))[vm.uid] == ""
        assert driver_of(sim, VF_BUS_ID) == "mlx5_core"


def mig_devices(bus_id: str) -> list[tuple[str, int]]:
    with nvml_session():
        gpus, _ = list_gpus()
        return sorted((m.profile, m.placement_start) for g in gpus if g.bus_id == bus_id for m in list_mig_devices(g))


async def test_admin_access_to_a_dynamic_mig_device_makes_and_destroys_nothing(scratch: Path) -> None:
    profile = in_mig_mode("dgx-h100", scratch)
    async with agent_in_process(scratch, str(profile), backend_config={"nvidia-mig": {"mode": "dynamic"}}) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await kubelet.wait_for_plugin(GPU)
        made, other = f"{DEVICE}-mig-3g40gb-9-0", f"{DEVICE}-mig-3g40gb-9-4"
        watch_unmade = allocate(env.server, "watch-unmade", [("mig", GPU, other)], admin=True)
        assert (await plugin.prepare([watch_unmade]))[watch_unmade.uid].error == ""
        assert mig_devices(BUS_ID) == [], "admin access made no MIG device"
        assert nodes_of(env.settings.cdi_dir, watch_unmade.uid) >= {"/dev/nvidia0"}

        watch = allocate(env.server, "watch", [("mig", GPU, made)], admin=True)
        workload = allocate(env.server, "train", [("mig", GPU, made)])
        assert (await plugin.prepare([watch]))[watch.uid].error == ""
        assert mig_devices(BUS_ID) == []
        assert (await plugin.prepare([workload]))[workload.uid].error == ""
        assert mig_devices(BUS_ID) == [("3g.40gb", 0)]
        late = allocate(env.server, "late-watch", [("mig", GPU, made)], admin=True)
        assert (await plugin.prepare([late]))[late.uid].error == ""
        assert nodes_of(env.settings.cdi_dir, late.uid) == nodes_of(env.settings.cdi_dir, workload.uid), (
            "a watcher of a MIG device a workload made gets that device's nodes")
        for claim in (watch, late, watch_unmade):
            assert (await plugin.unprepare([claim]))[claim.uid] == ""
        assert mig_devices(BUS_ID) == [("3g.40gb", 0)], "admin unprepares destroyed nothing"
        assert (await plugin.unprepare([workload]))[workload.uid] == ""
        assert mig_devices(BUS_ID) == []
