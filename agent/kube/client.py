"""The agent's only connection to the Kubernetes API server, through the official `kubernetes.aio` client.

Every path and field selector it sends is built by agent/kube/paths.py from values checked for their kind; a
value that is not valid raises InvalidRequestError before anything is sent.

Requests go through the client's own request path (`ApiClient.param_serialize` + `call_api`: its
credentials, TLS, retries of connections), with JSON bodies in and out. The generated per-group API classes are
not used: importing CoreV1Api alone loads ~235 model classes (24 MB here) and every call validates its
arguments with pydantic, where the agent needs a handful of paths and the raw objects — including fields a
newer server sends that this client's models would drop.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from urllib.request import getproxies_environment, proxy_bypass

import aiohttp
from kubernetes.aio import client, config

from agent.kube.errors import InvalidRequestError, KubeconfigError, KubeError
from agent.kube.paths import EVENTS, NODES, RESOURCE_CLAIMS, RESOURCE_SLICES, ApiPath, api_path, slice_selector
from agent.kube.unreachable import why_unreachable

__all__ = ["InvalidRequestError", "KubeClient", "KubeError", "KubeconfigError"]

_IN_CLUSTER_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
_SLICES = api_path(RESOURCE_SLICES)
_JSON = "application/json"
_MERGE_PATCH = "application/merge-patch+json"
_APPLY_PATCH = "application/apply-patch+yaml"  # a JSON body is YAML too


@dataclass
class KubeClient:
    """Typed calls for what the agent needs; every method raises KubeError."""

    api: client.ApiClient

    @classmethod
    async def connect(cls, kubeconfig: Path | None = None) -> KubeClient:
        """From a kubeconfig file when given, else in-cluster credentials, else $KUBECONFIG / ~/.kube/config."""
        configuration = client.Configuration()
        in_cluster = kubeconfig is None and _in_cluster()
        if not in_cluster:
            _check_kubeconfig(kubeconfig)
        try:
            if kubeconfig is not None:
                await config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
            elif in_cluster:
                config.load_incluster_config(client_configuration=configuration)
            else:
                await config.load_kube_config(client_configuration=configuration)
        except (config.ConfigException, OSError) as e:
            where = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
            raise KubeconfigError(f"kubeconfig {where} is not usable: {e}") from None
        # The client's session would look proxies (and ~/.netrc) up in the environment on every request,
        # which costs ~0.6 ms each here; resolve the proxy once instead.
        configuration.client_session_kwargs = {"trust_env": False}
        if not configuration.proxy:
            configuration.proxy = _environment_proxy(configuration.host)
        return cls(client.ApiClient(configuration))

    async def close(self) -> None:
        await self.api.close()

    async def request(
        self,
        method: str,
        path: ApiPath,
        *,
        body: Mapping[str, Any] | None = None,
        query: Sequence[tuple[str, str]] = (),
        what: str = "",
        content_type: str = _JSON,
        timeout: float | None = None,
        decode: bool = True,
    ) -> Any:
        """One API request to a path built by `api_path`; the decoded JSON response (None without `decode`: the
        body is read, not parsed), or KubeError with the server's message. `timeout` bounds the whole request in
        seconds (the client's default: 5 minutes)."""
        what = what or f"{method} {path}"
        headers = {"Accept": _JSON}
        if body is not None:
            headers["Content-Type"] = content_type
        try:
            method, url, headers, data, _ = await self.api.param_serialize(
                method=method, resource_path=path, query_params=list(query), header_params=headers,
                body=None if body is None else dict(body), auth_settings=["BearerToken"],
            )
            response = await self.api.call_api(method, url, header_params=headers, body=data,
                                               _request_timeout=timeout, _preload_content=False)
            raw = await response.read()
        except Exception as e:  # connection refused, timeouts, TLS: the server was not reached
            raise KubeError(f"{what}: {why_unreachable(e)}") from None
        if 200 <= response.status < 300:
            if not decode:
                return None
            try:
                return json.loads(raw) if raw else {}
            except ValueError:  # a proxy's page, a cut body: not the object asked for
                raise KubeError(f"{what}: the answer is not JSON", response.status) from None
        message, reason = _status_message(raw)
        raise KubeError(f"{what}: {message or response.reason}", response.status, reason)

    async def get_claim(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """A ResourceClaim, None when it does not exist."""
        path = api_path(RESOURCE_CLAIMS, namespace, name)
        try:
            claim: Mapping[str, Any] = await self.request("GET", path, what=f"get resourceclaim {namespace}/{name}")
        except KubeError as e:
            if e.status == 404:
                return None
            raise
        return claim

    async def apply_claim_status(self, namespace: str, name: str, body: Mapping[str, Any], field_manager: str,
                                 timeout: float) -> None:
        """Server-side apply on a ResourceClaim's status as `field_manager`, forcing ownership: the server merges
        the applied fields with those of other managers and removes what this manager owned and no longer applies.
        The claim the server answers with is not decoded: nothing reads it, and it is the biggest part of the
        write's work in the agent (the whole claim, its managedFields included)."""
        await self.request(
            "PATCH", api_path(RESOURCE_CLAIMS, namespace, name, "status"), body=body, content_type=_APPLY_PATCH,
            timeout=timeout, query=[("fieldManager", field_manager), ("force", "true")],
            what=f"apply status of resourceclaim {namespace}/{name}", decode=False)

    async def get_node_uid(self, name: str) -> str:
        node = await self.request("GET", api_path(NODES, name=name), what=f"get node {name}")
        uid: str = node["metadata"]["uid"]
        return uid

    async def list_slices(self, node: str, driver: str) -> list[dict[str, Any]]:
        """This node's slices of one driver."""
        return (await self.list_slices_versioned(node, driver))[0]

    async def list_slices_versioned(self, node: str, driver: str) -> tuple[list[dict[str, Any]], str]:
        """This node's slices of one driver, and the list's resourceVersion to watch from."""
        listed = await self.request("GET", _SLICES, query=[("fieldSelector", slice_selector(node, driver))],
                                    what=f"list resourceslices of {driver} on {node}")
        items: list[dict[str, Any]] = listed.get("items") or []
        return items, str(listed.get("metadata", {}).get("resourceVersion", ""))

    async def watch_slices(
        self, node: str, driver: str, resource_version: str, timeout: int
    ) -> AsyncIterator[dict[str, Any]]:
        """Watch events of this node's slices of one driver after `resource_version`, for about `timeout`
        seconds (the server ends the watch then); BOOKMARK events carry the latest resourceVersion."""
        query = [("fieldSelector", slice_selector(node, driver)), ("watch", "true"),
                 ("resourceVersion", resource_version), ("allowWatchBookmarks", "true"),
                 ("timeoutSeconds", str(timeout))]
        what = f"watch resourceslices of {driver} on {node}"
        try:
            method, url, headers, _, _ = await self.api.param_serialize(
                method="GET", resource_path=_SLICES, query_params=query, header_params={"Accept": _JSON},
                auth_settings=["BearerToken"],
            )
            response = await self.api.call_api(method, url, header_params=headers, _preload_content=False,
                                               _request_timeout=timeout + 30)
        except Exception as e:
            raise KubeError(f"{what}: {why_unreachable(e)}") from None
        if response.status != 200:
            message, reason = _status_message(await response.read())
            raise KubeError(f"{what}: {message or response.reason}", response.status, reason)
        try:
            async for line in response.response.content:
                if line.strip():
                    yield json.loads(line)
        except (aiohttp.ClientError, ValueError, OSError, TimeoutError) as e:  # a cut connection, a torn event
            raise KubeError(f"{what}: stream ended: {why_unreachable(e)}") from None
        finally:
            response.response.release()

    async def create_slice(self, body: Mapping[str, Any]) -> dict[str, Any]:
        created: dict[str, Any] = await self.request("POST", _SLICES, body=body, what="create resourceslice")
        return created

    async def replace_slice(self, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        replaced: dict[str, Any] = await self.request("PUT", api_path(RESOURCE_SLICES, name=name), body=body,
                                                      what=f"replace resourceslice {name}")
        return replaced

    async def delete_slice(self, name: str, uid: str | None = None, resource_version: str | None = None) -> None:
        """Delete a slice; with uid and resourceVersion only that very version of it (409 otherwise)."""
        preconditions = {k: v for k, v in (("uid", uid), ("resourceVersion", resource_version)) if v}
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": preconditions} if preconditions else None
        try:
            await self.request("DELETE", api_path(RESOURCE_SLICES, name=name), body=body,
                               what=f"delete resourceslice {name}")
        except KubeError as e:
            if e.status != 404:
                raise


    async def create_event(self, namespace: str, body: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        """Create an events.k8s.io/v1 Event."""
        created: dict[str, Any] = await self.request(
            "POST", api_path(EVENTS, namespace), body=body, timeout=timeout,
            what=f"create event {namespace}/{body.get('metadata', {}).get('name', '')}")
        return created

    async def patch_event(self, namespace: str, name: str, patch: Mapping[str, Any],
                          timeout: float) -> dict[str, Any]:
        """Merge-patch an events.k8s.io/v1 Event (a series' count and last observation)."""
        patched: dict[str, Any] = await self.request(
            "PATCH", api_path(EVENTS, namespace, name), body=patch, content_type=_MERGE_PATCH,
            timeout=timeout, what=f"patch event {namespace}/{name}")
        return patched


def _environment_proxy(url: str) -> str | None:
    """The proxy HTTPS_PROXY / HTTP_PROXY name for `url`, unless NO_PROXY exempts its host."""
    parts = urlsplit(url)
    if not parts.hostname or proxy_bypass(parts.hostname):
        return None
    return getproxies_environment().get(parts.scheme) or None


def _check_kubeconfig(kubeconfig: Path | None) -> None:
    """Say plainly that a kubeconfig file is missing (the client would answer "Expected key current-context")."""
    if kubeconfig is None:
        if os.environ.get("KUBECONFIG"):
            return  # a list of files the client merges, any of which may be missing
        default = Path("~/.kube/config").expanduser()
        if not default.exists():
            raise KubeconfigError(f"no Kubernetes credentials: not in a cluster (no service account token) and no "
                                  f"kubeconfig at {default}; give --kubeconfig FILE or set KUBECONFIG")
        return
    if os.pathsep in str(kubeconfig):
        return  # KUBECONFIG's list form
    if not kubeconfig.exists():
        raise KubeconfigError(f"kubeconfig {kubeconfig} does not exist")
    if not kubeconfig.is_file():
        raise KubeconfigError(f"kubeconfig {kubeconfig} is not a file")


def _in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and _IN_CLUSTER_TOKEN.exists()


def _status_message(body: bytes) -> tuple[str, str]:
    """The message and reason of a Kubernetes Status body, when the body is one."""
    try:
        status = json.loads(body)
    except ValueError:
        return body.decode(errors="replace")[:300], ""
    if isinstance(status, dict):
        return str(status.get("message", "")), str(status.get("reason", ""))
    return "", ""
