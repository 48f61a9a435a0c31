"""Configuration of the NVIDIA backends: their own settings (health watching, MIG mode), and the opaque
configuration a claim or device class can give NVIDIA GPUs and MIG devices (driver files, GPU sharing)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from backends.config import CONFIG_API_VERSION, BackendConfig, OpaqueConfig, Reconfiguration
from backends.nvidia.driver_files import Capability
from backends.nvidia.health_rules import DEFAULT_IGNORED_XIDS
from backends.vfio import VfioConfig

__all__ = [
    "DEFAULT_GPU_CONFIG",
    "ExclusiveProcess",
    "GpuBackendConfig",
    "GpuConfig",
    "GpuSharingSettings",
    "MemoryLimit",
    "MigBackendConfig",
    "MigMode",
    "Mps",
    "MpsConfig",
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


_BYTE_SUFFIXES = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30,
                  "Ti": 2**40}
_MEMORY = "^[0-9]{1,15}(k|M|G|T|Ki|Mi|Gi|Ti)?$"
_MEMORY_WORDS = "a whole amount of bytes with an optional suffix k, M, G, T, Ki, Mi, Gi or Ti (e.g. 4Gi)"


def _bytes(text: str) -> int:
    digits = text.rstrip("kMGTi")
    return int(digits) * _BYTE_SUFFIXES[text[len(digits):]]


def _memory(text: str) -> str:
    if re.fullmatch(_MEMORY, text) is None:
        raise ValueError(f"must be {_MEMORY_WORDS}")
    return text


# The pattern goes into the JSON schema (the admission policy); the validator says what is wrong in words.
MemoryLimit = Annotated[str, AfterValidator(_memory),
                        Field(json_schema_extra={"pattern": _MEMORY, "description": _MEMORY_WORDS})]
"""An amount of memory as a Kubernetes quantity in whole bytes (`4Gi`, `500M`, `1073741824`)."""


class MpsConfig(BaseModel):
    """`sharing.mpsConfig` of `strategy: MPS`: the limits the claim's MPS control daemon gives every client.

    Named as in NVIDIA's DRA driver (`MpsConfig`), so its `mpsConfig` block carries over unchanged, except that
    `defaultPerDevicePinnedMemoryLimit` is keyed by the device's name in the pool or its GPU UUID (not by an index
    into the claim's devices). `defaultActiveThreadPercentage` (1-100) bounds the share of a GPU's streaming
    multiprocessors each client may use; `defaultPinnedDeviceMemoryLimit` bounds the device memory each client may
    pin on every GPU of the claim, overridden per GPU by `defaultPerDevicePinnedMemoryLimit`. Limits larger than
    the GPU's memory, and keys that name no device of the claim, fail the claim at prepare.
    """

    model_config = ConfigDict(populate_by_name=True, extra="forbid", frozen=True)

    # Strict: a number written as a string is refused, as NVIDIA's Go types and the admission policy refuse it.
    default_active_thread_percentage: int | None = Field(
        default=None, alias="defaultActiveThreadPercentage", ge=1, le=100, strict=True)
    default_pinned_device_memory_limit: MemoryLimit | None = Field(default=None, alias="defaultPinnedDeviceMemoryLimit")
    default_per_device_pinned_memory_limit: dict[str, MemoryLimit] = Field(
        default_factory=dict, alias="defaultPerDevicePinnedMemoryLimit", max_length=32)

    def pinned_limits(self, devices: Mapping[str, str]) -> dict[str, int]:
        """The pinned memory limit in bytes per device of the claim that has one; `devices` maps each device's
        name to its GPU UUID. Raises ValueError naming a key that is no device of the claim."""
        limits: dict[str, int] = {}
        if self.default_pinned_device_memory_limit is not None:
            limits = {name: _bytes(self.default_pinned_device_memory_limit) for name in devices}
        by_uuid = {uuid: name for name, uuid in devices.items() if uuid}
        for key, limit in self.default_per_device_pinned_memory_limit.items():
            name = key if key in devices else by_uuid.get(key)
            if name is None:
                raise ValueError(f"defaultPerDevicePinnedMemoryLimit names {key!r}, which is not a device of this "
                                 f"claim (its devices: {', '.join(sorted(devices))}, or their GPU UUIDs)")
            limits[name] = _bytes(limit)
        return limits


class Mps(_Strategy):
    """`strategy: MPS`: CUDA MPS. The agent runs one MPS control daemon per claim, sets its GPUs to compute mode
    EXCLUSIVE_PROCESS (only the daemon's MPS server opens them; the containers' processes are its clients) and
    gives every container of the claim the daemon's pipe directory; `mpsConfig` sets the daemon's limits."""

    strategy: Literal["MPS"]
    mps_config: MpsConfig = Field(default_factory=MpsConfig, alias="mpsConfig")


Sharing = Annotated[TimeSlicing | ExclusiveProcess | Mps, Field(discriminator="strategy")]
"""How the containers and processes sharing a claim's GPU use it."""


class GpuConfig(OpaqueConfig):
    """`apiVersion: dra-agent.io/v1alpha1`, `kind: GpuConfig`.

    `driverCapabilities` chooses which parts of the host's NVIDIA driver the container gets: `compute` (CUDA),
    `utility` (NVML, nvidia-smi), `video` (NVDEC/NVENC), `graphics` (OpenGL, EGL, Vulkan). `sharing` (optional)
    sets how processes share the GPU: `{strategy: TimeSlicing}`, `{strategy: ExclusiveProcess}` or
    `{strategy: MPS, mpsConfig: {...}}`; without it the GPU's compute mode is left as it is.
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
        Reconfiguration("GpuConfig.sharing.MPS", ("sharing", "strategy"), "MPS",
                        "sets the GPU's compute mode to Exclusive Process and runs a CUDA MPS control daemon for the "
                        "claim"),
    )

    driver_capabilities: tuple[Capability, ...] = Field(
        default=("compute", "utility"), alias="driverCapabilities", min_length=1, max_length=4
    )
    sharing: Sharing | None = None

    def conflict(self, other: OpaqueConfig) -> str | None:
        if isinstance(self.sharing, Mps) and isinstance(other, VfioConfig):
            return ("GpuConfig.sharing MPS runs an MPS control daemon on the GPU through the nvidia driver, and "
                    "VfioConfig binds the GPU to vfio-pci, away from that driver: ask for one of them")
        return None


DEFAULT_GPU_CONFIG = GpuConfig(api_version=CONFIG_API_VERSION, kind="GpuConfig")
"""What a GPU gets when its claim gives no GpuConfig."""
