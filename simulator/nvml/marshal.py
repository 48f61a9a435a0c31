"""How the simulated NVML meets pynvml's ctypes calls: handle tokens, argument marshalling, the call wrapper.

pynvml calls each C symbol with ctypes objects: handles are opaque pointers, out-parameters arrive as
`byref(x)`, strings as `create_string_buffer` buffers, structs by reference. Handles here are opaque
non-zero tokens that encode what they name (GPU, MIG device, GPU instance, compute instance, event set).
Every entry point runs under one lock, checks initialisation, resolves its handle, applies the GPU's
`lost` flag and injected faults, and turns `SimulatedNvmlError` into the int return code.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Concatenate, ParamSpec, TypeVar

from simulator.nvml.state import (
    ComputeInstance,
    GpuInstance,
    NvmlReturn,
    SimGpu,
    SimulatedNvmlError,
    parse_bus_id,
)

__all__ = [
    "Client",
    "HandleKind",
    "LibraryCore",
    "Target",
    "api",
    "array_length",
    "check_version",
    "handle_value",
    "on_handle",
    "out",
    "set_fields",
    "set_string",
    "store_handle",
    "store_handle_at",
    "store_pointer_field",
    "token",
    "uint",
]

_P = ParamSpec("_P")
_L = TypeVar("_L", bound="LibraryCore")
_PTR = ctypes.sizeof(ctypes.c_void_p)


class HandleKind(IntEnum):
    """What a handle token names; the kind sits in the token's top bits."""

    GPU = 1
    MIG_DEVICE = 2
    GPU_INSTANCE = 3
    COMPUTE_INSTANCE = 4
    EVENT_SET = 5


def token(kind: HandleKind, index: int = 0, gi: int = 0, ci: int = 0) -> int:
    """The opaque pointer value of a handle: kind, GPU index (or event-set id), GI id and CI id."""
    return (int(kind) << 48) | (index << 32) | (gi << 16) | ci


def _untoken(value: int) -> tuple[int, int, int, int]:
    return value >> 48, (value >> 32) & 0xFFFF, (value >> 16) & 0xFFFF, value & 0xFFFF


def handle_value(arg: Any) -> int | None:
    """The pointer value of a handle argument (a ctypes pointer, c_void_p or int); None for NULL or junk."""
    if arg is None or isinstance(arg, int):
        return arg
    try:
        value: int | None = ctypes.cast(arg, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None
    return value


def out(ref: Any) -> Any:
    """The object an out-parameter (`byref(x)`, `pointer(x)` or `x` itself) designates."""
    if ref is None:
        raise SimulatedNvmlError(NvmlReturn.ERROR_INVALID_ARGUMENT, "NULL out-parameter")
    obj = getattr(ref, "_obj", None)
    if obj is not None:
        return obj
    if isinstance(ref, ctypes._Pointer):
        try:
            return ref.contents
        except ValueError:
            raise SimulatedNvmlError(NvmlReturn.ERROR_INVALID_ARGUMENT, "NULL out-parameter") from None
    return ref


def uint(arg: Any) -> int:
    """An integer argument, whether pynvml passed a ctypes int or a plain Python int."""
    value = getattr(arg, "value", arg)
    if not isinstance(value, int):
        raise SimulatedNvmlError(NvmlReturn.ERROR_INVALID_ARGUMENT, f"expected an integer, got {arg!r}")
    return value


def _poke(address: int, value: int) -> None:
    ctypes.memmove(address, ctypes.byref(ctypes.c_void_p(value)), _PTR)


def store_handle(ref: Any, value: int) -> None:
    """Write handle `value` into an out-parameter of a handle type."""
    _poke(ctypes.addressof(out(ref)), value)


def store_handle_at(array: Any, i: int, value: int) -> None:
    """Write handle `value` into element `i` of a caller's handle array."""
    arr = out(array)
    _poke(ctypes.addressof(arr) + i * _PTR, value)


def store_pointer_field(struct: Any, name: str, value: int) -> None:
    """Write handle `value` into pointer field `name` of a struct."""
    _poke(ctypes.addressof(struct) + getattr(type(struct), name).offset, value)


def set_fields(struct: Any, **values: object) -> None:
    """Set the named fields the struct has (v1 structs lack some v2 fields, e.g. `name`)."""
    present = {f[0] for f in getattr(type(struct), "_fields_", ())}
    for name, value in values.items():
        if name in present:
            setattr(struct, name, value)


def check_version(struct: Any, major: int) -> None:
    """Real NVML rejects a versioned struct whose `version` is not (major << 24 | sizeof)."""
    if getattr(struct, "version", None) != (major << 24) | ctypes.sizeof(struct):
        raise SimulatedNvmlError(NvmlReturn.ERROR_ARGUMENT_VERSION_MISMATCH, type(struct).__name__)


def set_string(buffer: Any, length: Any, text: str) -> None:
    """Copy `text` into a caller's char buffer of `length` bytes (NUL included)."""
    data = text.encode()
    if buffer is None:
        raise SimulatedNvmlError(NvmlReturn.ERROR_INVALID_ARGUMENT, "NULL buffer")
    if len(data) + 1 > uint(length):
        raise SimulatedNvmlError(NvmlReturn.ERROR_INSUFFICIENT_SIZE, f"{len(data) + 1} bytes needed")
    buffer.value = data


def array_length(array: Any) -> int:
    """Element count of a caller's ctypes array (pointers carry no length: treat them as large enough)."""
    arr = getattr(array, "_obj", array)
    return len(arr) if isinstance(arr, ctypes.Array) else 1 << 16


@dataclass(frozen=True)
class Target:
    """What a device, GPU-instance or compute-instance handle resolved to."""

    kind: HandleKind
    index: int
    gpu: SimGpu
    gi: GpuInstance | None = None
    ci: ComputeInstance | None = None

    @property
    def mig(self) -> bool:
        return self.kind is HandleKind.MIG_DEVICE


@dataclass(eq=False)
class Client:
    """One process using the library: what NVML keeps per process, its init count (and, in `EventSymbols`, the
    event sets it made). The GPUs' state is the same for every client."""

    name: str
    init_count: int = 0


class LibraryCore:
    """Shared state of the simulated library: the GPUs in NVML order, the lock, and the clients.

    The calls of a thread inside `serving(client)` count as that client's (the NVML server runs each process's
    calls so); any other call counts as this process's own client's (tests calling the library directly)."""

    def __init__(self, gpus: list[SimGpu]) -> None:
        # NVML enumerates GPUs in PCI bus-id order.
        self._gpus: list[SimGpu] = sorted(gpus, key=lambda g: parse_bus_id(g.bus_id))
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # event waiters sleep here
        self._calls: Counter[str] = Counter()
        self.durations: dict[str, float] = {}  # symbol → seconds a call takes, as slow hardware would (tests)
        self._own_client = Client("this process")
        self._serving = threading.local()

    def _client(self) -> Client:
        """The client the calling thread acts for."""
        client: Client | None = getattr(self._serving, "client", None)
        return client if client is not None else self._own_client

    @contextmanager
    def serving(self, client: Client) -> Iterator[None]:
        """Calls made by this thread inside the block are `client`'s."""
        self._serving.client = client
        try:
            yield
        finally:
            self._serving.client = None

    def client_gone(self, client: Client) -> None:
        """The client's process shut NVML down for good or died: forget what NVML kept for it."""
        with self._lock:
            client.init_count = 0
            self._client_released(client)
            self._changed.notify_all()

    def _client_released(self, client: Client) -> None:
        """Drop what `client` holds beyond its init count (see `EventSymbols`); called under the lock."""

    def _state_changed(self) -> None:
        """The GPUs' state changed: a kept node saves what outlives the process (see `MigSymbols`)."""

    def call_counts(self) -> dict[str, int]:
        """How often each C symbol has been called."""
        with self._lock:
            return dict(self._calls)

    def call_count(self, symbol: str) -> int:
        """How often the C symbol `symbol` has been called (tests count wake-ups and probes with it)."""
        with self._lock:
            return self._calls[symbol]

    def _admit(self, gpu: SimGpu, symbol: str) -> None:
        """Apply the GPU's lost flag and any fault injected for `symbol`."""
        if gpu.lost:
            raise SimulatedNvmlError(NvmlReturn.ERROR_GPU_IS_LOST, gpu.bus_id)
        code = gpu.faults.get(symbol, 0)
        if code:
            raise SimulatedNvmlError(code, f"injected for {symbol}")

    def _resolve(self, handle: object, kinds: tuple[HandleKind, ...]) -> Target:
        value = handle_value(handle)
        bad = SimulatedNvmlError(NvmlReturn.ERROR_INVALID_ARGUMENT, f"not a valid handle: {handle!r}")
        if not value:
            raise bad
        kind, index, gi_id, ci_id = _untoken(value)
        if kind not in kinds or index >= len(self._gpus):
            raise bad
        gpu = self._gpus[index]
        if kind == HandleKind.GPU:
            return Target(HandleKind.GPU, index, gpu)
        gi = gpu.gpu_instances.get(gi_id)
        if gi is None:
            raise bad
        if kind == HandleKind.GPU_INSTANCE:
            return Target(HandleKind.GPU_INSTANCE, index, gpu, gi)
        ci = gi.compute_instances.get(ci_id)
        if ci is None:
            raise bad
        return Target(HandleKind(kind), index, gpu, gi, ci)


def _run(self: LibraryCore, symbol: str, body: Callable[[], int]) -> int:
    duration = self.durations.get(symbol)
    if duration:  # the hardware's time: other calls go on meanwhile, as they do while a GPU works
        time.sleep(duration)
    with self._lock:
        self._calls[symbol] += 1
        try:
            if self._client().init_count == 0:
                raise SimulatedNvmlError(NvmlReturn.ERROR_UNINITIALIZED)
            return int(body())
        except SimulatedNvmlError as exc:
            return exc.code


def api(fn: Callable[Concatenate[_L, _P], int]) -> Callable[Concatenate[_L, _P], int]:
    """Wrap an entry point that takes no device handle."""

    @functools.wraps(fn)
    def call(self: _L, /, *args: _P.args, **kwargs: _P.kwargs) -> int:
        return _run(self, fn.__name__, lambda: fn(self, *args, **kwargs))

    return call


def on_handle(
    *kinds: HandleKind,
) -> Callable[[Callable[Concatenate[_L, Target, _P], int]], Callable[Concatenate[_L, Any, _P], int]]:
    """Wrap an entry point whose first argument is a handle of one of `kinds`; it receives the `Target`."""

    def wrap(fn: Callable[Concatenate[_L, Target, _P], int]) -> Callable[Concatenate[_L, Any, _P], int]:
        symbol = fn.__name__

        @functools.wraps(fn)
        def call(self: _L, handle: Any, /, *args: _P.args, **kwargs: _P.kwargs) -> int:
            def body() -> int:
                target = self._resolve(handle, kinds)
                self._admit(target.gpu, symbol)
                return fn(self, target, *args, **kwargs)

            return _run(self, symbol, body)

        return call

    return wrap
