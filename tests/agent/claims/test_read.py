"""Reading claims for prepare: this driver's results, configuration precedence, refusals with reasons."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from agent.claims.opaque import effective_config
from agent.claims.read import ClaimError, check_reference, configs_for, read_allocation
from backends.contract import ClaimRef
from backends.nvidia.config import GpuConfig

UID = "0b7c8c5e-6f0a-4b8e-9d2a-1c3e5f7a9b0d"
REF = ClaimRef(UID, "team-a", "train-gpu")
DRIVER = "gpu.nvidia.com"


def claim(**changes: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "metadata": {"name": "train-gpu", "namespace": "team-a", "uid": UID},
        "status": {"allocation": {"devices": {
            "results": [
                {"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-0000-18-00-0"},
                {"request": "nic", "driver": "sriov.dra-agent.io", "pool": "node-a", "device": "vf-0000-19-00-1"},
                {"request": "big/h100", "driver": DRIVER, "pool": "node-a", "device": "gpu-0000-1c-00-0",
                 "adminAccess": True},
            ],
            "config": [
                {"source": "FromClaim", "requests": ["gpu"],
                 "opaque": {"driver": DRIVER, "parameters": _gpu_config("compute")}},
                {"source": "FromClass", "requests": [],
                 "opaque": {"driver": DRIVER, "parameters": _gpu_config("utility")}},
                {"source": "FromClaim", "requests": [],
                 "opaque": {"driver": DRIVER, "parameters": _gpu_config("video")}},
                {"source": "FromClaim", "requests": ["nic"],
                 "opaque": {"driver": "sriov.dra-agent.io", "parameters": {"anything": True}}},
            ],
        }}},
    }
    obj.update(changes)
    return obj


def _gpu_config(*capabilities: str) -> dict[str, Any]:
    return {"apiVersion": "dra-agent.io/v1alpha1", "kind": "GpuConfig", "driverCapabilities": list(capabilities)}


def test_only_this_drivers_results_and_configs() -> None:
    allocation = read_allocation(claim(), REF, DRIVER)
    assert [d.device for d in allocation.devices] == ["gpu-0000-18-00-0", "gpu-0000-1c-00-0"]
    assert [c.index for c in allocation.configs] == [0, 1, 2]
    big = allocation.devices[1]
    assert big.request == "big/h100" and big.request_name == "big" and big.admin_access


def test_configuration_precedence_class_then_claim_then_request() -> None:
    allocation = read_allocation(claim(), REF, DRIVER)
    gpu, big = allocation.devices
    assert [c.index for c in configs_for(allocation, gpu)] == [1, 2, 0]
    assert [c.index for c in configs_for(allocation, big)] == [1, 2]
    effective = effective_config(configs_for(allocation, gpu), (GpuConfig,), "nvidia-gpu")
    assert isinstance(effective, GpuConfig) and effective.driver_capabilities == ("compute",)
    assert effective_config(configs_for(allocation, big), (GpuConfig,), "nvidia-gpu").driver_capabilities == (
        "video",)


def test_subrequest_configs_match_their_parent_request() -> None:
    obj = claim()
    obj["status"]["allocation"]["devices"]["config"] = [
        {"source": "FromClaim", "requests": ["big"],
         "opaque": {"driver": DRIVER, "parameters": _gpu_config("graphics")}}]
    allocation = read_allocation(obj, REF, DRIVER)
    assert [c.index for c in configs_for(allocation, allocation.devices[1])] == [0]
    assert configs_for(allocation, allocation.devices[0]) == []


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"apiVersion": "dra-agent.io/v1alpha1", "kind": "TpuConfig"}, "does not accept apiVersion"),
        ({"apiVersion": "dra-agent.io/v1", "kind": "GpuConfig"}, "it accepts: dra-agent.io/v1alpha1/GpuConfig"),
        (_gpu_config("compute", "teleport"), "GpuConfig.driverCapabilities.1: Input should be"),
        ({**_gpu_config("compute"), "devices": ["/dev/sda"]}, "GpuConfig.devices: Extra inputs are not permitted"),
        ("just a string", "parameters must be an object"),
    ],
)
def test_invalid_opaque_config_names_the_field(parameters: Any, message: str) -> None:
    obj = claim()
    obj["status"]["allocation"]["devices"]["config"][1]["opaque"]["parameters"] = parameters
    allocation = read_allocation(obj, REF, DRIVER)
    with pytest.raises(ClaimError, match=message) as caught:
        effective_config(configs_for(allocation, allocation.devices[0]), (GpuConfig,), "nvidia-gpu")
    assert "opaque config #1 (from the device class, all requests)" in str(caught.value)


def test_uid_mismatch() -> None:
    obj = claim()
    obj["metadata"]["uid"] = "11111111-2222-3333-4444-555555555555"
    with pytest.raises(ClaimError, match="deleted and created again"):
        read_allocation(obj, REF, DRIVER)


def test_not_allocated() -> None:
    obj = claim()
    del obj["status"]["allocation"]
    with pytest.raises(ClaimError, match="is not allocated"):
        read_allocation(obj, REF, DRIVER)


def test_allocated_only_to_another_driver() -> None:
    with pytest.raises(ClaimError, match=r"no device allocated by driver tpu.google.com \(allocated by: gpu"):
        read_allocation(claim(), REF, "tpu.google.com")


@pytest.mark.parametrize(
    "mutate",
    [
        lambda c: c["status"]["allocation"]["devices"].update(results={"not": "a list"}),
        lambda c: c["status"]["allocation"]["devices"]["results"][0].pop("device"),
        lambda c: c["status"]["allocation"]["devices"]["config"][0].update(source="FromNowhere"),
        lambda c: c["status"]["allocation"]["devices"]["config"][0].update(requests=[1]),
    ],
)
def test_malformed_allocations(mutate: Any) -> None:
    obj = copy.deepcopy(claim())
    mutate(obj)
    with pytest.raises(ClaimError):
        read_allocation(obj, REF, DRIVER)


@pytest.mark.parametrize(
    "ref",
    [
        ClaimRef("../../etc/passwd", "ns", "n"),
        ClaimRef(UID.upper(), "ns", "n"),
        ClaimRef(UID, "Bad_NS", "n"),
        ClaimRef(UID, "ns", "x/../y"),
        ClaimRef("", "ns", "n"),
    ],
)
def test_references_no_api_server_would_produce(ref: ClaimRef) -> None:
    with pytest.raises(ClaimError):
        check_reference(ref)


def test_sound_reference() -> None:
    check_reference(REF)
