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


def _gib(size: int) -> str:
    """A memory size for a message, in GiB with up to two decimals (whole numbers only: a float of a hostile
    size would overflow, and the digits of a huge one are not worth showing)."""
    if abs(size) > 2**63:
        return "more than 8589934592Gi" if size > 0 else "less than -8589934592Gi"
    hundredths = (abs(size) * 100 + 2**29) // 2**30
    whole, cents = divmod(hundredths, 100)
    return f"{'-' if size < 0 else ''}{whole}.{cents:02d}".rstrip("0").rstrip(".") + "Gi"


def _held(entry: Mapping[str, object]) -> int:
    """The memory a recorded share holds. An entry without a positive amount (the ledger writes none, an older
    agent may have) holds none: counted as written, a negative one would free memory the other shares hold."""
    memory = entry.get("memory", 0)
    return memory if isinstance(memory, int) and not isinstance(memory, bool) and memory > 0 else 0


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

    def admit(self, claim: str, device: str, share: str, strategy: str, memory: int, capacity: int) -> None:
        """Record the share, which holds `memory` bytes of the GPU's `capacity`; refuse it when a share of the
        same GPU for another claim uses another strategy, when it holds no memory, or when the shares would hold
        more memory than the GPU has. The scheduler never allocates such shares; a claim whose allocation says
        otherwise (written by hand, or by a scheduler that lost count) fails here rather than overcommit the GPU:
        what the ledger records of a GPU never adds up to less than one byte a share or more than the GPU has."""
        with self._lock:
            journal = self._load()
            key = f"{claim}/{device}/{share}"
            if memory < 1:
                amount = f"{memory} bytes" if memory >= -(2**63) else _gib(memory)
                raise PrepareError(f"{device}: this share holds no memory ({amount}); a share holds at least one "
                                   "byte")
            if memory > capacity:
                raise PrepareError(f"{device}: this share holds {_gib(memory)} of memory, more than the GPU's "
                                   f"{_gib(capacity)}")
            held = 0
            for other_key, other in journal:
                if other_key == key or other["device"] != device:
                    continue
                if other["sharing"] != strategy:
                    raise PrepareError(
                        f"{device}: this share's sharing strategy is {strategy}, but a share of the GPU prepared "
                        f"for claim {other['claim']} uses {other['sharing']}; the shares of one GPU must use the "
                        "same strategy")
                held += _held(other)
            if held + memory > capacity:
                raise PrepareError(f"{device}: this share's {_gib(memory)} of memory does not fit: the shares "
                                   f"prepared on the GPU hold {_gib(held)} of its {_gib(capacity)}")
            journal.put(key, {"claim": claim, "device": device, "share": share, "sharing": strategy,
                              "memory": memory})

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
