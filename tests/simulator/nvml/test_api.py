"""The simulated NVML, driven through the real pynvml functions it is plugged in under."""

from __future__ import annotations

import ctypes
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.node.catalog import GPU_MODELS
from simulator.nvml.api import NO_INSTANCE, SimGpu, SimulatedNvml, SimulatedNvmlError
from tests.support.timing import scaled

A100, H100, T4 = GPU_MODELS["A100-SXM4-40GB"], GPU_MODELS["H100-SXM5-80GB"], GPU_MODELS["Tesla-T4"]
A100_UUID = "GPU-0a100000-0000-4000-8000-000000000001"
H100_UUID = "GPU-0b100000-0000-4000-8000-000000000002"
T4_UUID = "GPU-07400000-0000-4000-8000-000000000003"
MIB = 1 << 20
ID_1G, ID_3G, ID_7G = 19, 9, 0  # H100 GPU-instance profile ids (mechanics.md §3)


def _gpus() -> list[SimGpu]:
    # Listed out of bus order on purpose: NVML enumerates by PCI bus id.
    return [
        SimGpu(H100, "0000:9a:00.0", H100_UUID, minor=1, numa_node=1, serial="1650123456789"),
        SimGpu(T4, "0000:c3:00.0", T4_UUID, minor=2),
        SimGpu(A100, "0000:18:00.0", A100_UUID, minor=0, numa_node=0,
               faults={"nvmlDeviceGetMemoryInfo": pynvml.NVML_ERROR_GPU_IS_LOST}),
    ]


@pytest.fixture
def sim() -> Iterator[SimulatedNvml]:
    with SimulatedNvml(_gpus()) as s:
        pynvml.nvmlInit()
        yield s


def _placement(start: int, size: int) -> Any:
    return ctypes.byref(pynvml.c_nvmlGpuInstancePlacement_t(start, size))


def _create_gi(handle: Any, profile_id: int, start: int, size: int) -> Any:
    return pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, profile_id, _placement(start, size))


def _full_ci(gi: Any) -> Any:
    """Create the default compute instance (as large as the GPU instance), as `nvidia-smi -C` does."""
    slices = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}
    gi_info = pynvml.nvmlGpuInstanceGetInfo(gi)
    profile = pynvml.nvmlDeviceGetGpuInstanceProfileInfoById(gi_info.device, gi_info.profileId)
    ci_profile = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gi, slices[profile.sliceCount], pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    )
    return pynvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile.id)


def _placements(handle: Any, profile_id: int) -> list[tuple[int, int]]:
    count = ctypes.c_uint(0)
    pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, None, ctypes.byref(count))
    array = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
    pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, array, ctypes.byref(count))
    return [(p.start, p.size) for p in array[: count.value]]


def _ptr(handle: Any) -> int | None:
    value: int | None = ctypes.cast(handle, ctypes.c_void_p).value
    return value


def _init_error() -> type[BaseException] | None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return type(exc)
    pynvml.nvmlShutdown()
    return None


# -- enumeration and identity ---------------------------------------------------------------------


def test_enumeration_follows_pci_order_and_reports_identity(sim: SimulatedNvml) -> None:
    assert pynvml.nvmlDeviceGetCount() == 3
    assert pynvml.nvmlSystemGetDriverVersion() == "580.95.05"
    assert pynvml.nvmlSystemGetCudaDriverVersion_v2() == 13000
    uuids = [pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(3)]
    assert uuids == [A100_UUID, H100_UUID, T4_UUID]

    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetName(h) == "NVIDIA A100-SXM4-40GB"
    assert pynvml.nvmlDeviceGetMinorNumber(h) == 0
    assert pynvml.nvmlDeviceGetIndex(h) == 0
    assert pynvml.nvmlDeviceGetArchitecture(h) == pynvml.NVML_DEVICE_ARCH_AMPERE
    assert pynvml.nvmlDeviceGetCudaComputeCapability(h) == (8, 0)
    assert pynvml.nvmlDeviceGetBrand(h) == pynvml.NVML_BRAND_NVIDIA
    assert pynvml.nvmlDeviceGetNumaNodeId(h) == 0
    pci = pynvml.nvmlDeviceGetPciInfo(h)
    # pynvml's printable structs decode char fields on read, so these come back as str.
    assert pci.busId == "00000000:18:00.0"
    assert pci.busIdLegacy == "0000:18:00.0"
    assert (pci.domain, pci.bus, pci.device) == (0, 0x18, 0)
    assert pci.pciDeviceId == 0x20B010DE

    h100 = pynvml.nvmlDeviceGetHandleByIndex(1)
    assert pynvml.nvmlDeviceGetName(h100) == "NVIDIA H100 80GB HBM3"
    assert pynvml.nvmlDeviceGetPciInfo(h100).busId == "00000000:9A:00.0"
    assert pynvml.nvmlDeviceGetMemoryInfo(h100).total == 81559 * MIB
    assert pynvml.nvmlDeviceGetArchitecture(h100) == pynvml.NVML_DEVICE_ARCH_HOPPER
    assert pynvml.nvmlDeviceGetCudaComputeCapability(h100) == (9, 0)
    assert pynvml.nvmlDeviceGetSerial(h100) == "1650123456789"
    t4 = pynvml.nvmlDeviceGetHandleByIndex(2)
    assert pynvml.nvmlDeviceGetBrand(t4) == pynvml.NVML_BRAND_NVIDIA
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetMigMode(t4)

    for bus_id in ("0000:9a:00.0", "00000000:9A:00.0"):
        assert _ptr(pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)) == _ptr(h100)
    assert _ptr(pynvml.nvmlDeviceGetHandleByUUID(H100_UUID)) == _ptr(h100)
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetHandleByUUID("GPU-does-not-exist")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetHandleByIndex(3)


def test_faults_are_per_gpu_and_per_symbol(sim: SimulatedNvml) -> None:
    a100, h100 = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in (0, 1))
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetMemoryInfo(a100)
    assert pynvml.nvmlDeviceGetMemoryInfo(h100).total == 81559 * MIB
    # Only the named symbol fails: the v2 query on the same GPU still answers.
    assert pynvml.nvmlDeviceGetMemoryInfo(a100, version=pynvml.nvmlMemory_v2).total == 40960 * MIB


def test_missing_symbol_and_uninitialised_calls(sim: SimulatedNvml) -> None:
    h = pynvml.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
    pynvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


def test_uninstall_restores_pynvml() -> None:
    lib_before, error_before = pynvml.nvmlLib, _init_error()
    refcount, cached = pynvml._nvmlLib_refcount, dict(pynvml._nvmlGetFunctionPointer_cache)
    with SimulatedNvml(_gpus()) as sim:
        assert pynvml.nvmlLib is sim
        pynvml.nvmlInit()  # left initialised on purpose: uninstall must restore the refcount too
        assert pynvml.nvmlDeviceGetCount() == 3
    assert pynvml.nvmlLib is lib_before
    assert pynvml._nvmlLib_refcount == refcount
    assert pynvml._nvmlGetFunctionPointer_cache == cached, "no function of the simulation is left in the cache"
    assert _init_error() is error_before
    if lib_before is None:  # this machine has no NVIDIA driver
        assert error_before is pynvml.NVMLError_LibraryNotFound


def test_implemented_symbols_are_symbols_pynvml_looks_up() -> None:
    source = Path(pynvml.__file__).read_text()
    looked_up = set(re.findall(r'_nvmlGetFunctionPointer\("(\w+)"\)', source))
    symbols = SimulatedNvml.implemented_symbols()
    assert len(symbols) >= 50
    assert symbols <= looked_up, sorted(symbols - looked_up)
    assert {"nvmlErrorString", "nvmlEventSetWait_v2", "nvmlDeviceGetPciInfo_v3"} <= symbols


# -- MIG placements and instances -----------------------------------------------------------------


def test_possible_placements_two_call_pattern_regardless_of_mig_mode(sim: SimulatedNvml) -> None:
    h100 = pynvml.nvmlDeviceGetHandleByIndex(1)
    assert pynvml.nvmlDeviceGetMigMode(h100) == [0, 0]
    assert _placements(h100, ID_1G) == [(s, 1) for s in range(7)]
    assert _placements(h100, ID_3G) == [(0, 4), (4, 4)]
    assert _placements(h100, ID_7G) == [(0, 8)]
    info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h100, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    assert (info.id, info.memorySizeMB, info.instanceCount, info.sliceCount) == (ID_1G, 9984, 7, 1)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h100, pynvml.NVML_GPU_INSTANCE_PROFILE_8_SLICE)
    with pytest.raises(pynvml.NVMLError_NotSupported):  # MIG off: no GPU instances can be created
        _create_gi(h100, ID_1G, 0, 1)


def _h100_with_mig(sim: SimulatedNvml) -> Any:
    h100 = pynvml.nvmlDeviceGetHandleByIndex(1)
    assert pynvml.nvmlDeviceSetMigMode(h100, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_SUCCESS
    return h100


def test_seven_1g_instances_fill_an_h100(sim: SimulatedNvml) -> None:
    h100 = _h100_with_mig(sim)
    for start in range(7):
        _create_gi(h100, ID_1G, start, 1)
    assert pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h100, ID_1G) == 0
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        pynvml.nvmlDeviceCreateGpuInstance(h100, ID_1G)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        _create_gi(h100, ID_1G, 3, 1)
    assert [(v.profile, v.start) for v in sim.instances(1)] == [("1g.10gb", s) for s in range(7)]


def test_overlap_and_invalid_start(sim: SimulatedNvml) -> None:
    h100 = _h100_with_mig(sim)
    _create_gi(h100, ID_1G, 5, 1)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        _create_gi(h100, ID_3G, 4, 4)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        _create_gi(h100, ID_3G, 2, 4)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        _create_gi(h100, ID_1G, 7, 1)
    gi = _create_gi(h100, ID_3G, 0, 4)
    info = pynvml.nvmlGpuInstanceGetInfo(gi)
    assert (info.profileId, info.placement.start, info.placement.size) == (ID_3G, 0, 4)
    assert pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h100, ID_3G) == 0


def test_compute_instance_profiles_follow_the_gpu_instance(sim: SimulatedNvml) -> None:
    h100 = _h100_with_mig(sim)
    shared = pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    gi7 = _create_gi(h100, ID_7G, 0, 8)
    one = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi7, 0, shared)
    assert (one.sliceCount, one.instanceCount) == (1, 7)
    three = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi7, 2, shared)
    assert (three.sliceCount, three.instanceCount) == (3, 2)
    full = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi7, 4, shared)
    assert (full.sliceCount, full.instanceCount, full.multiprocessorCount) == (7, 1, 132)
    pynvml.nvmlGpuInstanceCreateComputeInstance(gi7, three.id)
    pynvml.nvmlGpuInstanceCreateComputeInstance(gi7, three.id)
    assert pynvml.nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi7, one.id) == 1
    with pytest.raises(pynvml.NVMLError_InUse):  # compute instances still inside
        pynvml.nvmlGpuInstanceDestroy(gi7)
    with pytest.raises(pynvml.NVMLError_InUse):  # nor can MIG be disabled under GPU instances
        pynvml.nvmlDeviceSetMigMode(h100, pynvml.NVML_DEVICE_MIG_DISABLE)

    sim.destroy_instance(1, pynvml.nvmlGpuInstanceGetInfo(gi7).id)
    gi4 = pynvml.nvmlDeviceCreateGpuInstance(h100, 5)  # 4g.40gb
    with pytest.raises(pynvml.NVMLError_NotSupported):  # 4g offers 1c, 2c, 4c only
        pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi4, 2, shared)
    with pytest.raises(pynvml.NVMLError_NotSupported):  # larger than the GPU instance
        pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi4, 4, shared)


@settings(max_examples=40, deadline=None, database=None)
@given(st.permutations(list(range(10))))
def test_any_destroy_order_frees_the_whole_gpu(order: list[int]) -> None:
    with SimulatedNvml(_gpus()) as sim:
        pynvml.nvmlInit()
        h100 = _h100_with_mig(sim)
        layout = [(ID_3G, 4, 4), (14, 0, 2), (ID_1G, 2, 1), (ID_1G, 3, 1)]  # 3g, 2g, 1g, 1g
        gis = [_create_gi(h100, pid, start, size) for pid, start, size in layout]
        cis = [pynvml.nvmlGpuInstanceCreateComputeInstance(gis[0], 0) for _ in range(3)]  # three 1c in the 3g
        cis += [pynvml.nvmlGpuInstanceCreateComputeInstance(gis[1], 0) for _ in range(2)]  # two 1c in the 2g
        cis += [_full_ci(gis[2]), _full_ci(gis[3])]
        owner = [0, 0, 0, 1, 1, 2, 3]
        objects: list[tuple[str, int]] = [("gi", i) for i in range(3)] + [("ci", i) for i in range(7)]
        # Ten objects but four GIs: the fourth GI is destroyed last, after the permuted ones.
        alive_cis = set(range(7))
        deferred: list[int] = []
        for kind, i in (objects[k] for k in order):
            if kind == "ci":
                pynvml.nvmlComputeInstanceDestroy(cis[i])
                alive_cis.discard(i)
            elif any(owner[c] == i for c in alive_cis):
                with pytest.raises(pynvml.NVMLError_InUse):
                    pynvml.nvmlGpuInstanceDestroy(gis[i])
                deferred.append(i)
            else:
                pynvml.nvmlGpuInstanceDestroy(gis[i])
        for i in [*deferred, 3]:
            pynvml.nvmlGpuInstanceDestroy(gis[i])
        assert sim.instances(1) == []
        with pytest.raises(pynvml.NVMLError_InvalidArgument):  # stale handles are refused
            pynvml.nvmlGpuInstanceGetInfo(gis[0])
        gi = _create_gi(h100, ID_7G, 0, 8)
        assert pynvml.nvmlGpuInstanceGetInfo(gi).placement.size == 8
        pynvml.nvmlShutdown()


def test_concurrent_creates_never_double_book(sim: SimulatedNvml) -> None:
    h100 = _h100_with_mig(sim)
    results: list[bool] = []
    lock = threading.Lock()

    def create(start: int) -> None:
        try:
            _create_gi(h100, ID_1G, start, 1)
            ok = True
        except pynvml.NVMLError_InsufficientResources:
            ok = False
        with lock:
            results.append(ok)

    threads = [threading.Thread(target=create, args=(s % 7,)) for s in range(28)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(True) == 7
    assert sorted(v.start for v in sim.instances(1)) == list(range(7))


# -- MIG mode -------------------------------------------------------------------------------------


def test_mig_mode_pending_on_ampere_until_reset(sim: SimulatedNvml) -> None:
    a100 = pynvml.nvmlDeviceGetHandleByIndex(0)
    status = pynvml.nvmlDeviceSetMigMode(a100, pynvml.NVML_DEVICE_MIG_ENABLE)
    assert status == pynvml.NVML_ERROR_RESET_REQUIRED
    assert pynvml.nvmlDeviceGetMigMode(a100) == [0, 1]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        _create_gi(a100, 19, 0, 1)
    sim.reset_gpu(0)
    assert pynvml.nvmlDeviceGetMigMode(a100) == [1, 1]
    _create_gi(a100, 19, 0, 1)
    assert sim.instances(0)[0][:2] == ("1g.5gb", 0)


def test_mig_mode_immediate_on_hopper_and_refused_while_busy(sim: SimulatedNvml) -> None:
    h100 = pynvml.nvmlDeviceGetHandleByIndex(1)
    sim.set_busy(1)
    with pytest.raises(pynvml.NVMLError_InUse):
        pynvml.nvmlDeviceSetMigMode(h100, pynvml.NVML_DEVICE_MIG_ENABLE)
    assert pynvml.nvmlDeviceGetMigMode(h100) == [0, 0]
    sim.set_busy(1, False)
    assert pynvml.nvmlDeviceSetMigMode(h100, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_SUCCESS
    assert pynvml.nvmlDeviceGetMigMode(h100) == [1, 1]
    assert pynvml.nvmlDeviceSetMigMode(h100, pynvml.NVML_DEVICE_MIG_DISABLE) == pynvml.NVML_SUCCESS
    assert sim.mig_mode(1) == (False, False)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceSetMigMode(pynvml.nvmlDeviceGetHandleByIndex(2), pynvml.NVML_DEVICE_MIG_ENABLE)


# -- MIG devices ----------------------------------------------------------------------------------


def test_mig_device_enumeration_finds_exactly_the_created_devices(sim: SimulatedNvml) -> None:
    h100 = _h100_with_mig(sim)
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(h100) == 7
    created = {}
    for pid, start, size in [(ID_3G, 4, 4), (ID_1G, 0, 1)]:
        ci_info = pynvml.nvmlComputeInstanceGetInfo(_full_ci(_create_gi(h100, pid, start, size)))
        gi_id = pynvml.nvmlGpuInstanceGetInfo(ci_info.gpuInstance).id
        created[pynvml.nvmlDeviceGetUUID(ci_info.device)] = (gi_id, ci_info.id)
    static_gi, static_ci = sim.create_instance(1, "1g.10gb", 2)  # pre-created layouts use the same rules
    created[sim.mig_uuid(1, static_gi, static_ci)] = (static_gi, static_ci)

    found = {}
    for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(h100)):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h100, slot)
        except pynvml.NVMLError_NotFound:
            continue
        assert pynvml.nvmlDeviceIsMigDeviceHandle(mig).value == 1
        parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
        assert pynvml.nvmlDeviceGetUUID(parent) == H100_UUID
        ids = (pynvml.nvmlDeviceGetGpuInstanceId(mig), pynvml.nvmlDeviceGetComputeInstanceId(mig))
        found[pynvml.nvmlDeviceGetUUID(mig)] = ids
    assert found == created
    for uuid, (gi, ci) in found.items():
        assert uuid == sim.mig_uuid(1, gi, ci) and uuid.startswith("MIG-")

    profiles = {view.gi: view.profile for view in sim.instances(1)}
    three_g = next(u for u, (gi, _) in found.items() if profiles[gi] == "3g.40gb")
    mig = pynvml.nvmlDeviceGetHandleByUUID(three_g)
    assert pynvml.nvmlDeviceGetMemoryInfo(mig).total == 40448 * MIB
    assert pynvml.nvmlDeviceGetName(mig) == "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
    attrs = pynvml.nvmlDeviceGetAttributes(mig)
    assert (attrs.gpuInstanceSliceCount, attrs.computeInstanceSliceCount) == (3, 3)
    assert (attrs.multiprocessorCount, attrs.memorySizeMB) == (60, 40448)
    assert pynvml.nvmlDeviceIsMigDeviceHandle(h100).value == 0
    with pytest.raises(SimulatedNvmlError) as err:
        sim.create_instance(1, "3g.40gb", 2)
    assert err.value.code == pynvml.NVML_ERROR_INVALID_ARGUMENT


# -- events and lost GPUs -------------------------------------------------------------------------


def _event_set_on(index: int) -> tuple[Any, Any]:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    event_set = pynvml.nvmlEventSetCreate()
    wanted = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError
    supported = pynvml.nvmlDeviceGetSupportedEventTypes(handle)
    pynvml.nvmlDeviceRegisterEvents(handle, wanted & supported, event_set)
    return handle, event_set


def _later(delay: float, action: Callable[[], object]) -> threading.Timer:
    timer = threading.Timer(delay, action)
    timer.start()
    return timer


def test_xid_event_reaches_a_waiter_on_another_thread(sim: SimulatedNvml) -> None:
    h100, event_set = _event_set_on(1)
    assert sim.inject_xid(0, 48) == 0  # GPU 0 is registered nowhere
    timer = _later(0.1, lambda: sim.inject_xid(1, 79))
    started = time.monotonic()
    data = pynvml.nvmlEventSetWait_v2(event_set, int(scaled(5) * 1000))
    timer.join()
    assert time.monotonic() - started < scaled(4)  # woken by the event, well before the wait's end
    assert data.eventType == pynvml.nvmlEventTypeXidCriticalError
    assert data.eventData == 79
    assert _ptr(data.device) == _ptr(h100)
    assert (data.gpuInstanceId, data.computeInstanceId) == (NO_INSTANCE, NO_INSTANCE)
    pynvml.nvmlEventSetFree(event_set)


def test_wait_without_events_times_out(sim: SimulatedNvml) -> None:
    _, event_set = _event_set_on(1)
    started = time.monotonic()
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(event_set, 300)
    assert 0.28 <= time.monotonic() - started < 0.3 + scaled(1.7)


def test_lost_gpu_fails_calls_and_wakes_waiters(sim: SimulatedNvml) -> None:
    h100, event_set = _event_set_on(1)
    timer = _later(0.1, lambda: sim.set_lost(1))
    started = time.monotonic()
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlEventSetWait_v2(event_set, int(scaled(5) * 1000))
    timer.join()
    assert time.monotonic() - started < scaled(4)  # woken by the loss, well before the wait's end
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetUUID(h100)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetHandleByIndex(1)
    assert pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(2)) == T4_UUID
    sim.set_lost(1, False)
    assert pynvml.nvmlDeviceGetUUID(h100) == H100_UUID
