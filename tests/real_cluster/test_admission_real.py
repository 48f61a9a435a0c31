"""The admission policy of deploy/ evaluated by the real API server: every chosen set of opaque parameters gets the
server's verdict that the agent gives at prepare, a refusal names the field the agent names, and the server says
exactly what the project's own CEL evaluation of the policy says (which the fast tier relies on). The policy that
admits reconfigurations by namespace (test_reconfigurations_real.py) is told to allow every one everywhere here, so
that only the shape of the parameters decides."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.admission.policy import MESSAGE, builtin_drivers, policy_objects
from agent.claims.opaque import InvalidParameters, validate_parameters
from cluster.kubectl import KubectlError
from tests.real_cluster.cluster_env import RealCluster, every_reconfiguration_allowed
from tests.support.admission_cases import CHOSEN, as_policy_names, claim, mutated
from tests.support.admission_cel import evaluate

pytestmark = pytest.mark.xdist_group("real-cluster")

DRIVERS = builtin_drivers()
POLICY, _ = policy_objects(DRIVERS)


@pytest.fixture(scope="module", autouse=True)
def _every_reconfiguration_allowed(real_cluster: RealCluster) -> Iterator[None]:
    with every_reconfiguration_allowed(real_cluster.kubectl):
        yield


def agent_fields(driver: str, params: Any) -> set[str]:
    """The fields the agent names when it refuses these parameters at prepare (empty: it accepts them), an entry of
    a map counting as the map."""
    try:
        validate_parameters(params, DRIVERS[driver])
    except InvalidParameters as e:
        return {as_policy_names(p.field) for p in e.problems}
    return set()


def server_verdict(cluster: RealCluster, obj: dict[str, Any]) -> str | None:
    """The policy's message when the server refuses the object (dry run), None when it admits it."""
    try:
        cluster.kubectl.run("create", "--dry-run=server", "-f", "-", input=json.dumps(obj))
    except KubectlError as e:
        assert "denied request: " in e.stderr, e.stderr
        return e.stderr.split("denied request: ", 1)[1].strip()
    return None


@pytest.mark.parametrize(("driver", "params", "field"), CHOSEN)
@pytest.mark.parametrize("template", [False, True], ids=["claim", "template"])
def test_the_server_gives_the_agents_verdict(real_cluster: RealCluster, driver: str, params: Any,
                                            field: str | None, template: bool) -> None:
    obj = claim(driver, params, template)
    refused = server_verdict(real_cluster, obj)
    expected = agent_fields(driver, params)
    assert (refused is not None) == bool(expected), (refused, expected)
    # What the server says is what the project's evaluation of the policy says, word for word.
    assert ([refused] if refused else []) == evaluate(POLICY, obj).messages[:1]
    if refused is not None:
        match = MESSAGE.fullmatch(refused)
        assert match, refused
        assert match["field"] == field
        assert field in expected


@settings(max_examples=120, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(case=mutated(), template=st.booleans())
def test_generated_parameters_get_the_agents_verdict_from_the_server(real_cluster: RealCluster,
                                                                     case: tuple[str, Any], template: bool) -> None:
    driver, params = case
    obj = claim(driver, params, template)
    refused = server_verdict(real_cluster, obj)
    assert (refused is not None) == bool(agent_fields(driver, params)), (params, refused)
    assert ([refused] if refused else []) == evaluate(POLICY, obj).messages[:1], params
