"""Simulated NVML events through the real pynvml API, and the control channel that injects them from outside."""

from __future__ import annotations

import ctypes
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from backends.nvidia.nvml import nvml_session
from simulator.node.catalog import GPU_MODELS
from simulator.node.node import SimulatedNode
from simulator.nvml.api import NO_INSTANCE, SimGpu, SimulatedNvml
from simulator.nvml.control import ControlError, control_socket, request, serve_control
from simulator.nvml.marshal import Client
from tests.support.timing import scaled

A100, T4 = GPU_MODELS["A100-SXM4-40GB"], GPU_MODELS["Tesla-T4"]
A100_UUID = "GPU-0a100000-0000-4000-8000-000000000001"
T4_UUID = "GPU-07400000-0000-4000-8000-000000000003"
XID = pynvml.nvmlEventTypeXidCriticalError
DBE = pynvml.nvmlEventTypeDoubleBitEccError
SBE = pynvml.nvmlEventTypeSingleBitEccError


def _gpus(t4_faults: dict[str, int] | None = None) -> list[SimGpu]:
    return [SimGpu(A100, "0000:18:00.0", A100_UUID, minor=0, mig_enabled=True),
            SimGpu(T4, "0000:3b:00.0", T4_UUID, minor=1, faults=t4_faults or {})]


@pytest.fixture
def sim() -> Iterator[SimulatedNvml]:
    with SimulatedNvml(_gpus()) as s:
        pynvml.nvmlInit()
        yield s
        pynvml.nvmlShutdown()


def _watch(index: int, types: int = XID | DBE | SBE, event_set: Any = None) -> tuple[Any, Any]:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    event_set = event_set or pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(handle, types & pynvml.nvmlDeviceGetSupportedEventTypes(handle), event_set)
    return handle, event_set


def _ptr(handle: Any) -> int | None:
    value: int | None = ctypes.cast(handle, ctypes.c_void_p).value
    return value


def _soon(action: Callable[[], object], delay: float = 0.1) -> threading.Timer:
    timer = threading.Timer(delay, action)
    timer.start()
    return timer


def _ms(seconds: float) -> int:
    """An NVML wait's timeout (milliseconds) that bounds a failure: stretched by the time factor."""
    return int(scaled(seconds) * 1000)


# -- waiting ----------------------------------------------------------------------------------------------


def test_a_wait_sleeps_until_an_event_is_injected(sim: SimulatedNvml) -> None:
    t4, event_set = _watch(1)
    cpu, started = time.process_time(), time.monotonic()
    timer = _soon(lambda: sim.inject_xid(1, 48), delay=0.5)
    data = pynvml.nvmlEventSetWait_v2(event_set, _ms(10))
    timer.join()
    assert 0.45 <= time.monotonic() - started < 0.5 + scaled(2.5)
    assert time.process_time() - cpu < 0.2  # asleep on a condition variable, not spinning
    assert sim.call_count("nvmlEventSetWait_v2") == 1
    assert (data.eventType, data.eventData) == (XID, 48)
    assert _ptr(data.device) == _ptr(t4)
    assert (data.gpuInstanceId, data.computeInstanceId) == (NO_INSTANCE, NO_INSTANCE)


def test_a_wait_times_out_and_the_old_wrapper_waits_too(sim: SimulatedNvml) -> None:
    _, event_set = _watch(1)
    started = time.monotonic()
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait(event_set, 200)
    assert 0.19 <= time.monotonic() - started < 0.2 + scaled(1.3)
    sim.inject_ecc(1)
    assert pynvml.nvmlEventSetWait(event_set, 0).eventType == DBE  # queued events come without waiting


def test_only_registered_types_of_registered_gpus_arrive(sim: SimulatedNvml) -> None:
    _, xid_only = _watch(1, XID)
    _, both = _watch(1, XID | DBE)
    assert sim.inject_ecc(1) == 1  # only the set that asked for ECC errors
    assert sim.inject_ecc(1, double_bit=False) == 0
    assert sim.inject_xid(0, 79, lost=False) == 0  # GPU 0 is registered nowhere
    assert sim.inject_xid(1, 13) == 2
    assert pynvml.nvmlEventSetWait_v2(xid_only, 100).eventData == 13
    assert pynvml.nvmlEventSetWait_v2(both, 100).eventType == DBE  # in the order they happened
    assert pynvml.nvmlEventSetWait_v2(both, 100).eventData == 13
    for event_set in (xid_only, both):
        with pytest.raises(pynvml.NVMLError_Timeout):
            pynvml.nvmlEventSetWait_v2(event_set, 0)
    assert sim.registrations(1) == XID | DBE


def test_registration_rules(sim: SimulatedNvml) -> None:
    event_set = pynvml.nvmlEventSetCreate()
    t4 = pynvml.nvmlDeviceGetHandleByIndex(1)
    assert pynvml.nvmlDeviceGetSupportedEventTypes(t4) == XID | DBE | SBE
    with pytest.raises(pynvml.NVMLError_NotSupported):  # a type the GPU does not support
        pynvml.nvmlDeviceRegisterEvents(t4, pynvml.nvmlEventTypePState, event_set)
    sim.create_instance(0, "1g.5gb", 0)
    a100 = pynvml.nvmlDeviceGetHandleByIndex(0)
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(a100, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):  # per-MIG-device registration does not exist
        pynvml.nvmlDeviceRegisterEvents(mig, XID, event_set)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceRegisterEvents(t4, XID, t4)  # not an event set


def test_a_driver_without_events_is_not_supported() -> None:
    with SimulatedNvml(_gpus({"nvmlDeviceRegisterEvents": pynvml.NVML_ERROR_NOT_SUPPORTED})):
        pynvml.nvmlInit()
        try:
            with pytest.raises(pynvml.NVMLError_NotSupported):
                _watch(1)
            _watch(0)  # the other GPU is fine
        finally:
            pynvml.nvmlShutdown()


def test_events_attributed_to_a_mig_instance(sim: SimulatedNvml) -> None:
    gi, ci = sim.create_instance(0, "3g.20gb", 4)
    _, event_set = _watch(0)
    sim.inject_xid(0, 94, gi=gi, ci=ci)
    sim.inject_xid(0, 95, gi=gi)
    first, second = (pynvml.nvmlEventSetWait_v2(event_set, 100) for _ in range(2))
    assert (first.eventData, first.gpuInstanceId, first.computeInstanceId) == (94, gi, ci)
    assert (second.eventData, second.gpuInstanceId, second.computeInstanceId) == (95, gi, NO_INSTANCE)
    with pytest.raises(ValueError, match="no GPU instance 9"):
        sim.inject_xid(0, 94, gi=9)
    with pytest.raises(ValueError, match="no compute instance 5"):
        sim.inject_xid(0, 94, gi=gi, ci=5)
    with pytest.raises(ValueError, match="not in MIG mode"):
        sim.inject_xid(1, 94, gi=gi)
    with pytest.raises(ValueError, match="needs its GPU instance"):
        sim.inject_xid(0, 94, ci=ci)


# -- lost GPUs and reset ---------------------------------------------------------------------------------


def test_xid_79_takes_the_gpu_off_the_bus_until_reset(sim: SimulatedNvml) -> None:
    t4, event_set = _watch(1)
    _, other = _watch(0)
    sim.inject_xid(1, 79)
    assert pynvml.nvmlEventSetWait_v2(event_set, 100).eventData == 79  # the event first, then the loss
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlEventSetWait_v2(event_set, _ms(5))
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetHandleByUUID(T4_UUID)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetMemoryInfo(t4)
    with pytest.raises(ValueError, match="is lost"):
        sim.inject_xid(1, 48)
    with pytest.raises(pynvml.NVMLError_Timeout):  # a set without the lost GPU is not affected
        pynvml.nvmlEventSetWait_v2(other, 0)

    sim.reset_gpu(1)
    assert pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByUUID(T4_UUID)) == T4_UUID
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(event_set, 0)


def test_a_waiter_learns_of_a_lost_gpu_at_once(sim: SimulatedNvml) -> None:
    _, event_set = _watch(1)
    timer = _soon(lambda: sim.set_lost(1))
    started = time.monotonic()
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlEventSetWait_v2(event_set, _ms(10))
    timer.join()
    assert time.monotonic() - started < scaled(3)  # woken by the loss, well before the wait's end


def test_reset_drops_unread_events_of_that_gpu_only(sim: SimulatedNvml) -> None:
    _, event_set = _watch(1)
    _watch(0, event_set=event_set)
    sim.inject_xid(1, 48)
    sim.inject_xid(0, 48, lost=True)
    sim.reset_gpu(0)
    data = pynvml.nvmlEventSetWait_v2(event_set, 100)
    assert (_ptr(data.device), data.eventData) == (_ptr(pynvml.nvmlDeviceGetHandleByIndex(1)), 48)
    assert sim.inject_xid(0, 13, lost=False) == 1  # registrations survive a reset


def test_free_and_shutdown_end_waits(sim: SimulatedNvml) -> None:
    _, event_set = _watch(1)
    timer = _soon(lambda: pynvml.nvmlEventSetFree(event_set))
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlEventSetWait_v2(event_set, _ms(10))
    timer.join()
    assert sim.inject_xid(1, 48) == 0  # its registrations are gone
    _, event_set = _watch(1)
    pynvml.nvmlInit()  # a second reference: the shutdown below leaves one
    pynvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(event_set, 0)


def test_init_counts_and_event_sets_are_per_client(sim: SimulatedNvml) -> None:
    # What the NVML server does for each process: its calls run as that process's client.
    other = Client("another process")
    _, mine = _watch(1)
    with sim.serving(other):
        with pytest.raises(pynvml.NVMLError_Uninitialized):
            pynvml.nvmlDeviceGetCount()  # this process's init is not the other's
        pynvml.nvmlInit()
        _, theirs = _watch(1)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlEventSetWait_v2(mine, 0)  # a set is a pointer into the process that made it
    assert sim.inject_xid(1, 48) == 2, "an event reaches the sets of every process watching the GPU"
    assert pynvml.nvmlEventSetWait_v2(mine, 0).eventData == 48
    waiting: list[BaseException] = []

    def wait_as_the_other() -> None:
        with sim.serving(other):
            pynvml.nvmlEventSetWait_v2(theirs, 0)  # the queued Xid
            try:
                pynvml.nvmlEventSetWait_v2(theirs, _ms(10))
            except pynvml.NVMLError as e:
                waiting.append(e)

    waits = sim.call_count("nvmlEventSetWait_v2")
    waiter = threading.Thread(target=wait_as_the_other)
    waiter.start()
    deadline = time.monotonic() + scaled(5)
    while sim.call_count("nvmlEventSetWait_v2") < waits + 2:  # the other is in its second, long wait
        assert time.monotonic() < deadline, "the other process's wait did not begin"
        time.sleep(0.01)
    sim.client_gone(other)  # its connection closed: the process died
    waiter.join(timeout=scaled(5))
    assert not waiter.is_alive() and isinstance(waiting[0], pynvml.NVMLError_Uninitialized)
    assert sim.inject_xid(1, 48) == 1, "only this process's set is left"
    with sim.serving(other), pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


def test_an_unloaded_driver_fails_init(sim: SimulatedNvml) -> None:
    sim.set_driver_loaded(False)
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()
    assert pynvml.nvmlDeviceGetCount() == 2, "the session opened before goes on"
    sim.set_driver_loaded(True)
    pynvml.nvmlInit()
    pynvml.nvmlShutdown()


# -- the control channel ---------------------------------------------------------------------------------


@pytest.fixture
def served(sim: SimulatedNvml, scratch: Path) -> Iterator[Path]:
    with serve_control(sim, scratch):
        yield scratch


def test_control_requests_from_another_thread(sim: SimulatedNvml, served: Path) -> None:
    _, event_set = _watch(1)
    gpus = request(served, {"op": "list"})["gpus"]
    assert [(g["index"], g["uuid"], g["bus_id"]) for g in gpus] == [(0, A100_UUID, "0000:18:00.0"),
                                                                    (1, T4_UUID, "0000:3b:00.0")]
    assert gpus[1]["registered_events"] == XID | DBE | SBE
    replies: list[dict[str, Any]] = []
    thread = threading.Thread(target=lambda: replies.append(request(served, {"op": "xid", "gpu": T4_UUID,
                                                                             "xid": 48})))
    thread.start()
    assert pynvml.nvmlEventSetWait_v2(event_set, _ms(5)).eventData == 48
    thread.join()
    assert replies[0] == {"ok": True, "delivered": 1, "gpu": {**gpus[1], "lost": False}}

    assert request(served, {"op": "ecc", "gpu": "0000:3B:00.0"})["delivered"] == 1
    assert pynvml.nvmlEventSetWait_v2(event_set, 100).eventType == DBE
    assert request(served, {"op": "lost", "gpu": 1})["gpu"]["lost"] is True
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlEventSetWait_v2(event_set, 100)
    assert request(served, {"op": "reset", "gpu": "1"})["gpu"]["lost"] is False
    gi, ci = sim.create_instance(0, "1g.5gb", 0)
    assert request(served, {"op": "xid", "gpu": 0, "xid": 94, "gi": gi, "ci": ci})["delivered"] == 0
    assert request(served, {"op": "driver", "loaded": False}) == {"ok": True, "loaded": False}
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()
    request(served, {"op": "driver", "loaded": True})
    pynvml.nvmlInit()
    pynvml.nvmlShutdown()


@pytest.mark.parametrize(("message", "error"), [
    ({"op": "xid", "gpu": "GPU-nope", "xid": 79}, f"no GPU 'GPU-nope' on this node; GPUs: 0 ({A100_UUID}"),
    ({"op": "xid", "gpu": 7, "xid": 79}, "no GPU 7 on this node"),
    ({"op": "xid", "gpu": 1}, "'xid' must be an integer"),
    ({"op": "xid", "gpu": 1, "xid": -1}, "'xid' must be an integer"),
    ({"op": "xid", "gpu": 1, "xid": 94, "gi": 1}, "not in MIG mode"),
    ({"op": "xid", "gpu": 1, "xid": 94, "lost": "yes"}, "'lost' must be"),
    ({"op": "reset"}, "op reset needs 'gpu'"),
    ({"op": "explode", "gpu": 0}, "unknown op 'explode'"),
    ({"op": "driver", "loaded": "no"}, "op driver needs 'loaded': true or false"),
    (["xid"], "a request is a JSON object"),
])
def test_control_refuses_bad_requests_clearly(served: Path, message: Any, error: str) -> None:
    with pytest.raises(ControlError) as err:
        request(served, message)
    assert error in str(err.value)


def test_control_answers_garbage_and_survives(sim: SimulatedNvml, served: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("")
        sock.settimeout(scaled(5))
        sock.sendto(b"\xff not json", str(control_socket(served)))
        reply = json.loads(sock.recv(4096))
    assert reply["ok"] is False and reply["error"]
    assert request(served, {"op": "list"})["ok"] is True


def test_no_server_is_a_clear_error(scratch: Path) -> None:
    with pytest.raises(ControlError, match=r"no simulated node serves .*is `dra-agent run --simulate"):
        request(scratch, {"op": "list"})


def test_a_root_longer_than_a_socket_path_works(sim: SimulatedNvml, scratch: Path) -> None:
    root = scratch / ("x" * 60) / ("y" * 60)
    root.mkdir(parents=True)
    assert len(str(control_socket(root))) > 107
    with serve_control(sim, root):
        assert request(root, {"op": "xid", "gpu": 1, "xid": 13})["ok"] is True
    assert not control_socket(root).exists()


def test_the_cli_injects_into_a_node_served_by_another_process(sim_node: Callable[[str], SimulatedNode]) -> None:
    node = sim_node("mixed")
    assert node.control_socket.exists()
    with nvml_session():  # the node's library: served, like the control channel, by the node's services
        _, event_set = _watch(1)

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "simulator.nvml.control", "--sim-root",
                                   str(node.root), *args], capture_output=True, text=True, timeout=scaled(30))

        gpu = node.nvml.gpus[1]
        gi = node.nvml.instances(1)[0].gi
        done = cli("xid", gpu.uuid, "94", "--gi", str(gi), "--ci", "0")
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"xid on GPU 1 ({gpu.bus_id}), delivered to 1 event set(s)"
        data = pynvml.nvmlEventSetWait_v2(event_set, _ms(5))
        assert (data.eventData, data.gpuInstanceId, data.computeInstanceId) == (94, gi, 0)

        listed = cli("--json", "list")
        assert [g["uuid"] for g in json.loads(listed.stdout)["gpus"]] == [g.uuid for g in node.nvml.gpus]
        bad = cli("xid", "GPU-nope", "79")
        assert bad.returncode == 1
        assert bad.stderr.startswith("error: no GPU 'GPU-nope' on this node; GPUs: 0 (")
        usage = cli("xid", "0")
        assert usage.returncode == 2
