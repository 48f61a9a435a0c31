"""Watches of the test API server: one committed write as the history keeps it, and one open watch with the events
it still has to send (objects entering or leaving its selector are ADDED or DELETED), then how it ends.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from simulator.apiserver.objects import with_version
from simulator.apiserver.resources import JsonObject, ResourceType
from simulator.apiserver.selectors import Selector

__all__ = ["ADDED", "BOOKMARK", "DELETED", "ERROR", "MODIFIED", "Change", "Watch"]

ADDED, MODIFIED, DELETED, BOOKMARK, ERROR = "ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"


@dataclass(frozen=True)
class Change:
    """One committed write, as kept in the watch history."""

    rv: int
    type: str
    rt: ResourceType
    obj: JsonObject
    old: JsonObject | None


class Watch:
    """One open watch: the events it still has to send, in order, then how it ends (clean end or reset)."""

    END, RESET = "end", "reset"

    def __init__(self, selector: Selector, *, bookmarks: bool) -> None:
        self.selector = selector
        self.bookmarks = bookmarks
        self.queue: asyncio.Queue[JsonObject | str] = asyncio.Queue()

    def send(self, type_: str, obj: JsonObject) -> None:
        self.queue.put_nowait({"type": type_, "object": obj})

    def offer(self, change: Change) -> None:
        """Queue what this watch sees of ``change``: objects entering or leaving its selector are ADDED or DELETED."""
        if change.rt is not self.selector.rt:
            return
        now_matches = change.type != DELETED and self.selector.matches(change.obj)
        was_matching = change.old is not None and self.selector.matches(change.old)
        if change.type == DELETED:
            if was_matching:
                self.send(DELETED, change.obj)
        elif now_matches:
            self.send(MODIFIED if was_matching else ADDED, change.obj)
        elif was_matching and change.old is not None:
            self.send(DELETED, with_version(change.old, change.rv))

    def end(self, *, reset: bool = False) -> None:
        self.queue.put_nowait(self.RESET if reset else self.END)
