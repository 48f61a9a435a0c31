"""The health of GPUs a claim uses through MPS: each claim's MPS control daemon is watched for its end (a pidfd the
event loop waits on, no polling). A daemon that ends while its claim is prepared is started again, with the same
pipe directory and limits, and its GPUs are reported unhealthy (cause `mps-daemon`) until it answers again; after
that they report what NVML last said of them. Watching starts with the backend's health stream, which first looks
at every claim's daemon: one that ended while no agent ran (or with the node's reboot) is started again too.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

from structlog.typing import FilteringBoundLogger

from backends.contract import BackendError, DevicesChanged, Health, HealthEvent
from backends.nvidia.mps import MpsDaemons

__all__ = ["CAUSE", "MpsWatch", "with_daemons"]

CAUSE = "mps-daemon"
_FIRST_RETRY, _LAST_RETRY = 1.0, 30.0

Item = HealthEvent | DevicesChanged


class MpsWatch:
    """The daemons watched by one backend, and the devices whose daemon is being started again (`down`)."""

    def __init__(self, daemons: MpsDaemons, log: FilteringBoundLogger) -> None:
        self._daemons = daemons
        self._log = log
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sink: Callable[[HealthEvent], None] = lambda _: None
        self._fds: dict[str, int] = {}  # claim → pidfd of its daemon, registered with the loop
        self._reviving: dict[str, asyncio.Task[None]] = {}
        self._down: dict[str, list[str]] = {}  # claim → its devices, while its daemon is started again

    @property
    def down(self) -> set[str]:
        return {d for devices in self._down.values() for d in devices}

    def start(self, sink: Callable[[HealthEvent], None]) -> None:
        """Watch from now on, telling `sink` of health changes; every claim's daemon is looked at first."""
        self._loop, self._sink = asyncio.get_running_loop(), sink
        self._reviving[""] = self._loop.create_task(self._adopt())

    async def _adopt(self) -> None:
        for claim in await asyncio.to_thread(self._daemons.claims):
            self.watch(claim)

    def stop(self) -> None:
        for claim in list(self._fds):
            self._unwatch(claim)
        for task in self._reviving.values():
            task.cancel()
        self._reviving.clear()
        self._loop = None

    def watch(self, claim: str) -> None:
        """Wait for the end of the claim's daemon (just started, or found running); one already gone is started
        again. Nothing happens while the health stream does not run (nothing would hear of it)."""
        if self._loop is None:
            return
        self._unwatch(claim)
        pid = self._daemons.pid(claim)
        fd = _pidfd(pid) if pid is not None else None
        if fd is not None and self._daemons.pid(claim) != pid:  # ended between the two looks
            os.close(fd)
            fd = None
        if fd is None:
            self._revive_soon(claim)
            return
        self._fds[claim] = fd
        self._loop.add_reader(fd, self._ended, claim)

    def forget(self, claim: str) -> None:
        """The claim is being unprepared: its daemon's end is expected, and its devices are well again."""
        self._unwatch(claim)
        task = self._reviving.pop(claim, None)
        if task is not None:
            task.cancel()
        for device in self._down.pop(claim, []):
            self._sink(HealthEvent(device, Health.HEALTHY))

    def _unwatch(self, claim: str) -> None:
        fd = self._fds.pop(claim, None)
        if fd is not None:
            if self._loop is not None:
                self._loop.remove_reader(fd)
            os.close(fd)

    def _ended(self, claim: str) -> None:
        self._unwatch(claim)
        self._log.error("the MPS control daemon of a prepared claim ended; starting it again", claim=claim)
        self._revive_soon(claim)

    def _revive_soon(self, claim: str) -> None:
        assert self._loop is not None
        if claim not in self._reviving:
            self._reviving[claim] = self._loop.create_task(self._revive(claim))

    async def _revive(self, claim: str) -> None:
        try:
            delay = _FIRST_RETRY
            while True:
                entry: dict[str, Any] | None = (await asyncio.to_thread(self._daemons.claims)).get(claim)
                if entry is None:
                    return  # unprepared meanwhile
                if claim not in self._down:
                    self._down[claim] = list(entry["devices"])
                    for device in entry["devices"]:
                        self._sink(HealthEvent(device, Health.UNHEALTHY, cause=CAUSE, reason=(
                            f"the MPS control daemon of claim {claim} ended; starting it again")))
                try:
                    await asyncio.to_thread(self._daemons.ensure, claim, entry)
                    break
                except BackendError as e:
                    self._log.error("cannot start the MPS control daemon again", claim=claim, error=str(e),
                                    retry_seconds=delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, _LAST_RETRY)
            for device in self._down.pop(claim, []):
                self._sink(HealthEvent(device, Health.HEALTHY))
            self._log.info("MPS control daemon serving again", claim=claim, pid=self._daemons.pid(claim))
        finally:
            if self._reviving.get(claim) is asyncio.current_task():
                del self._reviving[claim]
        self.watch(claim)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None  # gone already


async def with_daemons(feed: AsyncIterator[Item], watch: MpsWatch) -> AsyncIterator[Item]:
    """The backend's health stream `feed` with the MPS daemons' events: while a device's daemon is down the device
    stays unhealthy whatever the feed says; once it serves again, the device is what the feed last said of it."""
    queue: asyncio.Queue[tuple[bool, Item] | BaseException | None] = asyncio.Queue()

    async def pump() -> None:
        try:
            async for item in feed:
                queue.put_nowait((True, item))
            queue.put_nowait(None)
        except Exception as e:
            queue.put_nowait(e)

    watch.start(lambda event: queue.put_nowait((False, event)))
    task = asyncio.create_task(pump())
    last: dict[str, HealthEvent] = {}
    try:
        while (got := await queue.get()) is not None:
            if isinstance(got, BaseException):
                raise got
            from_feed, item = got
            if isinstance(item, HealthEvent) and from_feed:
                last[item.device] = item
                if item.device in watch.down:
                    continue
            elif isinstance(item, HealthEvent) and item.health is Health.HEALTHY:
                item = last.get(item.device, item)
            yield item
    finally:
        watch.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
