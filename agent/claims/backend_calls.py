"""Calling the backends that own a claim's devices: prepare on all of them at once, unprepare one after the other,
each within BACKEND_TIMEOUT, and a message naming the devices when one fails (the claim's error)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from structlog.typing import FilteringBoundLogger

from agent.claims.holding import with_shares
from agent.claims.plan import Owner, Plan
from agent.claims.records import ClaimRecord
from agent.logs import get_logger
from agent.unexpected import unexpected
from backends.contract import Allocated, Backend, BackendError, ClaimRef, Prepared

__all__ = ["BACKEND_TIMEOUT", "prepare_on_backends", "unprepare_on_backends"]

BACKEND_TIMEOUT = 40.0
"""Seconds a backend may take for one claim: below the kubelet's 45 s deadline, so the claim gets an answer."""


async def prepare_on_backends(ref: ClaimRef, plan: Plan, log: FilteringBoundLogger
                              ) -> tuple[dict[str, list[Prepared]], str]:
    """Prepare on every owning backend concurrently; what succeeded is returned even when one fails."""

    async def one(owner: Owner, allocated: list[Allocated]) -> list[Prepared] | str:
        try:
            async with asyncio.timeout(BACKEND_TIMEOUT):
                prepared = list(await owner.backend.prepare(ref, allocated))
        except TimeoutError:
            return f"backend {owner.name} did not prepare {_devices(allocated)} within {BACKEND_TIMEOUT:.0f} s"
        except BackendError as e:
            return _about(allocated, str(e))
        except Exception as e:
            log.exception("backend prepare failed", backend=owner.name,
                          claim=f"{ref.namespace}/{ref.name}:{ref.uid}")
            return f"backend {owner.name} failed on {_devices(allocated)}: {unexpected(e)}"
        prepared = with_shares(allocated, prepared)
        wanted = {(a.device, a.share_id) for a in allocated}
        if {(p.device, p.share_id) for p in prepared} != wanted or len(prepared) != len(wanted):
            return f"backend {owner.name} answered for other devices than {_devices(allocated)}"
        return prepared

    names = list(plan.per_backend)
    if len(names) == 1:
        outcomes = [await one(*plan.per_backend[names[0]])]
    else:
        outcomes = await asyncio.gather(*(one(*plan.per_backend[n]) for n in names))
    done = {n: o for n, o in zip(names, outcomes, strict=True) if not isinstance(o, str)}
    errors = [o for o in outcomes if isinstance(o, str)]
    return done, "; ".join(errors)


async def unprepare_on_backends(backends: Mapping[str, Backend], ref: ClaimRef, record: ClaimRecord) -> str:
    """Undo a claim's devices from its record, backend by backend; an error message at the first that fails."""
    by_backend: dict[str, list[Prepared]] = {}
    for d in record.devices:
        by_backend.setdefault(d.backend, []).append(
            Prepared(device=d.device, edits=d.edits, common_edits=d.common_edits, restore=d.restore,
                     share_id=d.share_id))
    for backend, items in by_backend.items():
        if not backend:
            continue  # a device of a claim known from its CDI spec alone, no longer on this node
        owner = backends.get(backend)
        if owner is None:
            return f"backend {backend}, which prepared {_devices(items)}, is not loaded; load it to unprepare"
        try:
            async with asyncio.timeout(BACKEND_TIMEOUT):
                await owner.unprepare(ref, items)
        except TimeoutError:
            return f"backend {backend} did not unprepare {_devices(items)} within {BACKEND_TIMEOUT:.0f} s"
        except BackendError as e:
            return f"{_devices(items)}: {e}"
        except Exception as e:
            get_logger("claims").exception("backend unprepare failed", backend=backend,
                                           claim=f"{ref.namespace}/{ref.name}:{ref.uid}")
            return f"backend {backend} failed to unprepare {_devices(items)}: {unexpected(e)}"
    return ""


def _about(allocated: Sequence[Allocated], message: str) -> str:
    """A backend's error, led by the devices it is about unless it already names one of them first."""
    if any(message.startswith(f"{a.device}:") for a in allocated):
        return message
    return f"{_devices(allocated)}: {message}"


def _devices(items: Sequence[Allocated] | Sequence[Prepared]) -> str:
    return ", ".join(i.device for i in items)
