"""`BackendSuite`: every conformance check as a pytest test, for a backend author's own test module.

    from simulator.conformance import BackendSuite

    class TestAcmeFpga(BackendSuite):
        backend = "acme-fpga-card"            # the entry-point name (or the backend class itself)
        profile = "acme-node.yaml"            # a built-in profile, or a YAML path (relative: next to this file)
        config = {"ids": ["acce:0f01"]}       # the backend's settings

Or leave the class empty and define a `conformance_target` fixture returning a `Target` (parametrise it to check
several backends or configurations).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import pytest

from simulator.conformance.runner import Conformance
from simulator.conformance.target import BadClaimConfig

__all__ = ["BackendSuite"]


def _verdict(conformance: Conformance, check: str, what: str) -> None:
    problems = conformance.run(check)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        pytest.fail(f"backend {conformance.target.id} on {conformance.target.profile}: {what}:\n{lines}",
                    pytrace=False)


class BackendSuite:
    """The conformance checks; subclass it as `Test<Something>` and say what to check (see the module doc)."""

    backend: ClassVar[str | Callable[[], object]]
    profile: ClassVar[str | os.PathLike[str]]
    config: ClassVar[Mapping[str, Any]] = {}
    claim_config: ClassVar[Mapping[str, Any] | None] = None
    bad_claim_configs: ClassVar[Sequence[BadClaimConfig]] = ()
    devices_per_claim: ClassVar[int] = 1
    prepare_devices: ClassVar[Sequence[str]] = ()

    def test_contract(self, conformance: Conformance) -> None:
        _verdict(conformance, "contract", "the backend does not load or is not configured as the agent needs")

    def test_discover_passes_server_rules(self, conformance: Conformance) -> None:
        _verdict(conformance, "discovery", "discover() returns devices the API server would reject")

    def test_device_names_stable(self, conformance: Conformance) -> None:
        _verdict(conformance, "stable_names", "what discover() publishes is not stable")

    def test_prepare_idempotent(self, conformance: Conformance) -> None:
        _verdict(conformance, "idempotent_prepare", "prepare() is not idempotent")

    def test_unprepare_restores_node(self, conformance: Conformance) -> None:
        _verdict(conformance, "unprepare_restores", "unprepare() does not restore the node")

    def test_restore_records_suffice_after_restart(self, conformance: Conformance) -> None:
        _verdict(conformance, "restart_restore", "a restarted backend cannot undo a preparation")

    def test_rollback_after_interrupted_prepare(self, conformance: Conformance) -> None:
        _verdict(conformance, "interrupted_prepare", "a prepare cut short by a crash is not undone")

    def test_health_events_well_formed(self, conformance: Conformance) -> None:
        _verdict(conformance, "health", "health() misbehaves")

    def test_event_loop_never_blocked(self, conformance: Conformance) -> None:
        _verdict(conformance, "event_loop", "the backend blocks the agent's event loop")

    def test_served_by_agent(self, conformance: Conformance) -> None:
        _verdict(conformance, "served_by_agent", "the agent cannot serve the backend's devices")

    def test_claim_config_errors_per_claim(self, conformance: Conformance) -> None:
        _verdict(conformance, "claim_config_errors", "bad claim configuration is not reported per claim")
