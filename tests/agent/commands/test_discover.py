"""`dra-agent discover` on the built-in simulated nodes: valid slices, the seed shapes, aligned topology."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import pytest

from simulator.node.profile import builtin_profiles
from tests.support.cli_env import CliResult
from tests.support.slice_checks import assert_valid_slices

PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
NUMA = "resource.kubernetes.io/numaNode"
SWITCH = "dra-agent.io/pcieSwitch"

Slices = list[dict[str, Any]]


def discover(run_cli: Callable[..., CliResult], profile: str, *extra: str) -> Slices:
    result = run_cli("discover", "--simulate", profile, "-o", "json", "--log-format", "json", *extra)
    assert result.code == 0, result.err
    assert "Traceback" not in result.err
    slices: Slices = json.loads(result.out) if result.out.strip() else []
    return slices


def devices(slices: Slices, driver: str) -> list[dict[str, Any]]:
    return [d for s in slices if s["spec"]["driver"] == driver for d in s["spec"].get("devices", [])]


def attr(device: dict[str, Any], key: str) -> Any:
    (value,) = device["attributes"][key].values()
    return value


def test_every_builtin_profile_is_there() -> None:
    assert set(builtin_profiles()) >= {
        "gke-n1-t4x2", "gke-g2-l4", "gke-n1-p4x4", "a2-highgpu-1g", "dgx-h100", "tpu-v5e-8", "mixed",
    }


@pytest.mark.parametrize("profile", builtin_profiles())
def test_builtin_profile_publishes_slices_the_cluster_accepts(run_cli: Callable[..., CliResult],
                                                               profile: str) -> None:
    slices = discover(run_cli, profile)
    assert slices, f"{profile} published nothing"
    assert_valid_slices(slices)
    for s in slices:
        assert s["spec"]["nodeName"] == profile
        assert s["spec"]["pool"]["name"] == profile
    for device in (d for s in slices for d in s["spec"].get("devices", [])):
        assert PCI_BUS_ID in device["attributes"] and PCIE_ROOT in device["attributes"], device["name"]


@pytest.mark.parametrize(
    ("profile", "count", "product"),
    [
        ("gke-n1-t4x2", 2, "Tesla T4"),
        ("gke-g2-l4", 1, "NVIDIA L4"),
        ("gke-n1-p4x4", 4, "Tesla P4"),
        ("a2-highgpu-1g", 1, "NVIDIA A100-SXM4-40GB"),
    ],
)
def test_seed_node_shapes(run_cli: Callable[..., CliResult], profile: str, count: int, product: str) -> None:
    gpus = devices(discover(run_cli, profile), "gpu.nvidia.com")
    assert len(gpus) == count
    assert {attr(g, "productName") for g in gpus} == {product}
    assert sorted(attr(g, "index") for g in gpus) == list(range(count))
    for gpu in gpus:
        assert attr(gpu, "type") == "gpu"
        assert attr(gpu, "uuid").startswith("GPU-")
        assert attr(gpu, "migEnabled") is False
        for key in ("cudaComputeCapability", "driverVersion", "cudaDriverVersion"):
            assert "version" in gpu["attributes"][key]
        assert gpu["capacity"]["memory"]["value"]


def test_a100_is_mig_capable_and_t4_is_not(run_cli: Callable[..., CliResult]) -> None:
    (a100,) = devices(discover(run_cli, "a2-highgpu-1g"), "gpu.nvidia.com")
    assert attr(a100, "migCapable") is True
    assert attr(a100, "architecture") == "Ampere"
    assert attr(a100, "cudaComputeCapability") == "8.0.0"
    assert attr(a100, "driverVersion") == "580.95.5"  # NVIDIA's 580.95.05, made valid semver
    t4s = devices(discover(run_cli, "gke-n1-t4x2"), "gpu.nvidia.com")
    assert {attr(t, "migCapable") for t in t4s} == {False}


def test_unknown_numa_is_not_published(run_cli: Callable[..., CliResult]) -> None:
    for gpu in devices(discover(run_cli, "gke-n1-p4x4"), "gpu.nvidia.com"):
        assert NUMA not in gpu["attributes"]


def test_dgx_h100_topology(run_cli: Callable[..., CliResult]) -> None:
    slices = discover(run_cli, "dgx-h100")
    gpus = devices(slices, "gpu.nvidia.com")
    vfs = devices(slices, "sriov.dra-agent.io")
    assert len(gpus) == 8
    assert {attr(g, "productName") for g in gpus} == {"NVIDIA H100 80GB HBM3"}
    assert len({attr(g, SWITCH) for g in gpus}) == 8, "every GPU under its own switch"
    per_root = Counter(attr(g, PCIE_ROOT) for g in gpus)
    assert len(per_root) == 4 and set(per_root.values()) == {2}
    assert Counter(attr(g, NUMA) for g in gpus) == {0: 4, 1: 4}
    assert len({attr(d, PCI_BUS_ID) for d in gpus + vfs}) == len(gpus) + len(vfs)
    pfs_by_switch: dict[str, set[str]] = defaultdict(set)
    for vf in vfs:
        pfs_by_switch[attr(vf, SWITCH)].add(attr(vf, "pfPciBusID"))
    for gpu in gpus:
        assert len(pfs_by_switch[attr(gpu, SWITCH)]) == 1, "each GPU shares its switch with exactly one PF"
    # The GPU and the VFs under one switch are also on the same root complex and NUMA node.
    for vf in vfs:
        (gpu,) = [g for g in gpus if attr(g, SWITCH) == attr(vf, SWITCH)]
        assert attr(vf, PCIE_ROOT) == attr(gpu, PCIE_ROOT) and attr(vf, NUMA) == attr(gpu, NUMA)


def test_dgx_h100_vfs(run_cli: Callable[..., CliResult]) -> None:
    vfs = devices(discover(run_cli, "dgx-h100"), "sriov.dra-agent.io")
    assert len(vfs) == 64
    assert Counter(attr(v, "pfPciBusID") for v in vfs).most_common()[-1][1] == 8
    for vf in vfs:
        assert attr(vf, "type") == "vf"
        assert attr(vf, "rdma") is True
        assert attr(vf, "driver") == "mlx5_core"
        assert attr(vf, "vendorID") == "15b3" and attr(vf, "deviceID") == "101e"
        assert attr(vf, "linkSpeedMbps") == 400000
        assert attr(vf, "netdev").startswith(attr(vf, "pfName").removesuffix("np0"))
    assert sorted({attr(v, "vfIndex") for v in vfs}) == list(range(8))


def test_tpu_v5e_host(run_cli: Callable[..., CliResult]) -> None:
    slices = discover(run_cli, "tpu-v5e-8")
    chips = devices(slices, "tpu.google.com")
    assert len(chips) == 8
    assert {attr(c, "generation") for c in chips} == {"v5e"}
    assert {attr(c, "deviceNodeKind") for c in chips} == {"vfio"}
    assert sorted(attr(c, "index") for c in chips) == list(range(8))
    assert Counter(attr(c, NUMA) for c in chips) == {0: 4, 1: 4}
    assert not devices(slices, "gpu.nvidia.com") and not devices(slices, "sriov.dra-agent.io")


def test_mixed_node_has_every_kind(run_cli: Callable[..., CliResult]) -> None:
    slices = discover(run_cli, "mixed")
    nvidia = devices(slices, "gpu.nvidia.com")
    kinds = Counter(attr(d, "type") for d in nvidia)
    assert kinds == {"gpu": 1, "mig": 3}, "the MIG-mode GPU is offered only through its MIG devices"
    migs = {attr(d, "profile"): d for d in nvidia if attr(d, "type") == "mig"}
    assert set(migs) == {"3g.40gb", "2g.20gb", "1g.10gb"}
    three = migs["3g.40gb"]
    assert attr(three, "placementStart") == 0 and attr(three, "placementSize") == 4
    assert three["capacity"]["multiprocessors"]["value"] == "42"
    assert three["capacity"]["memory"]["value"] == "40192Mi"
    (full,) = [d for d in nvidia if attr(d, "type") == "gpu"]
    assert {attr(m, "parentUUID") for m in migs.values()}.isdisjoint({attr(full, "uuid")})
    tpus = devices(slices, "tpu.google.com")
    assert Counter(attr(t, "deviceNodeKind") for t in tpus) == {"accel": 2, "vfio": 1}
    vfs = devices(slices, "sriov.dra-agent.io")
    assert Counter(attr(v, "driver") for v in vfs) == {"mlx5_core": 8, "iavf": 2}


def test_device_names_are_stable_across_runs(run_cli: Callable[..., CliResult]) -> None:
    first = discover(run_cli, "mixed")
    second = discover(run_cli, "mixed")
    assert first == second


def test_table_output_names_every_device(run_cli: Callable[..., CliResult]) -> None:
    result = run_cli("discover", "--simulate", "gke-n1-t4x2", "-o", "table")
    assert result.code == 0
    assert "gpu.nvidia.com  pool gke-n1-t4x2: 2 devices in 1 slice(s)" in result.out
    assert result.out.count("Tesla T4") == 2


def test_yaml_output_is_the_same_objects(run_cli: Callable[..., CliResult]) -> None:
    import yaml

    as_yaml = list(yaml.safe_load_all(run_cli("discover", "--simulate", "gke-g2-l4").out))
    assert as_yaml == discover(run_cli, "gke-g2-l4")


def test_node_name_flag_names_the_pool(run_cli: Callable[..., CliResult]) -> None:
    slices = discover(run_cli, "gke-g2-l4", "--node-name", "worker-7")
    assert {s["spec"]["pool"]["name"] for s in slices} == {"worker-7"}
    assert {s["spec"]["nodeName"] for s in slices} == {"worker-7"}


def test_driver_can_be_renamed(run_cli: Callable[..., CliResult], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRA_AGENT_DRIVER_NAMES", '{"gpu.nvidia.com": "gpu.example.org"}')
    slices = discover(run_cli, "gke-g2-l4")
    assert {s["spec"]["driver"] for s in slices} == {"gpu.example.org"}


def test_backends_can_be_restricted(run_cli: Callable[..., CliResult]) -> None:
    slices = discover(run_cli, "mixed", "--backends", "tpu")
    assert {s["spec"]["driver"] for s in slices} == {"tpu.google.com"}
