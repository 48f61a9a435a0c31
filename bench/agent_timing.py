"""Times named calls inside a `dra-agent run` process, so that a benchmark can take the hardware's share (NVML
calls, sysfs writes and the kernel's reaction to them) out of the latency the kubelet sees.

Loaded at interpreter start through a `sitecustomize` module the benchmark writes (so it survives the agent's
re-execution under umockdev's preload). `DRA_BENCH_TIMED` lists `label=module:name` entries: `name` is a function
or a `Class.method` (sync or async), wrapped where the agent looks it up; a name that is the `os` module as a
module sees it (e.g. `backends.vfio_sysfs:os`) has that module's file writes timed, from `open` to `close` in the
writing thread. Each timed call is appended as one line `<label> <begin> <end>` (perf_counter seconds: the
system's monotonic clock, so the benchmark places it within its own calls) to the file `DRA_BENCH_TIMES` names.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["AGENT_SPANS", "agent_share", "environment", "install", "spans_within"]

TIMES, TIMED = "DRA_BENCH_TIMES", "DRA_BENCH_TIMED"

Record = Callable[[str, float, float], None]

AGENT_SPANS = [("prepare", "agent.kubelet.services:_DraServicer.NodePrepareResources"),
               ("unprepare", "agent.kubelet.services:_DraServicer.NodeUnprepareResources"),
               ("claim-read", "agent.kube.client:KubeClient.get_claim")]
"""What `agent_share` needs timed: the agent's handling of a kubelet call, and its read of the claim."""


def agent_share(within: Callable[[str, float, float], list[float]], call: str, began: float, ended: float) -> float:
    """The time the agent spent on one kubelet call (`call`: "prepare" or "unprepare") between `began` and
    `ended`: from its gRPC handler receiving the request to the handler's response, less the claim read (the API
    server's round trip). What it leaves out is the API server's, the transport's and the kubelet's own time (and
    gRPC's, which a request with no claims shows: `bench/prepare.py`)."""
    return sum(within(call, began, ended)) - sum(within("claim-read", began, ended))


class _TimedOs:
    """Stands in for `os` in one module: times open → close of each file it writes, in the writing thread."""

    def __init__(self, real: ModuleType, label: str, record: Record) -> None:
        self._real, self._label, self._record = real, label, record
        self._began = threading.local()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def open(self, path: Any, flags: int, *args: Any) -> int:
        self._began.at = time.perf_counter()
        return int(self._real.open(path, flags, *args))

    def close(self, fd: int) -> None:
        self._real.close(fd)
        began = getattr(self._began, "at", None)
        if began is not None:
            self._record(self._label, began, time.perf_counter())
            self._began.at = None


def _timed(label: str, call: Callable[..., Any], record: Record) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(call):
        @functools.wraps(call)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return await call(*args, **kwargs)
            finally:
                record(label, began, time.perf_counter())
        return timed_async

    @functools.wraps(call)
    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            record(label, began, time.perf_counter())
    return timed


def install(path: str, timed: str) -> None:
    """Wrap every `label=module:name` of `timed`; each call's span goes to `path`."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    lock = threading.Lock()

    def record(label: str, began: float, ended: float) -> None:
        with lock:
            os.write(fd, f"{label} {began:.9f} {ended:.9f}\n".encode())

    for entry in timed.split(","):
        label, _, target = entry.partition("=")
        module_name, _, name = target.partition(":")
        module = importlib.import_module(module_name)
        owner_name, _, attribute = name.rpartition(".")
        owner = getattr(module, owner_name) if owner_name else module
        current = getattr(owner, attribute)
        if current is os:
            setattr(owner, attribute, _TimedOs(os, label, record))
        else:
            setattr(owner, attribute, _timed(label, current, record))


def environment(folder: Path, times: Path, timed: Sequence[tuple[str, str]]) -> dict[str, str]:
    """Write a `sitecustomize` into `folder` that times `timed` ((label, `module:name`) pairs) into `times`; the
    environment that makes a Python process load it (and find this package)."""
    (folder / "sitecustomize.py").write_text(
        "import os\n"
        f"if os.environ.get({TIMES!r}):\n"
        "    from bench.agent_timing import install\n"
        f"    install(os.environ[{TIMES!r}], os.environ[{TIMED!r}])\n")
    root = Path(__file__).resolve().parent.parent
    python_path = os.pathsep.join(p for p in (str(folder), str(root), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": python_path, TIMES: str(times),
            TIMED: ",".join(f"{label}={target}" for label, target in timed)}


def spans_within(times: Path) -> Callable[[str, float, float], list[float]]:
    """Read the spans recorded in `times`; the durations of those of a label that lie within (began, ended)."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for line in times.read_text().splitlines():
        label, began, ended = line.split()
        spans.setdefault(label, []).append((float(began), float(ended)))

    def within(label: str, began: float, ended: float) -> list[float]:
        return [e - b for b, e in spans.get(label, ()) if began <= b and e <= ended]
    return within
