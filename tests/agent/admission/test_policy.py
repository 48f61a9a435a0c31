"""The admission policy for opaque parameters (deploy/base/40-admission-policy.yaml): generated from the models as they
are now, valid for a 1.37 API server, and, evaluated with cel-python, of the same verdict as the agent's own
validation at prepare (`validate_parameters`) on generated valid and invalid parameters, naming the same fields."""

from __future__ import annotations

import json
import re
from typing import Any

import kubernetes_validate
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.admission.__main__ import main as admission_main
from agent.admission.policy import MESSAGE, builtin_drivers, policy_objects, render
from agent.admission.reconfigurations import reconfiguration_objects
from agent.admission.schema_cel import SchemaError, checks_for
from agent.claims.opaque import InvalidParameters, validate_parameters
from tests.support.admission_cases import (
    CHOSEN,
    GPU,
    SRIOV,
    TPU,
    as_policy_names,
    claim,
    gpu,
    mutated,
    valid_parameters,
    vf,
)
from tests.support.admission_cel import Evaluation, evaluate
from tests.support.repository import ROOT

POLICY_FILE = ROOT / "deploy" / "base" / "40-admission-policy.yaml"
DRIVERS = builtin_drivers()
POLICY, BINDING = policy_objects(DRIVERS)



def fields_named(evaluation: Evaluation) -> list[str]:
    fields = []
    for message in evaluation.messages:
        match = MESSAGE.fullmatch(message)
        assert match, f"a message that names no field: {message!r}"
        fields.append(match["field"])
    return fields


def model_verdict(driver: str, params: Any) -> set[str]:
    """The fields the agent's validation names (empty: accepted), with the types the driver's backends accept; an
    entry of a map counts as the map."""
    try:
        validate_parameters(params, DRIVERS[driver])
    except InvalidParameters as e:
        return {as_policy_names(p.field) for p in e.problems}
    return set()


def assert_same_verdict(driver: str, params: dict[str, Any], template: bool = False) -> None:
    evaluation = evaluate(POLICY, claim(driver, params, template))
    assert not evaluation.errors, evaluation.errors
    policy_fields = set(fields_named(evaluation))
    model_fields = model_verdict(driver, params)
    assert evaluation.admitted == (not model_fields), (params, evaluation.messages, model_fields)
    # Every field the policy names, the agent names; the agent names every unknown field where the policy names
    # the first one of each object.
    assert policy_fields <= model_fields, (params, evaluation.messages, model_fields)
    unknown_at = {f.rpartition(".")[0] for m, f in zip(evaluation.messages, fields_named(evaluation), strict=True)
                  if "unknown field" in m}
    assert {f.rpartition(".")[0] for f in model_fields - policy_fields} <= unknown_at, (params, evaluation.messages,
                                                                                      model_fields)


# ---------------------------------------------------------------------------------------------------------------
# The file


def test_the_file_is_what_the_models_give_now() -> None:
    drivers = builtin_drivers()
    assert POLICY_FILE.read_text() == render([*policy_objects(drivers), *reconfiguration_objects(drivers)]), \
        "deploy/base/40-admission-policy.yaml is stale: run scripts/generate-admission-policy"


def test_the_file_reads_back_as_the_objects() -> None:
    assert list(yaml.safe_load_all(POLICY_FILE.read_text()))[:2] == [POLICY, BINDING]


@pytest.mark.parametrize("obj", [POLICY, BINDING], ids=["policy", "binding"])
def test_objects_validate_against_the_1_37_schema(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, "1.37", strict=True)


def test_the_binding_denies_with_the_policy() -> None:
    assert BINDING["spec"] == {"policyName": POLICY["metadata"]["name"], "validationActions": ["Deny"]}
    rules = POLICY["spec"]["matchConstraints"]["resourceRules"]
    assert [(r["resources"], r["operations"]) for r in rules] == [(["resourceclaims", "resourceclaimtemplates"],
                                                                   ["CREATE"])]


def test_messages_are_single_lines_naming_a_field() -> None:
    """The API server refuses a message with a line break; the tests below read the field from each message."""
    for validation in POLICY["spec"]["validations"]:
        for text in (validation["message"], validation.get("messageExpression", "")):
            assert "\n" not in text and "\r" not in text
        assert MESSAGE.fullmatch(validation["message"]), validation["message"]


def test_every_driver_of_the_agent_is_covered() -> None:
    assert set(DRIVERS) == {GPU, SRIOV, TPU}
    assert {m.KIND for m in DRIVERS[GPU]} == {"GpuConfig", "VfioConfig"}
    assert {m.KIND for m in DRIVERS[SRIOV]} == {"VfConfig", "VfioConfig"}
    assert DRIVERS[TPU] == ()


def test_a_schema_keyword_the_policy_cannot_express_fails_the_generator() -> None:
    with pytest.raises(SchemaError, match="uniqueItems"):
        checks_for({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}})
    with pytest.raises(SchemaError, match="pattern"):
        checks_for({"type": "object", "properties": {"a": {"type": "string", "pattern": "a+"}}})


# ---------------------------------------------------------------------------------------------------------------
# Chosen cases


@pytest.mark.parametrize(("driver", "params", "field"), CHOSEN)
@pytest.mark.parametrize("template", [False, True], ids=["claim", "template"])
def test_chosen_parameters(driver: str, params: dict[str, Any], field: str | None, template: bool) -> None:
    evaluation = evaluate(POLICY, claim(driver, params, template))
    assert fields_named(evaluation)[:1] == ([field] if field else [])
    assert_same_verdict(driver, params, template)


def test_the_policy_names_the_field_the_agent_names_in_its_message() -> None:
    params = gpu(sharing={"strategy": "TimeSlicing", "interval": "Long"})
    (message,) = evaluate(POLICY, claim(GPU, params)).messages
    assert message.startswith("opaque parameters GpuConfig: sharing.interval: unknown field")
    with pytest.raises(InvalidParameters, match=r"GpuConfig\.sharing\.interval: Extra inputs are not permitted"):
        validate_parameters(params, DRIVERS[GPU])


def test_the_policy_and_the_agent_agree_on_every_character_of_one_or_two_bytes() -> None:
    """Up to U+07FF: the kernel refuses NUL, `/`, `:`, and the bytes its isspace() takes (0x09 to 0x0d, 0x20, and
    0xa0, the second byte of U+00A0, U+00E0 `à`, U+0420 (Cyrillic Er) and 27 more); `%` alone is no `%d`. Every
    character against the policy's pattern, and the refused ones and every 16th other through the whole policy
    (cel-python takes a while over it)."""
    cel_string = r'netDevice\.name\.matches\(("(?:[^"\\]|\\.)*")\)'
    (pattern,) = {m for v in POLICY["spec"]["validations"] for m in re.findall(cel_string, v["expression"])}
    name_rule = re.compile(json.loads(pattern))
    refused = []
    for code in range(0x800):
        name = f"n{chr(code)}1"
        verdict = model_verdict(SRIOV, vf(netDevice={"name": name}))
        assert (name_rule.fullmatch(name) is None) == bool(verdict), hex(code)
        if verdict:
            refused.append(code)
        if verdict or code % 16 == 0:
            assert_same_verdict(SRIOV, vf(netDevice={"name": name}))
    assert refused[:10] == [0, 9, 10, 11, 12, 13, 32, ord("%"), ord("/"), ord(":")]
    assert refused[10:] == list(range(0xa0, 0x800, 0x40)), "the characters whose second byte is 0xa0"


@pytest.mark.parametrize("char", ["\u2003", "\u3000", "\u2028", "\ufeff", "\U0001f600", "\u0800", "†", "\u4e20",
                                  "\U0001f4a0"])
def test_the_policy_never_refuses_a_wider_character_the_agent_takes(char: str) -> None:
    """A character of three or four bytes with a byte 0xa0 (`†`, e2 80 a0) takes more than a regular expression over
    characters can say: the policy admits it, and the agent refuses the claim at prepare."""
    params = vf(netDevice={"name": f"n{char}1"})
    assert evaluate(POLICY, claim(SRIOV, params)).admitted
    assert model_verdict(SRIOV, params) == (set() if 0xa0 not in char.encode() else {"netDevice.name"})


def test_claims_without_config_or_of_other_drivers_are_admitted() -> None:
    bare = claim(GPU, gpu())
    del bare["spec"]["devices"]["config"]
    assert evaluate(POLICY, bare).admitted
    assert evaluate(POLICY, {"kind": "ResourceClaim", "spec": {}}).admitted
    assert evaluate(POLICY, claim("other.example.com", {"kind": "Bogus"})).admitted


def test_the_examples_and_device_classes_of_deploy_are_admitted() -> None:
    found = 0
    for path in sorted((ROOT / "deploy").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "ResourceClaimTemplate":
                evaluation = evaluate(POLICY, doc)
                assert evaluation.admitted, (path.name, evaluation.messages)
                found += 1
    assert found


def test_one_bad_entry_among_good_ones_is_refused() -> None:
    obj = claim(GPU, gpu())
    obj["spec"]["devices"]["config"].append({"opaque": {"driver": GPU, "parameters": gpu(sharing={})}})
    assert fields_named(evaluate(POLICY, obj)) == ["sharing.strategy"]


# ---------------------------------------------------------------------------------------------------------------
# Generated parameters: valid ones, and ones mutated by unknown fields, wrong types, values out of range and
# unknown types


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_parameters())
def test_generated_valid_parameters_are_admitted(case: tuple[str, dict[str, Any]]) -> None:
    driver, params = case
    assert_same_verdict(driver, params)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated(), st.booleans())
def test_generated_parameters_get_the_agents_verdict(case: tuple[str, dict[str, Any]], template: bool) -> None:
    driver, params = case
    assert_same_verdict(driver, params, template)


def test_the_generated_cases_are_both_valid_and_invalid() -> None:
    """The generator of the test above is not one-sided: of a fixed sample, many are valid and many invalid."""
    verdicts: list[bool] = []

    @settings(max_examples=200, deadline=None, database=None, derandomize=True)
    @given(mutated())
    def sample(case: tuple[str, dict[str, Any]]) -> None:
        verdicts.append(not model_verdict(*case))

    sample()
    assert verdicts.count(True) >= 25 and verdicts.count(False) >= 50, (verdicts.count(True), verdicts.count(False))



def test_renamed_drivers_get_a_policy_of_their_own(capsys: pytest.CaptureFixture[str]) -> None:
    assert admission_main(["gpu.nvidia.com=gpu.example.com"]) == 0
    policy = next(yaml.safe_load_all(capsys.readouterr().out))
    bad = gpu(sharing={"strategy": "RoundRobin"})
    assert fields_named(evaluate(policy, claim("gpu.example.com", bad))) == ["sharing.strategy"]
    assert evaluate(policy, claim(GPU, bad)).admitted
    with pytest.raises(SystemExit):
        admission_main(["nvidia=gpu.example.com"])
