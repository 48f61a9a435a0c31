"""The simulated kernel's side of sysfs writes: a simulated node's control files do what the kernel does when the
agent writes them (unbind, bind, driver_override, drivers_probe, sriov_numvfs).

One daemon thread per node watches, with inotify, the folders that hold control files: `bus/pci` (drivers_probe),
each `bus/pci/drivers/<name>` (bind, unbind) and each PCI function's folder (driver_override, sriov_numvfs). When a
writer closes one of them, the thread reads what was written, changes the tree (`pci`, `sriov`) and
sends the uevents the kernel sends. The effect lands a few milliseconds after close(), not before the write
returns as on a real kernel, and a refused write cannot fail: the file is put back and the refusal noted.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from pathlib import Path
from types import TracebackType

from inotify_simple import INotify, flags

from simulator.kernel.pci import PciCore, read_text
from simulator.kernel.sriov import SriovControl
from simulator.node.layout import NodePlan

__all__ = ["SimulatedKernel"]

_log = logging.getLogger(__name__)

_PROBE, _DRIVER, _FUNCTION = "probe", "driver", "function"


class SimulatedKernel:
    """Reacts to writes to the control files of the simulated node at `root` laid out by `plan`, from a daemon
    thread between `start()` and `stop()`."""

    def __init__(self, root: Path, plan: NodePlan) -> None:
        self.root = root
        self.plan = plan
        self._inotify: INotify | None = None
        self._watches: dict[int, tuple[str, str, Path]] = {}  # descriptor -> kind, bus id or driver, folder
        self._wake: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self._pci: PciCore | None = None
        self._sriov: SriovControl | None = None

    @property
    def refusals(self) -> list[str]:
        """The writes refused so far (that a real kernel would have failed), one line each."""
        return list(self._sriov.refusals) if self._sriov else []

    def driver_changes(self) -> dict[str, int]:
        """Every driver bind and unbind made so far, "<bus id> bind|unbind <driver>" → how often."""
        return dict(self._pci.driver_changes) if self._pci else {}

    def start(self) -> SimulatedKernel:
        self._pci = pci = PciCore(self.root, self.plan)
        self._sriov = SriovControl(pci)
        self._inotify = INotify()
        self._watch(pci.sys / "bus/pci", _PROBE, "")
        for driver in sorted((pci.sys / "bus/pci/drivers").iterdir()):
            self._watch(driver, _DRIVER, driver.name)
        # Watched through the bus/pci/devices links (inotify follows them): resolving 100+ paths costs more.
        for entry in sorted((pci.sys / "bus/pci/devices").iterdir()):
            self._watch(entry, _FUNCTION, entry.name)
        self._wake = os.pipe()
        self._thread = threading.Thread(target=self._run, name=f"simulated-kernel-{self.root.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is None or self._wake is None or self._inotify is None:
            return
        os.write(self._wake[1], b"x")
        self._thread.join()
        for fd in self._wake:
            os.close(fd)
        self._inotify.close()
        self._thread = self._wake = self._inotify = None
        self._watches.clear()

    def __enter__(self) -> SimulatedKernel:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()

    def _watch(self, folder: Path, kind: str, key: str) -> None:
        assert self._inotify is not None
        wd = self._inotify.add_watch(folder, flags.CLOSE_WRITE)
        self._watches[wd] = (kind, key, folder)

    def _run(self) -> None:
        assert self._inotify is not None and self._wake is not None
        # poll(2), not select(2): descriptors above 1023 are common in a test process.
        poller = select.poll()
        poller.register(self._inotify.fileno(), select.POLLIN)
        poller.register(self._wake[0], select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if self._wake[0] in ready:
                return
            for event in self._inotify.read(timeout=0):
                if event.mask & flags.IGNORED:  # the folder is gone (a disabled VF)
                    self._watches.pop(event.wd, None)
                    continue
                watch = self._watches.get(event.wd)
                if watch is None:
                    continue
                try:
                    self._apply(*watch, event.name)
                except Exception:  # one bad write must not end the node's kernel
                    _log.exception("simulated kernel: applying a write to %s/%s failed", watch[2], event.name)

    def _apply(self, kind: str, key: str, folder: Path, name: str) -> None:
        assert self._pci is not None and self._sriov is not None
        pci = self._pci
        if kind == _PROBE and name == "drivers_probe":
            pci.probe(_written_bus_id(folder / name))
        elif kind == _DRIVER and name == "bind":
            pci.bind(_written_bus_id(folder / name), key)
        elif kind == _DRIVER and name == "unbind":
            pci.unbind(_written_bus_id(folder / name), key)
        elif kind == _FUNCTION and name in ("driver_override", "sriov_numvfs"):
            function = pci.folder(key)
            if function is None:  # taken away by a pci-remove injection; a write there does nothing
                return
            if name == "driver_override":
                pci.normalize_override(function)
                return
            for vf in self._sriov.numvfs_written(key, function):
                self._watch(vf, _FUNCTION, vf.name)


def _written_bus_id(path: Path) -> str:
    """The bus id a writer put in a bind/unbind/drivers_probe file (the kernel accepts it with a newline)."""
    return read_text(path).strip("\0 \n")
