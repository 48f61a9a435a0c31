"""Bad input and broken hardware: clear messages, the rest still published, no tracebacks."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import structlog

from backends.contract import Inventory
from backends.nvidia.common import nvidia_gpus_in_sysfs, read_nvml
from backends.vfio_sysfs import Deadline, Rebinder
from simulator.node.node import SimulatedNode
from tests.support.cli_env import CliResult
from tests.support.slice_checks import assert_valid_slices
from tests.support.timing import scaled


def host_flags(node: SimulatedNode) -> list[str]:
    return ["--sysfs-root", str(node.sysfs), "--dev-root", str(node.dev), "--node-name", "node-a"]


def names(out: str, driver: str) -> list[str]:
    return [d["name"] for s in json.loads(out) if s["spec"]["driver"] == driver for d in s["spec"].get("devices", [])]


def test_unknown_profile(run_cli: Callable[..., CliResult]) -> None:
    result = run_cli("discover", "--simulate", "dgx-h1000")
    assert result.code == 2
    assert "unknown profile 'dgx-h1000'" in result.err and "dgx-h100" in result.err
    assert "Traceback" not in result.err


def test_malformed_profile_yaml(run_cli: Callable[..., CliResult], scratch: Path) -> None:
    bad = scratch / "bad.yaml"
    bad.write_text("name: x\nroot_complexes:\n  - ports: [\n")
    result = run_cli("discover", "--simulate", str(bad))
    assert result.code == 2
    assert f"{bad}: not valid YAML at line" in result.err
    assert "Traceback" not in result.err


def test_profile_with_unknown_model_and_field(run_cli: Callable[..., CliResult], scratch: Path) -> None:
    bad = scratch / "bad.yaml"
    bad.write_text(
        "name: x\nroot_complexes:\n  - integrated:\n      - gpu: RTX-9090\n      - nic: {model: E810, vf: 3}\n"
    )
    result = run_cli("discover", "--simulate", str(bad))
    assert result.code == 2
    assert "unknown GPU model 'RTX-9090'" in result.err and "H100-SXM5-80GB" in result.err
    assert "root_complexes.0.integrated.1.nic.vf: Extra inputs are not permitted" in result.err


def test_missing_profile_file(run_cli: Callable[..., CliResult], scratch: Path) -> None:
    result = run_cli("discover", "--simulate", str(scratch / "nope.yaml"))
    assert result.code == 2 and "cannot read profile" in result.err


def test_nvml_error_on_one_gpu_leaves_the_others(run_cli: Callable[..., CliResult], scratch: Path) -> None:
    profile = scratch / "faulty.yaml"
    profile.write_text(
        "name: faulty\nroot_complexes:\n  - numa_node: 0\n    integrated:\n"
        "      - gpu: Tesla-T4\n"
        "      - gpu: {model: Tesla-T4, faults: {nvmlDeviceGetMemoryInfo: 15}}\n"
        "      - gpu: Tesla-T4\n"
    )
    result = run_cli("discover", "--simulate", str(profile), "-o", "json", "--log-format", "json")
    assert result.code == 0
    assert names(result.out, "gpu.nvidia.com") == ["gpu-0000-00-04-0", "gpu-0000-00-06-0"]
    problems = [json.loads(line) for line in result.err.splitlines() if "device problem" in line]
    assert len(problems) == 1
    assert "GPU 1" in problems[0]["problem"] and "nvmlDeviceGetMemoryInfo" in problems[0]["problem"]
    assert "Traceback" not in result.err


def test_unreadable_sysfs_attributes(run_cli: Callable[..., CliResult],
                                     sim_node: Callable[[str], SimulatedNode]) -> None:
    node = sim_node("dgx-h100")
    vf_numa = node.sysfs / "bus/pci/devices/0000:19:00.3/numa_node"
    vf_numa.unlink()
    vf_numa.mkdir()  # reading a directory fails, even as root
    pf_total = node.sysfs / "bus/pci/devices/0000:1d:00.0/sriov_totalvfs"
    pf_total.unlink()
    pf_total.mkdir()
    result = run_cli("discover", *host_flags(node), "-o", "json", "--log-format", "json")
    assert result.code == 0, result.err
    vfs = names(result.out, "sriov.dra-agent.io")
    assert len(vfs) == 56, "the PF whose files cannot be read loses its 8 VFs, nothing else"
    assert not any(v.startswith("vf-0000-1d-") for v in vfs)
    assert "vf-0000-19-00-3" in vfs, "a VF with an unreadable NUMA node is still published"
    slices = json.loads(result.out)
    (vf,) = [d for s in slices for d in s["spec"].get("devices", []) if d["name"] == "vf-0000-19-00-3"]
    assert "resource.kubernetes.io/numaNode" not in vf["attributes"]
    assert_valid_slices(slices)
    assert "0000:19:00.3: numa_node" in result.err and "Is a directory" in result.err
    assert "NIC 0000:1d:00.0" in result.err
    assert "Traceback" not in result.err


def test_host_without_supported_hardware(run_cli: Callable[..., CliResult], scratch: Path) -> None:
    (scratch / "sys").mkdir()
    (scratch / "dev").mkdir()
    result = run_cli("discover", "--sysfs-root", str(scratch / "sys"), "--dev-root", str(scratch / "dev"),
                     "--node-name", "plain", "-o", "json")
    assert result.code == 0
    assert result.out.strip() in ("", "[]")
    assert "No supported devices found on node plain" in result.err


def test_a_backend_no_package_provides_is_bad_input(run_cli: Callable[..., CliResult]) -> None:
    result = run_cli("discover", "--simulate", "gke-g2-l4", "--backends", "fpga", "--log-format", "json")
    assert result.code == 2
    assert "unknown backend(s) fpga; installed backends: nvidia-gpu, nvidia-mig, sriov-nic, tpu" in result.err
    assert result.out == ""


def test_invalid_settings(run_cli: Callable[..., CliResult]) -> None:
    result = run_cli("discover", "--simulate", "gke-g2-l4", "--node-name", "Not_A_Node")
    assert result.code == 2
    assert "node_name = 'Not_A_Node' (from flag --node-name)" in result.err
    assert "Traceback" not in result.err


def test_backend_config_errors_name_the_backend(run_cli: Callable[..., CliResult], scratch: Path) -> None:
    config = scratch / "agent.yaml"
    config.write_text("backend_config:\n  nvidia-mig: {mode: sideways}\n")
    result = run_cli("discover", "--simulate", "mixed", "--config", str(config), "-o", "json")
    assert result.code == 2, "a mistake in the settings is the operator's to fix, not a backend left out"
    assert (f'backend_config.nvidia-mig.mode = "sideways" (from config file {config}): '
            "Input should be 'static' or 'dynamic'") in result.err
    assert not result.out


def test_nvidia_gpus_without_nvml_are_unserved_and_a_node_without_them_is_quiet(
        sim_node: Callable[[str], SimulatedNode], scratch: Path) -> None:
    profile = scratch / "no-driver.yaml"
    profile.write_text("name: no-driver\nnvidia: {installed: false}\nroot_complexes:\n  - ports:\n"
                       "      - gpu: {model: Tesla-T4}\n        count: 3\n"
                       "      - pci: {vendor: 0x10de, device: 0x1ad6, class_code: 0x0c0330}\n")  # NVIDIA, but USB
    node = sim_node(str(profile))
    gpus = [g.bus_id for g in node.plan.gpus]
    Rebinder(node.sysfs).to_vfio(gpus[0], Deadline(scaled(10)))  # passed through: NVML would not serve it anyway
    assert nvidia_gpus_in_sysfs(node.sysfs) == gpus[1:]
    inventory = read_nvml(structlog.get_logger(), node.sysfs, lambda *_: Inventory())
    (unserved,) = inventory.unserved
    assert unserved.devices == tuple(gpus[1:]) and inventory.devices == ()
    assert f"no loadable libnvidia-ml.so.1 in the driver root {node.root}" in unserved.reason
    assert "--driver-root" in unserved.reason

    quiet = sim_node("tpu-v5e-8")
    assert read_nvml(structlog.get_logger(), quiet.sysfs, lambda *_: Inventory()) == Inventory()


def test_backends_says_why_gpus_cannot_be_served(run_cli: Callable[..., CliResult], scratch: Path) -> None:
    profile = scratch / "container.yaml"
    profile.write_text("name: container\nnvidia: {layout: container}\nroot_complexes:\n  - ports:\n"
                       "      - gpu: {model: L4}\n")
    # The driver is in a driver container's root, and the agent is not told: its GPU cannot be served.
    result = run_cli("backends", "--simulate", str(profile), "--sim-root", str(scratch / "node"), "-o", "json")
    assert result.code == 0
    (row,) = [r for r in json.loads(result.out) if r["name"] == "nvidia-gpu"]
    assert row["status"].startswith("cannot serve 1 device(s): NVIDIA GPUs are on the node but NVML cannot be used")
    assert f"{scratch / 'node'}/usr/lib64/libnvidia-ml.so.1: not found" in row["status"]
    told = run_cli("backends", "--simulate", str(profile), "--sim-root", str(scratch / "node"), "-o", "json",
                   "--driver-root", str(scratch / "node/run/nvidia/driver"))
    (row,) = [r for r in json.loads(told.out) if r["name"] == "nvidia-gpu"]
    assert row["status"] == "1 device(s)"
