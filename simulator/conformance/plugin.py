"""The kit's pytest plugin, registered through the `pytest11` entry point: installing dra-agent makes the
`conformance_target` and `conformance` fixtures available to every test suite. It imports nothing heavy until a
test uses them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from simulator.conformance.runner import Conformance
    from simulator.conformance.target import Target


@pytest.fixture
def conformance_target(request: pytest.FixtureRequest) -> Target:
    """What to check, from the attributes of the `BackendSuite` subclass running the test. Override this fixture
    (e.g. parametrised) to check something else."""
    from simulator.conformance.target import Target

    suite: Any = request.cls
    if suite is None or not hasattr(suite, "backend") or not hasattr(suite, "profile"):
        pytest.fail("set `backend` (entry-point name or class) and `profile` (profile name or YAML path) on your "
                    "BackendSuite subclass, or define a `conformance_target` fixture returning a Target",
                    pytrace=False)
    profile = suite.profile
    if isinstance(profile, Path) or str(profile).endswith((".yaml", ".yml")):
        path = Path(profile)
        profile = path if path.is_absolute() else Path(request.path).parent / path
    return Target(backend=suite.backend, profile=profile, config=dict(suite.config),
                  claim_config=suite.claim_config, bad_claim_configs=tuple(suite.bad_claim_configs),
                  devices_per_claim=suite.devices_per_claim, prepare_devices=tuple(suite.prepare_devices))


@pytest.fixture
def conformance(conformance_target: Target) -> Conformance:
    """The checks of the target (see simulator.conformance)."""
    from simulator.conformance.runner import Conformance

    return Conformance(conformance_target)
