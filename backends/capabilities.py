"""The optional members of the backend contract, as protocols the agent and the conformance kit check with
`isinstance`.

`Backend` holds what every backend has. A backend may have more, and the agent uses it when it is there:
`reconcile` (`Reconciles`), the `records_own_changes` declaration (`RecordsOwnChanges`, whose value must be True:
see `records_own_changes`), the opaque claim parameters it accepts (`HasConfigTypes`), its settings' model
(`HasConfigModel`, which the conformance kit and `dra-agent backends --check` require), and the hardware it would
serve, found without running (`ListsHardware`).

These protocols are `runtime_checkable`: `isinstance` checks that the members are there, not their types or
values. A check that depends on a value reads it after the `isinstance`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from backends.config import BackendConfig, OpaqueConfig

__all__ = ["HasConfigModel", "HasConfigTypes", "ListsHardware", "Reconciles", "RecordsOwnChanges",
           "records_own_changes"]


@runtime_checkable
class Reconciles(Protocol):
    """A backend that keeps its own records of what it made on the hardware."""

    async def reconcile(self, held: Mapping[str, Sequence[str]]) -> None:
        """Release whatever was made for claims not in `held` (claim UID → this backend's device names).

        The agent calls it once at start, after replaying its checkpoint, with the claims that still hold the
        backend's devices (admin-access devices left out: those changed nothing).
        """


@runtime_checkable
class RecordsOwnChanges(Protocol):
    """A backend that declares (with `records_own_changes = True`, a class attribute) that `prepare` changes
    nothing on the node without first recording durably (synced) what it is about to change, and that
    `reconcile` undoes those changes for claims the agent does not hold. A backend that changes nothing
    qualifies too.

    The agent then writes its own `started` record without waiting for the disk (it survives any crash of the
    agent's process, not a power loss, which `reconcile` covers): one disk sync and one worker-thread hop fewer
    per prepare. Only the value True declares it: test with `records_own_changes(backend)`.
    """

    records_own_changes: bool


@runtime_checkable
class HasConfigTypes(Protocol):
    """A backend that accepts typed opaque parameters from claims and device classes: the agent validates each
    claim's parameters against these types (selected by `apiVersion` and `kind`) and hands the result to
    `prepare` as `Allocated.config`. Without it, a claim that gives parameters for the backend fails."""

    config_types: Sequence[type[OpaqueConfig]]


@runtime_checkable
class HasConfigModel(Protocol):
    """A backend whose settings (its `backend_config` section) are a pydantic model, validated at start."""

    config_model: type[BackendConfig]


@runtime_checkable
class ListsHardware(Protocol):
    """A backend that can tell which hardware of the node it would serve without being started: a look at sysfs
    only, no vendor library. When the backend cannot run (its start or its discovery failed), the agent counts
    that hardware as unserved (`dra_agent_unserved_devices`)."""

    def hardware(self, sysfs_root: Path) -> Sequence[str]:
        """The PCI addresses (or other names) of the hardware, each once; blocking (call off the event loop),
        and never raising: what cannot be read is left out."""


def records_own_changes(backend: object) -> bool:
    """Whether `backend` declares `records_own_changes = True` (present and True; anything else is no)."""
    return isinstance(backend, RecordsOwnChanges) and backend.records_own_changes is True
