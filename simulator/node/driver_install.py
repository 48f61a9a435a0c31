"""The simulated NVIDIA driver's user-space files, laid out as an installed driver leaves them: on the host
(`/usr/lib/<multiarch>/…`, the "host" layout) or in the GPU operator's driver container, whose root the host sees
at /run/nvidia/driver (the "container" layout, with the container's own /dev holding the driver's nodes).

Each library is its versioned file plus the soname link, and `etc/ld.so.cache` lists the sonames, as after an
ldconfig run. libnvidia-ml is the simulated NVML library (`simulator.nvml.library`), a copy per node: the library
finds its node's NVML server through the link beside the file it was loaded from
(`simulator.nvml.library.SERVER_LINK`), and two nodes' copies must be two libraries to a process that loads
both. `nvidia-cuda-mps-control` is the simulated MPS control program (`simulator.node.mps_control`); the other
libraries and binaries are placeholders, for the CDI mounts.
"""

from __future__ import annotations

import filecmp
import os
import platform
import shutil
from pathlib import Path

from backends.nvidia.ldcache import abi_flags
from simulator.node import mps_control
from simulator.node.devnodes import make_device_node
from simulator.node.ldconfig import write_ld_cache
from simulator.node.profile import NvidiaDriverSpec
from simulator.nvml.library import SERVER_LINK, build_library

__all__ = ["CONTAINER_DRIVER_ROOT", "MPS_CONTROL", "driver_root", "install_driver", "install_mps_control",
           "nvml_server_socket", "refresh_nvml_library"]

CONTAINER_DRIVER_ROOT = "run/nvidia/driver"
"""Where the host sees the root of the GPU operator's driver container."""
_LIBRARIES = ("libcuda.so", "libnvidia-ml.so", "libnvidia-ptxjitcompiler.so", "libnvidia-nvvm.so", "libnvcuvid.so",
              "libnvidia-encode.so")
_NVML = "libnvidia-ml.so"
MPS_CONTROL = "nvidia-cuda-mps-control"
_BINARIES = ("nvidia-smi", "nvidia-debugdump")
_DEVICE_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")


def driver_root(root: Path, layout: str) -> Path:
    """The driver root of the node at `root` whose driver's files have `layout` ("host" or "container")."""
    return root / CONTAINER_DRIVER_ROOT if layout == "container" else root


def nvml_server_socket(root: Path) -> Path:
    """Where the node at `root` serves NVML calls (see `simulator.nvml.server`)."""
    return root / ".sim" / "nvml-lib.sock"


def _library_dir(droot: Path) -> Path:
    return droot / "usr/lib" / f"{platform.machine()}-linux-gnu"


def install_driver(root: Path, spec: NvidiaDriverSpec, gpu_minors: list[int], *, char: bool = False) -> Path:
    """Lay out the driver's files for the node at `root` as `spec` places them; returns the driver root. In the
    container layout the container's /dev holds the driver's nodes too (the GPUs' `gpu_minors`, the control
    nodes and nvidia-caps/, as the host's /dev does; `char` as for `make_device_node`)."""
    droot = driver_root(root, spec.layout)
    libraries = _library_dir(droot)
    libraries.mkdir(parents=True, exist_ok=True)
    for base in _LIBRARIES:
        versioned = libraries / f"{base}.{spec.driver_version}"
        if base == _NVML:
            shutil.copyfile(build_library(), versioned)
        else:
            versioned.write_bytes(b"\x7fELF simulated\n")
        (libraries / f"{base}.1").unlink(missing_ok=True)
        (libraries / f"{base}.1").symlink_to(versioned.name)
    link = libraries / SERVER_LINK
    link.unlink(missing_ok=True)
    link.symlink_to(os.path.relpath(nvml_server_socket(root), libraries))
    inner = "/" + os.path.relpath(libraries, droot)
    flags = abi_flags()
    if flags is not None:
        write_ld_cache(droot / "etc/ld.so.cache", [(f"{b}.1", f"{inner}/{b}.1") for b in _LIBRARIES], flags)
    binaries = droot / "usr/bin"
    binaries.mkdir(parents=True, exist_ok=True)
    for name in _BINARIES:
        (binaries / name).write_bytes(b"#!/bin/sh\n")
        (binaries / name).chmod(0o755)
    install_mps_control(droot)
    if spec.layout == "container":
        _copy_device_nodes(root / "dev", droot / "dev", gpu_minors, char)
    return droot


def install_mps_control(droot: Path) -> None:
    """The simulated `nvidia-cuda-mps-control` (`simulator.node.mps_control`) in the driver root's usr/bin, run by
    the `python3` of the PATH it is started with (it needs only the standard library: the agent's container has
    its own Python, at another path than the host's); replaced atomically, so a node kept across versions of the
    simulator gets the current one."""
    program = droot / "usr/bin" / MPS_CONTROL
    text = "#!/usr/bin/env python3\n" + Path(mps_control.__file__).read_text()
    if program.is_file() and program.read_text() == text:
        return
    temp = program.with_name(f".{program.name}.tmp")
    temp.write_text(text)
    temp.chmod(0o755)
    os.replace(temp, program)


def _copy_device_nodes(host: Path, container: Path, gpu_minors: list[int], char: bool) -> None:
    container.mkdir(parents=True, exist_ok=True)
    names = [name for name in (*_DEVICE_NODES, *(f"nvidia{m}" for m in gpu_minors)) if (host / name).exists()]
    if (host / "nvidia-caps").is_dir():
        (container / "nvidia-caps").mkdir(exist_ok=True)
        names += [f"nvidia-caps/{cap.name}" for cap in sorted((host / "nvidia-caps").iterdir())]
    for name in names:
        make_device_node(str(container / name), char=char)


def refresh_nvml_library(root: Path, spec: NvidiaDriverSpec) -> None:
    """Replace an installed simulated NVML library built from older source (a node kept across versions of the
    simulator); the replacement is atomic, and a process that loaded the old file keeps it."""
    versioned = _library_dir(driver_root(root, spec.layout)) / f"{_NVML}.{spec.driver_version}"
    if not versioned.is_file():
        return  # not installed (yet)
    built = build_library()
    if filecmp.cmp(built, versioned, shallow=False):
        return
    temp = versioned.with_name(f".{versioned.name}.tmp")
    shutil.copyfile(built, temp)
    os.replace(temp, versioned)
