"""The NVIDIA driver's user-space files on the host that a GPU container needs, by driver capability.

Libraries are looked up under the host root in the usual library folders, preferring the exact version of the
running driver; each is bind-mounted read-only at its host path and at its soname (`.so.1`), so programs find
it without an ldconfig run in the container. Binaries come from /usr/bin. Only files that exist are returned.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

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
_LIBRARY_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib64", "usr/lib/aarch64-linux-gnu", "usr/lib")
_BINARY_DIRS = ("usr/bin",)
_OPTIONS = ("ro", "nosuid", "nodev", "bind")


def _library(host_root: Path, base: str, version: str) -> str | None:
    """Host path (as the runtime sees it) of the best versioned file of a library, or None."""
    for folder in _LIBRARY_DIRS:
        exact = f"{folder}/{base}.{version}"
        if os.path.isfile(host_root / exact):
            return f"/{exact}"
    for folder in _LIBRARY_DIRS:
        try:
            names = os.listdir(host_root / folder)
        except OSError:
            continue
        versioned = sorted(n for n in names if n.startswith(f"{base}.") and n[len(base) + 1 :][:1].isdigit()
                           and not os.path.islink(host_root / folder / n))
        if versioned:
            return f"/{folder}/{versioned[-1]}"
    return None


def driver_mounts(host_root: Path, driver_version: str, capabilities: Iterable[Capability]) -> tuple[Mount, ...]:
    """Bind mounts of the driver files for the given capabilities that exist on the host."""
    mounts: list[Mount] = []
    for capability in dict.fromkeys(capabilities):
        for base in _LIBRARIES.get(capability, ()):
            path = _library(host_root, base, driver_version)
            if path is not None:
                mounts.append(Mount(host_path=path, container_path=path, options=_OPTIONS))
                soname = f"{os.path.dirname(path)}/{base}.1"
                if soname != path:
                    mounts.append(Mount(host_path=path, container_path=soname, options=_OPTIONS))
        for name in _BINARIES.get(capability, ()):
            for folder in _BINARY_DIRS:
                if os.path.isfile(host_root / folder / name):
                    mounts.append(Mount(host_path=f"/{folder}/{name}", container_path=f"/{folder}/{name}",
                                        options=_OPTIONS))
                    break
    return tuple(mounts)
