"""Dynamic MIG as partitionable devices: a MIG-enabled GPU's GPU-instance profiles and placements turned into one
counter set per GPU and the devices that draw from it (pure computation).

Every possible MIG device (profile and placement) is published; what exists is decided at prepare. The counters
make the scheduler respect what NVML would: a placement takes the memory slices `[start, start + size)`
(counters `memory-slice-<i>`, 1 each), so overlapping placements exclude each other; the sum counters
(multiprocessors, engines, memory) carry the amounts, with totals that admit every combination NVML allows and
nothing more (one `+me` instance, for example, because the GPU has one OFA engine). The whole GPU draws
everything, so it excludes every MIG device and any one of them excludes it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from backends.contract import CounterConsumption, CounterSet

__all__ = ["GiProfile", "Placement", "counter_totals", "layout", "mig_label", "valid_combinations"]

MEMORY_SLICE = "memory-slice-{}"
_SUMS = ("multiprocessors", "copy-engines", "decoders", "encoders", "jpeg-engines", "ofa-engines", "memory")


@dataclass(frozen=True)
class GiProfile:
    """A GPU-instance profile as NVML describes it, with the placement starts it allows."""

    id: int
    name: str  # e.g. "1g.10gb", "1g.10gb+me"
    slices: int  # compute slices
    size: int  # memory slices a placement takes
    instances: int  # how many can exist at once
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int
    memory_bytes: int
    starts: tuple[int, ...]

    def amounts(self) -> dict[str, int]:
        return {"multiprocessors": self.multiprocessors, "copy-engines": self.copy_engines,
                "decoders": self.decoders, "encoders": self.encoders, "jpeg-engines": self.jpeg_engines,
                "ofa-engines": self.ofa_engines, "memory": self.memory_bytes}


@dataclass(frozen=True)
class Placement:
    """One possible MIG device: a profile at a start."""

    profile: GiProfile
    start: int

    @property
    def memory_slices(self) -> range:
        return range(self.start, self.start + self.profile.size)

    def consumption(self, counter_set: str) -> CounterConsumption:
        counters = self.profile.amounts() | {MEMORY_SLICE.format(i): 1 for i in self.memory_slices}
        return CounterConsumption(counter_set, {k: v for k, v in counters.items() if v})


def mig_label(profile: str) -> str:
    """A profile name as it appears in device names: lower case, letters and digits only ("1g10gbme")."""
    return re.sub(r"[^a-z0-9]", "", profile.lower())


def placements(profiles: Sequence[GiProfile]) -> list[Placement]:
    return [Placement(p, start) for p in profiles for start in p.starts]


def valid_combinations(profiles: Sequence[GiProfile]) -> Iterator[tuple[Placement, ...]]:
    """Every set of placements that can exist together, by NVML's rules: no two share a memory slice, no profile
    has more instances than it allows. Small: a GPU has at most a few dozen placements on 8 slices."""
    candidates = placements(profiles)

    def extend(start: int, chosen: tuple[Placement, ...], used: int,
               counts: Mapping[int, int]) -> Iterator[tuple[Placement, ...]]:
        yield chosen
        for i in range(start, len(candidates)):
            candidate = candidates[i]
            mask = sum(1 << s for s in candidate.memory_slices)
            count = counts.get(candidate.profile.id, 0)
            if mask & used or count >= candidate.profile.instances:
                continue
            yield from extend(i + 1, (*chosen, candidate), used | mask, {**counts, candidate.profile.id: count + 1})

    yield from extend(0, (), 0, {})


def counter_totals(profiles: Sequence[GiProfile], memory_slices: int) -> dict[str, int]:
    """The counter set's capacity: for each sum counter the most any valid combination uses, so every valid
    combination fits; 1 per memory slice."""
    totals = dict.fromkeys(_SUMS, 0)
    for combination in valid_combinations(profiles):
        for key in _SUMS:
            totals[key] = max(totals[key], sum(p.profile.amounts()[key] for p in combination))
    totals = {k: v for k, v in totals.items() if v}
    return totals | {MEMORY_SLICE.format(i): 1 for i in range(memory_slices)}


@dataclass(frozen=True)
class Layout:
    """One GPU's counter set, what the whole GPU draws, and its possible MIG devices."""

    counter_set: CounterSet
    whole: CounterConsumption
    placements: tuple[Placement, ...]


def layout(gpu_name: str, profiles: Sequence[GiProfile]) -> Layout:
    """The counter set of the GPU named `gpu_name` and its placements (profiles without a placement are left
    out: the GPU cannot create them)."""
    usable = [p for p in profiles if p.starts]
    memory_slices = max((s + p.size for p in usable for s in p.starts), default=0)
    totals = counter_totals(usable, memory_slices)
    counter_set = CounterSet(f"{gpu_name}-counters", totals)
    return Layout(counter_set, CounterConsumption(counter_set.name, dict(totals)), tuple(placements(usable)))
