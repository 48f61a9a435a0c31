"""The one form of the agent's validation errors: the server's field errors word for word where a rule answers as
the server does, the agent's own words with the refused value otherwise."""

from __future__ import annotations

from agent.kube.field_errors import FieldErrors
from agent.kube.names import SERVER_DNS_LABEL_MSG


def test_the_servers_words() -> None:
    errors = FieldErrors()
    errors.required("metadata.namespace")
    errors.required("metadata.name", "name or generateName is required")
    errors.invalid("status.devices[0].device", "GPU 0", SERVER_DNS_LABEL_MSG)
    errors.invalid_unshown("series.count", "should be at least 2")
    errors.too_long("status.devices[0].driver", 63)
    errors.too_many("status.devices[0].conditions", 9, 8)
    errors.duplicate("status.devices[1]", "gpu.example.com/pool/gpu-0")
    errors.unsupported("status.devices[0].conditions[0].status", "Maybe", ("False", "True", "Unknown"))
    assert errors == [
        "metadata.namespace: Required value",
        "metadata.name: Required value: name or generateName is required",
        'status.devices[0].device: Invalid value: "GPU 0": a lowercase RFC 1123 label must consist of lower case '
        "alphanumeric characters or '-', and must start and end with an alphanumeric character",
        'series.count: Invalid value: "": should be at least 2',
        "status.devices[0].driver: Too long: may not be more than 63 bytes",
        "status.devices[0].conditions: Too many: 9: must have at most 8 items",
        'status.devices[1]: Duplicate value: "gpu.example.com/pool/gpu-0"',
        'status.devices[0].conditions[0].status: Unsupported value: "Maybe": supported values: "False", "True", '
        '"Unknown"',
    ]


def test_values_are_shown_as_json_in_utf_8_and_cut() -> None:
    errors = FieldErrors()
    errors.invalid("metadata.name", "grün", "bad")
    errors.invalid("data", "x" * 500, "bad")
    errors.check(False, "spec.devices[0].name", "must be a DNS label", "y" * 500)
    assert errors[0] == 'metadata.name: Invalid value: "grün": bad'
    assert len(errors[1]) == len('data: Invalid value: : bad') + 200 and errors[1].endswith('...: bad')
    assert errors[2] == f'spec.devices[0].name: must be a DNS label, got "{"y" * 76}...'


def test_the_agents_own_words() -> None:
    errors = FieldErrors()
    errors.check(True, "spec.pool.name", "must be a DNS subdomain", "ok")
    errors.check(False, "spec.pool.name", "must be a DNS subdomain", "Not OK")
    errors.check_flag({"allNodes": "yes"}, "allNodes", "spec")
    errors.check_flag({"allNodes": True}, "allNodes", "spec")
    errors.check_key(False, "spec.devices[0].attributes", "bad key", "must be a C identifier")
    assert errors == [
        'spec.pool.name: must be a DNS subdomain, got "Not OK"',
        'spec.allNodes: must be true or false, got "yes"',
        'spec.devices[0].attributes: key "bad key" must be a C identifier',
    ]
