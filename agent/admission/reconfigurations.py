"""The ValidatingAdmissionPolicy that lets a ResourceClaim or ResourceClaimTemplate ask for a reconfiguration (vfio-pci
passthrough, a GPU sharing strategy, a VF's interface in the pod) only in the namespaces an operator chose.

Pure. The choice is a ConfigMap, the policy's parameter (`paramKind`): `dra-agent/dra-agent-reconfigurations`, one
key per reconfiguration name (the names of the agent's `allowed_configs` setting, `Reconfiguration.name`), its value
the namespaces allowed it, comma-separated, or `*` for every namespace; a reconfiguration without a key is allowed
nowhere. Without the ConfigMap every claim and template is refused (`parameterNotFoundAction: Deny`): a cluster
that lost it must not admit passthrough everywhere. What a parameters object asks for is read as the agent reads
it (`Reconfiguration.asked_by`), for parameters of the kinds the agent's drivers accept; the admission policy of
`agent.admission.policy` refuses parameters of any other shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agent.admission.policy import CONFIGS, claims_created, parameters_of
from agent.admission.schema_cel import literal
from backends.config import OpaqueConfig, Reconfiguration

__all__ = ["PARAMS_NAME", "PARAMS_NAMESPACE", "POLICY_NAME", "reconfiguration_objects", "reconfigurations"]

POLICY_NAME = "dra-agent-reconfigurations"
PARAMS_NAME = POLICY_NAME
PARAMS_NAMESPACE = "dra-agent"


def reconfigurations(drivers: Mapping[str, Sequence[type[OpaqueConfig]]]
                     ) -> list[tuple[Reconfiguration, type[OpaqueConfig], list[str]]]:
    """Every reconfiguration the drivers' kinds declare, with its kind and the drivers that take the kind."""
    found: dict[str, tuple[Reconfiguration, type[OpaqueConfig], list[str]]] = {}
    for driver, types in drivers.items():
        for model in types:
            for reconfiguration in model.RECONFIGURATIONS:
                found.setdefault(reconfiguration.name, (reconfiguration, model, []))[2].append(driver)
    return [found[name] for name in sorted(found)]


def _asks(reconfiguration: Reconfiguration) -> str:
    """CEL over `p`, parameters of the declaring kind: true when they ask for the reconfiguration. Each step is
    guarded by its type, as `schema_cel`'s checks are, so odd parameters never fail the evaluation."""
    conditions = []
    path = "p"
    for i, key in enumerate(reconfiguration.field):
        conditions.append(f"type({path}) == map && {literal(key)} in {path}")
        path = f"{path}[{literal(key)}]"
        if i == len(reconfiguration.field) - 1 and reconfiguration.value is None:
            conditions.append(f"type({path}) != null_type")
    if reconfiguration.value is not None:
        conditions.append(f"type({path}) == string && {path} == {literal(reconfiguration.value)}")
    return " && ".join(conditions) or "true"


def _allowed_here(name: str) -> str:
    """CEL: the ConfigMap lists the request's namespace (or `*`) under `name`."""
    key = literal(name)
    return (f"has(params.data) && {key} in params.data && params.data[{key}].split(\",\")"
            f".exists(n, n.trim() == request.namespace || n.trim() == \"*\")")


def reconfiguration_objects(drivers: Mapping[str, Sequence[type[OpaqueConfig]]]) -> list[dict[str, Any]]:
    """The policy and its binding for `drivers` (driver name → the configuration types it accepts)."""
    variables = [
        {"name": "configs", "expression": CONFIGS},
        {"name": "opaque", "expression": f"variables.configs.filter(c, has(c.opaque) && has(c.opaque.driver)"
                                         f" && c.opaque.driver in {literal(sorted(drivers))}"
                                         f" && has(c.opaque.parameters)).map(c, c.opaque)"},
    ]
    validations = []
    for reconfiguration, model, of in reconfigurations(drivers):
        asks = _asks(reconfiguration)
        asked = (f"variables.opaque.exists(o, o.driver in {literal(sorted(of))} && ({parameters_of(model)})"
                 + ("" if asks == "true" else f" && [o.parameters].exists(p, {asks})") + ")")
        name = reconfiguration.name
        said = (f"opaque parameters {model.KIND}: asks for {name} ({reconfiguration.what}), which is not allowed in "
                f"namespace ")
        advice = (f": the ConfigMap {PARAMS_NAMESPACE}/{PARAMS_NAME} lists under {name} the namespaces allowed it")
        validations.append({
            "expression": f"!({asked}) || ({_allowed_here(name)})",
            "messageExpression": f"{literal(said)} + request.namespace + {literal(advice)}",
            "message": said.removesuffix("namespace ") + "the request's namespace" + advice,
            "reason": "Forbidden",
        })
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": POLICY_NAME},
        "spec": {
            "failurePolicy": "Fail",
            "paramKind": {"apiVersion": "v1", "kind": "ConfigMap"},
            "matchConstraints": claims_created(),
            "variables": variables,
            "validations": validations,
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": POLICY_NAME},
        "spec": {
            "policyName": POLICY_NAME,
            "validationActions": ["Deny"],
            # A fixed ConfigMap in the agent's namespace: one in the claim's own namespace would be its writers' to
            # make.
            "paramRef": {"name": PARAMS_NAME, "namespace": PARAMS_NAMESPACE, "parameterNotFoundAction": "Deny"},
        },
    }
    return [policy, binding]
