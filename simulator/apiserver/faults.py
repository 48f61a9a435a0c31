"""Fault rules of the test API server (fail or delay chosen requests) and its request log.

Rules are checked in the order they were added and each counts the requests it took, so a given sequence of
requests always meets the same faults.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

PathPattern = str | re.Pattern[str]
QueryTest = Callable[[Mapping[str, str]], bool]
Methods = str | Collection[str] | None

WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def _method_matches(methods: Methods, method: str) -> bool:
    if methods is None or methods == "*":
        return True
    if isinstance(methods, str):
        return methods.upper() == method
    return method in {m.upper() for m in methods}


def path_matches(pattern: PathPattern, path: str) -> bool:
    """A compiled regex must match the whole path; a string is a glob in which ``*`` also crosses ``/``."""
    if isinstance(pattern, re.Pattern):
        return pattern.fullmatch(path) is not None
    return fnmatch.fnmatchcase(path, pattern)


@dataclass
class Fault:
    """Fail matching requests with ``status`` (a real ``Status`` body), or hold them ``delay`` seconds first.

    ``times`` is how many matching requests the rule takes (None: all, until cleared); ``hits`` counts them.
    """

    method: Methods
    path: PathPattern
    status: int | None = None
    delay: float = 0.0
    times: int | None = 1
    query: QueryTest | None = None
    retry_after: int | None = None
    message: str | None = None
    hits: int = 0

    @property
    def exhausted(self) -> bool:
        return self.times is not None and self.hits >= self.times

    def matches(self, method: str, path: str, query: Mapping[str, str]) -> bool:
        return (
            not self.exhausted
            and _method_matches(self.method, method)
            and path_matches(self.path, path)
            and (self.query is None or self.query(query))
        )


class FaultRules:
    """The rules in force, in the order they were added."""

    def __init__(self) -> None:
        self.rules: list[Fault] = []

    def add(self, fault: Fault) -> Fault:
        self.rules.append(fault)
        return fault

    def clear(self) -> None:
        self.rules.clear()

    def take(self, method: str, path: str, query: Mapping[str, str]) -> tuple[float, Fault | None]:
        """Apply the rules to one request: the total delay, and the failing rule if one matched.

        Delays of every matching rule add up; the first matching failure ends the walk.
        """
        delay = 0.0
        for fault in self.rules:
            if fault.matches(method, path, query):
                fault.hits += 1
                delay += fault.delay
                if fault.status is not None:
                    return delay, fault
        return delay, None


@dataclass
class RequestRecord:
    """One request as the server saw it. ``path`` is decoded (what rules and routes match); ``raw_path`` is the
    path as it came on the wire, percent-escapes kept, so a test can tell ``a%2Fb`` from ``a/b``. ``time`` is
    ``time.monotonic()`` on arrival; ``status`` is 0 until the answer starts (a watch gets 200 when its stream
    opens), ``duration`` None until it ends."""

    method: str
    path: str
    query: dict[str, str]
    time: float
    status: int = 0
    duration: float | None = None
    tags: set[str] = field(default_factory=set)  # e.g. "watch", "fault"
    raw_path: str = ""

    @property
    def is_write(self) -> bool:
        return self.method in WRITE_METHODS

    @property
    def is_watch(self) -> bool:
        return "watch" in self.tags


def select_records(
    records: list[RequestRecord],
    method: Methods = None,
    path: PathPattern = "*",
    *,
    since: float | None = None,
    until: float | None = None,
    status: int | None = None,
) -> list[RequestRecord]:
    """Records matching a method (or several), a path pattern, an arrival window [since, until) and a status."""
    return [
        r
        for r in records
        if _method_matches(method, r.method)
        and path_matches(path, r.path)
        and (since is None or r.time >= since)
        and (until is None or r.time < until)
        and (status is None or r.status == status)
    ]
