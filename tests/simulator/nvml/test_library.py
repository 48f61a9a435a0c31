"""The simulated libnvidia-ml: a real shared library that forwards every NVML call to the node's NVML server, which
reads and writes the caller's memory; its build, its layout in a driver root, and what it does when things go
wrong."""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from backends.nvidia.driver_root import DriverRoot
from backends.nvidia.ldcache import abi_flags, parse_ld_cache
from backends.nvidia.nvml import NvmlUnavailable, loaded_library, nvml_session, use_driver_root
from simulator.node.catalog import GPU_MODELS
from simulator.node.driver_install import install_driver, nvml_server_socket
from simulator.node.ldconfig import library_order, write_ld_cache
from simulator.node.profile import NvidiaDriverSpec
from simulator.nvml.abi import SYMBOLS
from simulator.nvml.api import SimGpu, SimulatedNvml
from simulator.nvml.library import HELLO, SERVER_LINK, LibraryBuildError, build_library
from simulator.nvml.server import NvmlServer
from tests.support.timing import scaled

H100, T4 = GPU_MODELS["H100-SXM5-80GB"], GPU_MODELS["Tesla-T4"]
H100_UUID = "GPU-0a100000-0000-4000-8000-000000000001"
T4_UUID = "GPU-07400000-0000-4000-8000-000000000003"
LDCONFIG = shutil.which("ldconfig") or "/sbin/ldconfig"
WAIT = scaled(5.0)  # seconds a test gives something that happens at once before calling it a failure


def _nvml() -> SimulatedNvml:
    return SimulatedNvml([SimGpu(H100, "0000:18:00.0", H100_UUID, minor=0, mig_enabled=True),
                          SimGpu(T4, "0000:3b:00.0", T4_UUID, minor=1)])


@pytest.fixture
def served(scratch: Path) -> Iterator[tuple[SimulatedNvml, NvmlServer]]:
    """A host-layout driver root at `scratch` whose library this process loads, served from a thread here."""
    install_driver(scratch, NvidiaDriverSpec(), [0, 1])
    sim = _nvml()
    use_driver_root(DriverRoot(scratch, scratch, scratch / "dev"))
    with_server = NvmlServer(sim, nvml_server_socket(scratch)).start()
    try:
        yield sim, with_server
    finally:
        with_server.stop()


def test_the_library_exports_exactly_the_simulated_entry_points() -> None:
    text = subprocess.run(["nm", "-D", "--defined-only", str(build_library())], capture_output=True, text=True,
                          check=True).stdout
    exported = {line.split()[-1] for line in text.splitlines() if " T " in line}
    assert exported == {*SYMBOLS, "nvmlErrorString"} == {*SimulatedNvml.implemented_symbols()}


def test_calls_reach_the_server_through_the_library_found_in_the_driver_root(
        served: tuple[SimulatedNvml, NvmlServer], scratch: Path) -> None:
    sim, _ = served
    with nvml_session():
        assert loaded_library() == scratch / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.95.05"
        assert isinstance(pynvml.nvmlLib, ctypes.CDLL), "a real library, not a Python object"
        assert pynvml.nvmlSystemGetDriverVersion() == "580.95.05"
        h100 = pynvml.nvmlDeviceGetHandleByUUID(H100_UUID.encode())
        assert pynvml.nvmlDeviceGetName(h100) == "NVIDIA H100 80GB HBM3"
        assert pynvml.nvmlDeviceGetPciInfo(h100).busId in ("00000000:18:00.0", b"00000000:18:00.0")
        info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h100, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
        count = ctypes.c_uint(0)
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(h100, info.id, None, ctypes.byref(count))
        placements = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(h100, info.id, placements, ctypes.byref(count))
        assert [(p.start, p.size) for p in placements] == [(i, 1) for i in range(7)]
        gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(h100, info.id, ctypes.byref(placements[2]))
        assert pynvml.nvmlGpuInstanceGetInfo(gi).placement.start == 2
        assert [(v.profile, v.start) for v in sim.instances(0)] == [("1g.10gb", 2)], "the server's state changed"
        with pytest.raises(pynvml.NVMLError_InsufficientResources):  # the rules are the simulation's
            pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(h100, info.id, ctypes.byref(placements[2]))
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetHandleByUUID(b"GPU-nope")
        assert pynvml.nvmlErrorString(pynvml.NVML_ERROR_GPU_IS_LOST) == "GPU is lost"
        buffer = ctypes.create_string_buffer(4)
        code = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetUUID")(h100, buffer, ctypes.c_uint(4))
        assert code == pynvml.NVML_ERROR_INSUFFICIENT_SIZE and buffer.raw == b"\0" * 4, "nothing written on failure"


def test_event_waits_block_only_their_own_connection(served: tuple[SimulatedNvml, NvmlServer]) -> None:
    sim, _ = served
    with nvml_session():
        t4 = pynvml.nvmlDeviceGetHandleByIndex(1)
        events = pynvml.nvmlEventSetCreate()
        pynvml.nvmlDeviceRegisterEvents(t4, pynvml.nvmlEventTypeXidCriticalError, events)
        got: list[int] = []
        waits = sim.call_count("nvmlEventSetWait_v2")
        wait_ms = int(scaled(10) * 1000)
        waiter = threading.Thread(target=lambda: got.append(pynvml.nvmlEventSetWait_v2(events, wait_ms).eventData))
        waiter.start()
        deadline = time.monotonic() + WAIT
        while sim.call_count("nvmlEventSetWait_v2") == waits:  # until the waiter is in the server
            assert time.monotonic() < deadline, "the wait did not reach the server"
            time.sleep(0.01)
        started = time.monotonic()
        for _ in range(20):  # other calls of the process go on meanwhile
            assert pynvml.nvmlDeviceGetMinorNumber(t4) == 1
        assert time.monotonic() - started < WAIT
        assert sim.inject_xid(1, 48) == 1
        waiter.join(WAIT)
        assert got == [48]
        pynvml.nvmlEventSetFree(events)


def test_a_process_that_dies_leaves_nothing_behind(served: tuple[SimulatedNvml, NvmlServer], scratch: Path) -> None:
    sim, _ = served
    script = ("import ctypes, os, sys, pynvml\n"
              "pynvml.nvmlLib = ctypes.CDLL(sys.argv[1])\n"
              "pynvml.nvmlInit()\n"
              "events = pynvml.nvmlEventSetCreate()\n"
              "pynvml.nvmlDeviceRegisterEvents(pynvml.nvmlDeviceGetHandleByIndex(1), 8, events)\n"
              "print(pynvml.nvmlDeviceGetCount(), flush=True)\n"
              "sys.stdin.read()\n")
    library = scratch / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
    with subprocess.Popen([sys.executable, "-c", script, str(library)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "2"
            assert sim.registrations(1) == pynvml.nvmlEventTypeXidCriticalError, "the child's event set is there"
        finally:
            child.kill()
    deadline = time.monotonic() + WAIT
    while sim.registrations(1):  # the server notices the closed connection
        assert time.monotonic() < deadline, "the dead process's event set is still registered"
        time.sleep(0.02)


def test_a_forked_child_opens_connections_of_its_own(served: tuple[SimulatedNvml, NvmlServer]) -> None:
    with nvml_session():
        assert pynvml.nvmlDeviceGetCount() == 2  # the parent has a pooled connection now
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                code = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetCount_v2")(ctypes.byref(ctypes.c_uint()))
                os.write(write, str(code).encode())
            finally:
                os._exit(0)
        os.close(write)
        answer = os.read(read, 16)
        os.waitpid(pid, 0)
        os.close(read)
        # A new process is a new NVML client: not initialised, whatever its parent did.
        assert int(answer) == pynvml.NVML_ERROR_UNINITIALIZED
        assert pynvml.nvmlDeviceGetCount() == 2, "the parent's connections are untouched"


def test_without_a_server_init_says_the_driver_is_not_loaded(served: tuple[SimulatedNvml, NvmlServer]) -> None:
    _, server = served
    with nvml_session():
        pass  # a pooled connection now exists
    server.stop()
    with pytest.raises(NvmlUnavailable, match="nvmlInit failed: Driver Not Loaded"), nvml_session():
        pass


def test_a_library_of_another_table_is_refused(served: tuple[SimulatedNvml, NvmlServer], scratch: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(WAIT)
        sock.connect(str(nvml_server_socket(scratch)))
        sock.sendall(HELLO[:-5] + b"0000\n")
        assert struct.unpack("<i", sock.recv(4))[0] == pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH
        assert sock.recv(1) == b"", "and the connection closed"


def test_hostile_requests_get_errors_and_the_server_goes_on(served: tuple[SimulatedNvml, NvmlServer],
                                                            scratch: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(WAIT)
        sock.connect(str(nvml_server_socket(scratch)))
        sock.sendall(HELLO)
        assert sock.recv(4) == b"\0\0\0\0"

        def call(symbol: int, *words: int) -> int:
            sock.sendall(struct.pack("<II8Q", symbol, len(words), *words, *([0] * (8 - len(words)))))
            answer: int = struct.unpack("<i", sock.recv(4))[0]
            return answer

        init, count = SYMBOLS.index("nvmlInitWithFlags"), SYMBOLS.index("nvmlDeviceGetCount_v2")
        assert call(9999) == pynvml.NVML_ERROR_INVALID_ARGUMENT  # no such entry point
        assert call(init, 0, 0, 0) == pynvml.NVML_ERROR_INVALID_ARGUMENT  # wrong argument count
        assert call(init, 0) == pynvml.NVML_SUCCESS
        assert call(count, 8) == pynvml.NVML_ERROR_INVALID_ARGUMENT  # a pointer into nothing
        assert call(count, 0) == pynvml.NVML_ERROR_INVALID_ARGUMENT  # NULL, as NVML answers it
        by_uuid = SYMBOLS.index("nvmlDeviceGetHandleByUUID")
        assert call(by_uuid, 16, 16) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    with nvml_session():
        assert pynvml.nvmlDeviceGetCount() == 2


def test_the_build_is_cached_and_needs_a_compiler(scratch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built = build_library(scratch / "cache")
    made = built.stat().st_mtime_ns
    assert build_library(scratch / "cache") == built and built.stat().st_mtime_ns == made, "no second compile"
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(LibraryBuildError, match=r"no `cc` on PATH: install one \(Debian: apt-get install gcc"):
        build_library(scratch / "other")


@pytest.mark.parametrize("layout", ["host", "container"])
def test_the_driver_is_laid_out_as_installed_with_a_cache_ldconfig_reads(scratch: Path, layout: str) -> None:
    (scratch / "dev").mkdir()
    for name in ("nvidiactl", "nvidia0", "nvidia-uvm"):
        (scratch / "dev" / name).write_bytes(b"")
    droot = install_driver(scratch, NvidiaDriverSpec(layout=layout, driver_version="570.1.2"), [0])
    assert droot == (scratch / "run/nvidia/driver" if layout == "container" else scratch)
    libraries = droot / "usr/lib/x86_64-linux-gnu"
    assert os.readlink(libraries / "libnvidia-ml.so.1") == "libnvidia-ml.so.570.1.2"
    assert (libraries / SERVER_LINK).resolve() == nvml_server_socket(scratch).resolve()
    container_dev = scratch / "run/nvidia/driver/dev"
    assert (container_dev / "nvidia0").exists() == (layout == "container"), "a driver container's own /dev"
    cache = droot / "etc/ld.so.cache"
    listed = subprocess.run([LDCONFIG, "-p", "-C", str(cache)], capture_output=True, text=True, check=True).stdout
    assert "libnvidia-ml.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1" in listed
    entries = parse_ld_cache(cache.read_bytes())
    assert [e.name for e in entries] == library_order([e.name for e in entries])
    search = DriverRoot(scratch, droot, scratch / "dev").find_library("libnvidia-ml.so.1")
    assert search.candidates == (libraries / "libnvidia-ml.so.570.1.2",)


def test_ld_cache_order_is_glibcs() -> None:
    # glibc's comparison takes runs of digits as numbers, and ldconfig writes the entries in descending order.
    assert library_order(["libz.so.1", "libz3.so.4", "libzstd.so.1", "libz.so.10", "libz.so.9"]) == [
        "libz3.so.4", "libzstd.so.1", "libz.so.10", "libz.so.9", "libz.so.1"]
    system = [e.name for e in parse_ld_cache(Path("/etc/ld.so.cache").read_bytes())]
    assert system == library_order(system), "the order of this machine's cache, which ldconfig wrote"


def test_written_cache_matches_ldconfig_for_the_same_entries(scratch: Path) -> None:
    write_ld_cache(scratch / "c", [("libb.so.1", "/x/libb.so.1"), ("liba.so.2", "/x/liba.so.2")], abi_flags() or 0)
    listed = subprocess.run([LDCONFIG, "-p", "-C", str(scratch / "c")], capture_output=True, text=True,
                            check=True).stdout
    assert listed.splitlines()[1:] == ["\tlibb.so.1 (libc6,x86-64) => /x/libb.so.1",
                                       "\tliba.so.2 (libc6,x86-64) => /x/liba.so.2"]


def test_a_fault_of_the_simulation_is_an_unknown_error_and_the_server_goes_on(
        served: tuple[SimulatedNvml, NvmlServer], monkeypatch: pytest.MonkeyPatch) -> None:
    sim, _ = served

    def broken(*args: object) -> int:
        raise ZeroDivisionError("a bug")

    with nvml_session():
        monkeypatch.setattr(sim, "nvmlDeviceGetCount_v2", broken)
        with pytest.raises(pynvml.NVMLError_Unknown):
            pynvml.nvmlDeviceGetCount()
        monkeypatch.undo()
        assert pynvml.nvmlDeviceGetCount() == 2


def test_a_new_driver_version_is_loaded_at_the_next_session_and_the_old_one_unloaded(
        served: tuple[SimulatedNvml, NvmlServer], scratch: Path) -> None:
    libraries = scratch / "usr/lib/x86_64-linux-gnu"
    with nvml_session():
        assert loaded_library() == libraries / "libnvidia-ml.so.580.95.05"
        old = pynvml.nvmlLib
        install_driver(scratch, NvidiaDriverSpec(driver_version="590.10.01"), [0, 1])  # upgraded meanwhile
        assert pynvml.nvmlDeviceGetCount() == 2, "an open session goes on with the library it has"
        assert loaded_library() == libraries / "libnvidia-ml.so.580.95.05"
    with nvml_session():
        assert loaded_library() == libraries / "libnvidia-ml.so.590.10.01"
        assert pynvml.nvmlLib is not old
        assert pynvml.nvmlDeviceGetCount() == 2
    maps = Path("/proc/self/maps").read_text()
    assert "libnvidia-ml.so.590.10.01" in maps and "libnvidia-ml.so.580.95.05" not in maps, "the old one unloaded"
