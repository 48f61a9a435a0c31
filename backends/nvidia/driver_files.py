"""The NVIDIA driver's user-space files that a GPU container needs, by driver capability, as CDI mounts.

Libraries are looked up in the driver root: first in the folder the loaded NVML library came from (the driver's
own), then in the usual library folders, preferring the exact version of the running driver; each is
bind-mounted read-only at its path in the driver root and at its soname (`.so.1`), so programs find it without an
ldconfig run in the container. Binaries come from the driver root's /usr/bin. The mount's host path is where the
container runtime on the host finds the file (its path below the host root: /run/nvidia/driver/usr/lib/... for
the GPU operator's driver container); its container path is its path in the driver root (/usr/lib/...). Only
files that exist are returned.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from backends.nvidia.driver_root import DriverRoot, library_dirs
from cdi.spec import Mount

__all__ = ["CAPABILITIES", "Capability", "driver_mounts"]

Capability = Literal["compute", "utility", "video", "graphics"]
CAPABILITIES: tuple[Capability, ...] = ("compute", "utility", "video", "graphics")

_LIBRARIES: dict[Capability, tuple[str, ...]] = {
    "utility": ("libnvidia-ml.so",),
    "compute": ("libcuda.so", "libnvidia-ptxjitcompiler.so", "libnvidia-nvvm.so", "libcudadebugger.so",
                "libnvidia-gpucomp.so"),
    "video": ("libnvcuvid.so", "libnvidia-encode.so", "libnvidia-opticalflow.so"),
    "graphics": ("libnvidia-glcore.so", "libnvidia-tls.so", "libnvidia-glsi.so", "libnvidia-eglcore.so",
                 "libEGL_nvidia.so", "libGLX_nvidia.so", "libGLESv2_nvidia.so"),
}
_BINARIES: dict[Capability, tuple[str, ...]] = {
    "utility": ("nvidia-smi", "nvidia-debugdump"),
    "compute": ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server"),
}
_BINARY_DIRS = ("usr/bin",)
_OPTIONS = ("ro", "nosuid", "nodev", "bind")


def _library(root: Path, folders: Iterable[str], base: str, version: str) -> Path | None:
    """The best versioned file of a library in the driver root (the agent's view), or None."""
    for folder in folders:
        exact = root / folder / f"{base}.{version}"
        if exact.is_file():
            return exact
    for folder in folders:
        try:
            names = os.listdir(root / folder)
        except OSError:
            continue
        versioned = sorted(n for n in names if n.startswith(f"{base}.") and n[len(base) + 1:][:1].isdigit()
                           and not os.path.islink(root / folder / n))
        if versioned:
            return root / folder / versioned[-1]
    return None


def _folders(driver: DriverRoot, nvml: Path | None) -> list[str]:
    folders = list(library_dirs())
    if nvml is not None and nvml.is_relative_to(driver.root):
        first = os.path.relpath(nvml.parent, driver.root)
        folders = [first, *(f for f in folders if f != first)]
    return folders


def driver_mounts(driver: DriverRoot, driver_version: str, capabilities: Iterable[Capability],
                  nvml: Path | None = None) -> tuple[Mount, ...]:
    """Bind mounts of the driver files for the given capabilities that exist in the driver root; `nvml` is the
    NVML library loaded from it, whose folder is searched first."""
    mounts: list[Mount] = []
    folders = _folders(driver, nvml)
    for capability in dict.fromkeys(capabilities):
        for base in _LIBRARIES.get(capability, ()):
            path = _library(driver.root, folders, base, driver_version)
            if path is not None:
                host, inside = driver.host_path(path), driver.container_path(path)
                mounts.append(Mount(host_path=host, container_path=inside, options=_OPTIONS))
                soname = f"{os.path.dirname(inside)}/{base}.1"
                if soname != inside:
                    mounts.append(Mount(host_path=host, container_path=soname, options=_OPTIONS))
        for name in _BINARIES.get(capability, ()):
            for folder in _BINARY_DIRS:
                path = driver.root / folder / name
                if path.is_file():
                    mounts.append(Mount(host_path=driver.host_path(path), container_path=driver.container_path(path),
                                        options=_OPTIONS))
                    break
    return tuple(mounts)
