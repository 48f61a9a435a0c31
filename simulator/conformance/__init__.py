"""The backend conformance kit: checks that a backend plugin behaves as the agent needs, on a simulated node,
against the test API server and the kubelet simulator. See docs/plugin-guide.md.

    from simulator.conformance import BackendSuite

    class TestMyBackend(BackendSuite):
        backend = "my-backend"
        profile = "my-node.yaml"

For a plugin's own tests it also offers the simulated node (`simulated_node`, `SimulatedNode`), udev events
injected into it (`UdevInjector`), the context a backend starts with there (`backend_context`), and
`scaled(seconds)`: a wait stretched by DRA_AGENT_TEST_TIME_FACTOR, as the kit's own waits are.

The names are imported on first use, so the pytest plugin (`simulator.conformance.plugin`) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from simulator.conformance.bench import backend_context
    from simulator.conformance.runner import CHECKS, Conformance
    from simulator.conformance.suite import BackendSuite
    from simulator.conformance.target import BadClaimConfig, LoadError, Target
    from simulator.node.node import SimulatedNode, simulated_node
    from simulator.timing import scaled
    from simulator.udev.hotplug import UdevInjector

__all__ = [
    "CHECKS",
    "BackendSuite",
    "BadClaimConfig",
    "Conformance",
    "LoadError",
    "SimulatedNode",
    "Target",
    "UdevInjector",
    "backend_context",
    "scaled",
    "simulated_node",
]

_HOMES = {
    "CHECKS": "simulator.conformance.runner", "Conformance": "simulator.conformance.runner",
    "BackendSuite": "simulator.conformance.suite", "BadClaimConfig": "simulator.conformance.target",
    "LoadError": "simulator.conformance.target", "Target": "simulator.conformance.target",
    "backend_context": "simulator.conformance.bench", "SimulatedNode": "simulator.node.node",
    "simulated_node": "simulator.node.node", "UdevInjector": "simulator.udev.hotplug",
    "scaled": "simulator.timing",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
