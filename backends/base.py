"""Plumbing shared by the built-in backends: the context, typed configuration, and the stop signal."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import ClassVar

from backends.config import BackendConfig, parse_config
from backends.contract import Allocated, BackendContext, ClaimRef, DevicesChanged, HealthEvent, Prepared, PrepareError

__all__ = ["BuiltinBackend"]


class BuiltinBackend:
    """Base of the built-in backends; third-party backends may use it or implement the protocol directly."""

    name: ClassVar[str]
    driver: ClassVar[str]
    config_model: ClassVar[type[BackendConfig]] = BackendConfig

    def __init__(self) -> None:
        self._ctx: BackendContext | None = None
        self._config: BackendConfig | None = None
        self._stopped = asyncio.Event()

    @property
    def ctx(self) -> BackendContext:
        if self._ctx is None:
            raise RuntimeError(f"backend {self.name} used before start()")
        return self._ctx

    async def start(self, ctx: BackendContext) -> None:
        self._config = parse_config(self.config_model, ctx.config, self.name)
        self._ctx = ctx

    async def health(self) -> AsyncIterator[HealthEvent | DevicesChanged]:
        # No health source of its own: the stream stays open, silent, until the backend stops.
        await self._stopped.wait()
        return
        yield  # makes this an async generator

    async def prepare(self, claim: ClaimRef, devices: Sequence[Allocated]) -> Sequence[Prepared]:
        raise PrepareError(f"backend {self.name} does not support preparing devices")

    async def unprepare(self, claim: ClaimRef, prepared: Sequence[Prepared]) -> None:
        return None

    async def stop(self) -> None:
        self._stopped.set()
