"""One test helper for "would the API server and the scheduler accept these slices?".

Checks every object against the real Kubernetes 1.37 JSON schema in strict mode (kubernetes-validate), the
API server's ResourceSlice rules, and the scheduler's per-pool rules (complete pool, unique names, counters).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import kubernetes_validate

from agent.slices.rules import validate_pool, validate_resource_slice

KUBERNETES_VERSION = "1.37"


def slice_problems(slices: Sequence[Mapping[str, Any]]) -> list[str]:
    """Everything wrong with a set of slices (empty when the cluster would accept them as they are)."""
    problems: list[str] = []
    for i, obj in enumerate(slices):
        try:
            kubernetes_validate.validate(dict(obj), KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"slice {i}: schema: {e.message}")
        problems.extend(f"slice {i}: {p}" for p in validate_resource_slice(obj))
    pools: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for obj in slices:
        pools.setdefault((obj["spec"]["driver"], obj["spec"]["pool"]["name"]), []).append(obj)
    for (driver, pool), members in pools.items():
        problems.extend(f"pool {driver}/{pool}: {p}" for p in validate_pool(members))
    return problems


def assert_valid_slices(slices: Sequence[Mapping[str, Any]]) -> None:
    problems = slice_problems(slices)
    assert not problems, "\n".join(problems)
