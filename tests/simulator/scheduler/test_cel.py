"""The allocator's CEL environment: the device variable, the Kubernetes quantity and semver libraries, and the
errors for what it does not support."""

from __future__ import annotations

from typing import Any

import pytest

from simulator.scheduler.cel import CelError, compile_selector, device_value

GPU: dict[str, Any] = {
    "name": "gpu-0",
    "attributes": {
        "type": {"string": "gpu"},
        "index": {"int": 3},
        "migCapable": {"bool": True},
        "driverVersion": {"version": "580.95.5"},
        "resource.kubernetes.io/pcieRoot": {"string": "pci0000:15"},
    },
    "capacity": {"memory": {"value": "81559Mi"}, "example.com/slots": {"value": "1k"}},
}


def matches(expression: str, dev: dict[str, Any] = GPU, driver: str = "gpu.nvidia.com") -> bool:
    return compile_selector(expression).matches(device_value(dev, driver))


@pytest.mark.parametrize("expression", [
    'device.driver == "gpu.nvidia.com"',
    'device.attributes["gpu.nvidia.com"].type == "gpu"',  # a bare name is in the driver's domain
    'device.attributes["gpu.nvidia.com"].index == 3 && device.attributes["gpu.nvidia.com"].migCapable',
    'device.attributes["resource.kubernetes.io"].pcieRoot == "pci0000:15"',
    '!("pcieRoot" in device.attributes["gpu.nvidia.com"])',
    'device.allowMultipleAllocations == false',
    'device.attributes["gpu.nvidia.com"].type.startsWith("g") && size(device.attributes["gpu.nvidia.com"]) == 4',
    '"x" in device.attributes["other.example.com"] == false',  # a domain without attributes is an empty map
    '!(false && device.attributes["gpu.nvidia.com"].missing == 1)',  # && is commutative over errors, as in CEL
    'device.attributes["gpu.nvidia.com"].missing == 1 || true',
    'has(device.attributes["gpu.nvidia.com"].type) && !has(device.attributes["gpu.nvidia.com"].uuid)',
    '[1, 2, 3].exists(i, i == device.attributes["gpu.nvidia.com"].index)',
])  # fmt: skip
def test_the_device_variable(expression: str) -> None:
    assert matches(expression)


@pytest.mark.parametrize("expression", [
    'device.capacity["gpu.nvidia.com"].memory.compareTo(quantity("79Gi")) > 0',
    'device.capacity["gpu.nvidia.com"].memory.compareTo(quantity("81559Mi")) == 0',
    'device.capacity["gpu.nvidia.com"].memory.compareTo(quantity("80Gi")) < 0',
    'device.capacity["gpu.nvidia.com"].memory.isLessThan(quantity("80Gi"))',
    'device.capacity["gpu.nvidia.com"].memory.isGreaterThan(quantity("80G"))',
    'device.capacity["example.com"].slots == quantity("1000")',  # equal by value, not by text
    'device.capacity["example.com"].slots.asInteger() == 1000',
    'device.capacity["example.com"].slots.add(24).asInteger() == 1024',
    'device.capacity["example.com"].slots.sub(quantity("1k")).sign() == 0',
    'quantity("1.5").asApproximateFloat() == 1.5 && !quantity("1.5").isInteger() && quantity("2").isInteger()',
    'quantity("1Gi").add(quantity("1Gi")) == quantity("2Gi")',
    'isQuantity("80Gi") && !isQuantity("80 GB")',
])  # fmt: skip
def test_quantity_library(expression: str) -> None:
    assert matches(expression)


@pytest.mark.parametrize("expression", [
    'device.attributes["gpu.nvidia.com"].driverVersion == semver("580.95.5")',  # version attributes are semvers
    'device.attributes["gpu.nvidia.com"].driverVersion.isGreaterThan(semver("580.82.7"))',
    'device.attributes["gpu.nvidia.com"].driverVersion.isLessThan(semver("1000.0.0"))',
    'device.attributes["gpu.nvidia.com"].driverVersion.compareTo(semver("580.95.5")) == 0',
    'device.attributes["gpu.nvidia.com"].driverVersion.major() == 580',
    'device.attributes["gpu.nvidia.com"].driverVersion.minor() == 95',
    'device.attributes["gpu.nvidia.com"].driverVersion.patch() == 5',
    'semver("1.0.0-alpha").isLessThan(semver("1.0.0-alpha.1"))',
    'semver("1.0.0-alpha.1").isLessThan(semver("1.0.0-beta"))',
    'semver("1.0.0-rc.1").isLessThan(semver("1.0.0"))',
    'semver("1.0.0-2").isLessThan(semver("1.0.0-10")) && semver("1.0.0-1").isLessThan(semver("1.0.0-alpha"))',
    'semver("1.0.0+build.5") == semver("1.0.0")',
    'isSemver("1.2.3") && !isSemver("1.2") && !isSemver("v1.2.3") && !isSemver("01.2.3")',
    'isSemver("v1.2", true) && semver("v01.2", true) == semver("1.2.0")',
])  # fmt: skip
def test_semver_library(expression: str) -> None:
    assert matches(expression)


@pytest.mark.parametrize(("expression", "problem"), [
    ('device.attributes["gpu.nvidia.com"].uuid == "x"', "no such key: 'uuid'"),
    ('device.attributes["other.example.com"].type == "gpu"', "no such key: 'type'"),
    ('device.capacity["gpu.nvidia.com"].cores.isGreaterThan(quantity("1"))', "no such key: 'cores'"),
    ('device.driver', "must evaluate to bool, not string (gpu.nvidia.com)"),
    ('quantity("80 GB") == quantity("1")', 'quantity: invalid quantity "80 GB"'),
    ('semver("1.2") == semver("1.2.0")', "semver: invalid semantic version '1.2'"),
    ('device.capacity["gpu.nvidia.com"].memory < quantity("1")', "no such overload"),  # only through compareTo
    ('semver("1.0.0").compareTo(quantity("1"))', "no such overload: compareTo(semver, quantity)"),
    ('device.capacity["gpu.nvidia.com"].memory.major() == 1', "no such overload: major(quantity)"),
])  # fmt: skip
def test_runtime_errors_name_the_expression_and_the_problem(expression: str, problem: str) -> None:
    with pytest.raises(CelError) as caught:
        matches(expression)
    assert caught.value.expression == expression
    assert problem in caught.value.problem
    assert expression in str(caught.value)


@pytest.mark.parametrize(("expression", "problem"), [
    ('device.attributes["x"].y.matchesRegex("a")', "function matchesRegex() is not supported"),
    ('lowerAscii(device.driver) == "x"', "function lowerAscii() is not supported"),
    ('cel.bind(d, device.attributes["gpu.nvidia.com"], d.type == "gpu")', "cel.bind() is not supported"),
    ('dev.driver == "x"', "undeclared variable 'dev': only 'device' is defined"),
    ('device.driver == ', "syntax error at line 1"),
    ('   ', "empty expression"),
])  # fmt: skip
def test_what_is_not_supported_fails_at_compile_time(expression: str, problem: str) -> None:
    with pytest.raises(CelError) as caught:
        compile_selector(expression)
    assert problem in caught.value.problem
    assert repr(expression) in str(caught.value)


def test_macro_variables_are_not_unknown_variables() -> None:
    assert matches('["gpu", "mig"].exists(t, t == device.attributes["gpu.nvidia.com"].type)')
    assert matches('[1, 2].all(n, n > 0) && [1, 2].map(n, n * 2) == [2, 4] && [1, 2].filter(n, n > 1) == [2]')


def test_each_expression_is_compiled_once() -> None:
    expression = 'device.driver == "compiled.example.com"'
    assert compile_selector(expression) is compile_selector(expression)


def test_an_attribute_cel_cannot_hold_is_an_error_for_that_device() -> None:
    with pytest.raises(ValueError, match=r"attribute bad: invalid semantic version '12\.4'"):
        device_value({"attributes": {"bad": {"version": "12.4"}}}, "x.example.com")
