"""Watching a simulated node's udev events from a child process under umockdev's preload
(tests/support/udev_harness.py).

The test process itself cannot receive injected events: its libudev was loaded without the preload, so its
monitors are real netlink sockets. The child runs the agent's monitor and real backends; the test injects events
with `UdevInjector` and reads what the child saw.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from simulator.udev.preload import UdevPreloadError, environment
from tests.support.timing import scaled

HARNESS = Path(__file__).with_name("udev_harness.py")

Message = dict[str, Any]


def preload_env(root: Path) -> dict[str, str]:
    """The environment of a process under the preload for the node at `root`; skips when umockdev is missing."""
    try:
        return environment(root)
    except UdevPreloadError as e:
        pytest.skip(str(e))


class Watcher:
    """tests/support/udev_harness.py on a node, with the messages it printed."""

    def __init__(self, root: Path, *args: str) -> None:
        self.root = root
        self.args = args
        self.messages: list[Message] = []
        self._read = 0
        self.process: asyncio.subprocess.Process | None = None
        self.log = root.with_name(root.name + "-watcher.log")

    async def __aenter__(self) -> Watcher:
        with self.log.open("ab") as log:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, str(HARNESS), "--sim-root", str(self.root), *self.args, env=preload_env(self.root),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log,
            )
        await self.expect(lambda m: "ready" in m or m.get("monitor") is False)
        self.started_with = {m["backend"]: set(m["devices"]) for m in self.messages if "devices" in m}
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.close()
        try:
            async with asyncio.timeout(scaled(10)):
                await self.process.wait()
        finally:
            if self.process.returncode is None:
                self.process.kill()
                await self.process.wait()

    async def expect(self, predicate: Callable[[Message], bool], timeout: float = scaled(10)) -> Message:
        """The next message (after those already taken) that satisfies `predicate`, waiting for it."""
        assert self.process is not None and self.process.stdout is not None
        try:
            async with asyncio.timeout(timeout):
                while True:
                    while self._read < len(self.messages):
                        message = self.messages[self._read]
                        self._read += 1
                        if predicate(message):
                            return message
                    line = await self.process.stdout.readline()
                    if not line:
                        raise AssertionError(f"the watcher ended:\n{self.errors()}")
                    self.messages.append(json.loads(line))
        except TimeoutError:
            raise AssertionError(f"no such message in {timeout} s; got {self.messages}\n{self.errors()}") from None

    def errors(self) -> str:
        """What the watcher logged (stderr)."""
        return self.log.read_text() if self.log.exists() else ""

    async def health(self, device: str, health: str) -> Message:
        """The next health event of `device` with this health ("Healthy", "Unhealthy")."""
        return await self.expect(lambda m: m.get("health", [None, None])[:2] == [device, health])

    async def devices(self, backend: str) -> list[str]:
        """The devices `backend` lists after its next device-set change."""
        await self.expect(lambda m: m.get("backend") == backend and "changed" in m)
        message = await self.expect(lambda m: m.get("backend") == backend and "devices" in m)
        names: list[str] = message["devices"]
        return names

    def taken(self) -> list[Message]:
        return self.messages[: self._read]
