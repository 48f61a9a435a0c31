"""The scheduler's allocation step against an API server: read a claim, the DeviceClasses, every ResourceSlice
and the other claims' allocations, allocate (:func:`simulator.scheduler.allocation.allocate`), and write
``status.allocation`` through the claim's ``/status`` subresource; or release a claim again.

It talks HTTP through the official ``kubernetes.aio`` client (:class:`agent.kube.client.KubeClient`), so it works
against :class:`simulator.apiserver.server.TestApiServer` and a real cluster alike. A write that loses a race
(409 Conflict on the claim's resourceVersion) is redone from fresh reads. Allocations made through one
:class:`Allocator` are serialized, so they never double-book a device; separate allocators (or a real scheduler)
writing at the same time could, as two schedulers could.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from agent.kube.client import KubeClient, KubeError
from agent.kube.paths import DEVICE_CLASSES, NODES, RESOURCE_CLAIMS, RESOURCE_SLICES, Resource, api_path
from simulator.scheduler.allocation import Allocation, DeviceResult, Unallocatable, allocate

__all__ = ["Allocator"]

def _existing(claim: Mapping[str, Any], node: str) -> Allocation:
    """The allocation a claim already has, as an :class:`Allocation` (it is kept, not redone)."""
    status = dict((claim.get("status") or {}).get("allocation") or {})
    results = [DeviceResult(r["request"], r["driver"], r["pool"], r["device"], bool(r.get("adminAccess")),
                            r.get("shareID"), dict(r.get("consumedCapacity") or {}))
               for r in (status.get("devices") or {}).get("results") or ()]  # fmt: skip
    return Allocation(node, results, status, ["already allocated: the existing allocation is kept"])


class Allocator:
    """Allocates and releases ResourceClaims in an API server, from a kubeconfig file or a connected client."""

    def __init__(self, source: str | os.PathLike[str] | KubeClient, *, attempts: int = 10) -> None:
        self._kubeconfig = None if isinstance(source, KubeClient) else Path(source)
        self._kube = source if isinstance(source, KubeClient) else None
        self._owned = self._kube is None
        self._attempts = attempts
        self._lock = asyncio.Lock()

    @classmethod
    async def connect(cls, kubeconfig: str | os.PathLike[str], *, attempts: int = 10) -> Allocator:
        """An allocator connected now through ``kubeconfig`` (``close()`` closes the connection)."""
        allocator = cls(kubeconfig, attempts=attempts)
        await allocator._client()
        return allocator

    async def _client(self) -> KubeClient:
        if self._kube is None:
            self._kube = await KubeClient.connect(self._kubeconfig)
        return self._kube

    async def client(self) -> KubeClient:
        """The connection this allocator writes through (opened now if it is not yet)."""
        return await self._client()

    async def close(self) -> None:
        """Close the connection if this allocator opened it."""
        if self._owned and self._kube is not None:
            await self._kube.close()
            self._kube = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:  # fmt: skip
        await self.close()

    async def _get_claim(self, kube: KubeClient, namespace: str, name: str) -> dict[str, Any]:
        claim = await kube.get_claim(namespace, name)
        if claim is None:
            raise Unallocatable([f"resourceclaim {namespace}/{name} does not exist"])
        return dict(claim)

    async def _node(self, kube: KubeClient, node: str) -> str | dict[str, Any]:
        """The Node object (its labels count for node selectors), or just its name if it is not registered."""
        try:
            found: dict[str, Any] = await kube.request("GET", api_path(NODES, name=node), what=f"get node {node}")
        except KubeError as e:
            if e.status == 404:
                return node
            raise
        return found

    async def _list(self, kube: KubeClient, resource: Resource) -> list[dict[str, Any]]:
        listed = await kube.request("GET", api_path(resource), what=f"list {resource.plural}")
        items: list[dict[str, Any]] = listed.get("items") or []
        return items

    async def allocate(self, namespace: str, name: str, *, node: str) -> Allocation:
        """Allocate the claim on ``node`` and write its ``status.allocation``.

        Raises :class:`Unallocatable` (with reasons) when it cannot be allocated there,
        :class:`simulator.scheduler.cel.CelError` for a selector that cannot be compiled, and
        :class:`agent.kube.client.KubeError` when the API server fails."""
        kube = await self._client()
        async with self._lock:
            for _ in range(self._attempts):
                claim = await self._get_claim(kube, namespace, name)
                if (claim.get("status") or {}).get("allocation"):
                    return _existing(claim, node)
                node_object = await self._node(kube, node)
                classes, slices, claims = await asyncio.gather(
                    self._list(kube, DEVICE_CLASSES), self._list(kube, RESOURCE_SLICES),
                    self._list(kube, RESOURCE_CLAIMS),
                )  # fmt: skip
                # In a thread: evaluating selectors takes a while, and the API server may share this event loop.
                allocation = await asyncio.to_thread(allocate, claim, classes=classes, slices=slices,
                                                     allocated=claims, node=node_object)  # fmt: skip
                body = {**claim, "status": {**(claim.get("status") or {}), "allocation": allocation.status}}
                try:
                    await kube.request("PUT", api_path(RESOURCE_CLAIMS, namespace, name, "status"), body=body,
                                       what=f"write the allocation of resourceclaim {namespace}/{name}")  # fmt: skip
                except KubeError as e:
                    if e.status == 409:  # the claim changed since it was read: read everything again
                        continue
                    raise
                return allocation
        raise KubeError(f"allocate resourceclaim {namespace}/{name}: the claim kept changing "
                        f"({self._attempts} conflicting writes)", 409, "Conflict")  # fmt: skip

    async def deallocate(self, namespace: str, name: str) -> None:
        """Release the claim: its ``status.allocation`` (and ``reservedFor``) are removed. A claim that is gone
        or not allocated is left as it is."""
        kube = await self._client()
        for _ in range(self._attempts):
            claim = await kube.get_claim(namespace, name)
            status = dict((claim or {}).get("status") or {})
            if claim is None or not status.get("allocation"):
                return
            status.pop("allocation", None)
            status.pop("reservedFor", None)
            try:
                await kube.request("PUT", api_path(RESOURCE_CLAIMS, namespace, name, "status"),
                                   body={**claim, "status": status},
                                   what=f"release resourceclaim {namespace}/{name}")  # fmt: skip
            except KubeError as e:
                if e.status in (409, 404):
                    continue
                raise
            return
        raise KubeError(f"release resourceclaim {namespace}/{name}: the claim kept changing", 409, "Conflict")
