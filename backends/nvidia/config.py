"""Opaque configuration a claim or device class can give NVIDIA GPUs and MIG devices."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from backends.config import CONFIG_API_VERSION, OpaqueConfig
from backends.nvidia.driver_files import Capability

__all__ = ["DEFAULT_GPU_CONFIG", "GpuConfig"]


class GpuConfig(OpaqueConfig):
    """`apiVersion: dra-agent.io/v1alpha1`, `kind: GpuConfig`.

    `driverCapabilities` chooses which parts of the host's NVIDIA driver the container gets: `compute` (CUDA),
    `utility` (NVML, nvidia-smi), `video` (NVDEC/NVENC), `graphics` (OpenGL, EGL, Vulkan).
    """

    API_VERSION: ClassVar[str] = CONFIG_API_VERSION
    KIND: ClassVar[str] = "GpuConfig"

    driver_capabilities: tuple[Capability, ...] = Field(
        default=("compute", "utility"), alias="driverCapabilities", min_length=1, max_length=4
    )


DEFAULT_GPU_CONFIG = GpuConfig(api_version=CONFIG_API_VERSION, kind="GpuConfig")
"""What a GPU gets when its claim gives no GpuConfig."""
