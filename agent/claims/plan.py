"""What preparing one claim means for a driver, decided before anything is touched: which backend owns each
allocated device, the device's effective opaque configuration, its request names, and which devices were allocated
with admin access. Also how the claims of one kubelet call are told apart by UID.

Pure: works on the allocation read from the claim (agent/claims/read.py) and a lookup of device owners; raises
ClaimError with a message for the pod's events when the claim cannot be prepared here, among others when its
configuration asks for a reconfiguration this node does not allow.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from agent.claims.opaque import effective_config
from agent.claims.read import ClaimAllocation, ClaimError, configs_for
from agent.claims.share_amounts import share_problem
from backends.config import OpaqueConfig
from backends.contract import Allocated, Backend, ClaimRef, Device

__all__ = ["DeviceKey", "Owner", "Plan", "one_per_uid", "plan_claim"]

DeviceKey = tuple[str, str | None]
"""A device as a claim holds it: its name, and the share id when the claim holds a share of it (one claim may
hold two shares of one device, for two requests)."""


@dataclass(frozen=True)
class Owner:
    """The backend that owns a device, and the device as the backend last reported it (its capacities and their
    request policies, which the amounts of a share of it must suit); None when not known."""

    name: str
    backend: Backend
    config_types: tuple[type[OpaqueConfig], ...] = ()
    device: Device | None = None


@dataclass(frozen=True)
class Plan:
    """What preparing one claim means: per backend, its devices with their effective configuration."""

    allocation: ClaimAllocation
    per_backend: dict[str, tuple[Owner, list[Allocated]]]
    requests: dict[DeviceKey, tuple[str, ...]]  # (device, share) → request names (subrequests stripped)
    admin: frozenset[str]  # devices allocated with admin access

    @property
    def devices(self) -> list[str]:
        """The names of the claim's devices, each once, sorted."""
        return sorted({device for device, _ in self.requests})

    @property
    def shared(self) -> frozenset[str]:
        """The devices the claim holds shares of."""
        return frozenset(device for device, share in self.requests if share is not None)


def plan_claim(allocation: ClaimAllocation, pool: str, driver: str, owner_of: Callable[[str], Owner | None], *,
               allowed: Collection[str] = ()) -> Plan:
    """The plan for a claim's devices of `driver` in this node's `pool`; `allowed` names the reconfigurations the
    node makes (its `allowed_configs` setting)."""
    per_backend: dict[str, tuple[Owner, list[Allocated]]] = {}
    requests: dict[DeviceKey, tuple[str, ...]] = {}
    admin: set[str] = set()
    whole = {r.device for r in allocation.devices if r.share_id is None and not r.admin_access}
    mixed = sorted(whole & {r.device for r in allocation.devices if r.share_id is not None})
    if mixed:
        raise ClaimError(f"device {mixed[0]} is allocated to the claim both whole and as a share; a device is "
                         "either shared by capacity or not")
    for result in allocation.devices:
        if result.pool != pool:
            raise ClaimError(f"device {result.device} was allocated from pool {result.pool}; "
                             f"this node's pool is {pool}")
        owner = owner_of(result.device)
        if owner is None:
            raise ClaimError(f"device {result.device} is not a device of driver {driver} on this node")
        problem = share_problem(result, owner.device) if result.share_id and owner.device is not None else None
        if problem is not None:
            raise ClaimError(f"claim {allocation.ref.namespace}/{allocation.ref.name}: {problem}")
        config = effective_config(configs_for(allocation, result), owner.config_types, owner.name)
        refused = _not_allowed(config, allowed)
        if refused:
            raise ClaimError(f"device {result.device} (request {result.request_name}): its {config.KIND} asks for "
                             f"{refused}, which this node does not allow: its operator allows it by naming it in the "
                             f"allowed_configs setting (now {', '.join(sorted(allowed)) or 'none'})")
        entry = per_backend.setdefault(owner.name, (owner, []))
        key = (result.device, result.share_id)
        if all((a.device, a.share_id) != key for a in entry[1]):
            entry[1].append(Allocated(result.device, result.request, config, result.admin_access,
                                      share_id=result.share_id, consumed=result.consumed))
            if result.admin_access:
                admin.add(result.device)
        requests[key] = tuple(dict.fromkeys((*requests.get(key, ()), result.request_name)))
    return Plan(allocation, per_backend, requests, frozenset(admin))


def _not_allowed(config: object, allowed: Collection[str]) -> str:
    """The reconfigurations `config` asks for that are not `allowed`, said in words; empty when none."""
    if not isinstance(config, OpaqueConfig):
        return ""
    refused = [r for r in config.reconfigurations() if r.name not in allowed]
    return ", ".join(f"{r.name} ({r.what})" for r in refused)


def one_per_uid(claims: Sequence[ClaimRef], done: str) -> tuple[list[ClaimRef], dict[str, str]]:
    """The claims of a kubelet call, each UID once; a UID named with two different names gets an error instead
    ("... not `done`"), as no answer (keyed by UID) could say which of the two it is for."""
    by_uid: dict[str, list[ClaimRef]] = {}
    for ref in claims:
        by_uid.setdefault(ref.uid, []).append(ref)
    refs: list[ClaimRef] = []
    clashes: dict[str, str] = {}
    for uid, named in by_uid.items():
        names = sorted({f"{r.namespace}/{r.name}" for r in named})
        if len(names) > 1:
            clashes[uid] = f"claim UID {uid} appears in one request as {' and '.join(names)}; not {done}"
        else:
            refs.append(named[0])
    return refs, clashes
