"""Keeps this node's ResourceSlices in the API server equal to the desired ones, per driver.

This first form replaces the pool wholesale when anything differs: it writes every desired slice (updating
existing ones in name order, creating the rest) under a new pool generation, then deletes the leftovers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from structlog.typing import FilteringBoundLogger

from agent.kube import KubeClient

__all__ = ["Publisher"]


class Publisher:
    """Publishes the pools of one node."""

    def __init__(self, kube: KubeClient, node: str, node_uid: str | None, log: FilteringBoundLogger) -> None:
        self._kube = kube
        self._node = node
        self._owner = (
            [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid, "controller": True}]
            if node_uid else []
        )
        self._log = log

    async def publish(self, driver: str, desired: Sequence[Mapping[str, Any]]) -> int:
        """Make the driver's slices equal `desired`; returns the number of writes. Raises KubeError."""
        existing = sorted(await self._kube.list_slices(self._node, driver), key=lambda s: s["metadata"]["name"])
        if [_content(s) for s in existing] == [_content(d) for d in desired]:
            return 0
        generation = max((s["spec"]["pool"]["generation"] for s in existing), default=-1) + 1
        writes = 0
        for index, wanted in enumerate(desired):
            body: dict[str, Any] = {**wanted, "metadata": dict(wanted["metadata"]), "spec": dict(wanted["spec"])}
            body["spec"]["pool"] = {**wanted["spec"]["pool"], "generation": generation}
            if self._owner:
                body["metadata"]["ownerReferences"] = self._owner
            if index < len(existing):
                body["metadata"]["name"] = existing[index]["metadata"]["name"]
                body["metadata"]["resourceVersion"] = existing[index]["metadata"]["resourceVersion"]
                body["metadata"].pop("generateName", None)
                await self._kube.replace_slice(body["metadata"]["name"], body)
            else:
                await self._kube.create_slice(body)
            writes += 1
        for leftover in existing[len(desired):]:
            await self._kube.delete_slice(leftover["metadata"]["name"])
            writes += 1
        self._log.info("published slices", driver=driver, slices=len(desired), generation=generation, writes=writes)
        return writes


def _content(obj: Mapping[str, Any]) -> Any:
    """What must match for a slice to count as unchanged: the spec without the pool generation."""
    spec = dict(obj["spec"])
    spec["pool"] = {k: v for k, v in spec["pool"].items() if k != "generation"}
    return spec
