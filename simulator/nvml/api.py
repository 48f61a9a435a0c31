"""The simulated node's NVML: the GPUs' state and NVML's rules, behind methods named after the C symbols.

Processes reach it through the node's NVML library (`library`), whose calls the node's NVML server
(`server`) turns into calls of these methods with the ctypes arguments pynvml would pass, so pynvml's own
wrapper code runs unchanged and returns the structs, strings and `NVMLError` subclasses it would on a real node.
Unit tests of the rules may also plug it under pynvml in their own process: `SimulatedNvml(gpus).install()`
puts it in `pynvml.nvmlLib`.

This module owns the system entry points and which GPUs are listed, plugging in, and the test-facing controls
for MIG layouts; device identity is in `identity`, MIG entry points in `mig`, compute mode in `compute`, event sets and
injected events, lost GPUs and reset in `events`, state and rules in `state`, ctypes marshalling and the
per-process clients in `marshal` (all in `simulator.nvml`). Symbols not implemented are absent from the library
too, so pynvml raises `NVMLError_FunctionNotFound` as it would with an older driver.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

from simulator.nvml.compute import ComputeModeSymbols
from simulator.nvml.events import (
    EVENT_DOUBLE_BIT_ECC,
    EVENT_SINGLE_BIT_ECC,
    EVENT_XID,
    NO_INSTANCE,
    EventSymbols,
)
from simulator.nvml.identity import IdentitySymbols
from simulator.nvml.marshal import (
    HandleKind,
    api,
    out,
    set_string,
    store_handle,
    token,
    uint,
)
from simulator.nvml.mig import MigSymbols
from simulator.nvml.state import (
    MigInstanceView,
    NvmlReturn,
    SimGpu,
    SimulatedNvmlError,
    create_compute_instance,
    create_gpu_instance,
    destroy_gpu_instance,
    mig_uuid,
    parse_bus_id,
)

__all__ = [
    "EVENT_DOUBLE_BIT_ECC",
    "EVENT_SINGLE_BIT_ECC",
    "EVENT_XID",
    "NO_INSTANCE",
    "MigInstanceView",
    "SimGpu",
    "SimulatedNvml",
    "SimulatedNvmlError",
]

_MIB = 1 << 20
_NVIDIA = 0x10DE
_NVIDIA_DRIVER = "nvidia"
_GPU, _MIG = HandleKind.GPU, HandleKind.MIG_DEVICE

_MESSAGES = {
    NvmlReturn.SUCCESS: "Success",
    NvmlReturn.ERROR_UNINITIALIZED: "Uninitialized",
    NvmlReturn.ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NvmlReturn.ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NvmlReturn.ERROR_NOT_SUPPORTED: "Not Supported",
    NvmlReturn.ERROR_NOT_FOUND: "Not Found",
    NvmlReturn.ERROR_INSUFFICIENT_SIZE: "Insufficient Size",
    NvmlReturn.ERROR_TIMEOUT: "Timeout",
    NvmlReturn.ERROR_GPU_IS_LOST: "GPU is lost",
    NvmlReturn.ERROR_RESET_REQUIRED: "GPU requires restart",
    NvmlReturn.ERROR_IN_USE: "In use by another client",
    NvmlReturn.ERROR_INSUFFICIENT_RESOURCES: "Insufficient resources",
    NvmlReturn.ERROR_ARGUMENT_VERSION_MISMATCH: "Argument version mismatch",
}


class _ErrorString:
    """`nvmlErrorString`: pynvml sets `restype` on the function it gets, which a bound method refuses."""

    restype: object = None
    argtypes: object = None

    def __call__(self, code: Any) -> bytes:
        try:
            return _MESSAGES.get(NvmlReturn(uint(code)), "Unknown Error").encode()
        except (ValueError, SimulatedNvmlError):
            return b"Unknown Error"


class _Saved(NamedTuple):
    lib: object
    cache: dict[str, object]
    refcount: int


class SimulatedNvml(MigSymbols, ComputeModeSymbols, EventSymbols, IdentitySymbols):
    """The simulated library: GPUs in PCI bus-id order (NVML's order; index = position among those listed).

    Thread-safe: one lock guards all state, as the agent calls NVML from worker threads and an event thread.
    `driver_version` and `cuda_driver_version` (e.g. 13000 for CUDA 13.0) are what the system queries report.
    """

    driver_loaded: bool = True
    """Whether the kernel module is loaded: without it nvmlInit fails with DRIVER_NOT_LOADED (`set_driver_loaded`)."""
    sysfs_root: Path | None = None
    """The node's sysfs: NVML lists only the GPUs the nvidia driver holds, so with this set a GPU bound to another
    driver there (vfio-pci, for passthrough) or to none is absent from the count and from every handle lookup,
    and listed again once nvidia holds it. The list is read at every call, not when the session starts: as with
    NVML, whose nvmlInit_v2 attaches no GPU and whose enumeration follows the driver's GPUs in a running process
    (its documentation of nvmlDeviceRemoveGpu_v2 and nvmlDeviceDiscoverGpus), a GPU bound to nvidia after
    nvmlInit is counted without a new session, and the others are numbered again. The test-facing controls below
    still take positions among all GPUs."""

    def __init__(
        self, gpus: list[SimGpu], driver_version: str = "580.95.05", cuda_driver_version: int = 13000
    ) -> None:
        super().__init__(gpus)
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version
        self._error_string = _ErrorString()
        self._saved: _Saved | None = None

    @classmethod
    def implemented_symbols(cls) -> frozenset[str]:
        """Names of the NVML C symbols this library provides."""
        return frozenset(name for name in dir(cls) if name.startswith("nvml"))

    # -- plugging into pynvml ------------------------------------------------------------------------

    def install(self) -> SimulatedNvml:
        """Make pynvml use this library (until `uninstall`); returns self."""
        import pynvml

        with pynvml.libLoadLock:
            if self._saved is not None:
                raise RuntimeError("this simulated NVML is already installed")
            cache = pynvml._nvmlGetFunctionPointer_cache
            self._saved = _Saved(pynvml.nvmlLib, dict(cache), pynvml._nvmlLib_refcount)
            cache.clear()  # function pointers cached from another library must not be reused
            pynvml.nvmlLib = self
        return self

    def uninstall(self) -> None:
        """Give pynvml back the library, function-pointer cache and init refcount it had before `install`."""
        import pynvml

        with pynvml.libLoadLock:
            if self._saved is None:
                return
            pynvml.nvmlLib = self._saved.lib
            cache = pynvml._nvmlGetFunctionPointer_cache
            cache.clear()
            cache.update(self._saved.cache)
            pynvml._nvmlLib_refcount = self._saved.refcount
            self._saved = None

    def __enter__(self) -> SimulatedNvml:
        return self.install()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.uninstall()

    # -- test-facing controls ------------------------------------------------------------------------

    @property
    def gpus(self) -> tuple[SimGpu, ...]:
        """The GPUs in NVML index order."""
        return tuple(self._gpus)

    def set_driver_loaded(self, loaded: bool) -> None:
        """Load or unload the kernel module: calls from then on (nvmlInit first) see it; sessions already open carry
        on, as NVML's descriptors keep the module in use."""
        with self._lock:
            self.driver_loaded = loaded

    def set_busy(self, index: int, busy: bool = True) -> None:
        """Mark GPU `index` as running processes (a MIG mode change then fails with IN_USE)."""
        with self._lock:
            self._gpus[index].busy = busy

    def create_instance(self, index: int, profile_name: str, start: int) -> tuple[int, int]:
        """Create a GPU instance of `profile_name` at `start` with one full-size compute instance.

        Goes through the same rules as the NVML calls (MIG must be enabled); raises `SimulatedNvmlError`.
        Returns (GPU instance id, compute instance id).
        """
        with self._lock:
            gpu = self._gpus[index]
            try:
                profile = gpu.model.mig_profile(profile_name)
            except KeyError:
                raise SimulatedNvmlError(NvmlReturn.ERROR_INVALID_ARGUMENT, profile_name) from None
            gi = create_gpu_instance(gpu, profile, start)
            full = next(i for i, s in ((0, 1), (1, 2), (2, 3), (3, 4), (4, 7)) if s == profile.slices)
            ci = create_compute_instance(gi, full)
            self._state_changed()
            return gi.id, ci.id

    def destroy_instance(self, index: int, gi_id: int) -> None:
        """Destroy GPU instance `gi_id` of GPU `index` together with its compute instances."""
        with self._lock:
            gpu = self._gpus[index]
            gi = gpu.gpu_instances[gi_id]
            gi.compute_instances.clear()
            destroy_gpu_instance(gpu, gi)
            self._state_changed()

    def instances(self, index: int) -> list[MigInstanceView]:
        """The GPU instances of GPU `index` as (profile name, start, GI id, CI ids), by GI id."""
        with self._lock:
            return [
                MigInstanceView(gi.profile.name, gi.start, gi.id, tuple(sorted(gi.compute_instances)))
                for gi in sorted(self._gpus[index].gpu_instances.values(), key=lambda g: g.id)
            ]

    def mig_mode(self, index: int) -> tuple[bool, bool]:
        """(current, pending) MIG mode of GPU `index`."""
        with self._lock:
            gpu = self._gpus[index]
            return gpu.mig_enabled, gpu.mig_pending

    def mig_uuid(self, index: int, gi: int, ci: int) -> str:
        """The UUID NVML reports for the MIG device (gi, ci) of GPU `index`."""
        return mig_uuid(self._gpus[index].uuid, gi, ci)

    # -- init and system -----------------------------------------------------------------------------

    def nvmlInitWithFlags(self, flags: Any) -> int:
        with self._lock:
            self._calls["nvmlInitWithFlags"] += 1
            if not self.driver_loaded:
                return NvmlReturn.ERROR_DRIVER_NOT_LOADED
            self._client().init_count += 1
        return NvmlReturn.SUCCESS

    @api
    def nvmlShutdown(self) -> int:
        client = self._client()
        client.init_count -= 1
        if client.init_count == 0:
            self._client_released(client)
        return NvmlReturn.SUCCESS

    @property
    def nvmlErrorString(self) -> _ErrorString:
        return self._error_string

    @api
    def nvmlSystemGetDriverVersion(self, buffer: Any, length: Any) -> int:
        set_string(buffer, length, self.driver_version)
        return NvmlReturn.SUCCESS

    @api
    def nvmlSystemGetNVMLVersion(self, buffer: Any, length: Any) -> int:
        # NVML's version is the CUDA major version followed by the driver version, e.g. "13.580.95.05".
        set_string(buffer, length, f"{self.cuda_driver_version // 1000}.{self.driver_version}")
        return NvmlReturn.SUCCESS

    @api
    def nvmlSystemGetCudaDriverVersion(self, version: Any) -> int:
        out(version).value = self.cuda_driver_version
        return NvmlReturn.SUCCESS

    @api
    def nvmlSystemGetCudaDriverVersion_v2(self, version: Any) -> int:
        out(version).value = self.cuda_driver_version
        return NvmlReturn.SUCCESS

    # -- enumeration ---------------------------------------------------------------------------------

    def _listed(self) -> list[int]:
        """Positions of the GPUs NVML lists, in its order: with `sysfs_root` set, those the nvidia driver holds (one
        read of the driver's folder, which links every function bound to it). A GPU gone from the bus stays listed,
        as lost (see `set_lost`)."""
        if self.sysfs_root is None:
            return list(range(len(self._gpus)))
        try:
            bound = set(os.listdir(self.sysfs_root / "bus/pci/drivers" / _NVIDIA_DRIVER))
        except FileNotFoundError:
            bound = set()
        devices = self.sysfs_root / "bus/pci/devices"
        return [i for i, gpu in enumerate(self._gpus) if gpu.bus_id in bound or not (devices / gpu.bus_id).is_dir()]

    @api
    def nvmlDeviceGetCount_v2(self, count: Any) -> int:
        out(count).value = len(self._listed())
        return NvmlReturn.SUCCESS

    def _hand_out(self, index: int, symbol: str, device: Any, value: int | None = None) -> int:
        self._admit(self._gpus[index], symbol)
        store_handle(device, token(_GPU, index) if value is None else value)
        return NvmlReturn.SUCCESS

    @api
    def nvmlDeviceGetHandleByIndex_v2(self, index: Any, device: Any) -> int:
        i, listed = uint(index), self._listed()
        if i >= len(listed):
            return NvmlReturn.ERROR_INVALID_ARGUMENT
        return self._hand_out(listed[i], "nvmlDeviceGetHandleByIndex_v2", device)

    @api
    def nvmlDeviceGetHandleByUUID(self, uuid: Any, device: Any) -> int:
        wanted = getattr(uuid, "value", uuid)
        text = wanted.decode() if isinstance(wanted, bytes) else str(wanted)
        for i in self._listed():
            gpu = self._gpus[i]
            if gpu.uuid == text:
                return self._hand_out(i, "nvmlDeviceGetHandleByUUID", device)
            for gi, ci in gpu.mig_slots():
                if mig_uuid(gpu.uuid, gi.id, ci.id) == text:
                    mig = token(_MIG, i, gi.id, ci.id)
                    return self._hand_out(i, "nvmlDeviceGetHandleByUUID", device, mig)
        return NvmlReturn.ERROR_NOT_FOUND

    @api
    def nvmlDeviceGetHandleByPciBusId_v2(self, bus_id: Any, device: Any) -> int:
        wanted = getattr(bus_id, "value", bus_id)
        try:
            key = parse_bus_id(wanted.decode() if isinstance(wanted, bytes) else str(wanted))
        except ValueError:
            return NvmlReturn.ERROR_INVALID_ARGUMENT
        for i in self._listed():
            if parse_bus_id(self._gpus[i].bus_id) == key:
                return self._hand_out(i, "nvmlDeviceGetHandleByPciBusId_v2", device)
        return NvmlReturn.ERROR_NOT_FOUND
