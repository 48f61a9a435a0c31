"""The backtracking search for one claim: requests in order, each one's sub-requests in order, devices in
inventory order, the first full solution wins (as the upstream structured allocator).

A shareable device (``allowMultipleAllocations``) is not taken by a pick: each pick is a share that takes its
consumption of the device's capacities, and the device stays a candidate while capacity is left (also for another
request of the same claim).

Within a request, devices are picked in increasing inventory order, so each set of devices is tried once rather
than in every order. Constraints and counters are checked at every pick, so a dead end is left at once; a step
budget turns a pathological claim into :class:`TooManyCombinations` instead of a hang.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from simulator.scheduler.pools import Candidate, DeviceKey, SetKey

__all__ = ["Choice", "Constraint", "Search", "TooManyCombinations"]

MAX_RESULTS = 32  # AllocationResultsMaxSize of resource.k8s.io/v1


@dataclass
class Choice:
    """One way to satisfy a request: the request itself, or one of its ``firstAvailable`` sub-requests."""

    request: str  # the name results carry: "<request>" or "<request>/<sub-request>"
    parent: str  # the request's own name
    class_name: str
    mode: str  # ExactCount or All
    count: int
    admin: bool
    tolerations: tuple[Mapping[str, Any], ...] = ()
    selectors: tuple[str, ...] = ()
    candidates: list[Candidate] = field(default_factory=list)  # on the node and matching every selector
    untolerated: dict[DeviceKey, str] = field(default_factory=dict)  # candidate -> the taint it is refused for
    capacity: dict[str, Fraction] = field(default_factory=dict)  # exactly.capacity.requests
    shares: dict[DeviceKey, dict[str, Fraction]] = field(default_factory=dict)  # shareable candidate -> its take

    @property
    def needed(self) -> int:
        return len(self.candidates) if self.mode == "All" else self.count


@dataclass(frozen=True)
class Constraint:
    """``matchAttribute`` or ``distinctAttribute`` over some requests (all when none are named)."""

    kind: str
    attribute: str
    requests: frozenset[str]

    def applies(self, choice: Choice) -> bool:
        return not self.requests or choice.parent in self.requests or choice.request in self.requests

    def scope(self, names: Sequence[str]) -> list[str]:
        return [n for n in names if not self.requests or n in self.requests]


class TooManyCombinations(Exception):
    """The search used its step budget without an answer."""

    def __init__(self, steps: int) -> None:
        super().__init__(f"gave up after trying {steps} device placements")
        self.steps = steps


@dataclass(frozen=True)
class Pick:
    choice: Choice
    device: Candidate
    consumed: Mapping[str, Fraction] | None = None  # a share of a shareable device: what it takes


class Search:
    """One search over a claim's requests (each a list of choices, tried in order)."""

    def __init__(
        self,
        requests: Sequence[Sequence[Choice]],
        constraints: Sequence[Constraint],
        held: Mapping[DeviceKey, Any],
        counters_left: Mapping[SetKey, Mapping[str, Fraction]],
        capacity_left: Mapping[DeviceKey, Mapping[str, Fraction]] | None = None,
        *,
        max_steps: int = 100_000,
    ) -> None:
        self.requests, self.constraints = requests, constraints
        self.held, self.left = held, counters_left
        self.capacity_left = capacity_left or {}
        self.taken: dict[DeviceKey, dict[str, Fraction]] = {}  # shares picked so far, per device
        self.max_steps, self.steps = max_steps, 0
        self.picks: list[Pick] = []
        self.drawn: dict[SetKey, dict[str, Fraction]] = {}
        self._claimed: set[DeviceKey] = set()
        self._values: list[list[Any]] = [[] for _ in constraints]  # attribute values picked, per constraint

    def run(self) -> list[Pick] | None:
        """The first solution (one pick per device), or None; TooManyCombinations past the budget."""
        return list(self.picks) if self._request(0) else None

    def _request(self, index: int) -> bool:
        if index == len(self.requests):
            return True
        for choice in self.requests[index]:
            if choice.mode == "All":
                if choice.candidates and self._all(index, choice, 0):
                    return True
            elif self._exact(index, choice, choice.count, 0):
                return True
        return False

    def _exact(self, index: int, choice: Choice, need: int, start: int) -> bool:
        if need == 0:
            return self._request(index + 1)
        if len(self.picks) + need > MAX_RESULTS:
            return False
        candidates = choice.candidates
        for position in range(start, len(candidates) - need + 1):
            device = candidates[position]
            if device.key in choice.untolerated or not self._add(choice, device):
                continue
            if self._exact(index, choice, need - 1, position + 1):
                return True
            self._remove(choice, device)
        return False

    def _all(self, index: int, choice: Choice, position: int) -> bool:
        if position == len(choice.candidates):
            return self._request(index + 1)
        device = choice.candidates[position]
        if len(self.picks) >= MAX_RESULTS or device.key in choice.untolerated or not self._add(choice, device):
            return False  # every device is needed: one that cannot be had ends this choice
        if self._all(index, choice, position + 1):
            return True
        self._remove(choice, device)
        return False

    def _add(self, choice: Choice, device: Candidate) -> bool:
        self.steps += 1
        if self.steps > self.max_steps:
            raise TooManyCombinations(self.max_steps)
        if device.key in self._claimed or (not choice.admin and device.key in self.held):
            return False
        share = None if choice.admin else choice.shares.get(device.key)
        if share is not None:
            already, left = self.taken.get(device.key, {}), self.capacity_left.get(device.key, {})
            if any(already.get(n, Fraction(0)) + a > left.get(n, Fraction(0)) for n, a in share.items()):
                return False
        drawn = {} if choice.admin else device.drawn  # admin access draws no counters
        for set_key, amounts in drawn.items():
            already, left = self.drawn.get(set_key, {}), self.left.get(set_key, {})
            if any(already.get(n, Fraction(0)) + a > left.get(n, Fraction(0)) for n, a in amounts.items()):
                return False
        values: list[tuple[str, Any] | None] = []
        for constraint, seen in zip(self.constraints, self._values, strict=True):
            if not constraint.applies(choice):
                values.append(None)
                continue
            value = device.attribute(constraint.attribute)
            if value is None:
                return False
            if constraint.kind == "matchAttribute" and seen and seen[0] != value:
                return False
            if constraint.kind == "distinctAttribute" and value in seen:
                return False
            values.append(value)
        for seen, value in zip(self._values, values, strict=True):
            if value is not None:
                seen.append(value)
        for set_key, amounts in drawn.items():
            counters = self.drawn.setdefault(set_key, {})
            for name, amount in amounts.items():
                counters[name] = counters.get(name, Fraction(0)) + amount
        if share is None:
            self._claimed.add(device.key)
        else:
            taken = self.taken.setdefault(device.key, {})
            for name, amount in share.items():
                taken[name] = taken.get(name, Fraction(0)) + amount
        self.picks.append(Pick(choice, device, share))
        return True

    def _remove(self, choice: Choice, device: Candidate) -> None:
        pick = self.picks.pop()
        if pick.consumed is None:
            self._claimed.discard(device.key)
        else:
            for name, amount in pick.consumed.items():
                self.taken[device.key][name] -= amount
        for constraint, seen in zip(self.constraints, self._values, strict=True):
            if constraint.applies(choice):
                seen.pop()
        for set_key, amounts in ({} if choice.admin else device.drawn).items():
            counters = self.drawn[set_key]
            for name, amount in amounts.items():
                counters[name] -= amount
