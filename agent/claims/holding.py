"""Who holds a device: whether a claim's devices are free for it, given what other claims have prepared.

A device is held whole by one claim at a time, or, when it is shared by capacity, by shares of any number of
claims; never by both at once. Devices allocated with admin access hold nothing. Whether two shares of one device
can work side by side (their configurations) is the owning backend's call, not this module's. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from agent.claims.plan import Plan
from agent.claims.records import ClaimRecord
from backends.contract import Allocated, Prepared

__all__ = ["held_elsewhere", "with_shares"]


def held_elsewhere(uid: str, plan: Plan, claims: Iterable[ClaimRecord]) -> str:
    """Why a device of the plan of claim `uid` cannot be prepared now (another claim holds it whole, or holds a
    share of a device this claim wants whole, or the other way round); empty when none."""
    wanted = set(plan.devices) - plan.admin
    for other in claims:
        if other.uid == uid:
            continue
        for d in sorted(other.devices, key=lambda d: d.device):
            if d.admin_access or d.device not in wanted:
                continue
            mine_shared = d.device in plan.shared
            if mine_shared and d.share_id is not None:
                continue
            who = f"{other.namespace}/{other.name} ({other.uid})" if other.name else f"with UID {other.uid}"
            if d.share_id is not None:
                return (f"device {d.device} is prepared as a share for claim {who}; a claim that holds it whole "
                        "must wait until no share of it is prepared")
            if mine_shared:
                return (f"device {d.device} is prepared whole for claim {who}; a share of it must wait until that "
                        "claim is unprepared")
            return f"device {d.device} is already prepared for claim {who}; unprepare that claim first"
    return ""


def with_shares(allocated: Sequence[Allocated], prepared: Sequence[Prepared]) -> list[Prepared]:
    """A backend's answers, with the share id filled in where it left it out for a device it was given one share
    of (a backend written before shares answers per device)."""
    only_share: dict[str, str | None] = {}
    for a in allocated:
        only_share[a.device] = a.share_id if a.device not in only_share else None
    return [replace(p, share_id=only_share[p.device]) if p.share_id is None and only_share.get(p.device) else p
            for p in prepared]
