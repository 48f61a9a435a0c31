"""Full GPUs shared by memory: how a GPU is published for it, and the shares prepared on each GPU.

With `sharing.byMemory` on, nvidia-gpu publishes each full GPU with `allowMultipleAllocations` and a request policy
for its `memory` capacity: shares from one step (1Gi by default) up to the GPU's memory rounded down to a step,
and, for a claim that names no amount, all of that (a claim that asks for nothing in particular gets the whole
GPU's worth, so no other share fits beside it). The scheduler adds the shares up; the GPU enforces none of it.

The shares of one GPU must agree on how the GPU is used (their `GpuConfig.sharing`: none or TimeSlicing, as
NVIDIA's own driver requires equal configurations for shares of one GPU): this ledger
(`<state_dir>/gpu-shares.json`) records each prepared share with its sharing strategy before the GPU is touched,
refuses a share that disagrees with the others, and forgets a share at its unprepare or, for claims no longer
held, at start. Blocking (files): call from a worker thread; calls are serialised.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from structlog.typing import FilteringBoundLogger

from backends.contract import Allocated, CapacityPolicy, CapacityRange, PrepareError
from backends.journal import Journal
from backends.nvidia.config import GpuConfig

__all__ = ["GpuShares", "memory_policy", "sharing_of"]

NO_STRATEGY = "none"


def memory_policy(memory: int, step: int) -> CapacityPolicy | None:
    """The request policy of a GPU's `memory` when it is shared by memory: whole steps from one step up to the
    memory rounded down to a step; by default all of that. None when the GPU has less than two steps (the API
    server wants min plus one step within the capacity)."""
    if memory < 2 * step:
        return None
    top = memory // step * step
    return CapacityPolicy(default=top, valid_range=CapacityRange(min=step, max=top, step=step))


def sharing_of(allocated: Allocated) -> str:
    """The share's sharing strategy, as compared between the shares of one GPU."""
    config = allocated.config
    sharing = config.sharing if isinstance(config, GpuConfig) else None
    return NO_STRATEGY if sharing is None else sharing.strategy


class GpuShares:
    """The prepared shares of full GPUs, by (claim, device, share), with their sharing strategy."""

    def __init__(self, state_dir: Path | None, log: FilteringBoundLogger) -> None:
        # Not synced: like compute modes, what a share set up on a GPU does not outlive a reboot.
        self._journal = Journal(state_dir / "gpu-shares.json", durable=False) if state_dir is not None else None
        self._log = log
        self._lock = threading.Lock()
        self._loaded = False

    def _load(self) -> Journal:
        if self._journal is None:
            raise PrepareError("GPU shares are prepared only by `dra-agent run`, which records them")
        if not self._loaded:
            self._journal.load()
            for problem in self._journal.problems:
                self._log.error(problem)
            self._loaded = True
        return self._journal

    def admit(self, claim: str, device: str, share: str, strategy: str) -> None:
        """Record the share, or refuse it when a share of the same GPU for another claim uses another
        strategy."""
        with self._lock:
            journal = self._load()
            key = f"{claim}/{device}/{share}"
            for other_key, other in journal:
                if other_key != key and other["device"] == device and other["sharing"] != strategy:
                    raise PrepareError(
                        f"{device}: this share's sharing strategy is {strategy}, but a share of the GPU prepared "
                        f"for claim {other['claim']} uses {other['sharing']}; the shares of one GPU must use the "
                        "same strategy")
            journal.put(key, {"claim": claim, "device": device, "share": share, "sharing": strategy})

    def release(self, claim: str, device: str, share: str) -> None:
        """Forget the share (nothing to do when it is not recorded)."""
        with self._lock:
            journal = self._load()
            journal.remove(f"{claim}/{device}/{share}")

    def shares_of(self, device: str) -> list[Mapping[str, str]]:
        """The shares recorded for a GPU."""
        with self._lock:
            return [dict(e) for _, e in self._load() if e["device"] == device]

    def reconcile(self, held: Mapping[str, Sequence[str]]) -> None:
        """Forget the shares of claims the core no longer holds."""
        if self._journal is None:
            return
        with self._lock:
            journal = self._load()
            for key, entry in list(journal):
                if entry["device"] not in held.get(entry["claim"], ()):
                    self._log.info("forgetting a GPU share of a claim no longer prepared", device=entry["device"],
                                   claim=entry["claim"], share=entry["share"])
                    journal.remove(key)

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()
