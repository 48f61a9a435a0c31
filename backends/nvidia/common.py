"""What the NVIDIA backends share: one NVML read per discovery, and the attributes every NVIDIA device carries
(full GPU or MIG): product, architecture and version facts."""

from __future__ import annotations

from collections.abc import Callable

from structlog.typing import FilteringBoundLogger

from backends.contract import AttributeValue, Inventory, Version
from backends.nvidia.nvml import (
    GpuInfo,
    GpuProblem,
    NvmlError,
    NvmlUnavailable,
    SystemInfo,
    list_gpus,
    nvml_session,
    system_info,
)

__all__ = ["clip", "gpu_attributes", "read_nvml"]

Reader = Callable[[SystemInfo, list[GpuInfo], list[GpuProblem]], Inventory]


def read_nvml(log: FilteringBoundLogger, read: Reader) -> Inventory:
    """Run `read` over the GPUs NVML sees, inside one NVML session (blocking: call from a worker thread).

    No NVIDIA driver on the host is not an error (an empty inventory); NVML failing as a whole is a warning.
    """
    try:
        with nvml_session():
            system = system_info()
            gpus, problems = list_gpus()
            return read(system, gpus, problems)
    except NvmlUnavailable as e:
        log.debug("no NVIDIA driver on this host", reason=str(e))
        return Inventory()
    except NvmlError as e:
        return Inventory(warnings=(f"NVML: {e}",))


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
