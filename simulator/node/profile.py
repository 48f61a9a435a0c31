"""Node profiles: the YAML description of a simulated node (its PCIe tree and the devices on it).

A profile lists root complexes; below each hang root ports (`ports`) or endpoints directly on the root bus
(`integrated`, as in cloud VMs). A port holds one device or a PCIe switch whose downstream ports hold more.
See docs/simulated-node.md for the schema with examples.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from simulator.node.catalog import GPU_MODELS, NIC_MODELS, TPU_MODELS

__all__ = [
    "GpuSpec",
    "NicSpec",
    "NodeProfile",
    "PciSpec",
    "ProfileError",
    "RootComplexSpec",
    "Slot",
    "TpuSpec",
    "builtin_profiles",
    "load_profile",
]


class ProfileError(Exception):
    """A profile cannot be found or is not a valid node description."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _short_form(value: Any) -> Any:
    """Allow `gpu: H100-SXM5-80GB` as shorthand for `gpu: {model: H100-SXM5-80GB}`."""
    return {"model": value} if isinstance(value, str) else value


class MigInstanceSpec(_Spec):
    """A MIG instance that exists when the node starts: profile name and placement start."""

    profile: str
    start: int = Field(ge=0, le=7)


class MigSpec(_Spec):
    enabled: bool = True
    instances: list[MigInstanceSpec] = []


def _in_catalog(catalog: Mapping[str, object], kind: str) -> AfterValidator:
    def check(name: str) -> str:
        if name not in catalog:
            raise ValueError(f"unknown {kind} model {name!r}; known: {', '.join(sorted(catalog))}")
        return name

    return AfterValidator(check)


GpuModelName = Annotated[str, _in_catalog(GPU_MODELS, "GPU")]
NicModelName = Annotated[str, _in_catalog(NIC_MODELS, "NIC")]
TpuModelName = Annotated[str, _in_catalog(TPU_MODELS, "TPU")]


class GpuSpec(_Spec):
    model: GpuModelName
    uuid: str | None = None
    mig: MigSpec | None = None
    faults: dict[str, int] = {}
    """NVML C symbol → error code returned for this GPU, e.g. {nvmlDeviceGetMemoryInfo: 15}."""

    @model_validator(mode="after")
    def _mig_capable(self) -> GpuSpec:
        model = GPU_MODELS[self.model]
        if self.mig and self.mig.enabled and not model.mig_profiles:
            raise ValueError(f"{self.model} does not support MIG")
        for inst in self.mig.instances if self.mig else []:
            names = [p.name for p in model.mig_profiles]
            if inst.profile not in names:
                raise ValueError(f"{self.model} has no MIG profile {inst.profile!r}; it has {', '.join(names)}")
        return self


class SriovSpec(_Spec):
    total_vfs: int = Field(ge=1, le=256)
    num_vfs: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _within_total(self) -> SriovSpec:
        if self.num_vfs > self.total_vfs:
            raise ValueError(f"num_vfs {self.num_vfs} exceeds total_vfs {self.total_vfs}")
        return self


class NicSpec(_Spec):
    model: NicModelName
    name: str | None = Field(default=None, max_length=15)
    """Netdev name of the physical function; derived from the bus number when absent."""
    sriov: SriovSpec | None = None
    link: Literal["up", "down"] = "up"

    @model_validator(mode="after")
    def _sriov_capable(self) -> NicSpec:
        model = NIC_MODELS[self.model]
        if self.sriov and self.sriov.total_vfs > model.max_vfs:
            raise ValueError(f"{self.model} supports at most {model.max_vfs} VFs")
        return self


class TpuSpec(_Spec):
    model: TpuModelName


def _dev_node(path: str) -> str:
    """A path below /dev: relative, plain names, no '.' or '..'."""
    parts = path.split("/")
    if not all(p and p not in (".", "..") and p.replace("{n}", "").replace("-", "").replace("_", "")
               .replace(".", "").isalnum() for p in parts):
        raise ValueError(f"{path!r} is not a path below /dev (names of letters, digits, '-', '_', '.' and {{n}})")
    return path


# Files the simulated tree writes in every function's folder.
_FUNCTION_FILES = frozenset({"vendor", "device", "class", "subsystem_vendor", "subsystem_device", "revision",
                             "numa_node", "driver_override", "config", "uevent", "driver", "subsystem",
                             "iommu_group", "remove", "reset", "enable", "local_cpulist", "local_cpus"})


class PciSpec(_Spec):
    """Any other PCI function, e.g. an FPGA card for a third-party backend."""

    vendor: int = Field(ge=0, le=0xFFFF)
    device: int = Field(ge=0, le=0xFFFF)
    class_code: int = Field(default=0x120000, ge=0, le=0xFFFFFF)
    driver: str | None = None
    dev_nodes: list[Annotated[str, AfterValidator(_dev_node)]] = []
    """Device nodes to create under /dev for it, e.g. ['acme/fpga{n}']: `{n}` is the function's number among the
    profile's functions with the same vendor and device id (0, 1, ... in the order the profile lists them), so
    `count` can repeat it."""
    char_class: str | None = Field(default=None, pattern=r"^[a-z][a-z0-9_]*$", max_length=32)
    """With a class name (e.g. 'acme_fpga') each device node is also the driver's class device in sysfs, as a real
    driver makes it: `<function>/<class>/<name>` with `dev` and `uevent` (DEVNAME), linked from
    `class/<class>/<name>`. Unbinding the driver takes them away with their nodes, binding brings them back."""

    sysfs_attributes: dict[Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]*$", max_length=64)], str] = {}
    """More files in the function's sysfs folder, name → content, e.g. {bitstream: factory}: state a driver
    exposes there (a write is kept, with no effect of its own)."""

    @model_validator(mode="after")
    def _nodes_for_class(self) -> PciSpec:
        if self.char_class and not self.dev_nodes:
            raise ValueError("char_class needs dev_nodes: the class devices are the device nodes")
        if self.char_class and not self.driver:
            raise ValueError("char_class needs a driver: class devices belong to the bound driver")
        taken = sorted(self.sysfs_attributes.keys() & _FUNCTION_FILES)
        if taken:
            raise ValueError(f"sysfs_attributes {taken} are files every PCI function has already")
        return self


class Slot(_Spec):
    """One occupant of a port: exactly one of gpu, nic, tpu, pci or switch; `count` repeats it."""

    gpu: GpuSpec | None = None
    nic: NicSpec | None = None
    tpu: TpuSpec | None = None
    pci: PciSpec | None = None
    switch: list[Slot] | None = None
    count: int = Field(default=1, ge=1, le=64)

    @field_validator("gpu", "nic", "tpu", mode="before")
    @classmethod
    def _expand(cls, v: Any) -> Any:
        return _short_form(v)

    @model_validator(mode="after")
    def _exactly_one(self) -> Slot:
        kinds = [k for k in ("gpu", "nic", "tpu", "pci", "switch") if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError(f"a slot holds exactly one of gpu, nic, tpu, pci, switch (got {kinds or 'none'})")
        if self.switch is not None and not self.switch:
            raise ValueError("a switch needs at least one downstream port")
        return self


class RootComplexSpec(_Spec):
    """A PCIe root complex (host bridge) and what hangs below it."""

    domain: int = Field(default=0, ge=0, le=0xFFFF)
    bus: int | None = Field(default=None, ge=0, le=0xFF)
    """Root bus number; the next free bus when absent."""
    numa_node: int = Field(default=-1, ge=-1)
    ports: list[Slot] = []
    integrated: list[Slot] = []

    @model_validator(mode="after")
    def _no_switch_on_root_bus(self) -> RootComplexSpec:
        if any(s.switch is not None for s in self.integrated):
            raise ValueError("a switch needs a root port: put it under ports, not integrated")
        return self


class NvidiaDriverSpec(_Spec):
    """The node's NVIDIA driver: its versions, and where and whether its user-space files are."""

    driver_version: str = "580.95.05"
    cuda_version: str = "13.0"
    layout: Literal["host", "container"] = "host"
    """Where the driver's user-space files (libnvidia-ml and the rest) are: installed on the host (/usr/lib/...),
    or in the GPU operator's driver container, whose root the host sees at /run/nvidia/driver."""
    installed: bool = True
    """Whether those files are there when the node is built; false stands for a driver container not up yet (see
    `simulator.node.driver_install.install_driver`)."""
    loaded: bool = True
    """Whether the kernel module is loaded; false makes nvmlInit fail with NVML_ERROR_DRIVER_NOT_LOADED."""

    @field_validator("cuda_version")
    @classmethod
    def _major_minor(cls, v: str) -> str:
        major, _, minor = v.partition(".")
        if not (major.isdigit() and minor.isdigit()):
            raise ValueError("cuda_version must look like 13.0")
        return v

    @property
    def cuda_driver_version(self) -> int:
        """NVML's integer form, e.g. 13000 for 13.0."""
        major, _, minor = self.cuda_version.partition(".")
        return int(major) * 1000 + int(minor) * 10


class NodeProfile(_Spec):
    """A simulated node."""

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    description: str = ""
    nvidia: NvidiaDriverSpec = NvidiaDriverSpec()
    root_complexes: list[RootComplexSpec] = Field(min_length=1)
    device_nodes: Literal["files", "char"] = "files"
    """What the node's /dev entries are: empty files (enough for the agent, and made by any user), or real
    character devices with /dev/null's numbers (made as root), for a container runtime that stats every device node
    a CDI spec names and creates it in the container (see `simulator.node.devnodes`)."""


def builtin_profiles() -> list[str]:
    """Names of the profiles shipped with the agent."""
    folder = resources.files("simulator.node") / "profiles"
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_profile(name_or_path: str) -> NodeProfile:
    """A built-in profile by name, or a profile from a YAML file path."""
    if name_or_path in builtin_profiles():
        text = (resources.files("simulator.node") / "profiles" / f"{name_or_path}.yaml").read_text()
        source = f"built-in profile {name_or_path}"
    elif name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path:
        path = Path(name_or_path)
        try:
            text = path.read_text()
        except OSError as e:
            raise ProfileError(f"cannot read profile {path}: {e.strerror or e}") from None
        source = str(path)
    else:
        raise ProfileError(
            f"unknown profile {name_or_path!r}; built-in profiles: {', '.join(builtin_profiles())} "
            "(or give the path of a YAML file)"
        )
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        raise ProfileError(f"{source}: not valid YAML{at}: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: expected a mapping with name and root_complexes")
    try:
        return NodeProfile.model_validate(data)
    except ValidationError as e:
        lines = [f"{source}: invalid profile:"]
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"])
            lines.append(f"  {loc or '(top)'}: {err['msg']}")
        raise ProfileError("\n".join(lines)) from None
