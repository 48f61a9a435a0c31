"""The agent's only connection to the Kubernetes API server, through the official `kubernetes.aio` client.

Objects come and go as plain JSON mappings (the raw responses), not client models: the agent reads a few
fields and must not lose fields a newer server sends. Errors become `KubeError` with the server's own message.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes.aio import client, config

__all__ = ["KubeClient", "KubeError"]

_IN_CLUSTER_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


class KubeError(Exception):
    """An API request failed; `status` is the HTTP status (0 when the server could not be reached)."""

    def __init__(self, message: str, status: int = 0, reason: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


@dataclass
class KubeClient:
    """Typed calls for what the agent needs; every method raises KubeError."""

    api: client.ApiClient

    @classmethod
    async def connect(cls, kubeconfig: Path | None = None) -> KubeClient:
        """From a kubeconfig file when given, else in-cluster credentials, else $KUBECONFIG / ~/.kube/config."""
        configuration = client.Configuration()
        try:
            if kubeconfig is not None:
                await config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
            elif _in_cluster():
                config.load_incluster_config(client_configuration=configuration)
            else:
                await config.load_kube_config(client_configuration=configuration)
        except (config.ConfigException, OSError) as e:
            where = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
            raise KubeError(f"cannot load Kubernetes credentials ({where}): {e}") from None
        return cls(client.ApiClient(configuration))

    async def close(self) -> None:
        await self.api.close()

    @property
    def _resource(self) -> client.ResourceV1Api:
        return client.ResourceV1Api(self.api)

    async def _call(self, what: str, request: Any) -> Any:
        """Await a `*_without_preload_content` call and decode its JSON, or raise KubeError."""
        try:
            response = await request
            body = await response.read()
        except Exception as e:  # connection refused, timeouts, TLS: the server was not reached
            raise KubeError(f"{what}: {type(e).__name__}: {e}") from None
        if 200 <= response.status < 300:
            return json.loads(body) if body else {}
        message, reason = _status_message(body)
        raise KubeError(f"{what}: {message or response.reason}", response.status, reason)

    async def get_claim(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """A ResourceClaim, None when it does not exist."""
        try:
            claim: Mapping[str, Any] = await self._call(
                f"get resourceclaim {namespace}/{name}",
                self._resource.read_namespaced_resource_claim_without_preload_content(name, namespace),
            )
        except KubeError as e:
            if e.status == 404:
                return None
            raise
        return claim

    async def get_node_uid(self, name: str) -> str:
        node = await self._call(f"get node {name}", client.CoreV1Api(self.api).read_node_without_preload_content(name))
        uid: str = node["metadata"]["uid"]
        return uid

    async def list_slices(self, node: str, driver: str) -> list[dict[str, Any]]:
        """This node's slices of one driver."""
        listed = await self._call(
            f"list resourceslices of {driver} on {node}",
            self._resource.list_resource_slice_without_preload_content(
                field_selector=f"spec.nodeName={node},spec.driver={driver}"
            ),
        )
        items: list[dict[str, Any]] = listed.get("items", [])
        return items

    async def create_slice(self, body: Mapping[str, Any]) -> dict[str, Any]:
        created: dict[str, Any] = await self._call(
            "create resourceslice", self._resource.create_resource_slice_without_preload_content(_slice(body)),
        )
        return created

    async def replace_slice(self, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        replaced: dict[str, Any] = await self._call(
            f"replace resourceslice {name}",
            self._resource.replace_resource_slice_without_preload_content(name, _slice(body)),
        )
        return replaced

    async def delete_slice(self, name: str) -> None:
        try:
            await self._call(f"delete resourceslice {name}",
                             self._resource.delete_resource_slice_without_preload_content(name))
        except KubeError as e:
            if e.status != 404:
                raise


def _in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and _IN_CLUSTER_TOKEN.exists()


def _slice(body: Mapping[str, Any]) -> client.V1ResourceSlice:
    model = client.V1ResourceSlice.from_dict(dict(body))
    if model is None:
        raise KubeError("empty ResourceSlice body")
    return model


def _status_message(body: bytes) -> tuple[str, str]:
    """The message and reason of a Kubernetes Status body, when the body is one."""
    try:
        status = json.loads(body)
    except ValueError:
        return body.decode(errors="replace")[:300], ""
    if isinstance(status, dict):
        return str(status.get("message", "")), str(status.get("reason", ""))
    return "", ""
