"""Who the test API server's token stands for, and the one authorization the server models: which drivers'
entries of a ResourceClaim's `status.devices` that caller may change.

The real server (pkg/registry/resource/utils.go, `AuthorizedForDeviceStatus`) checks, for each driver whose entries
a status write adds, removes or changes, the verb `associated-node:<verb>` on `resourceclaims/driver` with the
driver as resource name when the caller is a service account whose token carries the node of the claim's
allocation, then `arbitrary-node:<verb>`; otherwise `arbitrary-node:<verb>` only (`<verb>` is the request's:
`patch` for a patch or an apply, `update` for a PUT). A refusal is one Forbidden error on `status.devices` per
driver, in the 422 with the validation errors, worded as the server words it.

Here the permissions are stated rather than derived from RBAC: `status_drivers` are the drivers whose entries the
caller may change on any node (None: every driver), as a ClusterRole granting both verbs would.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.claims.status_rules import device_key
from agent.kube.names import is_node_name

__all__ = ["AGENT_USER", "ANYONE", "Caller", "device_status_forbidden"]

AGENT_USER = "system:serviceaccount:dra-agent:dra-agent"
"""The user the agent's service account token names (deploy/)."""


@dataclass(frozen=True)
class Caller:
    """The identity behind the test API server's token: `user` as the server names it, `node` the node a pod-bound
    service account token carries (None: none), and the drivers whose `status.devices` entries it may change
    (None: every driver)."""

    user: str = AGENT_USER
    node: str | None = None
    status_drivers: frozenset[str] | None = None


ANYONE = Caller()
"""The default: the agent's service account, on no node, allowed every driver."""


def device_status_forbidden(caller: Caller, verb: str, namespace: str, new: Mapping[str, Any],
                            old: Mapping[str, Any]) -> list[str]:
    """The server's Forbidden errors for a change of `status.devices` from the claim status `old` to `new`
    (a claim not allocated is not checked: its entries are dropped anyway)."""
    if not new.get("allocation"):
        return []
    verbs = [f"arbitrary-node:{verb}"]
    if _is_service_account(caller.user) and caller.node and is_node_name(caller.node) \
            and caller.node == _allocated_node(new["allocation"]):
        verbs.insert(0, f"associated-node:{verb}")
    errors = []
    for driver in sorted(_changed_drivers(new, old)):
        if caller.status_drivers is None or driver in caller.status_drivers:
            continue
        denied = (f'resourceclaims.resource.k8s.io "{driver}" is forbidden: User "{caller.user}" cannot {verbs[0]} '
                  f'resource "resourceclaims/driver" in API group "resource.k8s.io" in the namespace "{namespace}"')
        errors.append(f'status.devices: Forbidden: changing status.devices requires resource="resourceclaims/driver", '
                      f'verb="[{" ".join(verbs)}]" permission: {denied}')
    return errors


def _changed_drivers(new: Mapping[str, Any], old: Mapping[str, Any]) -> set[str]:
    """The drivers of the entries added, removed or changed."""
    before = {device_key(e): e for e in old.get("devices") or () if isinstance(e, Mapping)}
    drivers = set()
    for entry in new.get("devices") or ():
        if not isinstance(entry, Mapping):
            continue
        if before.pop(device_key(entry), None) != entry:
            drivers.add(str(entry.get("driver") or ""))
    return drivers | {str(e.get("driver") or "") for e in before.values()}


def _allocated_node(allocation: Any) -> str:
    """The node of an allocation for exactly one node by name (`metadata.name In [node]`), else ""."""
    selector = allocation.get("nodeSelector") if isinstance(allocation, Mapping) else None
    terms = selector.get("nodeSelectorTerms") if isinstance(selector, Mapping) else None
    if not isinstance(terms, list) or len(terms) != 1 or not isinstance(terms[0], Mapping):
        return ""
    expressions, fields = terms[0].get("matchExpressions") or [], terms[0].get("matchFields") or []
    if expressions or len(fields) != 1 or not isinstance(fields[0], Mapping):
        return ""
    field = fields[0]
    values = field.get("values") or []
    if field.get("key") != "metadata.name" or field.get("operator") != "In" or len(values) != 1:
        return ""
    return str(values[0])


def _is_service_account(user: str) -> bool:
    parts = user.split(":")
    return len(parts) == 4 and parts[:2] == ["system", "serviceaccount"] and all(parts[2:])
