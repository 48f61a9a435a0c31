"""GPU sharing: the compute mode a claim's `GpuConfig.sharing` asks for, set on its full GPUs at prepare and
put back at unprepare. The one place where a sharing strategy is checked against the device it is for (`mps_of`,
`wanted_mode`); the MPS daemon itself is `mps`'s.

`TimeSlicing` is compute mode DEFAULT (every process of every container sharing the claim gets turns on the GPU;
NVML offers no call for the length of a turn, so the driver's own applies); `ExclusiveProcess` and `MPS` are
EXCLUSIVE_PROCESS (with MPS, the daemon's server is that one process). A MIG device has no compute mode of its
own (NVML says NOT_SUPPORTED): its processes always take turns, so `TimeSlicing` asks for nothing there and
`ExclusiveProcess` and `MPS` are refused. A claim with adminAccess watches a GPU another claim may hold and never
changes its mode.

Shares of a GPU (it is shared by capacity, see `gpu_shares`): every share whose configuration sets a mode sets
the same one (the shares' configurations must agree), so the first share records the GPU's mode from before and
sets it, the others record that same original, and the mode goes back only when the last of them goes.
`ExclusiveProcess` and `MPS` are refused for a share: one process at a time, or one claim's daemon, cannot serve
several claims.

Crash safety: the GPU's mode before the change is recorded in a journal in the backend's state directory (the
intent) before NVML is asked to change it, and goes into the claim's restore record. Unprepare, the rollback of a
prepare a crash cut short, and `reconcile` at start put the recorded mode back and drop the entry.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from structlog.typing import FilteringBoundLogger

from backends.contract import Allocated, PrepareError
from backends.journal import Journal
from backends.nvidia.config import ExclusiveProcess, GpuConfig, Mps, MpsConfig, TimeSlicing
from backends.nvidia.nvml import NvmlError, nvml_session
from backends.nvidia.nvml_compute import (
    COMPUTE_MODE_NAMES,
    DEFAULT,
    EXCLUSIVE_PROCESS,
    NO_PERMISSION,
    NOT_FOUND,
    compute_mode,
    set_compute_mode,
)

__all__ = ["ComputeModes", "claim_mps_config", "mps_of", "wanted_mode"]


def mps_of(allocated: Allocated) -> MpsConfig | None:
    """The MPS settings of a device whose configuration asks for MPS (never for adminAccess); None otherwise."""
    config = allocated.config
    sharing = config.sharing if isinstance(config, GpuConfig) else None
    return sharing.mps_config if isinstance(sharing, Mps) and not allocated.admin_access else None


def claim_mps_config(devices: Sequence[Allocated]) -> MpsConfig:
    """The MPS settings of a claim's devices that ask for MPS: one daemon serves them all, so they must agree."""
    configs = [c for c in map(mps_of, devices) if c is not None]
    if not configs or any(c != configs[0] for c in configs):
        raise PrepareError("the GPUs of a claim that use MPS share one MPS control daemon: the requests' "
                           "GpuConfig.sharing.mpsConfig must be the same for all of them")
    return configs[0]


def wanted_mode(allocated: Allocated, mig_device: bool = False) -> int | None:
    """The compute mode the device's configuration asks for; None: leave the GPU's mode as it is."""
    config = allocated.config
    sharing = config.sharing if isinstance(config, GpuConfig) else None
    if sharing is None or allocated.admin_access:
        return None
    if allocated.share_id is not None and isinstance(sharing, ExclusiveProcess | Mps):
        raise PrepareError(f"{allocated.device}: sharing strategy {sharing.strategy} cannot be used on a share of a "
                           f"GPU: {_ONE_OWNER[sharing.strategy]} cannot serve the several claims sharing it by "
                           "memory; use TimeSlicing or no sharing strategy")
    if mig_device:
        if isinstance(sharing, ExclusiveProcess | Mps):
            raise PrepareError(f"{allocated.device}: sharing strategy {sharing.strategy} needs a full GPU; a MIG "
                               "device has no compute mode of its own (NVML refuses to set one; its processes always "
                               "take turns)")
        return None
    return DEFAULT if isinstance(sharing, TimeSlicing) else EXCLUSIVE_PROCESS


_ONE_OWNER = {"ExclusiveProcess": "one process at a time", "MPS": "the MPS control daemon of one claim"}


def _key(claim: str, device: str, share: str | None) -> str:
    return f"{claim}/{device}" if share is None else f"{claim}/{device}/{share}"


def _name(mode: int) -> str:
    return COMPUTE_MODE_NAMES.get(mode, str(mode))


class ComputeModes:
    """The compute modes one backend set for claims, and its journal of the modes the GPUs had
    (`<state_dir>/compute-modes.json`). Blocking (NVML, files): call from a worker thread; calls are serialised."""

    def __init__(self, state_dir: Path | None, log: FilteringBoundLogger) -> None:
        # Not synced: the driver sets every GPU's compute mode back to Default when it loads after a reboot.
        self._journal = Journal(state_dir / "compute-modes.json", durable=False) if state_dir is not None else None
        self._log = log
        self._lock = threading.Lock()
        self._loaded = False

    def _load(self) -> None:
        if not self._loaded and self._journal is not None:
            self._journal.load()
            for problem in self._journal.problems:
                self._log.error(problem)
            self._loaded = True

    def apply(self, claim: str, device: str, bus_id: str, mode: int, share: str | None = None) -> dict[str, Any]:
        """Set the GPU at `bus_id` to `mode` for (claim, device), or for one `share` of it, recording the mode it
        had first; the restore record."""
        if self._journal is None:
            raise PrepareError("GPU sharing is set only by `dra-agent run`, which records the GPU's mode to put "
                               "it back")
        with self._lock, nvml_session():
            self._load()
            key = _key(claim, device, share)
            shared_original: int | None = None
            for other_key, other in self._journal:
                if other_key == key or other["busId"] != bus_id:
                    continue
                if share is None or "share" not in other or other.get("mode") != mode:
                    raise PrepareError(f"{device}: the compute mode of GPU {bus_id} is set for claim "
                                       f"{other['claim']} already")
                shared_original = other["original"]  # the mode from before the first share
            entry = self._journal.get(key)
            try:
                # An entry left by an attempt that did not finish knows the mode from before it.
                original = entry["original"] if entry is not None else (
                    shared_original if shared_original is not None else compute_mode(bus_id))
                record = {"claim": claim, "device": device, "busId": bus_id, "original": original}
                if share is not None:
                    record |= {"share": share, "mode": mode}
                self._journal.put(key, record)
                if compute_mode(bus_id) != mode:
                    set_compute_mode(bus_id, mode)
            except NvmlError as e:
                self._put_back(key)
                hint = " (setting a compute mode needs root)" if e.code == NO_PERMISSION else ""
                raise PrepareError(f"{device}: cannot set compute mode {_name(mode)} on GPU {bus_id}: "
                                   f"{e}{hint}") from None
        self._log.info("GPU compute mode set", device=device, claim=claim, gpu=bus_id, mode=_name(mode),
                       original=_name(original))
        return {"busId": bus_id, "original": original}

    def restore(self, claim: str, device: str, record: Mapping[str, Any] | None = None,
                share: str | None = None) -> None:
        """Put back the mode recorded for (claim, device), or one `share` of it, in the journal (or, failing that,
        in `record`, the restore record); nothing to do when neither has one. A share leaves the mode to the
        shares that stay."""
        with self._lock:
            self._load()
            key = _key(claim, device, share)
            entry = self._journal.get(key) if self._journal is not None else None
            if entry is None and record:
                entry = {"busId": record["busId"], "original": record["original"]}
            if entry is None:
                return
            if share is not None and self._journal is not None and self._shared_by_others(key, entry["busId"]):
                self._journal.remove(key)
                return
            with nvml_session():
                self._restore(key, device, entry)

    def reconcile(self, held: Mapping[str, Sequence[str]]) -> None:
        """Put back the modes set for claims the core no longer holds."""
        with self._lock:
            self._load()
            if self._journal is None:
                return
            stale = [(k, e) for k, e in self._journal if e["device"] not in held.get(e["claim"], ())]
            if not stale:
                return
            with nvml_session():
                for key, entry in stale:
                    if "share" in entry and self._shared_by_others(key, entry["busId"]):
                        self._journal.remove(key)  # the shares that stay keep the mode
                        continue
                    self._log.warning("restoring a GPU compute mode set for a claim no longer prepared",
                                      device=entry["device"], claim=entry["claim"], gpu=entry["busId"])
                    self._restore(key, entry["device"], entry)

    def _shared_by_others(self, key: str, bus_id: str) -> bool:
        assert self._journal is not None
        return any(k != key and e["busId"] == bus_id for k, e in self._journal)

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()

    def _restore(self, key: str, device: str, entry: Mapping[str, Any]) -> None:
        bus_id, original = entry["busId"], entry["original"]
        try:
            if compute_mode(bus_id) != original:
                set_compute_mode(bus_id, original)
                self._log.info("GPU compute mode restored", device=device, gpu=bus_id, mode=_name(original))
        except NvmlError as e:
            if e.code != NOT_FOUND:  # the journal keeps the entry: the next unprepare or start tries again
                raise PrepareError(f"{device}: cannot restore compute mode {_name(original)} on GPU {bus_id}: "
                                   f"{e}") from None
            self._log.warning("GPU gone: its compute mode is not restored", device=device, gpu=bus_id)
        if self._journal is not None:
            self._journal.remove(key)

    def _put_back(self, key: str) -> None:
        """After a failed change: the mode the GPU had, if NVML still answers; the entry goes either way only when
        that worked."""
        assert self._journal is not None
        entry = self._journal.get(key)
        if entry is None:
            return
        try:
            if compute_mode(entry["busId"]) != entry["original"]:
                set_compute_mode(entry["busId"], entry["original"])
        except NvmlError as e:
            self._log.error("cannot put a GPU's compute mode back after a failed prepare", gpu=entry["busId"],
                            error=str(e))
            return
        self._journal.remove(key)
