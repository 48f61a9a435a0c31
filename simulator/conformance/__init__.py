"""The backend conformance kit: checks that a backend plugin behaves as the agent needs, on a simulated node,
against the test API server and the kubelet simulator. See docs/plugin-guide.md.

    from simulator.conformance import BackendSuite

    class TestMyBackend(BackendSuite):
        backend = "my-backend"
        profile = "my-node.yaml"

The names are imported on first use, so the pytest plugin (`simulator.conformance.plugin`) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from simulator.conformance.runner import CHECKS, Conformance
    from simulator.conformance.suite import BackendSuite
    from simulator.conformance.target import BadClaimConfig, LoadError, Target

__all__ = ["CHECKS", "BackendSuite", "BadClaimConfig", "Conformance", "LoadError", "Target"]

_HOMES = {
    "CHECKS": "runner", "Conformance": "runner", "BackendSuite": "suite", "BadClaimConfig": "target",
    "LoadError": "target", "Target": "target",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
