"""Moving a PCI function between drivers through sysfs, within a deadline.

A write to `unbind` or `drivers_probe` runs the driver's remove or probe inside the kernel, and even a write to
`driver_override` waits for the device's lock while one runs; a GPU with a process holding it can block unbind
indefinitely. So the writes run in a daemon writer thread that is abandoned when it outlives its deadline (later
work gets a new one). One function's whole change (override, unbind, probe, and the waits between) is one job
for that thread: handing each write over separately cost two thread switches each. The thread is kept between
jobs, as starting one per job cost a few hundred microseconds. The effect of a write is confirmed by re-reading
the function's `driver` link until it names the expected driver (a driver's probe may finish after the write
returns): soon at first, then less often.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends.contract import PrepareError
from backends.sysfs import SysfsError, read_link_name

__all__ = ["VFIO_PCI", "Deadline", "Job", "Rebinder", "StuckError"]

VFIO_PCI = "vfio-pci"
_FIRST_POLL, _POLL = 0.00025, 0.002  # seconds between reads of a driver link: first, and at most


class StuckError(PrepareError):
    """A job outlived its deadline and was given up on: it may still be blocked in the kernel, and its caller must
    undo what it did from another thread."""


@dataclass
class Deadline:
    """The time left for one claim's rebinding (monotonic)."""

    seconds: float
    at: float = 0.0

    def __post_init__(self) -> None:
        self.at = time.monotonic() + self.seconds

    def left(self) -> float:
        return max(0.0, self.at - time.monotonic())


@dataclass
class Job:
    """Work handed to the writer thread, and how it ended; `abandoned` once its caller has given up on it (its
    later writes are refused, and it must not start anything else)."""

    run: Callable[[Job], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    abandoned: bool = False
    writing: str = ""  # the write in progress, for the message when it does not return
    notify: Callable[[], None] | None = None  # called from the writer thread once done


class _Writer:
    """A daemon thread that runs the jobs handed to it, one after the other."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="sysfs-writer", daemon=True).start()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job.result = job.run(job)
            except BaseException as e:  # handed to the caller
                job.error = e
            job.done.set()
            if job.notify is not None:
                job.notify()


class Rebinder:
    """Driver changes of PCI functions under `sysfs_root`."""

    def __init__(self, sysfs_root: Path) -> None:
        self.sysfs = sysfs_root
        self._writer: _Writer | None = None
        self._writer_lock = threading.Lock()

    def folder(self, bus_id: str) -> Path:
        return self.sysfs / "bus/pci/devices" / bus_id

    def driver(self, bus_id: str) -> str | None:
        return read_link_name(self.folder(bus_id) / "driver")

    def to_vfio(self, bus_id: str, deadline: Deadline) -> None:
        """Override, unbind, probe; return once vfio-pci holds the function."""
        self._run(lambda job: self.to_vfio_in(job, bus_id, self.driver(bus_id), deadline), deadline,
                  f"binding {bus_id} to {VFIO_PCI}")

    def back_to(self, bus_id: str, original: str | None, deadline: Deadline) -> None:
        """Clear the override and hand the function back to `original` (None: leave it unbound)."""
        self._run(lambda job: self.back_to_in(job, bus_id, original, deadline), deadline,
                  f"handing {bus_id} back to {original or 'no driver'}")

    def to_vfio_in(self, job: Job, bus_id: str, driver: str | None, deadline: Deadline) -> None:
        """`to_vfio` from within a job of the writer thread, for a function whose driver was just read."""
        if driver == VFIO_PCI:
            return
        self._write_now(job, self.folder(bus_id) / "driver_override", VFIO_PCI)
        if driver is not None:  # an override changes no binding: the driver read before still holds
            self._write_now(job, self.folder(bus_id) / "driver/unbind", bus_id)
            self.wait_for(bus_id, None, deadline)
        self._write_now(job, self.sysfs / "bus/pci/drivers_probe", bus_id)
        self.wait_for(bus_id, VFIO_PCI, deadline)

    def back_to_in(self, job: Job, bus_id: str, original: str | None, deadline: Deadline) -> None:
        """`back_to` from within a job of the writer thread."""
        if not self.folder(bus_id).is_dir():
            return  # the function is gone (a VF disabled, a device removed): nothing to give back
        # A newline clears driver_override on every kernel (an empty write is refused by some).
        self._write_now(job, self.folder(bus_id) / "driver_override", "\n")
        current = self.driver(bus_id)
        if current == original:
            return
        if current is not None:
            self._write_now(job, self.folder(bus_id) / "driver/unbind", bus_id)
            self.wait_for(bus_id, None, deadline)
        if original is not None:
            self._write_now(job, self.sysfs / "bus/pci/drivers_probe", bus_id)
            self.wait_for(bus_id, original, deadline)

    def wait_for(self, bus_id: str, driver: str | None, deadline: Deadline) -> None:
        poll = _FIRST_POLL
        while True:
            try:
                current = self.driver(bus_id)
            except SysfsError as e:
                raise PrepareError(f"{bus_id}: {e}") from None
            if current == driver:
                return
            if deadline.left() <= 0:
                wanted = f"bound to {driver}" if driver else "unbound"
                raise PrepareError(f"{bus_id} is not {wanted} within {deadline.seconds:g} s "
                                   f"(its driver is {current or 'none'})")
            time.sleep(poll)
            poll = min(poll * 2, _POLL)

    def write(self, path: Path, value: str, deadline: Deadline) -> None:
        """Write `value` to a sysfs control file, giving up (the writer thread stays blocked) when the deadline
        passes."""
        self._run(lambda job: self._write_now(job, path, value), deadline, "")

    def _run(self, steps: Callable[[Job], Any], deadline: Deadline, what: str) -> Any:
        """Run `steps` in the writer thread, blocking; its result, or PrepareError when it fails or outlives the
        deadline."""
        job, writer = self._submit(steps)
        if not job.done.wait(deadline.left()):
            raise self._given_up(job, writer, deadline, what)
        if job.error is not None:
            raise job.error
        return job.result

    async def run(self, steps: Callable[[Job], Any], deadline: Deadline, what: str) -> Any:
        """`_run` for the event loop: one hand-over to the writer thread and one back, whatever `steps` do."""
        loop = asyncio.get_running_loop()
        finished = loop.create_future()

        def finish() -> None:
            if not finished.done():
                finished.set_result(None)

        def notify() -> None:  # in the writer thread
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(finish)

        job, writer = self._submit(steps, notify)
        try:
            await asyncio.wait_for(asyncio.shield(finished), deadline.left())
        except TimeoutError:
            raise self._given_up(job, writer, deadline, what) from None
        if job.error is not None:
            raise job.error
        return job.result

    def _submit(self, steps: Callable[[Job], Any], notify: Callable[[], None] | None = None) -> tuple[Job, _Writer]:
        job = Job(steps, notify=notify)
        with self._writer_lock:
            if self._writer is None:
                self._writer = _Writer()
            writer = self._writer
        writer.submit(job)
        return job, writer

    def _given_up(self, job: Job, writer: _Writer, deadline: Deadline, what: str) -> StuckError:
        job.abandoned = True  # what it has not written yet, it will not write
        with self._writer_lock:
            if self._writer is writer:
                self._writer = None  # stuck in the kernel: later work goes to a new thread
        if not job.writing:
            return StuckError(f"{what or 'the write'} did not finish within {deadline.seconds:g} s")
        stuck = f"{job.writing} did not return within {deadline.seconds:g} s; the kernel may still be busy with it"
        return StuckError(f"{what}: {stuck}" if what else stuck)

    @staticmethod
    def _write_now(job: Job, path: Path, value: str) -> None:
        """One write, from the writer thread."""
        if job.abandoned:
            raise PrepareError(f"not writing {value.strip()!r} to {path}: given up")
        job.writing = f"writing {value.strip()!r} to {path}"
        try:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, value.encode())
            finally:
                os.close(fd)
        except OSError as e:
            raise PrepareError(f"cannot write {value.strip()!r} to {path}: {e.strerror or e}") from None
        job.writing = ""
