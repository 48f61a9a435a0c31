"""Configuration of the NVIDIA backends: their own settings (health watching, MIG mode), and the opaque
configuration a claim or device class can give NVIDIA GPUs and MIG devices (driver files, GPU sharing)."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from backends.config import CONFIG_API_VERSION, BackendConfig, OpaqueConfig, Reconfiguration
from backends.nvidia.driver_files import Capability
from backends.nvidia.health_rules import DEFAULT_IGNORED_XIDS

__all__ = [
    "DEFAULT_GPU_CONFIG",
    "ExclusiveProcess",
    "GpuBackendConfig",
    "GpuConfig",
    "GpuSharingSettings",
    "MigBackendConfig",
    "MigMode",
    "Mps",
    "NvidiaHealthConfig",
    "Sharing",
    "TimeSlicing",
]


class NvidiaHealthConfig(BackendConfig):
    """What both NVIDIA backends' configurations hold: how GPU health is judged.

    `ignoredXids` lists the Xid codes that leave a GPU healthy (the whole list: the default is NVIDIA's list of
    application-caused Xids); `recheckSeconds` is how often a GPU that does not answer NVML is probed for its
    recovery (only while one does not). `nvmlRetrySeconds` is the longest wait between attempts to load NVML
    while the node has NVIDIA GPUs and NVML cannot be used (attempts start 1 s apart and double): a driver
    container that comes up after the agent is taken up within that long.
    """

    model_config = ConfigDict(populate_by_name=True)

    ignored_xids: frozenset[Annotated[int, Field(ge=0, le=0xFFFFFFFF)]] = Field(
        default=DEFAULT_IGNORED_XIDS, alias="ignoredXids"
    )
    recheck_seconds: float = Field(default=30.0, alias="recheckSeconds", gt=0, le=3600)
    nvml_retry_seconds: float = Field(default=30.0, alias="nvmlRetrySeconds", ge=1, le=3600)


class GpuSharingSettings(BaseModel):
    """`backend_config.nvidia-gpu.sharing`: whether full GPUs are offered to many claims at once.

    `byMemory: true` publishes every full GPU with `allowMultipleAllocations`: a claim asks for an amount of the
    GPU's `memory` capacity (`exactly.capacity.requests.memory`), in steps of `memoryStep` (1Gi unless set), and
    several claims share the GPU as long as their amounts fit in its memory. The amount is a promise the scheduler
    keeps, not a limit the GPU enforces (see docs/devices.md). Off by default: each GPU goes to one claim.
    """

    model_config = ConfigDict(populate_by_name=True, extra="forbid", frozen=True)

    by_memory: bool = Field(default=False, alias="byMemory")
    memory_step: int = Field(default=2**30, alias="memoryStep", ge=2**20)


class GpuBackendConfig(NvidiaHealthConfig):
    """`backend_config.nvidia-gpu`: health settings, and `sharing` (`GpuSharingSettings`)."""

    sharing: GpuSharingSettings = Field(default_factory=GpuSharingSettings)


MigMode = Literal["static", "dynamic"]


class MigBackendConfig(NvidiaHealthConfig):
    """`backend_config.nvidia-mig`: the health settings of nvidia-gpu, and how MIG-enabled GPUs are offered.

    `mode` `static` publishes the MIG devices that exist; `dynamic` publishes the whole GPU and every MIG profile
    at every placement as partitionable devices, and creates the MIG device a claim was allocated at prepare.
    `modelModes` overrides `mode` per GPU model (NVML's product name, e.g. "NVIDIA H100 80GB HBM3").
    """

    mode: MigMode = "static"
    model_modes: dict[str, MigMode] = Field(default_factory=dict, alias="modelModes")

    def mode_for(self, product_name: str) -> MigMode:
        return self.model_modes.get(product_name, self.mode)


class _Strategy(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TimeSlicing(_Strategy):
    """`strategy: TimeSlicing`: the processes of every container sharing the claim take turns on the GPU (its
    compute mode is set to DEFAULT). NVML has no call for the length of a turn, so the driver's own applies."""

    strategy: Literal["TimeSlicing"]


class ExclusiveProcess(_Strategy):
    """`strategy: ExclusiveProcess`: one process at a time owns the GPU (compute mode EXCLUSIVE_PROCESS); another
    process's CUDA context creation fails until it exits."""

    strategy: Literal["ExclusiveProcess"]


_MPS_REFUSED = ("MPS is not supported: it needs an MPS control daemon per claim with its pipe and log directories "
                "mounted into the containers, which dra-agent does not run; use TimeSlicing or ExclusiveProcess")


class Mps(_Strategy):
    """`strategy: MPS`: refused. CUDA MPS needs a control daemon per claim and its pipe and log directories
    mounted into every container, which the agent does not run."""

    # `not: {}` (nothing is valid) carries the refusal into the JSON schema the admission policy is made from.
    strategy: Literal["MPS"] = Field(json_schema_extra={"not": {}, "description": _MPS_REFUSED})

    @field_validator("strategy")
    @classmethod
    def _unsupported(cls, strategy: str) -> str:
        raise ValueError(_MPS_REFUSED)


Sharing = Annotated[TimeSlicing | ExclusiveProcess | Mps, Field(discriminator="strategy")]
"""How the containers and processes sharing a claim's GPU use it."""


class GpuConfig(OpaqueConfig):
    """`apiVersion: dra-agent.io/v1alpha1`, `kind: GpuConfig`.

    `driverCapabilities` chooses which parts of the host's NVIDIA driver the container gets: `compute` (CUDA),
    `utility` (NVML, nvidia-smi), `video` (NVDEC/NVENC), `graphics` (OpenGL, EGL, Vulkan). `sharing` (optional)
    sets how processes share the GPU: `{strategy: TimeSlicing}` or `{strategy: ExclusiveProcess}`; without it
    the GPU's compute mode is left as it is.
    """

    API_VERSION: ClassVar[str] = CONFIG_API_VERSION
    KIND: ClassVar[str] = "GpuConfig"
    # The GPU's compute mode is the GPU's, not the claim's: other shares of a GPU shared by memory must agree with
    # it. MPS, once supported, will be GpuConfig.sharing.MPS.
    RECONFIGURATIONS: ClassVar[tuple[Reconfiguration, ...]] = (
        Reconfiguration("GpuConfig.sharing.TimeSlicing", ("sharing", "strategy"), "TimeSlicing",
                        "sets the GPU's compute mode to Default for the claim"),
        Reconfiguration("GpuConfig.sharing.ExclusiveProcess", ("sharing", "strategy"), "ExclusiveProcess",
                        "sets the GPU's compute mode to Exclusive Process for the claim"),
    )

    driver_capabilities: tuple[Capability, ...] = Field(
        default=("compute", "utility"), alias="driverCapabilities", min_length=1, max_length=4
    )
    sharing: Sharing | None = None


DEFAULT_GPU_CONFIG = GpuConfig(api_version=CONFIG_API_VERSION, kind="GpuConfig")
"""What a GPU gets when its claim gives no GpuConfig."""
