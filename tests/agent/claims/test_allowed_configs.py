"""Reconfiguration is the node operator's to allow: with the default settings a claim asking for vfio-pci
passthrough, a GPU sharing strategy (its compute mode) or a VF's interface in the pod fails, naming the
`allowed_configs` setting, and nothing on the node changes; a node that names the reconfiguration makes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent.claims.plan import Owner, plan_claim
from agent.claims.read import ClaimError, read_allocation
from backends.config import CONFIG_API_VERSION, Reconfiguration
from backends.contract import ClaimRef
from backends.nvidia.config import GpuConfig
from backends.nvidia.gpu import NvidiaGpuBackend
from backends.sriov.backend import SriovNicBackend
from backends.sriov.vf_config import VfConfig
from backends.vfio import VfioConfig
from simulator.kubelet import KubeletSimulator
from tests.support.agent_env import ALL_RECONFIGURATIONS, agent_in_process, allocate

POOL, GPU, SRIOV = "node-a", "gpu.nvidia.com", "sriov.dra-agent.io"
GPU_DEVICE, VF_DEVICE, GPU_BDF = "gpu-0000-18-00-0", "vf-0000-19-00-1", "0000:18:00.0"
VFIO = {"apiVersion": CONFIG_API_VERSION, "kind": "VfioConfig"}


def gpu_config(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": CONFIG_API_VERSION, "kind": "GpuConfig", **fields}


def claim(driver: str, device: str, parameters: dict[str, Any], source: str = "FromClaim") -> dict[str, Any]:
    return {"metadata": {"uid": "u1", "namespace": "team-a", "name": "c"},
            "status": {"allocation": {"devices": {
                "results": [{"driver": driver, "pool": POOL, "request": "dev", "device": device}],
                "config": [{"source": source, "requests": ["dev"],
                            "opaque": {"driver": driver, "parameters": parameters}}]}}}}


def plan(driver: str, device: str, parameters: dict[str, Any], allowed: tuple[str, ...] = (),
         source: str = "FromClaim") -> object:
    backend = NvidiaGpuBackend() if driver == GPU else SriovNicBackend()
    owner = Owner(backend.name, backend, tuple(backend.config_types))
    allocation = read_allocation(claim(driver, device, parameters, source), ClaimRef("u1", "team-a", "c"), driver)
    return plan_claim(allocation, POOL, driver, lambda name: owner, allowed=allowed)


ASKING = [
    (GPU, GPU_DEVICE, VFIO, "VfioConfig"),
    (SRIOV, VF_DEVICE, VFIO, "VfioConfig"),
    (GPU, GPU_DEVICE, gpu_config(sharing={"strategy": "TimeSlicing"}), "GpuConfig.sharing.TimeSlicing"),
    (GPU, GPU_DEVICE, gpu_config(sharing={"strategy": "ExclusiveProcess"}), "GpuConfig.sharing.ExclusiveProcess"),
    (GPU, GPU_DEVICE, gpu_config(sharing={"strategy": "MPS"}), "GpuConfig.sharing.MPS"),
    (SRIOV, VF_DEVICE, {"apiVersion": CONFIG_API_VERSION, "kind": "VfConfig", "netDevice": {"name": "net1"}},
     "VfConfig.netDevice"),
]


@pytest.mark.parametrize(("driver", "device", "parameters", "name"), ASKING)
def test_a_reconfiguration_not_allowed_fails_the_claim_naming_the_setting(driver: str, device: str,
                                                                         parameters: dict[str, Any],
                                                                         name: str) -> None:
    with pytest.raises(ClaimError) as refused:
        plan(driver, device, parameters)
    kind = parameters["kind"]
    assert str(refused.value).startswith(f"device {device} (request dev): its {kind} asks for {name} (")
    assert str(refused.value).endswith("which this node does not allow: its operator allows it by naming it in the "
                                       "allowed_configs setting (now none)")
    others = tuple(n for n in ALL_RECONFIGURATIONS if n != name)
    with pytest.raises(ClaimError, match=f"asks for {name.replace('.', '[.]')} "):
        plan(driver, device, parameters, allowed=others)
    assert plan(driver, device, parameters, allowed=(name,))


def test_a_device_class_asking_for_one_is_refused_alike() -> None:
    """The node decides what it does, whoever wrote the configuration: a class is usable by every claim writer."""
    with pytest.raises(ClaimError, match="asks for VfioConfig"):
        plan(GPU, GPU_DEVICE, VFIO, source="FromClass")


@pytest.mark.parametrize("parameters", [gpu_config(), gpu_config(driverCapabilities=["compute", "video"]),
                                        gpu_config(sharing=None),
                                        {"apiVersion": CONFIG_API_VERSION, "kind": "VfConfig"},
                                        {"apiVersion": CONFIG_API_VERSION, "kind": "VfConfig", "netDevice": None}])
def test_parameters_asking_for_no_reconfiguration_need_no_allowance(parameters: dict[str, Any]) -> None:
    driver, device = (GPU, GPU_DEVICE) if parameters["kind"] == "GpuConfig" else (SRIOV, VF_DEVICE)
    assert plan(driver, device, parameters)


def test_every_reconfiguration_is_declared_once_with_what_it_does() -> None:
    declared = [r for kind in (GpuConfig, VfioConfig, VfConfig) for r in kind.RECONFIGURATIONS]
    assert sorted(r.name for r in declared) == sorted(ALL_RECONFIGURATIONS)
    assert all(r.what for r in declared)
    assert Reconfiguration("X.a.b", ("a", "b"), "on").asked_by({"a": {"b": "on"}})
    assert not Reconfiguration("X.a.b", ("a", "b"), "on").asked_by({"a": {"b": "off"}})
    assert not Reconfiguration("X.a", ("a",)).asked_by({"a": None})


async def test_the_default_node_refuses_passthrough_and_changes_nothing(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100", backends=("nvidia-gpu",), allowed_configs=()) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await kubelet.wait_for_plugin(GPU)
        vm = allocate(env.server, "vm", [("dev", GPU, GPU_DEVICE)], [
            {"source": "FromClaim", "requests": ["dev"], "opaque": {"driver": GPU, "parameters": VFIO}}])
        error = (await plugin.prepare([vm]))[vm.uid].error
        assert "asks for VfioConfig (binds the device's whole IOMMU group to vfio-pci for the claim), which this " \
               "node does not allow" in error
        assert env.settings.sim_root is not None
        driver = env.settings.sim_root / "sys/bus/pci/devices" / GPU_BDF / "driver"
        assert driver.resolve().name == "nvidia", "the GPU stays on its driver"
        assert not list(env.settings.cdi_dir.glob(f"*{vm.uid}*"))
        plain = allocate(env.server, "plain", [("dev", GPU, GPU_DEVICE)])
        assert (await plugin.prepare([plain]))[plain.uid].error == "", "the GPU is free for others"
