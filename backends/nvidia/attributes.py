"""Attributes every NVIDIA device carries (full GPU or MIG): product, architecture and version facts."""

from __future__ import annotations

from backends.contract import AttributeValue, Version
from backends.nvidia.nvml import GpuInfo, SystemInfo

__all__ = ["clip", "gpu_attributes"]


def clip(text: str, limit: int = 64) -> str:
    """Cut a string attribute to the API's 64-byte limit without splitting a UTF-8 character."""
    return text.encode()[:limit].decode(errors="ignore")


def gpu_attributes(gpu: GpuInfo, system: SystemInfo) -> tuple[dict[str, AttributeValue], list[str]]:
    """Attributes shared by a GPU and its MIG devices, and problems with values that cannot be published."""
    problems: list[str] = []
    attrs: dict[str, AttributeValue] = {
        "productName": clip(gpu.product_name),
        "brand": gpu.brand,
        "architecture": gpu.architecture,
        "cudaComputeCapability": Version(f"{gpu.compute_capability[0]}.{gpu.compute_capability[1]}.0"),
    }
    try:
        attrs["driverVersion"] = Version.lenient(system.driver_version)
    except ValueError as e:
        problems.append(f"driverVersion left out: {e}")
    cuda = system.cuda_driver_version
    attrs["cudaDriverVersion"] = Version(f"{cuda // 1000}.{cuda % 1000 // 10}.0")
    return attrs, problems
