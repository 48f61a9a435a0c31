"""The admission policy for opaque parameters (deploy/base/40-admission-policy.yaml): generated from the models as they
are now, valid for a 1.37 API server, and, evaluated with cel-python, of the same verdict as the agent's own
validation at prepare (`validate_parameters`) on generated valid and invalid parameters, naming the same fields."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.admission.__main__ import main as admission_main
from agent.admission.policy import MESSAGE, builtin_drivers, policy_objects, render
from agent.admission.schema_cel import SchemaError, checks_for
from agent.claims.opaque import InvalidParameters, validate_parameters
from backends.config import CONFIG_API_VERSION
from tests.admission_cel import Evaluation, evaluate

ROOT = Path(__file__).resolve().parent.parent
POLICY_FILE = ROOT / "deploy" / "base" / "40-admission-policy.yaml"
DRIVERS = builtin_drivers()
POLICY, BINDING = policy_objects(DRIVERS)

GPU, SRIOV, TPU = "gpu.nvidia.com", "sriov.dra-agent.io", "tpu.google.com"


def claim(driver: str, parameters: Any, template: bool = False) -> dict[str, Any]:
    """A ResourceClaim (or a ResourceClaimTemplate) with one opaque configuration entry, and another driver's."""
    devices = {"requests": [{"name": "r", "exactly": {"deviceClassName": "c"}}], "config": [
        {"opaque": {"driver": "other.example.com", "parameters": {"anything": [1, "goes"]}}},
        {"requests": ["r"], "opaque": {"driver": driver, "parameters": parameters}},
    ]}
    if template:
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": "t", "namespace": "default"}, "spec": {"spec": {"devices": devices}}}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "c", "namespace": "default"}, "spec": {"devices": devices}}


def fields_named(evaluation: Evaluation) -> list[str]:
    fields = []
    for message in evaluation.messages:
        match = MESSAGE.fullmatch(message)
        assert match, f"a message that names no field: {message!r}"
        fields.append(match["field"])
    return fields


def model_verdict(driver: str, params: Any) -> set[str]:
    """The fields the agent's validation names (empty: accepted), with the types the driver's backends accept."""
    try:
        validate_parameters(params, DRIVERS[driver])
    except InvalidParameters as e:
        return {p.field for p in e.problems}
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
    assert POLICY_FILE.read_text() == render(policy_objects(builtin_drivers())), \
        "deploy/base/40-admission-policy.yaml is stale: run scripts/generate-admission-policy"


def test_the_file_reads_back_as_the_objects() -> None:
    assert list(yaml.safe_load_all(POLICY_FILE.read_text())) == [POLICY, BINDING]


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


def gpu(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": CONFIG_API_VERSION, "kind": "GpuConfig", **fields}


def vf(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": CONFIG_API_VERSION, "kind": "VfConfig", **fields}


VFIO = {"apiVersion": CONFIG_API_VERSION, "kind": "VfioConfig"}


@pytest.mark.parametrize(("driver", "params", "field"), [
    (GPU, gpu(), None),
    (GPU, gpu(driverCapabilities=["compute", "video"], sharing={"strategy": "TimeSlicing"}), None),
    (GPU, gpu(sharing=None), None),
    (GPU, VFIO, None),
    (SRIOV, vf(netDevice={"name": "net%d"}), None),
    (SRIOV, VFIO, None),
    (GPU, gpu(sharing={"strategy": "MPS"}), "sharing.strategy"),
    (GPU, gpu(sharing={"strategy": "RoundRobin"}), "sharing.strategy"),
    (GPU, gpu(sharing={}), "sharing.strategy"),
    (GPU, gpu(sharing="TimeSlicing"), "sharing"),
    (GPU, gpu(sharing={"strategy": "TimeSlicing", "interval": "Long"}), "sharing.interval"),
    (GPU, gpu(driverCapabilities=["compute", "teleport"]), "driverCapabilities"),
    (GPU, gpu(driverCapabilities=[]), "driverCapabilities"),
    (GPU, gpu(devices=["/dev/sda"]), "devices"),
    (GPU, vf(), "kind"),
    (GPU, {"apiVersion": "dra-agent.io/v1", "kind": "GpuConfig"}, "kind"),
    (GPU, {"kind": "GpuConfig"}, "kind"),
    (GPU, {"apiVersion": 1, "kind": ["GpuConfig"]}, "kind"),
    (SRIOV, vf(netDevice={"name": "eth0:1"}), "netDevice.name"),
    (SRIOV, vf(netDevice={"name": "a-very-long-name0"}), "netDevice.name"),
    (SRIOV, vf(netDevice={"name": "ü" * 8}), "netDevice.name"),
    (SRIOV, vf(netDevice={"name": ".."}), "netDevice.name"),
    (SRIOV, vf(netDevice={"name": "net%d%d"}), "netDevice.name"),
    (SRIOV, vf(netDevice={"name": "netà"}), "netDevice.name"),
    (SRIOV, vf(netDevice={"name": "lo"}), "netDevice.name"),
    (SRIOV, vf(netDevice={"name": "\u2003x"}), None),
    (SRIOV, vf(netDevice={"name": "a\x1cb"}), None),
    (SRIOV, vf(netDevice={}), "netDevice.name"),
    (SRIOV, vf(netDevice={"name": "net1", "mtu": 9000}), "netDevice.mtu"),
    (SRIOV, {**VFIO, "iommu": "off"}, "iommu"),
    (TPU, gpu(), "kind"),
])
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


_NAME_CHARS = st.sampled_from("abcdefghijklmnopqrstuvwxyz0123456789-_.%d/: \t\u00a0\u2028\u2003éà")
_ODD_CHARS = st.sampled_from("%/: \t\n\0\x1c\x85\u00a0\u2028\u2003\u3000éà\u0420.")
_PLAIN = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz0123456789-_"), max_size=9)
# Plain names, names with one character out of the ordinary, names from anything.
interface_names = st.one_of(_PLAIN, st.builds(lambda a, c, b: a + c + b, _PLAIN, _ODD_CHARS, _PLAIN),
                            st.builds(lambda a, b: a + "%d" + b, _PLAIN, _PLAIN), st.text(_NAME_CHARS, max_size=18),
                            st.sampled_from(["net1", "net%d", ".", "..", "", "lo", "lo0"]))
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=False, allow_infinity=False),
                         st.text(max_size=8), st.sampled_from(["compute", "MPS", "TimeSlicing", "GpuConfig"]))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
field_names = st.one_of(st.from_regex(r"[a-zA-Z][a-zA-Z0-9]{0,8}", fullmatch=True),
                        st.sampled_from(["strategy", "name", "sharing", "TimeSlicing", "kind"]))


@st.composite
def valid_parameters(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    kind = draw(st.sampled_from(["GpuConfig", "VfConfig", "VfioConfig"]))
    params: dict[str, Any] = {"apiVersion": CONFIG_API_VERSION, "kind": kind}
    if kind == "GpuConfig":
        driver = GPU
        if draw(st.booleans()):
            params["driverCapabilities"] = draw(st.lists(st.sampled_from(["compute", "utility", "video", "graphics"]),
                                                         min_size=1, max_size=4))
        sharing = draw(st.sampled_from([None, "absent", "TimeSlicing", "ExclusiveProcess"]))
        if sharing != "absent":
            params["sharing"] = None if sharing is None else {"strategy": sharing}
    elif kind == "VfConfig":
        driver = SRIOV
        net = draw(st.sampled_from(["absent", None, "named"]))
        if net != "absent":
            params["netDevice"] = None if net is None else {"name": draw(interface_names)}
    else:
        driver = draw(st.sampled_from([GPU, SRIOV]))
    return driver, params


def _objects(params: dict[str, Any]) -> list[dict[str, Any]]:
    """Every object in the parameters, the parameters themselves first."""
    found = [params]
    for value in params.values():
        if isinstance(value, dict):
            found += _objects(value)
    return found


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    driver, params = draw(valid_parameters())
    params = copy.deepcopy(params)
    for _ in range(draw(st.integers(0, 2))):
        how = draw(st.sampled_from(["unknown field", "wrong value", "out of range", "drop", "type", "driver"]))
        obj = draw(st.sampled_from(_objects(params)))
        if how == "unknown field":
            obj[draw(field_names)] = draw(json_values)
        elif how == "wrong value" and obj:
            obj[draw(st.sampled_from(sorted(obj)))] = draw(json_values)
        elif how == "out of range":
            choice = draw(st.sampled_from(["caps", "strategy", "name"]))
            if choice == "caps":
                params["driverCapabilities"] = draw(st.lists(st.sampled_from(["compute", "utility", "teleport"]),
                                                             max_size=6))
            elif choice == "strategy":
                params["sharing"] = {"strategy": draw(st.sampled_from(["MPS", "RoundRobin", "", "timeslicing"]))}
            else:
                params["netDevice"] = {"name": draw(st.text(_NAME_CHARS, min_size=14, max_size=70))}
        elif how == "drop" and obj:
            del obj[draw(st.sampled_from(sorted(obj)))]
        elif how == "type":
            params["kind"] = draw(st.sampled_from(["GpuConfig", "VfConfig", "VfioConfig", "TpuConfig", "gpuconfig"]))
            if draw(st.booleans()):
                params["apiVersion"] = draw(st.sampled_from(["dra-agent.io/v1", "v1", CONFIG_API_VERSION]))
        elif how == "driver":
            driver = draw(st.sampled_from([GPU, SRIOV, TPU]))
    return driver, params


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
    bad = gpu(sharing={"strategy": "MPS"})
    assert fields_named(evaluate(policy, claim("gpu.example.com", bad))) == ["sharing.strategy"]
    assert evaluate(policy, claim(GPU, bad)).admitted
    with pytest.raises(SystemExit):
        admission_main(["nvidia=gpu.example.com"])
