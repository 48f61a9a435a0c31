"""The admission policy that admits a claim asking for a reconfiguration only in the namespaces its ConfigMap lists
(deploy/base/40-admission-policy.yaml and 45-reconfiguration-namespaces.yaml), evaluated with cel-python: the
chosen cases, and generated parameters with generated ConfigMaps, where the policy refuses exactly what the agent
reads as asked for (`OpaqueConfig.reconfigurations`) and the ConfigMap does not allow in the claim's namespace."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from agent.admission.__main__ import main as admission_main
from agent.admission.policy import builtin_drivers
from agent.admission.reconfigurations import PARAMS_NAME, PARAMS_NAMESPACE, reconfiguration_objects
from agent.claims.opaque import InvalidParameters, validate_parameters
from tests.support.admission_cases import (
    GPU,
    RECONFIGURATION_CASES,
    VFIO,
    allowed_in,
    claim,
    config_map_data,
    valid_parameters,
)
from tests.support.admission_cel import evaluate
from tests.support.repository import ROOT

DRIVERS = builtin_drivers()
POLICY, BINDING = reconfiguration_objects(DRIVERS)
NAMESPACE = "vms"


def config_map(data: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": PARAMS_NAME, "namespace": PARAMS_NAMESPACE},
            **({"data": data} if data else {})}


def asked(driver: str, params: Any) -> set[str] | None:
    """What the agent reads the parameters as asking for; None for parameters it refuses outright (the other policy
    refuses those)."""
    try:
        return {r.name for r in validate_parameters(params, DRIVERS.get(driver, ())).reconfigurations()}
    except InvalidParameters:
        return None


def refused(driver: str, params: Any, data: dict[str, str], template: bool = False) -> list[str]:
    evaluation = evaluate(POLICY, claim(driver, params, template, NAMESPACE), config_map(data))
    assert not evaluation.errors, evaluation.errors
    return evaluation.messages


def test_the_binding_reads_a_fixed_config_map_and_refuses_without_it() -> None:
    assert BINDING["spec"]["paramRef"] == {"name": "dra-agent-reconfigurations", "namespace": "dra-agent",
                                           "parameterNotFoundAction": "Deny"}
    assert POLICY["spec"]["paramKind"] == {"apiVersion": "v1", "kind": "ConfigMap"}
    assert BINDING["spec"]["validationActions"] == ["Deny"]


def test_the_base_ships_the_config_map_the_binding_names_empty() -> None:
    (shipped,) = yaml.safe_load_all((ROOT / "deploy/base/45-reconfiguration-namespaces.yaml").read_text())
    assert shipped["metadata"]["name"] == PARAMS_NAME and shipped["metadata"]["namespace"] == PARAMS_NAMESPACE
    assert shipped["data"] == {}, "nothing is allowed until an operator says so"
    file = list(yaml.safe_load_all((ROOT / "deploy/base/40-admission-policy.yaml").read_text()))
    assert file[2:] == [POLICY, BINDING]


@pytest.mark.parametrize("obj", [POLICY, BINDING], ids=["policy", "binding"])
def test_objects_validate_against_the_1_37_schema(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, "1.37", strict=True)


@pytest.mark.parametrize(("driver", "params", "data", "name"), RECONFIGURATION_CASES)
@pytest.mark.parametrize("template", [False, True], ids=["claim", "template"])
def test_chosen_cases(driver: str, params: Any, data: dict[str, str], name: str | None, template: bool) -> None:
    messages = refused(driver, params, data, template)
    if name is None:
        assert messages == []
        return
    (message,) = messages
    assert message.startswith(f"opaque parameters {params['kind']}: asks for {name} (")
    assert message.endswith(f"which is not allowed in namespace {NAMESPACE}: the ConfigMap "
                            f"dra-agent/dra-agent-reconfigurations lists under {name} the namespaces allowed it")


def test_every_reconfiguration_is_checked_once() -> None:
    names = [v["messageExpression"].split(" asks for ", 1)[1].split(" ", 1)[0] for v in POLICY["spec"]["validations"]]
    assert sorted(names) == ["GpuConfig.sharing.ExclusiveProcess", "GpuConfig.sharing.MPS",
                             "GpuConfig.sharing.TimeSlicing", "VfConfig.netDevice", "VfioConfig"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_parameters(), config_map_data, st.booleans())
def test_the_policy_refuses_what_the_agent_reads_as_asked_and_the_config_map_does_not_allow(
        case: tuple[str, dict[str, Any]], data: dict[str, str], template: bool) -> None:
    driver, params = case
    wanted = asked(driver, params)
    assume(wanted is not None)
    assert wanted is not None
    expected = wanted - allowed_in(data, NAMESPACE)
    messages = refused(driver, params, data, template)
    assert {m.split(" asks for ", 1)[1].split(" ", 1)[0] for m in messages} == expected, (params, data, messages)


def test_renamed_drivers_get_a_policy_of_their_own(capsys: pytest.CaptureFixture[str]) -> None:
    assert admission_main(["gpu.nvidia.com=gpu.example.com"]) == 0
    renamed = list(yaml.safe_load_all(capsys.readouterr().out))[2]
    assert renamed["metadata"]["name"] == "dra-agent-reconfigurations"
    assert evaluate(renamed, claim("gpu.example.com", VFIO, namespace=NAMESPACE), config_map({})).messages
    assert evaluate(renamed, claim(GPU, VFIO, namespace=NAMESPACE), config_map({})).admitted
