"""A simulated node on disk: its sysfs and /dev trees plus the simulated NVML plugged in under pynvml, with the
NVML's control channel served under the node's root while the node is in use."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from backends.simulation.catalog import GPU_MODELS
from backends.simulation.kernel import SimulatedKernel
from backends.simulation.kernel_process import KernelProcess
from backends.simulation.layout import NodePlan, plan_node
from backends.simulation.nvml import SimGpu, SimulatedNvml
from backends.simulation.nvml_control import control_socket, serve_control
from backends.simulation.nvml_persist import load_mig_state
from backends.simulation.profile import NodeProfile, ProfileError, load_profile
from backends.simulation.sysfs_tree import write_tree

__all__ = ["CONTAINER_DRIVER_ROOT", "SimulatedNode", "driver_root", "mig_minor", "simulated_node"]


@dataclass
class SimulatedNode:
    """The simulated hardware of one node, rooted at `root` (root/sys, root/dev)."""

    profile: NodeProfile
    plan: NodePlan
    root: Path
    nvml: SimulatedNvml

    @property
    def sysfs(self) -> Path:
        return self.root / "sys"

    @property
    def dev(self) -> Path:
        return self.root / "dev"

    @property
    def driver_root(self) -> Path:
        """Where the NVIDIA driver's user-space files are (or go), by the profile's layout."""
        return driver_root(self.root, self.profile.nvidia.layout)

    @classmethod
    def build(cls, profile: NodeProfile, root: Path) -> SimulatedNode:
        """Lay the profile out, write its trees under `root` and create its NVML state (not yet installed)."""
        plan = plan_node(profile)
        write_tree(plan, root / "sys", root / "dev")
        node = cls(profile, plan, root, _nvml(plan))
        node.nvml.state_file = root / _MIG_STATE
        node.nvml.sysfs_root = node.sysfs  # NVML lists the GPUs the nvidia driver holds there
        node.reboot()
        if plan.gpus and profile.nvidia.installed:
            _write_driver_files(node.driver_root, profile.nvidia.driver_version)
            _write_mig_minors(root, [g.minor for g in plan.gpus if GPU_MODELS[g.spec.model].mig_profiles])
        return node

    @property
    def control_socket(self) -> Path:
        """Where the node takes injected NVML events from other processes (see `nvml_control`)."""
        return control_socket(self.root)

    @property
    def boot_id_file(self) -> Path:
        return self.root / "proc/sys/kernel/random/boot_id"

    def reboot(self) -> str:
        """Give the node a new boot id, as a reboot does (MIG instances made since are gone at the next open);
        returns it."""
        (self.root / _MIG_STATE).unlink(missing_ok=True)
        self.boot_id_file.parent.mkdir(parents=True, exist_ok=True)
        boot_id = str(uuid.uuid4())
        self.boot_id_file.write_text(boot_id + "\n")
        return boot_id

    @classmethod
    def open(cls, profile: NodeProfile, root: Path) -> SimulatedNode:
        """The node kept at `root`: built there by an earlier run from the same profile, or built now.

        A kept node survives agent restarts, with whatever the agent changed in its sysfs, like real hardware.
        A folder holding a node of another profile, or anything else, is refused rather than overwritten.
        """
        marker = root / _MARKER
        fingerprint = profile.model_dump_json()
        if marker.exists():
            if marker.read_text() != fingerprint:
                raise ProfileError(f"{root} holds a simulated node of another profile; use an empty folder")
            plan = plan_node(profile)
            nvml = _nvml(plan)
            # MIG instances live on the GPUs until a reboot, not with the process that made them.
            load_mig_state(nvml.gpus, root / _MIG_STATE)
            nvml.state_file = root / _MIG_STATE
            nvml.sysfs_root = root / "sys"
            return cls(profile, plan, root, nvml)
        if root.exists() and any(root.iterdir()):
            raise ProfileError(f"{root} is not empty and holds no simulated node; use an empty folder")
        root.mkdir(parents=True, exist_ok=True)
        node = cls.build(profile, root)
        marker.write_text(fingerprint)
        return node


_MARKER = ".dra-agent-simulated-node.json"
CONTAINER_DRIVER_ROOT = "run/nvidia/driver"
"""Where the host sees the root of the GPU operator's driver container."""


def driver_root(root: Path, layout: str) -> Path:
    """The driver root of a node at `root` whose driver files have `layout` ("host" or "container")."""
    return root / CONTAINER_DRIVER_ROOT if layout == "container" else root
_MIG_STATE = ".sim/nvml-mig.json"


def _nvml(plan: NodePlan) -> SimulatedNvml:
    """The simulated NVIDIA driver of a node: its GPUs and their MIG instances from the profile."""
    profile = plan.profile
    gpus = [
        SimGpu(
            model=GPU_MODELS[g.spec.model],
            bus_id=g.bus_id,
            uuid=g.uuid,
            minor=g.minor,
            numa_node=g.numa_node,
            serial=f"{1650000000000 + g.minor:013d}",
            mig_enabled=bool(g.spec.mig and g.spec.mig.enabled),
            faults=dict(g.spec.faults),
        )
        for g in plan.gpus
    ]
    nvml = SimulatedNvml(
        gpus,
        driver_version=profile.nvidia.driver_version,
        cuda_driver_version=profile.nvidia.cuda_driver_version,
    )
    for g in plan.gpus:
        for inst in g.spec.mig.instances if g.spec.mig else []:
            try:
                nvml.create_instance(g.minor, inst.profile, inst.start)
            except Exception as e:
                raise ProfileError(
                    f"GPU {g.bus_id}: cannot create MIG instance {inst.profile} at {inst.start}: {e}"
                ) from None
    return nvml


# The NVIDIA driver's user-space files a GPU container gets, as an installed driver leaves them on the host.
_DRIVER_LIBRARIES = ("libcuda.so", "libnvidia-ml.so", "libnvidia-ptxjitcompiler.so", "libnvidia-nvvm.so",
                     "libnvcuvid.so", "libnvidia-encode.so")
_DRIVER_BINARIES = ("nvidia-smi", "nvidia-debugdump", "nvidia-cuda-mps-control")


def _write_driver_files(root: Path, version: str) -> None:
    libraries = root / "usr/lib/x86_64-linux-gnu"
    libraries.mkdir(parents=True, exist_ok=True)
    for base in _DRIVER_LIBRARIES:
        (libraries / f"{base}.{version}").write_bytes(b"\x7fELF simulated\n")
        (libraries / f"{base}.1").symlink_to(f"{base}.{version}")
    binaries = root / "usr/bin"
    binaries.mkdir(parents=True, exist_ok=True)
    for name in _DRIVER_BINARIES:
        (binaries / name).write_bytes(b"#!/bin/sh\n")
        (binaries / name).chmod(0o755)


# The NVIDIA driver's table of MIG capability minors: per GPU, 15 GPU instances of 1 + 8 entries (the GPU
# instance's access file, then its compute instances'), after "config" and "monitor"; the same on every host.
_MIG_GPU_INSTANCES, _MIG_COMPUTE_INSTANCES = 15, 8


def mig_minor(gpu_minor: int, gpu_instance: int, compute_instance: int | None = None) -> int:
    """The nvidia-caps minor of a GPU instance's (or one of its compute instances') access capability."""
    per_gi = 1 + _MIG_COMPUTE_INSTANCES
    base = 3 + gpu_minor * _MIG_GPU_INSTANCES * per_gi + gpu_instance * per_gi
    return base if compute_instance is None else base + 1 + compute_instance


def _write_mig_minors(root: Path, gpu_minors: list[int]) -> None:
    """/proc/driver/nvidia-caps/mig-minors and the /dev/nvidia-caps nodes of MIG-capable GPUs."""
    lines = ["config 1", "monitor 2"]
    for minor in range(max(gpu_minors, default=-1) + 1):
        for gi in range(_MIG_GPU_INSTANCES):
            lines.append(f"gpu{minor}/gi{gi}/access {mig_minor(minor, gi)}")
            lines.extend(f"gpu{minor}/gi{gi}/ci{ci}/access {mig_minor(minor, gi, ci)}"
                         for ci in range(_MIG_COMPUTE_INSTANCES))
    table = root / "proc/driver/nvidia-caps/mig-minors"
    table.parent.mkdir(parents=True, exist_ok=True)
    table.write_text("\n".join(lines) + "\n")
    caps = root / "dev/nvidia-caps"
    caps.mkdir(parents=True, exist_ok=True)
    for minor in gpu_minors:
        for gi in range(_MIG_GPU_INSTANCES):
            for cap in (mig_minor(minor, gi), *(mig_minor(minor, gi, ci) for ci in range(_MIG_COMPUTE_INSTANCES))):
                (caps / f"nvidia-cap{cap}").write_bytes(b"")


def _memory_dir() -> str | None:
    """A RAM-backed scratch directory when there is one: like the real sysfs, the simulated one lives in
    memory; on a disk every file creation costs a journal write and building a large node takes seconds."""
    for candidate in (os.environ.get("XDG_RUNTIME_DIR"), "/dev/shm"):
        if candidate and os.path.isdir(candidate) and os.access(candidate, os.W_OK):
            return candidate
    return None  # the system's temporary directory


@contextmanager
def simulated_node(profile: str | NodeProfile, root: Path | None = None,
                   kernel_process: bool = False) -> Iterator[SimulatedNode]:
    """A node from a profile (name, path or object) with its NVML installed, its control channel served and its
    kernel reacting to sysfs writes (see `kernel`) for the duration of the block: from a thread of this process,
    or with `kernel_process` from a process of its own (see `kernel_process`), as for `dra-agent run`.

    Without `root` the node lives in a temporary folder removed afterwards; with `root` it is kept there
    (see `SimulatedNode.open`).
    """
    spec = load_profile(profile) if isinstance(profile, str) else profile
    if root is not None:
        node = SimulatedNode.open(spec, root)
        with node.nvml, serve_control(node.nvml, node.root), _kernel(node, kernel_process):
            yield node
        return
    base = Path(tempfile.mkdtemp(prefix=f"dra-sim-{spec.name}-", dir=_memory_dir()))
    try:
        node = SimulatedNode.build(spec, base)
        with node.nvml, serve_control(node.nvml, node.root), _kernel(node, kernel_process):
            yield node
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _kernel(node: SimulatedNode, in_process_of_its_own: bool) -> SimulatedKernel | KernelProcess:
    if in_process_of_its_own:
        return KernelProcess(node.root, node.profile)
    return SimulatedKernel(node.root, node.plan)
