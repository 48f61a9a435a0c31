"""Hardware facts for the simulated node: GPU, MIG, NIC and TPU models as real devices report them.

GPU names, PCI ids, memory sizes and MIG profile tables (ids, instance counts, memory, SMs, engines, placements)
follow NVIDIA's published `nvidia-smi mig -lgip/-lgipp` output; TPU ids follow the gVisor TPU ABI.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "GOOGLE",
    "GPU_MODELS",
    "INTEL",
    "MELLANOX",
    "NIC_MODELS",
    "NVIDIA",
    "TPU_MODELS",
    "GpuModel",
    "MigProfile",
    "NicModel",
    "TpuModel",
]

NVIDIA = 0x10DE
MELLANOX = 0x15B3
INTEL = 0x8086
GOOGLE = 0x1AE0

# NVML constants, repeated here so the catalogue does not import pynvml.
_ARCH_PASCAL, _ARCH_TURING, _ARCH_AMPERE, _ARCH_ADA, _ARCH_HOPPER = 4, 6, 7, 8, 9
_BRAND_TESLA, _BRAND_NVIDIA = 2, 14


@dataclass(frozen=True)
class MigProfile:
    """A GPU-instance profile: its NVML index and id, size, engines and where it may be placed."""

    name: str
    index: int  # NVML_GPU_INSTANCE_PROFILE_* passed to nvmlDeviceGetGpuInstanceProfileInfo
    id: int  # the profile id printed by nvidia-smi and taken by the create calls
    slices: int  # compute slices (the "g" in 3g.40gb)
    instances: int
    memory_mib: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpegs: int
    ofas: int
    starts: tuple[int, ...]  # allowed placement starts on the 8-wide memory-slice axis
    size: int  # memory slices occupied


@dataclass(frozen=True)
class GpuModel:
    """A GPU product as NVML and sysfs describe it."""

    key: str
    product_name: str
    device_id: int
    architecture: int
    compute_capability: tuple[int, int]
    memory_mib: int
    multiprocessors: int
    brand: int = _BRAND_NVIDIA
    class_code: int = 0x030200  # 3D controller
    mig_profiles: tuple[MigProfile, ...] = ()

    def mig_profile(self, name: str) -> MigProfile:
        """The MIG profile called `name` (e.g. '1g.10gb'); KeyError if this GPU has none such."""
        for profile in self.mig_profiles:
            if profile.name == name:
                return profile
        raise KeyError(name)


def _mig(name: str, index: int, pid: int, slices: int, inst: int, mib: int, sm: int,
         engines: tuple[int, int, int, int, int], starts: tuple[int, ...], size: int) -> MigProfile:
    ce, dec, enc, jpg, ofa = engines
    return MigProfile(name, index, pid, slices, inst, mib, sm, ce, dec, enc, jpg, ofa, starts, size)


_ONE = (0, 1, 2, 3, 4, 5, 6)
_A100_40 = (
    _mig("1g.5gb", 0x0, 19, 1, 7, 4864, 14, (1, 0, 0, 0, 0), _ONE, 1),
    _mig("1g.5gb+me", 0x7, 20, 1, 1, 4864, 14, (1, 1, 0, 1, 1), _ONE, 1),
    _mig("1g.10gb", 0x9, 15, 1, 4, 9856, 14, (1, 1, 0, 0, 0), (0, 2, 4, 6), 2),
    _mig("2g.10gb", 0x1, 14, 2, 3, 9856, 28, (2, 1, 0, 0, 0), (0, 2, 4), 2),
    _mig("3g.20gb", 0x2, 9, 3, 2, 19968, 42, (3, 2, 0, 0, 0), (0, 4), 4),
    _mig("4g.20gb", 0x3, 5, 4, 1, 19968, 56, (4, 2, 0, 0, 0), (0,), 4),
    _mig("7g.40gb", 0x4, 0, 7, 1, 40192, 98, (7, 5, 0, 1, 1), (0,), 8),
)
_A100_80 = (
    _mig("1g.10gb", 0x0, 19, 1, 7, 9856, 14, (1, 0, 0, 0, 0), _ONE, 1),
    _mig("1g.10gb+me", 0x7, 20, 1, 1, 9856, 14, (1, 1, 0, 1, 1), _ONE, 1),
    _mig("1g.20gb", 0x9, 15, 1, 4, 19968, 14, (1, 1, 0, 0, 0), (0, 2, 4, 6), 2),
    _mig("2g.20gb", 0x1, 14, 2, 3, 19968, 28, (2, 1, 0, 0, 0), (0, 2, 4), 2),
    _mig("3g.40gb", 0x2, 9, 3, 2, 40192, 42, (3, 2, 0, 0, 0), (0, 4), 4),
    _mig("4g.40gb", 0x3, 5, 4, 1, 40192, 56, (4, 2, 0, 0, 0), (0,), 4),
    _mig("7g.80gb", 0x4, 0, 7, 1, 80384, 98, (7, 5, 0, 1, 1), (0,), 8),
)
_H100_80 = (
    _mig("1g.10gb", 0x0, 19, 1, 7, 9984, 16, (1, 1, 0, 1, 0), _ONE, 1),
    _mig("1g.10gb+me", 0x7, 20, 1, 1, 9984, 16, (1, 1, 0, 1, 1), _ONE, 1),
    _mig("1g.20gb", 0x9, 15, 1, 4, 20096, 26, (1, 1, 0, 1, 0), (0, 2, 4, 6), 2),
    _mig("2g.20gb", 0x1, 14, 2, 3, 20096, 32, (2, 2, 0, 2, 0), (0, 2, 4), 2),
    _mig("3g.40gb", 0x2, 9, 3, 2, 40448, 60, (3, 3, 0, 3, 0), (0, 4), 4),
    _mig("4g.40gb", 0x3, 5, 4, 1, 40448, 64, (4, 4, 0, 4, 0), (0,), 4),
    _mig("7g.80gb", 0x4, 0, 7, 1, 81152, 132, (8, 7, 0, 7, 1), (0,), 8),
)

GPU_MODELS: dict[str, GpuModel] = {
    m.key: m
    for m in (
        GpuModel("Tesla-P4", "Tesla P4", 0x1BB3, _ARCH_PASCAL, (6, 1), 7680, 20, _BRAND_TESLA),
        GpuModel("Tesla-T4", "Tesla T4", 0x1EB8, _ARCH_TURING, (7, 5), 15360, 40, _BRAND_NVIDIA),
        GpuModel("L4", "NVIDIA L4", 0x27B8, _ARCH_ADA, (8, 9), 23034, 58),
        GpuModel("A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB", 0x20B0, _ARCH_AMPERE, (8, 0), 40960, 108,
                 mig_profiles=_A100_40),
        GpuModel("A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB", 0x20B2, _ARCH_AMPERE, (8, 0), 81920, 108,
                 mig_profiles=_A100_80),
        GpuModel("H100-SXM5-80GB", "NVIDIA H100 80GB HBM3", 0x2330, _ARCH_HOPPER, (9, 0), 81559, 132,
                 mig_profiles=_H100_80),
    )
}


@dataclass(frozen=True)
class NicModel:
    """A network adapter: PF and VF ids, kernel drivers, RDMA, line rate."""

    key: str
    vendor_id: int
    device_id: int
    vf_device_id: int | None
    driver: str
    vf_driver: str
    speed_mbps: int
    rdma: bool
    max_vfs: int
    class_code: int = 0x020000  # Ethernet controller


NIC_MODELS: dict[str, NicModel] = {
    m.key: m
    for m in (
        NicModel("ConnectX-7", MELLANOX, 0x1021, 0x101E, "mlx5_core", "mlx5_core", 400000, True, 127),
        NicModel("ConnectX-6Dx", MELLANOX, 0x101D, 0x101E, "mlx5_core", "mlx5_core", 100000, True, 127),
        NicModel("E810", INTEL, 0x1593, 0x1889, "ice", "iavf", 100000, True, 256),
        NicModel("gVNIC", GOOGLE, 0x0042, None, "gve", "gve", 100000, False, 0),
    )
}


@dataclass(frozen=True)
class TpuModel:
    """A TPU chip generation: its PCI device id and how the host exposes it."""

    key: str
    device_id: int
    interface: str  # "accel" (/dev/accelN) or "vfio" (/dev/vfio/<group>)
    class_code: int = 0x120000  # processing accelerator


TPU_MODELS: dict[str, TpuModel] = {
    m.key: m
    for m in (
        TpuModel("v4", 0x005E, "accel"),
        TpuModel("v4lite", 0x0056, "accel"),
        TpuModel("v5e", 0x0063, "vfio"),
        TpuModel("v5p", 0x0062, "vfio"),
        TpuModel("v6e", 0x006F, "vfio"),
    )
}
