"""A whole GPU in MIG mode allocated whole (dynamic MIG): MIG mode goes off for the claim at prepare and comes
back on at unprepare.

Only where that needs no GPU reset, which the agent never does: Hopper and newer change MIG mode at once; an
Ampere GPU would only record the change as pending until a reset, so it is refused, as is a GPU whose MIG mode
change is pending already. MIG mode goes off only while no GPU instance exists (whoever made it) and no process
uses the GPU (NVML refuses with IN_USE otherwise).

While a claim holds it, the GPU stays nvidia-mig's: it is published as before (the whole GPU and its placements,
so the scheduler's counters stay as they were), and nvidia-gpu, which publishes GPUs not in MIG mode, leaves it
out (`held_whole`).

Crash safety: the intent (claim, device, GPU) is recorded in a journal in the backend's state directory before
MIG mode changes; the GPU was in MIG mode then, so unprepare, the rollback of a prepare a crash cut short, and
`reconcile` at start all turn MIG mode back on if it is off, and drop the entry.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from structlog.typing import FilteringBoundLogger

from backends.contract import PrepareError
from backends.failpoints import failpoint
from backends.journal import Journal
from backends.nvidia.nvml import NvmlError, nvml_session
from backends.nvidia.nvml_compute import IN_USE, gpu_instance_count, mig_mode, minor_number, set_mig_mode

__all__ = ["WholeGpus", "held_whole"]

# GPUs held whole with MIG mode off, per node (sysfs root) in this process: nvidia-gpu reads it at discovery.
_held_lock = threading.Lock()
_held: dict[str, set[str]] = {}


def _node(sysfs_root: Path) -> str:
    return os.path.realpath(sysfs_root)


def held_whole(sysfs_root: Path) -> frozenset[str]:
    """PCI addresses of the GPUs nvidia-mig holds whole for claims on the node at `sysfs_root`."""
    with _held_lock:
        return frozenset(_held.get(_node(sysfs_root), ()))


class WholeGpus:
    """nvidia-mig's whole-GPU claims and their journal (`<state_dir>/mig-whole.json`). Blocking (NVML, fsync):
    call from a worker thread; calls are serialised."""

    def __init__(self, state_dir: Path, sysfs_root: Path, log: FilteringBoundLogger) -> None:
        # Synced: a GPU's MIG mode outlives a reboot, so its record must outlive a power cut.
        self._journal = Journal(state_dir / "mig-whole.json", durable=True)
        self._node = _node(sysfs_root)
        self._log = log
        self._lock = threading.Lock()

    def load(self) -> None:
        with self._lock:
            self._journal.load()
            for problem in self._journal.problems:
                self._log.error(problem)
            for _, entry in self._journal:
                self._hold(entry["busId"], True)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter([entry for _, entry in self._journal])

    def held(self) -> frozenset[str]:
        return frozenset(entry["busId"] for _, entry in self._journal)

    def take(self, claim: str, device: str, bus_id: str) -> int:
        """Turn MIG mode off on the GPU for (claim, device), or find it off for it already; the GPU's minor number
        (NVML says it may change with the mode)."""
        key = f"{claim}/{device}"
        with self._lock, nvml_session():
            try:
                mode = mig_mode(bus_id)
                if self._journal.get(key) is not None and not mode.enabled:
                    return minor_number(bus_id)  # taken for this claim by an earlier call
                for other_key, other in self._journal:
                    if other_key != key and other["busId"] == bus_id:
                        raise PrepareError(f"GPU {bus_id} is held whole for claim {other['claim']} already")
                if not mode.enabled:
                    raise PrepareError(f"GPU {bus_id} left MIG mode outside dra-agent; it is offered again as a "
                                       "full GPU at the next discovery")
                self._check(bus_id, mode.pending, mode.resetless)
                if gpu_instance_count(bus_id):
                    raise PrepareError(f"GPU {bus_id} has MIG devices; it can be used whole only when it has none")
                # The intent first: from here on a crash leaves a record that MIG mode may be off and is ours.
                self._journal.put(key, {"claim": claim, "device": device, "busId": bus_id})
                self._hold(bus_id, True)
                failpoint("mig-whole-after-intent")
                self._switch_off(key, bus_id)
                failpoint("mig-whole-after-mode-off")
                self._log.info("MIG mode turned off for a claim of the whole GPU", device=device, claim=claim,
                               gpu=bus_id)
                return minor_number(bus_id)
            except NvmlError as e:
                self._give_back_quietly(key)
                raise PrepareError(f"GPU {bus_id}: {e}") from None

    def give_back(self, claim: str, device: str) -> None:
        """Turn MIG mode on again on the GPU held for (claim, device), if it is off, and drop the entry (kept
        when NVML refuses, for the next unprepare or start to try again)."""
        key = f"{claim}/{device}"
        with self._lock:
            entry = self._journal.get(key)
            if entry is None:
                return
            with nvml_session():
                self._restore(key, entry)

    def reconcile(self, held: Mapping[str, Sequence[str]]) -> None:
        """Turn MIG mode on again on GPUs held for claims the core no longer holds."""
        with self._lock:
            stale = [(k, e) for k, e in self._journal if e["device"] not in held.get(e["claim"], ())]
            if not stale:
                return
            with nvml_session():
                for key, entry in stale:
                    self._log.warning("turning MIG mode on again on a GPU held whole for a claim no longer "
                                      "prepared", device=entry["device"], claim=entry["claim"], gpu=entry["busId"])
                    self._restore(key, entry)

    def close(self) -> None:
        with self._lock:
            for _, entry in self._journal:
                self._hold(entry["busId"], False)
            self._journal.close()

    def _check(self, bus_id: str, pending: bool, resetless: bool) -> None:
        if pending:
            raise PrepareError(f"GPU {bus_id} has a MIG mode change pending a GPU reset; using it whole needs that "
                               "reset, and dra-agent never resets GPUs")
        if not resetless:
            raise PrepareError(f"GPU {bus_id} cannot leave MIG mode without a GPU reset (before Hopper), and "
                               "dra-agent never resets GPUs; allocate one of its MIG devices instead")

    def _switch_off(self, key: str, bus_id: str) -> None:
        try:
            set_mig_mode(bus_id, False)
        except NvmlError as e:
            self._give_back_quietly(key)
            if e.code == IN_USE:
                raise PrepareError(f"GPU {bus_id} is in use (processes run on it): MIG mode cannot be turned off "
                                   "to use it whole") from None
            raise
        if mig_mode(bus_id).enabled:  # a driver that left it pending after all: put it back as it was
            self._give_back_quietly(key)
            raise PrepareError(f"GPU {bus_id} did not leave MIG mode without a reset; dra-agent never resets GPUs")

    def _restore(self, key: str, entry: dict[str, Any]) -> None:
        bus_id = entry["busId"]
        try:
            if not mig_mode(bus_id).enabled:
                set_mig_mode(bus_id, True)
                self._log.info("MIG mode turned on again", device=entry["device"], claim=entry["claim"], gpu=bus_id)
        except NvmlError as e:
            raise PrepareError(f"GPU {bus_id}: cannot turn MIG mode on again: {e}") from None
        self._journal.remove(key)
        if bus_id not in self.held():
            self._hold(bus_id, False)

    def _give_back_quietly(self, key: str) -> None:
        """Undo after a failed prepare; a failure is logged, the prepare's own error is what the claim gets."""
        entry = self._journal.get(key)
        if entry is None:
            return
        try:
            self._restore(key, entry)
        except PrepareError as e:
            self._log.error("cannot turn MIG mode on again after a failed prepare", gpu=entry["busId"],
                            error=str(e))

    def _hold(self, bus_id: str, held: bool) -> None:
        with _held_lock:
            gpus = _held.setdefault(self._node, set())
            if held:
                gpus.add(bus_id)
            else:
                gpus.discard(bus_id)
