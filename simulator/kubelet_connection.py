"""The kubelet's connection to one registered DRA plugin: NodePrepareResources and NodeUnprepareResources with
the kubelet's checks on the answers, the raw health stream, and the errors a caller sees where the kubelet fails.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import grpc

from agent.claims.results import ClaimResult
from agent.kubelet.services import (
    HEALTH_SERVICES,
    DeviceHealthReport,
    DraClient,
    DraVersion,
    PluginInfo,
    watch_health,
)
from backends.contract import ClaimRef
from simulator.timing import scaled

__all__ = [
    "CALL_TIMEOUT",
    "OWN_CONNECTIONS",
    "Identity",
    "KubeletError",
    "Plugin",
    "RegistrationRefused",
    "rpc",
    "rpc_error",
]

T = TypeVar("T")
Identity = tuple[int, int]  # (inode, ctime): a socket re-created at the same path is a new plugin

# gRPC's C core shares connections among channels to the same address. A plugin restarted at the same socket
# path would then inherit its dead predecessor's connection and reconnect backoff, and fail calls with
# "Connection refused" for a while; the kubelet (grpc-go) gives each plugin connection its own.
OWN_CONNECTIONS = (("grpc.use_local_subchannel_pool", 1),)

CALL_TIMEOUT = scaled(45.0)  # the kubelet's deadline, stretched by the time factor like every wait of a test


class KubeletError(Exception):
    """A kubelet operation failed the way the kubelet would fail it; `code` is set for gRPC errors."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class RegistrationRefused(KubeletError):
    """The kubelet refused a plugin; the plugin was told the same reason."""


def rpc_error(method: str, e: grpc.aio.AioRpcError) -> KubeletError:
    return KubeletError(f"{method}: {e.code().name}: {e.details()}", e.code())


async def rpc(method: str, call: Awaitable[T]) -> T:
    try:
        return await call
    except grpc.aio.AioRpcError as e:
        raise rpc_error(method, e) from e


def _check_keys(method: str, claims: Sequence[ClaimRef], results: Mapping[str, object]) -> None:
    """The kubelet's checks on a response map: only requested UIDs, and one entry for each."""
    wanted = {c.uid for c in claims}  # the kubelet never sends a UID twice; count distinct ones
    for uid in results:
        if uid not in wanted:
            raise KubeletError(f"{method} returned result for unknown claim UID {uid}")
    if len(wanted) > len(results):
        raise KubeletError(f"{method} skipped {len(wanted) - len(results)} ResourceClaims")


def _raise_first_error(method: str, claims: Sequence[ClaimRef], errors: Mapping[str, str]) -> None:
    for claim in claims:
        if errors[claim.uid]:
            raise KubeletError(f"{method} failed for ResourceClaim {claim.name}: {errors[claim.uid]}")


class Plugin:
    """One registered plugin instance and the kubelet's DRA connection to it."""

    def __init__(
        self, info: PluginInfo, endpoint: str, version: DraVersion, socket_path: Path, identity: Identity
    ) -> None:
        self.info = info
        self.driver = info.name
        self.endpoint = endpoint
        self.version: DraVersion = version
        self.socket_path = socket_path
        self.identity = identity
        self._channel = grpc.aio.insecure_channel(f"unix:{endpoint}", options=OWN_CONNECTIONS)
        self._channel.get_state(try_to_connect=True)  # the kubelet connects at registration, not at first call
        self._client = DraClient(self._channel, version)
        self._health_task: asyncio.Task[None] | None = None
        self._settled = False  # the registration attempt, status notification included, is over

    def __repr__(self) -> str:
        return f"Plugin({self.driver!r}, {self.endpoint!r}, {self.version!r})"

    @property
    def health_service(self) -> str | None:
        """The health stream's service the kubelet uses with this plugin: the first of its own (a 1.37 kubelet
        prefers v1 to v1alpha1) that the plugin offers; None when it offers none."""
        return next((s for s in HEALTH_SERVICES if s in self.info.supported_versions), None)

    @property
    def connected(self) -> bool:
        return self._channel.get_state() == grpc.ChannelConnectivity.READY

    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, ClaimResult]:
        """NodePrepareResources; raises KubeletError as the kubelet fails, per-claim errors stay in the results."""
        results = await rpc("NodePrepareResources", self._client.prepare(claims, timeout=CALL_TIMEOUT))
        _check_keys("NodePrepareResources", claims, results)
        return results

    async def prepare_or_raise(self, claims: Sequence[ClaimRef]) -> dict[str, ClaimResult]:
        """prepare, also failing on the first per-claim error as the kubelet fails the pod."""
        results = await self.prepare(claims)
        _raise_first_error("NodePrepareResources", claims, {uid: r.error for uid, r in results.items()})
        return results

    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        """NodeUnprepareResources: claim UID → error ("" for success)."""
        results = await rpc("NodeUnprepareResources", self._client.unprepare(claims, timeout=CALL_TIMEOUT))
        _check_keys("NodeUnprepareResources", claims, results)
        return results

    async def unprepare_or_raise(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        results = await self.unprepare(claims)
        _raise_first_error("NodeUnprepareResources", claims, results)
        return results

    async def health(self) -> AsyncIterator[list[DeviceHealthReport]]:
        """The raw NodeWatchResources stream: one full device list per message."""
        try:
            # Closed promptly (aclosing): that ends the RPC instead of leaving it to the garbage collector.
            async with contextlib.aclosing(watch_health(self._channel, self.health_service or HEALTH_SERVICES[0])
                                           ) as stream:
                async for reports in stream:
                    yield reports
        except grpc.aio.AioRpcError as e:
            raise rpc_error("NodeWatchResources", e) from e

    async def _close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        await self._channel.close()
