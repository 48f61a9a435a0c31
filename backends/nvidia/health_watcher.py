"""The NVIDIA backends' health watcher: one thread per process, waiting on one NVML event set.

nvidia-gpu and nvidia-mig share it: the first subscriber starts the thread, the last one stops it. The thread
registers every GPU for Xid and ECC events (masked by what each supports), waits in a loop with a timeout of
`WAIT_MS` (NVML offers no descriptor to wait on, so the timeout is what bounds a stop), and hands what it sees
to each subscriber's event loop with `call_soon_threadsafe` as `health_rules` notices.

It also finds out when a GPU is well again, the only NVML work besides waiting: a GPU is probed when a backend
asks (a udev event for its PCI function) and, while some GPU does not answer NVML or NVML itself fails, on a
timer. While every GPU is fine, the thread only waits.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING

from backends.nvidia.health_notices import Notices, Subscriber
from backends.nvidia.health_rules import WATCHED_EVENTS, EventType, GpuEvent, GpuLost, GpuUnmonitored
from backends.nvidia.nvml import NvmlError, NvmlUnavailable, nvml_session
from backends.nvidia.nvml_events import (
    GPU_IS_LOST,
    NOT_FOUND,
    NOT_SUPPORTED,
    EventSet,
    WatchedGpu,
    probe,
    watched_gpus,
)

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

__all__ = ["WAIT_MS", "HealthWatcher", "subscribe", "unsubscribe"]

WAIT_MS = 1000
"""How long one NVML wait blocks: a stop takes at most this long; idle, the thread wakes once per wait."""

class HealthWatcher:
    """The thread and what it knows: the GPUs, which backends suspect, what they asked for; what it has told
    them is kept in `Notices`."""

    def __init__(self, log: FilteringBoundLogger, wait_ms: int | None = None) -> None:
        self._log = log
        self._wait_ms = WAIT_MS if wait_ms is None else wait_ms
        self._notices = Notices(log)
        self._lock = threading.Lock()  # guards what the event loops touch: the thread's start, requests
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._asked: set[str] = set()  # UUIDs or bus ids to probe at once
        self._suspected: set[str] = set()  # UUIDs a backend found unhealthy
        self._expected: set[str] = set()  # UUIDs backends publish devices on
        self._refresh = False
        # The thread's own state.
        self._gpus: dict[str, WatchedGpu] = {}
        self._by_key: dict[int, str] = {}
        self._registered: set[str] = set()
        self._suspects: dict[str, bool] = {}  # UUID → whether NVML answered for it when last probed
        self._events: EventSet | None = None
        self._due: float | None = None

    # -- the event loops' side (thread-safe) ------------------------------------------------------------

    def subscribe(self, sub: Subscriber) -> None:
        """Add a subscriber, tell it what is known already, and start the thread if it is not running."""
        self._notices.add(sub)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="nvml-health", daemon=True)
                self._thread.start()

    def unsubscribe(self, sub: Subscriber) -> bool:
        """Remove a subscriber; True when it was the last one (then call `stop`)."""
        return self._notices.remove(sub)

    def expect(self, uuids: set[str]) -> None:
        """Backends publish devices on these GPUs: one that NVML no longer enumerates is looked for by UUID."""
        with self._lock:
            self._expected |= uuids
        self._wake.set()

    def suspect(self, uuid: str) -> None:
        """A backend found the GPU unhealthy: watch for its recovery."""
        with self._lock:
            self._suspected.add(uuid)
        self._wake.set()

    def recheck(self, ref: str) -> None:
        """Probe the GPU with this UUID or PCI address now, if something is wrong with it."""
        with self._lock:
            self._asked.add(ref)
        self._wake.set()

    def refresh(self) -> None:
        """GPUs may have come or gone: enumerate them again."""
        with self._lock:
            self._refresh = True
        self._wake.set()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the thread and wait for it (blocks up to one NVML wait)."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self._wait_ms / 1000 + 5 if timeout is None else timeout)
        self._notices.close()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- notices ------------------------------------------------------------------------------------------

    def _report(self, uuid: str, notice: GpuLost | GpuUnmonitored, permanent: bool = False) -> None:
        self._notices.report(uuid, notice, permanent)

    def _recovered(self, uuid: str, everything: bool) -> None:
        """End what the watcher reported for the GPU, and with `everything` what backends suspect too."""
        suspected = self._suspects.pop(uuid, None) is not None if everything else False
        self._notices.recovered(uuid, everything, suspected)

    def _sick(self) -> set[str]:
        """GPUs worth probing on the timer: lost, unmonitored for a passing reason, or not answering."""
        return self._notices.passing() | {u for u, answers in self._suspects.items() if not answers}

    def _recheck_seconds(self) -> float:
        return self._notices.recheck_seconds()

    # -- the thread ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            try:
                with nvml_session():
                    self._watch()
            except NvmlUnavailable as e:
                self._log.debug("no NVIDIA driver: no GPU health to watch", reason=str(e))
                self._pause(None)  # until stopped, or asked to look again (a GPU appeared)
            except NvmlError as e:
                self._went_down(e)
                self._pause(self._recheck_seconds())
            except Exception as e:  # a bug here must not end health reporting silently
                self._log.exception("GPU health watcher failed", error=str(e))
                self._went_down(e)
                self._pause(self._recheck_seconds())

    def _pause(self, timeout: float | None) -> None:
        self._wake.wait(timeout)
        self._wake.clear()

    def _watch(self) -> None:
        self._build()
        try:
            while not self._stopping:
                self._serve_requests()
                if self._events is not None and self._registered:
                    self._wait_once()
                else:
                    self._pause(None if self._due is None else max(0.0, self._due - time.monotonic()))
                self._on_timer()
        finally:
            self._free_events()

    def _went_down(self, error: Exception) -> None:
        """NVML failed as a whole: every GPU's health is unknown until it works again."""
        self._free_events()
        self._registered.clear()
        for uuid in self._gpus:
            self._report(uuid, GpuUnmonitored(uuid, f"NVML failed: {error}"))

    def _build(self) -> None:
        """Enumerate the GPUs and register them all in a new event set."""
        found = {g.uuid: g for g in watched_gpus()}
        with self._lock:
            expected = set(self._expected)
        for uuid in (set(self._gpus) | expected) - set(found):  # known or published, not enumerated now
            try:
                found[uuid] = probe(uuid)
            except NvmlError as e:
                if e.code == GPU_IS_LOST:
                    self._report(uuid, GpuLost(uuid, str(e)))
                elif e.code == NOT_FOUND:  # removed from the node
                    self._gpus.pop(uuid, None)
                    with self._lock:
                        self._expected.discard(uuid)
                    self._recovered(uuid, everything=True)
                else:
                    self._report(uuid, GpuUnmonitored(uuid, f"NVML does not answer for it: {e}"))
        self._gpus.update(found)
        self._by_key = {g.key: u for u, g in self._gpus.items()}
        self._rebuild_events()
        self._schedule()

    def _rebuild_events(self) -> None:
        self._free_events()
        self._events = EventSet()
        for gpu in list(self._gpus.values()):
            self._register(gpu)

    def _free_events(self) -> None:
        if self._events is not None:
            self._events.free()
            self._events = None
        self._registered.clear()

    def _register(self, gpu: WatchedGpu) -> None:
        assert self._events is not None
        try:
            mask = self._events.register(gpu, WATCHED_EVENTS)
        except NvmlError as e:
            if e.code == GPU_IS_LOST:
                self._report(gpu.uuid, GpuLost(gpu.uuid, str(e)))
            elif e.code == NOT_SUPPORTED:
                self._report(gpu.uuid, GpuUnmonitored(gpu.uuid, "the driver cannot report its events"), True)
            else:
                self._report(gpu.uuid, GpuUnmonitored(gpu.uuid, f"registering for its events failed: {e}"))
            return
        if not mask:
            self._report(gpu.uuid, GpuUnmonitored(gpu.uuid, "it reports no Xid or ECC events"), True)
            return
        self._registered.add(gpu.uuid)
        reported = self._notices.reported(gpu.uuid)
        if reported is not None:  # it answers again
            self._recovered(gpu.uuid, everything=isinstance(reported.notice, GpuLost))

    def _wait_once(self) -> None:
        assert self._events is not None
        try:
            event = self._events.wait(self._wait_ms)
        except NvmlError as e:
            if e.code != GPU_IS_LOST:
                raise
            self._find_lost(e)
            return
        if event is None:
            return
        uuid = self._by_key.get(event.key)
        if uuid is None:
            self._log.debug("NVML event for an unknown GPU handle", event_type=event.event_type)
            return
        xid = event.event_type & EventType.XID
        self._notices.event(GpuEvent(uuid, event.event_type, event.data, event.gpu_instance, event.compute_instance),
                            xid=bool(xid))

    def _find_lost(self, error: NvmlError) -> None:
        """A wait said a GPU is lost without saying which: probe the registered ones, then wait without them."""
        lost = []
        for uuid in sorted(self._registered):
            try:
                probe(uuid)
            except NvmlError as e:
                if e.code == GPU_IS_LOST:
                    lost.append(uuid)
        if not lost:
            raise error  # no GPU to blame: waiting again would fail the same way at once
        for uuid in lost:
            self._report(uuid, GpuLost(uuid, str(error)))
        self._rebuild_events()
        self._schedule()

    def _serve_requests(self) -> None:
        with self._lock:
            asked, self._asked = self._asked, set()
            suspected, self._suspected = self._suspected, set()
            refresh, self._refresh = self._refresh, False
            unknown = self._expected - set(self._gpus) - self._notices.reported_gpus()
        if refresh or unknown:
            self._build()
        for uuid in suspected - set(self._suspects):
            self._suspects[uuid] = self._answers(uuid)
        by_bus_id = {g.bus_id: u for u, g in self._gpus.items()}
        for ref in asked:
            uuid = by_bus_id.get(ref, ref)
            if uuid in self._suspects or self._notices.reported(uuid) is not None:
                self._try_recover(uuid)
        self._schedule()

    def _answers(self, uuid: str) -> bool:
        try:
            probe(uuid)
        except NvmlError:
            return False
        return True

    def _try_recover(self, uuid: str) -> None:
        try:
            gpu = probe(uuid)
        except NvmlError as e:
            if e.code == NOT_FOUND:
                self._gpus.pop(uuid, None)
                self._recovered(uuid, everything=True)
            elif uuid in self._suspects:
                self._suspects[uuid] = False
            return
        self._gpus[uuid] = gpu
        self._by_key[gpu.key] = uuid
        reported = self._notices.reported(uuid)
        if uuid in self._suspects or (reported is not None and isinstance(reported.notice, GpuLost)):
            self._recovered(uuid, everything=True)  # the GPU itself is well again
        if uuid not in self._registered and self._events is not None:
            self._register(gpu)  # ends an "unmonitored" report, or makes a new one

    def _schedule(self) -> None:
        """Run the timer while something is sick, not otherwise."""
        if not self._sick():
            self._due = None
        elif self._due is None:
            self._due = time.monotonic() + self._recheck_seconds()

    def _on_timer(self) -> None:
        if self._due is None or time.monotonic() < self._due:
            return
        self._due = None
        for uuid in sorted(self._sick()):
            self._try_recover(uuid)
        self._schedule()


# -- one watcher per process ----------------------------------------------------------------------------

_shared_lock = threading.Lock()
_shared: HealthWatcher | None = None


def subscribe(sub: Subscriber) -> HealthWatcher:
    """Subscribe to the process's watcher, starting it if needed."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = HealthWatcher(sub.log.bind(component="nvml-health"))
        _shared.subscribe(sub)
        return _shared


async def unsubscribe(watcher: HealthWatcher, sub: Subscriber) -> None:
    """Unsubscribe; the last one out stops the thread and waits for it."""
    global _shared
    with _shared_lock:
        last = watcher.unsubscribe(sub)
        if last and _shared is watcher:
            _shared = None
    if last:
        await asyncio.to_thread(watcher.stop)
