"""A simulated node's hardware on disk: its sysfs and /dev trees, its NVIDIA driver's files (among them the
simulated NVML library) and the NVML state of its GPUs. Serving it while it is in use (the kernel side: reactions
to sysfs writes, the NVML server, the control channel) is `simulator.node.node`'s and `simulator.kernel`'s job;
this module knows nothing of them, so the kernel's own process can open the node here."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from simulator.node.catalog import GPU_MODELS
from simulator.node.devnodes import make_device_node
from simulator.node.driver_install import driver_root, install_driver, install_mps_control, refresh_nvml_library
from simulator.node.layout import NodePlan, plan_node
from simulator.node.procfs import write_host_net
from simulator.node.profile import NodeProfile, ProfileError
from simulator.node.sysfs_tree import write_tree
from simulator.nvml.api import SimGpu, SimulatedNvml
from simulator.nvml.control import control_socket
from simulator.nvml.persist import load_mig_state

__all__ = ["SimulatedNode", "mig_minor"]


@dataclass
class SimulatedNode:
    """The simulated hardware of one node, rooted at `root` (root/sys, root/dev, the driver's files)."""

    profile: NodeProfile
    plan: NodePlan
    root: Path
    served_elsewhere: bool = False
    """Another process serves the node (this one attached to its kernel): its NVML state is not here."""

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

    @cached_property
    def nvml(self) -> SimulatedNvml:
        """The node's NVML state, as the process serving the node keeps it: the profile's GPUs and MIG instances,
        with what processes made on them since the node last rebooted. Only the serving process uses it (tests
        that open a node in their own process reach it here)."""
        if self.served_elsewhere:
            raise RuntimeError(f"the simulated node at {self.root} is served by another process: its GPUs are "
                               "reached through its NVML library and control channel only")
        nvml = _nvml(self.plan)
        load_mig_state(nvml.gpus, self.root / _MIG_STATE)  # MIG instances live until a reboot, like on hardware
        nvml.state_file = self.root / _MIG_STATE
        nvml.sysfs_root = self.sysfs  # NVML lists the GPUs the nvidia driver holds there
        nvml.driver_loaded = self.profile.nvidia.loaded
        return nvml

    @classmethod
    def build(cls, profile: NodeProfile, root: Path) -> SimulatedNode:
        """Lay the profile out under `root`: sysfs and /dev trees, the driver's files, a new boot."""
        plan = plan_node(profile)
        write_tree(plan, root / "sys", root / "dev")
        write_host_net(root)
        node = cls(profile, plan, root)
        node.reboot()
        node.nvml  # noqa: B018 - made now, so that a profile whose MIG instances do not fit is refused here
        if plan.gpus:
            char = profile.device_nodes == "char"
            _write_mig_minors(root, [g.minor for g in plan.gpus if GPU_MODELS[g.spec.model].mig_profiles], char)
            if profile.nvidia.installed:
                install_driver(root, profile.nvidia, [g.minor for g in plan.gpus], char=char)
        (root / _MARKER).write_text(profile.model_dump_json())
        return node

    @property
    def control_socket(self) -> Path:
        """Where the node takes injected NVML events from other processes (see `simulator.nvml.control`)."""
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
    def existing(cls, profile: NodeProfile, root: Path) -> SimulatedNode:
        """The node of `profile` already built at `root`; ProfileError when there is none, or one of another
        profile."""
        try:
            fingerprint = (root / _MARKER).read_text()
        except OSError:
            raise ProfileError(f"{root} holds no simulated node") from None
        if fingerprint != profile.model_dump_json():
            raise ProfileError(f"{root} holds a simulated node of another profile; use an empty folder")
        return cls(profile, plan_node(profile), root)

    @classmethod
    def open(cls, profile: NodeProfile, root: Path) -> SimulatedNode:
        """The node kept at `root`: built there by an earlier run from the same profile, or built now.

        A kept node survives agent restarts, with whatever the agent changed in its sysfs, like real hardware.
        A folder holding a node of another profile, or anything else, is refused rather than overwritten.
        """
        if (root / _MARKER).exists():
            node = cls.existing(profile, root)
            if profile.nvidia.installed:
                refresh_nvml_library(root, profile.nvidia)
                install_mps_control(driver_root(root, profile.nvidia.layout))
            return node
        if root.exists() and any(p.name != _SIM for p in root.iterdir()):
            raise ProfileError(f"{root} is not empty and holds no simulated node; use an empty folder")
        root.mkdir(parents=True, exist_ok=True)
        return cls.build(profile, root)


_MARKER = ".dra-agent-simulated-node.json"
_SIM = ".sim"  # the node's own sockets, lock and GPU state
_MIG_STATE = f"{_SIM}/nvml-mig.json"


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


# The NVIDIA driver's table of MIG capability minors: per GPU, 15 GPU instances of 1 + 8 entries (the GPU
# instance's access file, then its compute instances'), after "config" and "monitor"; the same on every host.
_MIG_GPU_INSTANCES, _MIG_COMPUTE_INSTANCES = 15, 8


def mig_minor(gpu_minor: int, gpu_instance: int, compute_instance: int | None = None) -> int:
    """The nvidia-caps minor of a GPU instance's (or one of its compute instances') access capability."""
    per_gi = 1 + _MIG_COMPUTE_INSTANCES
    base = 3 + gpu_minor * _MIG_GPU_INSTANCES * per_gi + gpu_instance * per_gi
    return base if compute_instance is None else base + 1 + compute_instance


def _write_mig_minors(root: Path, gpu_minors: list[int], char: bool) -> None:
    """/proc/driver/nvidia-caps/mig-minors and the /dev/nvidia-caps nodes of MIG-capable GPUs (`char` as for
    `make_device_node`)."""
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
                make_device_node(str(caps / f"nvidia-cap{cap}"), char=char)
