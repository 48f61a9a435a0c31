"""The URL paths of the API objects the agent reads and writes, and the field selector of its ResourceSlices.

Every path sent to the API server is built here, by `api_path`, from segments checked for their kind before
anything is sent: a namespace must be a DNS label, an object's name must follow its resource's rules (every
resource here takes DNS subdomains: ResourceClaims, ResourceSlices, DeviceClasses and Events by their validation,
Nodes by the node-name rule), a subresource must be one the resource has. A value that fails raises
InvalidRequestError naming the field, and the request is not made. A valid segment is still escaped with nothing
kept, `/` included. The check is what keeps `/`, `%`, `.` and `..` out: an HTTP client folds `.` and `..` segments
(escaped as `%2E%2E` too) into the path before it sends it, so escaping alone cannot; the escaping keeps a path
exact should a rule ever allow more.

The slices' field selector, `spec.nodeName=<node>,spec.driver=<driver>`, gets the same treatment: a node name (a
DNS subdomain) and a driver name (a DNS subdomain once lower-cased) cannot hold the `,`, `=`, `!` or `\\` that would
change what the selector selects.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import NewType
from urllib.parse import quote

from agent.kube.errors import InvalidRequestError
from agent.kube.names import (
    DNS_LABEL_MSG,
    DRIVER_MSG,
    NODE_NAME_MSG,
    SUBDOMAIN_MSG,
    is_dns_label,
    is_dns_subdomain,
    is_driver_name,
    is_node_name,
)

__all__ = [
    "DEVICE_CLASSES",
    "EVENTS",
    "NODES",
    "RESOURCE_CLAIMS",
    "RESOURCE_SLICES",
    "ApiPath",
    "Resource",
    "api_path",
    "slice_selector",
]

ApiPath = NewType("ApiPath", str)
"""A path `api_path` built: the only kind the client sends (mypy holds every caller to it)."""

_SHOWN = 80
"""Characters of a refused value a message shows (a name can be any length)."""


@dataclass(frozen=True)
class Resource:
    """A type of API object: where its objects live and what names they take."""

    kind: str
    group: str  # "" for the core API
    version: str
    plural: str
    namespaced: bool
    is_name: Callable[[object], bool] = is_dns_subdomain
    name_rule: str = SUBDOMAIN_MSG
    subresources: frozenset[str] = frozenset()

    @property
    def prefix(self) -> str:
        return f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"


NODES = Resource("Node", "", "v1", "nodes", namespaced=False, is_name=is_node_name, name_rule=NODE_NAME_MSG)
RESOURCE_SLICES = Resource("ResourceSlice", "resource.k8s.io", "v1", "resourceslices", namespaced=False)
RESOURCE_CLAIMS = Resource("ResourceClaim", "resource.k8s.io", "v1", "resourceclaims", namespaced=True,
                           subresources=frozenset({"status"}))
DEVICE_CLASSES = Resource("DeviceClass", "resource.k8s.io", "v1", "deviceclasses", namespaced=False)
EVENTS = Resource("Event", "events.k8s.io", "v1", "events", namespaced=True)


def api_path(resource: Resource, namespace: str | None = None, name: str | None = None,
             subresource: str | None = None) -> ApiPath:
    """The path of an object (`name`), of its subresource, or of a collection (no name: the objects of one
    namespace, or of all namespaces without one); InvalidRequestError when a part is not valid for its kind."""
    segments = [resource.plural]
    if namespace is not None:
        if not resource.namespaced:
            raise InvalidRequestError(f"a {resource.kind} is not in a namespace (given {_shown(namespace)})")
        _check(is_dns_label(namespace), f"{resource.kind} namespace", namespace, DNS_LABEL_MSG)
        segments = ["namespaces", namespace, *segments]
    if name is not None:
        if resource.namespaced and namespace is None:
            raise InvalidRequestError(f"{resource.kind} {_shown(name)} needs its namespace")
        _check(resource.is_name(name), f"{resource.kind} name", name, resource.name_rule)
        segments.append(name)
    if subresource is not None:
        if name is None or subresource not in resource.subresources:
            raise InvalidRequestError(f"a {resource.kind} has no subresource {_shown(subresource)} to address here")
        segments.append(subresource)
    return ApiPath(resource.prefix + "".join(f"/{quote(s, safe='')}" for s in segments))


def slice_selector(node: str, driver: str) -> str:
    """The field selector of one node's ResourceSlices of one driver; InvalidRequestError for a node or driver
    name that could change what it selects."""
    _check(is_node_name(node), "node name", node, NODE_NAME_MSG)
    _check(is_driver_name(driver), "driver name", driver, DRIVER_MSG)
    return f"spec.nodeName={node},spec.driver={driver}"


def _check(valid: bool, field: str, value: str, rule: str) -> None:
    if not valid:
        raise InvalidRequestError(f"{field} {_shown(value)} is not valid, so no request was sent: it {rule}")


def _shown(value: str) -> str:
    """The value quoted with its control and non-ASCII characters escaped (a look-alike '\\u0430' for 'a' shows as
    such), cut to a readable length."""
    return json.dumps(value[:_SHOWN]) + ("…" if len(value) > _SHOWN else "")
