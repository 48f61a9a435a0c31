"""A watchdog on an asyncio loop: a heartbeat on the loop and a thread that, when the heartbeat is late by more
than the limit, takes the loop thread's stack at that moment. The stack names the blocking call (a sleep, a file
read, a vendor library call) and the backend line that made it.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

__all__ = ["LIMIT", "LoopWatch", "Stall"]

LIMIT = 0.050
"""How long the backend may hold the event loop at once (seconds)."""
_BEAT = 0.005


@dataclass
class Stall:
    """The loop did not run its heartbeat for `seconds`; `stack` is the loop thread's stack while it was stuck and
    `phase` what the kit had asked the backend to do."""

    phase: str
    stack: list[traceback.FrameSummary]
    seconds: float = 0.0

    def frames_in(self, roots: Sequence[Path]) -> list[traceback.FrameSummary]:
        """The stack frames in the given source folders or files, innermost last."""
        return [f for f in self.stack if any(_under(Path(f.filename), root) for root in roots)]

    def describe(self, roots: Sequence[Path]) -> str:
        mine = self.frames_in(roots)
        where = mine[-1] if mine else self.stack[-1] if self.stack else None
        text = (f"{self.phase}: the event loop was blocked for {self.seconds * 1000:.0f} ms "
                f"(limit {LIMIT * 1000:.0f} ms)")
        if where is not None:
            text += f" at {where.filename}:{where.lineno} in {where.name}: `{(where.line or '').strip()}`"
            inner = self.stack[-1]
            if inner is not where:
                text += f" (inside {Path(inner.filename).name}:{inner.lineno} {inner.name})"
        return text


@dataclass
class LoopWatch:
    """Records stalls of the running loop longer than `limit` while in its `async with` block."""

    limit: float = LIMIT
    phase: str = "start"
    stalls: list[Stall] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._beat = time.perf_counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._heart: asyncio.Task[None] | None = None
        self._loop_thread = 0
        self._open: Stall | None = None

    async def __aenter__(self) -> LoopWatch:
        self._loop_thread = threading.get_ident()
        self._beat = time.perf_counter()
        self._heart = asyncio.create_task(self._heartbeat(), name="conformance loop heartbeat")
        self._thread = threading.Thread(target=self._watch, name="conformance loop watch", daemon=True)
        self._thread.start()
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        trace: TracebackType | None) -> None:
        self._stop.set()
        if self._heart is not None:
            self._heart.cancel()
            await asyncio.gather(self._heart, return_exceptions=True)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    async def _heartbeat(self) -> None:
        while True:
            now = time.perf_counter()
            stall = self._open
            if stall is not None:
                stall.seconds = now - self._beat - _BEAT
                self._open = None
            self._beat = now
            await asyncio.sleep(_BEAT)

    def _watch(self) -> None:
        while not self._stop.wait(_BEAT):
            late = time.perf_counter() - self._beat - _BEAT
            if late > self.limit and self._open is None:
                frame = sys._current_frames().get(self._loop_thread)
                stack = traceback.extract_stack(frame) if frame is not None else []
                stall = Stall(self.phase, list(stack), late)
                self._open = stall
                self.stalls.append(stall)


def _under(path: Path, root: Path) -> bool:
    try:
        return path.resolve() == root or path.resolve().is_relative_to(root)
    except OSError:
        return False
