"""The node's NVML server: runs the calls every process makes through the simulated libnvidia-ml on one
`SimulatedNvml`, so that all of them see one GPU state, as they share one kernel driver on a real node.

A unix stream socket; one thread per connection (a call blocked in nvmlEventSetWait blocks only its own). A
connection starts with the library's hello (`library.HELLO`): a library built from another table of entry
points is refused with NVML_ERROR_LIB_RM_VERSION_MISMATCH. Then each request is the symbol's number, the argument
count and eight argument words; the answer is the NVML return code. The caller is known by the socket's peer
credentials: its connections are one NVML client (`marshal.Client`), whose init count and event sets go when
its last connection closes, i.e. when the process is gone. Pointer arguments become ctypes objects filled from the
caller's memory and written back to it (`process_memory`), as `abi` says for each parameter.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import socket
import struct
import threading
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from simulator.nvml.abi import MAX_ARGS, MAX_ARRAY, SIGNATURES, SYMBOLS, Kind, Param
from simulator.nvml.api import SimulatedNvml
from simulator.nvml.control import socket_address
from simulator.nvml.library import HELLO
from simulator.nvml.marshal import Client
from simulator.nvml.process_memory import MemoryAccessError, read_into, read_string, write_from
from simulator.nvml.state import NvmlReturn
from simulator.timing import scaled

__all__ = ["NvmlServer"]

_log = logging.getLogger(__name__)
_REQUEST = struct.Struct(f"<II{MAX_ARGS}Q")
_ANSWER = struct.Struct("<i")
_PEER = struct.Struct("3i")  # struct ucred: pid, uid, gid
_BUFFER_LIMIT = 4096  # no NVML text is longer; a larger stated size is served with this many bytes


@dataclass(eq=False)
class _Process:
    client: Client
    connections: int = 0


@dataclass
class _Call:
    """One call's arguments as the simulation takes them, and what goes back to the caller afterwards."""

    args: list[Any] = field(default_factory=list)
    readback: list[tuple[Any, int, bytes]] = field(default_factory=list)  # object, address, bytes before the call
    buffers: list[tuple[ctypes.Array[ctypes.c_char], int]] = field(default_factory=list)
    arrays: list[tuple[ctypes.Array[Any], int, Any]] = field(default_factory=list)  # array, address, its count


class NvmlServer:
    """Serves `nvml` at `path` from threads of this process between `start()` and `stop()`."""

    def __init__(self, nvml: SimulatedNvml, path: Path) -> None:
        self.nvml = nvml
        self.path = path
        self._listener: socket.socket | None = None
        self._wake: tuple[int, int] | None = None
        self._threads: set[threading.Thread] = set()
        self._connections: set[socket.socket] = set()
        self._processes: dict[int, _Process] = {}
        self._lock = threading.Lock()
        self._inode = 0

    def start(self) -> NvmlServer:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with suppress(FileNotFoundError):
            self.path.unlink()  # left by a server that was killed
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            with socket_address(self.path) as address:
                listener.bind(address)
            listener.listen(64)
            self._inode = self.path.stat().st_ino
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self._wake = os.pipe()
        self._spawn(self._accept, "simulated-nvml-accept")
        return self

    def stop(self) -> None:
        """Stop accepting, end every connection (and the calls waiting in them) and wait for the threads."""
        if self._listener is None or self._wake is None:
            return
        os.write(self._wake[1], b"x")
        with self._lock:
            connections, processes = list(self._connections), list(self._processes.values())
        for connection in connections:
            with suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        for process in processes:
            self.nvml.client_gone(process.client)  # wakes calls blocked in an event wait
        for thread in list(self._threads):
            thread.join(timeout=scaled(10))
        self._listener.close()
        for fd in self._wake:
            os.close(fd)
        with suppress(FileNotFoundError):
            if self.path.stat().st_ino == self._inode:
                self.path.unlink()
        self._listener = self._wake = None

    def _spawn(self, target: Any, name: str, *args: Any) -> None:
        thread = threading.Thread(target=self._run, args=(target, *args), name=name, daemon=True)
        with self._lock:
            self._threads.add(thread)
        thread.start()

    def _run(self, target: Any, *args: Any) -> None:
        try:
            target(*args)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _accept(self) -> None:
        assert self._listener is not None and self._wake is not None
        poller = select.poll()  # not select(2): descriptors above 1023 are common in a test process
        poller.register(self._listener.fileno(), select.POLLIN)
        poller.register(self._wake[0], select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if self._wake[0] in ready:
                return
            try:
                connection, _ = self._listener.accept()
            except OSError:
                continue
            self._spawn(self._serve, "simulated-nvml-call", connection)

    # -- one connection ------------------------------------------------------------------------------

    def _serve(self, connection: socket.socket) -> None:
        pid = _PEER.unpack(connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEER.size))[0]
        with self._lock:
            self._connections.add(connection)
            process = self._processes.setdefault(pid, _Process(Client(f"process {pid}")))
            process.connections += 1
        try:
            if _receive(connection, len(HELLO)) != HELLO:
                connection.sendall(_ANSWER.pack(NvmlReturn.ERROR_LIB_RM_VERSION_MISMATCH))
                return
            connection.sendall(_ANSWER.pack(0))
            while True:
                request = _receive(connection, _REQUEST.size)
                if request is None:
                    return
                symbol, count, *words = _REQUEST.unpack(request)
                connection.sendall(_ANSWER.pack(self._call(pid, process.client, symbol, words[:count])))
        except OSError:
            return  # the process went away mid-call
        finally:
            connection.close()
            with self._lock:
                self._connections.discard(connection)
                process.connections -= 1
                gone = process.connections == 0 and self._processes.get(pid) is process
                if gone:
                    del self._processes[pid]
            if gone:
                self.nvml.client_gone(process.client)

    def _call(self, pid: int, client: Client, symbol: int, words: list[int]) -> int:
        if symbol >= len(SYMBOLS) or len(words) != len(SIGNATURES[SYMBOLS[symbol]]):
            return NvmlReturn.ERROR_INVALID_ARGUMENT  # a request no library of this table sends
        name = SYMBOLS[symbol]
        try:
            call = _marshal(pid, SIGNATURES[name], words)
        except MemoryAccessError:
            return NvmlReturn.ERROR_INVALID_ARGUMENT  # a pointer into nothing
        try:
            with self.nvml.serving(client):
                code = int(getattr(self.nvml, name)(*call.args))
        except Exception:  # a fault of the simulation: the caller gets NVML's "unknown error", the server goes on
            _log.exception("simulated NVML: %s of process %d failed", name, pid)
            return NvmlReturn.ERROR_UNKNOWN
        try:
            _write_back(pid, call, code)
        except MemoryAccessError:
            _log.warning("simulated NVML: %s of process %d returned into memory that is gone", name, pid)
        return code


def _receive(connection: socket.socket, size: int) -> bytes | None:
    """Exactly `size` bytes, or None at the end of the stream."""
    data = connection.recv(size, socket.MSG_WAITALL)
    while 0 < len(data) < size:
        more = connection.recv(size - len(data), socket.MSG_WAITALL)
        if not more:
            return None
        data += more
    return data if len(data) == size else None


def _marshal(pid: int, params: tuple[Param, ...], words: list[int]) -> _Call:
    """The simulation's arguments for a call with these argument words, the caller's memory read in one go."""
    call = _Call()
    reads: list[tuple[Any, int]] = []
    for i, (param, word) in enumerate(zip(params, words, strict=True)):
        kind = param.kind
        if kind in (Kind.UINT, Kind.ULL):
            call.args.append(word & (0xFFFFFFFF if kind is Kind.UINT else 0xFFFFFFFFFFFFFFFF))
        elif kind is Kind.HANDLE:
            call.args.append(word or None)
        elif not word:
            call.args.append(None)  # a NULL pointer: the simulation answers as NVML does
        elif kind is Kind.STRING:
            call.args.append(read_string(pid, word))
        elif kind is Kind.BUFFER:
            size = words[i + 1] & 0xFFFFFFFF
            buffer = ctypes.create_string_buffer(min(size, _BUFFER_LIMIT))
            call.buffers.append((buffer, word))
            call.args.append(buffer)
        elif kind is Kind.ARRAY:
            assert param.ctype is not None
            array = (param.ctype * MAX_ARRAY)()
            call.args.append(array)
            call.arrays.append((array, word, None))
        else:
            assert param.ctype is not None
            obj = param.ctype()
            reads.append((obj, word))
            call.args.append(ctypes.byref(obj))
    read_into(pid, reads)
    call.readback = [(obj, address, _bytes(obj)) for obj, address in reads]
    if call.arrays:  # an array's count is what the call leaves in the last argument
        count = call.args[-1]
        call.arrays = [(array, address, count) for array, address, _ in call.arrays]
    return call


def _bytes(obj: Any) -> bytes:
    return ctypes.string_at(ctypes.addressof(obj), ctypes.sizeof(obj))


def _write_back(pid: int, call: _Call, code: int) -> None:
    """Copy what the call changed into the caller's memory: changed values and structs always (NVML writes some on
    failure, e.g. a MIG mode change's activation status), texts and arrays on success."""
    spans: list[tuple[int, int, int]] = []
    for obj, address, before in call.readback:
        if _bytes(obj) != before:  # IN structs never change, so they are never written
            spans.append((ctypes.addressof(obj), address, ctypes.sizeof(obj)))
    if code == NvmlReturn.SUCCESS:
        for buffer, address in call.buffers:
            spans.append((ctypes.addressof(buffer), address, len(buffer.value) + 1))
        for array, address, count in call.arrays:
            n = min(getattr(count, "_obj", count).value if count is not None else 0, MAX_ARRAY)
            if n:
                spans.append((ctypes.addressof(array), address, n * ctypes.sizeof(array._type_)))
    write_from(pid, spans)
