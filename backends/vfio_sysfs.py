"""Moving a PCI function between drivers through sysfs, within a deadline.

A write to `unbind` or `drivers_probe` runs the driver's remove or probe inside the kernel and can block for as
long as the driver takes (a GPU with a process holding it can block unbind indefinitely), so writes run in a
daemon writer thread that is abandoned when a write outlives its deadline (the next write gets a new one); the
thread is kept between writes, as starting a thread per write cost a few hundred microseconds each. The effect of
a write is confirmed by re-reading the function's `driver` link until it names the expected driver (a driver's
probe may finish after the write returns): soon at first, then less often.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from backends.contract import PrepareError
from backends.sysfs import SysfsError, read_link_name

__all__ = ["VFIO_PCI", "Deadline", "Rebinder"]

VFIO_PCI = "vfio-pci"
_FIRST_POLL, _POLL = 0.00025, 0.002  # seconds between reads of a driver link: first, and at most


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
class _Write:
    """One write handed to the writer thread, and how it ended."""

    path: Path
    value: str
    done: threading.Event = field(default_factory=threading.Event)
    error: OSError | None = None


class _Writer:
    """A daemon thread that makes the writes handed to it, one after the other."""

    def __init__(self) -> None:
        self._writes: queue.SimpleQueue[_Write] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="sysfs-writer", daemon=True).start()

    def submit(self, write: _Write) -> None:
        self._writes.put(write)

    def _run(self) -> None:
        while True:
            write = self._writes.get()
            try:
                fd = os.open(write.path, os.O_WRONLY)
                try:
                    os.write(fd, write.value.encode())
                finally:
                    os.close(fd)
            except OSError as e:
                write.error = e
            write.done.set()


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
        if self.driver(bus_id) == VFIO_PCI:
            return
        self.write(self.folder(bus_id) / "driver_override", VFIO_PCI, deadline)
        if self.driver(bus_id) is not None:
            self.write(self.folder(bus_id) / "driver/unbind", bus_id, deadline)
            self.wait_for(bus_id, None, deadline)
        self.write(self.sysfs / "bus/pci/drivers_probe", bus_id, deadline)
        self.wait_for(bus_id, VFIO_PCI, deadline)

    def back_to(self, bus_id: str, original: str | None, deadline: Deadline) -> None:
        """Clear the override and hand the function back to `original` (None: leave it unbound)."""
        if not self.folder(bus_id).is_dir():
            return  # the function is gone (a VF disabled, a device removed): nothing to give back
        # A newline clears driver_override on every kernel (an empty write is refused by some).
        self.write(self.folder(bus_id) / "driver_override", "\n", deadline)
        current = self.driver(bus_id)
        if current == original:
            return
        if current is not None:
            self.write(self.folder(bus_id) / "driver/unbind", bus_id, deadline)
            self.wait_for(bus_id, None, deadline)
        if original is not None:
            self.write(self.sysfs / "bus/pci/drivers_probe", bus_id, deadline)
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
        write = _Write(path, value)
        with self._writer_lock:
            if self._writer is None:
                self._writer = _Writer()
            writer = self._writer
        writer.submit(write)
        if not write.done.wait(deadline.left()):
            with self._writer_lock:
                if self._writer is writer:
                    self._writer = None  # stuck in the kernel: later writes go to a new thread
            raise PrepareError(f"writing {value.strip()!r} to {path} did not return within "
                               f"{deadline.seconds:g} s; the kernel may still be busy with it")
        if write.error is not None:
            raise PrepareError(f"cannot write {value.strip()!r} to {path}: {write.error.strerror or write.error}")
