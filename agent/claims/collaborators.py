"""What a Preparer works with, in four parts: the devices of its driver, where prepared claims are remembered,
where claims are read, and the other agent instances on the node; plus who hears of what it does.

Each part is built once by the driver (agent/driver.py) and handed over whole, so a Preparer's constructor says
what it depends on in a few words, and a test builds only the parts it cares about. The device metadata files
(`MetadataFiles`, agent/claims/metadata_files.py) are handed over the same way, when the driver has them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from structlog.typing import FilteringBoundLogger

from agent.claims.checkpoint import Checkpoint
from agent.claims.locks import FileLock
from agent.claims.plan import Owner
from agent.claims.records import ClaimRecord
from agent.logs import get_logger
from agent.metrics import Metrics
from backends.contract import Backend, ClaimRef
from cdi.store import SpecStore

__all__ = ["CLAIM_READ_SECONDS", "ClaimMemory", "ClaimReader", "ClaimSource", "DriverDevices", "InstanceGuard",
           "Reporting"]

CLAIM_READ_SECONDS = 10.0
"""Seconds reading a claim from the API server may take, connecting included: a stalled API server fails the claim
well within the kubelet's 45 s deadline, and the kubelet asks again."""


class ClaimReader(Protocol):
    """Reads ResourceClaims from the API server."""

    async def get_claim(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The claim, None when it does not exist; other failures raise with a message for the operator."""


def _usable(device: str) -> str | None:
    return None


def _gone(owner: str) -> bool:
    return False


@dataclass(frozen=True)
class DriverDevices:
    """The devices one DRA driver prepares: its name and pool, its backends by name, which backend owns a device
    (kept current by hot-plug), why a device must not be newly prepared (unhealthy), else None, and the
    reconfigurations claims may ask for on this node (the `allowed_configs` setting; none unless named)."""

    driver: str
    pool: str
    backends: Mapping[str, Backend]
    owner_of: Callable[[str], Owner | None]
    unusable: Callable[[str], str | None] = _usable
    allowed_configs: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ClaimMemory:
    """Where prepared claims are remembered across restarts: the driver's checkpoint journal and its per-claim
    CDI specs."""

    checkpoint: Checkpoint
    specs: SpecStore


@dataclass(frozen=True)
class ClaimSource:
    """Where claims are read for prepare, and how long one read may take."""

    reader: ClaimReader
    read_seconds: float = CLAIM_READ_SECONDS


@dataclass(frozen=True)
class InstanceGuard:
    """The other agent instances on this node. `lock` is taken by every instance before it changes shared state;
    with `serialize` (a rolling update: two instances serve the kubelet) every prepare and unprepare holds it too.
    `owner_alive` tells whether the instance that wrote a checkpoint record still runs."""

    lock: FileLock | None = None
    serialize: bool = False
    owner_alive: Callable[[str], bool] = _gone


@dataclass(frozen=True)
class Reporting:
    """Who hears of what a Preparer does: its log, the metrics, and callbacks (none may block): `on_failure` is
    told of every claim not prepared, with the error (for an Event); `on_prepared` of every claim answered as
    prepared, with its record (for the claim's status), again when the kubelet asks again; `on_released` of
    every claim whose preparation was undone (unprepared, rolled back, reaped)."""

    log: FilteringBoundLogger = field(default_factory=lambda: get_logger("preparer"))
    metrics: Metrics | None = None
    on_failure: Callable[[ClaimRef, str], None] | None = None
    on_prepared: Callable[[ClaimRef, ClaimRecord], None] | None = None
    on_released: Callable[[ClaimRef, ClaimRecord], None] | None = None
