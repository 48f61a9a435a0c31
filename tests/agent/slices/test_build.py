"""Desired slices: order, chunking within the API limits, counters apart, invalid devices left out."""

from __future__ import annotations

from typing import Any

import pytest

from agent.node.inventory import BackendReport, merge_pools
from agent.node.plugins import FoundPlugin, LoadedPlugin
from agent.slices.build import device_body, pool_slices, slice_index
from backends.contract import CounterConsumption, CounterSet, Device, Inventory, Version
from backends.topology import PciTopology
from tests.support.slice_checks import assert_valid_slices


def gpus(n: int, **extra: Any) -> list[Device]:
    return [Device(name=f"dev-{i:04d}", attributes={"index": i}, capacity={"memory": 80 << 30}, **extra)
            for i in range(n)]


def spec_devices(result: Any) -> list[list[str]]:
    return [[d["name"] for d in s["spec"].get("devices", [])] for s in result.slices]


def test_attribute_and_capacity_forms() -> None:
    topo = PciTopology("0000:3b:00.0", pcie_root="pci0000:3a", pcie_switch="0000:39:00.0", numa_node=1)
    body = device_body(Device(
        name="gpu-0",
        attributes={"migCapable": True, "index": 3, "productName": "X", "driverVersion": Version("580.95.5")},
        capacity={"memory": 85899345920, "multiprocessors": 132},
        topology=topo,
    ))
    assert body["attributes"] == {
        "dra-agent.io/pcieSwitch": {"string": "0000:39:00.0"},
        "driverVersion": {"version": "580.95.5"},
        "index": {"int": 3},
        "migCapable": {"bool": True},
        "productName": {"string": "X"},
        "resource.kubernetes.io/numaNode": {"int": 1},
        "resource.kubernetes.io/pciBusID": {"string": "0000:3b:00.0"},
        "resource.kubernetes.io/pcieRoot": {"string": "pci0000:3a"},
    }
    assert body["capacity"] == {"memory": {"value": "80Gi"}, "multiprocessors": {"value": "132"}}


def test_backend_cannot_override_topology_attributes() -> None:
    device = Device(name="d", attributes={"resource.kubernetes.io/pcieRoot": "pci9999:00"},
                    topology=PciTopology("0000:3b:00.0", pcie_root="pci0000:3a"))
    result = pool_slices("gpu.example.com", "node-a", [device])
    assert result.device_count == 0
    assert "set from the PCI topology" in result.rejected[0]


@pytest.mark.parametrize(("count", "sizes"), [(1, [1]), (128, [128]), (129, [128, 1]), (300, [128, 128, 44])])
def test_chunks_of_128(count: int, sizes: list[int]) -> None:
    result = pool_slices("gpu.example.com", "node-a", list(reversed(gpus(count))))
    assert [len(s) for s in spec_devices(result)] == sizes
    names = [n for chunk in spec_devices(result) for n in chunk]
    assert names == sorted(names), "devices are published in name order"
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in result.slices} == {len(sizes)}
    assert_valid_slices(result.slices)


def test_counter_consumers_take_64_per_slice_and_counters_live_apart() -> None:
    sets = [CounterSet(f"gpu-{i}-counters", {"memory": 80 << 30, "memory-slice-0": 1}) for i in range(10)]
    consumers = [
        Device(name=f"gpu-{i}-part-{j}",
               consumes_counters=(CounterConsumption(f"gpu-{i}-counters", {"memory": 1 << 30}),))
        for i in range(10) for j in range(10)
    ]
    result = pool_slices("gpu.example.com", "node-a", consumers + gpus(5), sets)
    counter_slices = [s for s in result.slices if "sharedCounters" in s["spec"]]
    assert [len(s["spec"]["sharedCounters"]) for s in counter_slices] == [8, 2]
    assert all("devices" not in s["spec"] for s in counter_slices)
    device_slices = [s for s in result.slices if "devices" in s["spec"]]
    assert all(len(s["spec"]["devices"]) <= 64 for s in device_slices)
    assert sum(len(s["spec"]["devices"]) for s in device_slices) == 105
    assert_valid_slices(result.slices)


def test_a_mixed_slice_drops_to_64_when_a_heavy_device_joins() -> None:
    light = gpus(100)
    heavy = Device(name="dev-0050a", consumes_counters=(CounterConsumption("c", {"x": 1}),))
    result = pool_slices("gpu.example.com", "node-a", [*light, heavy], [CounterSet("c", {"x": 1})])
    sizes = [len(s) for s in spec_devices(result) if s]
    assert max(sizes) <= 128 and sum(sizes) == 101
    for s in result.slices:
        devices = s["spec"].get("devices", [])
        if any("consumesCounters" in d for d in devices):
            assert len(devices) <= 64
    assert_valid_slices(result.slices)


def test_empty_pool_still_has_one_slice() -> None:
    result = pool_slices("gpu.example.com", "node-a", [])
    assert len(result.slices) == 1
    assert "devices" not in result.slices[0]["spec"] and "sharedCounters" not in result.slices[0]["spec"]
    assert_valid_slices(result.slices)


def test_invalid_devices_are_left_out_with_reasons() -> None:
    bad = [
        Device(name="Bad_Name"),
        Device(name="long-string", attributes={"model": "x" * 65}),
        Device(name="bad-key", attributes={"not-an-identifier": 1}),
        Device(name="too-many", attributes={f"a{i}": i for i in range(33)}),
    ]
    result = pool_slices("gpu.example.com", "node-a", [*bad, *gpus(2)])
    assert result.device_count == 2
    assert len(result.rejected) == 4
    assert any(r.startswith("Bad_Name:") for r in result.rejected)
    assert_valid_slices(result.slices)


def test_generation_and_metadata() -> None:
    result = pool_slices("gpu.example.com", "node-a", gpus(3), generation=7)
    (obj,) = result.slices
    assert obj["apiVersion"] == "resource.k8s.io/v1" and obj["kind"] == "ResourceSlice"
    assert obj["spec"]["pool"] == {"name": "node-a", "generation": 7, "resourceSliceCount": 1}
    assert obj["spec"]["nodeName"] == "node-a" and obj["spec"]["driver"] == "gpu.example.com"
    assert obj["metadata"]["generateName"] == "00000-gpu.example.com-node-a-"
    assert obj["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "dra-agent",
                                         "dra-agent.io/driver": "gpu.example.com", "dra-agent.io/node": "node-a"}


def test_slice_names_carry_their_index_first() -> None:
    result = pool_slices("gpu.example.com", "node-a", gpus(300))
    prefixes = [s["metadata"]["generateName"] for s in result.slices]
    assert prefixes == ["00000-gpu.example.com-node-a-", "00001-gpu.example.com-node-a-",
                        "00002-gpu.example.com-node-a-"]
    assert [slice_index(p + "x7k2p") for p in prefixes] == [0, 1, 2]
    assert slice_index("node-a-gpu.example.com-x7k2p") is None
    assert slice_index("0000g-a") is None and slice_index("000a") is None
    long_node = "a" * 40 + "." + "b" * 40  # a valid node name, too long for a label value
    assert "dra-agent.io/node" not in pool_slices("gpu.example.com", long_node, []).slices[0]["metadata"]["labels"]


def test_taints_and_the_fallback_when_the_cluster_drops_them() -> None:
    taint = {"key": "gpu.example.com/xid", "value": "79", "effect": "NoSchedule"}
    with_taints = pool_slices("gpu.example.com", "node-a", gpus(3), taints={"dev-0001": [taint]})
    devices = with_taints.slices[0]["spec"]["devices"]
    assert [d.get("taints") for d in devices] == [None, [taint], None]
    assert_valid_slices(with_taints.slices)
    fallback = pool_slices("gpu.example.com", "node-a", gpus(3), taints={"dev-0001": [taint]}, taints_supported=False)
    assert [d["name"] for d in fallback.slices[0]["spec"]["devices"]] == ["dev-0000", "dev-0002"]
    assert "dev-0001: tainted (gpu.example.com/xid)" in fallback.rejected[0]


def _report(name: str, driver: str, devices: list[Device]) -> BackendReport:
    found = FoundPlugin(name, "dist", "1", None)  # type: ignore[arg-type]
    return BackendReport(LoadedPlugin(found, None), driver, Inventory(devices=tuple(devices)))  # type: ignore[arg-type]


def test_backends_sharing_a_driver_form_one_pool_and_duplicates_are_refused() -> None:
    reports = [
        _report("nvidia-gpu", "gpu.nvidia.com", [Device(name="gpu-a"), Device(name="same")]),
        _report("nvidia-mig", "gpu.nvidia.com", [Device(name="gpu-a-mig"), Device(name="same")]),
        _report("tpu", "tpu.google.com", [Device(name="tpu-a")]),
    ]
    gpu_pool, tpu_pool = merge_pools(reports)
    assert gpu_pool.driver == "gpu.nvidia.com" and gpu_pool.backends == ("nvidia-gpu", "nvidia-mig")
    assert [d.name for d in gpu_pool.devices] == ["gpu-a", "gpu-a-mig", "same"]
    assert gpu_pool.problems == ("device same of backend nvidia-mig is also published by nvidia-gpu; left out",)
    assert [d.name for d in tpu_pool.devices] == ["tpu-a"]
