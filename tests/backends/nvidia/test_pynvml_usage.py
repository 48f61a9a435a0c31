"""The project's NVML calls exist in the installed pynvml, and the simulation answers exactly what they use."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pynvml

from simulator.nvml.api import SimulatedNvml
from tests.support.repository import ROOT

WRAPPERS = sorted((ROOT / "backends/nvidia").glob("nvml*.py"))
_LOOKUP = re.compile(r'_nvmlGetFunctionPointer\("(\w+)"\)')


def project_calls() -> dict[str, int]:
    """pynvml function → number of positional arguments the project passes to it."""
    calls: dict[str, int] = {}
    for node in (n for path in WRAPPERS for n in ast.walk(ast.parse(path.read_text()))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "pynvml"
                and func.attr.startswith("nvml")):  # not the ctypes structures it defines
            calls[func.attr] = len(node.args)
        elif isinstance(func, ast.Name) and func.id == "_call":
            # _call("name", pynvml.fn, *args): the name must match and the rest are fn's arguments.
            label, target = node.args[0], node.args[1]
            assert isinstance(label, ast.Constant) and isinstance(target, ast.Attribute)
            assert isinstance(label.value, str), f"_call label {label.value!r} is not a name"
            assert label.value == target.attr, f"_call label {label.value} does not match {target.attr}"
            calls[target.attr] = len(node.args) - 2
    return calls


def test_every_called_function_exists_with_a_compatible_signature() -> None:
    calls = project_calls()
    assert len(calls) > 20
    # The health watcher's calls are covered too (nvml_events.py).
    assert {"nvmlEventSetCreate", "nvmlDeviceGetSupportedEventTypes", "nvmlDeviceRegisterEvents",
            "nvmlEventSetWait_v2", "nvmlEventSetFree", "nvmlDeviceGetHandleByUUID"} <= set(calls)
    for name, argc in calls.items():
        fn = getattr(pynvml, name, None)
        assert callable(fn), f"pynvml has no function {name}"
        inspect.signature(fn).bind(*([None] * argc))  # raises TypeError when the arity is wrong


def test_simulation_implements_every_symbol_the_project_reaches() -> None:
    implemented = SimulatedNvml.implemented_symbols()
    for name in project_calls():
        source = inspect.getsource(getattr(pynvml, name))
        symbols = set(_LOOKUP.findall(source))
        # Wrappers that delegate (nvmlInit → nvmlInitWithFlags, nvmlDeviceGetPciInfo → …_v3) reach further.
        for callee in set(re.findall(r"\b(nvml\w+)\(", source)) - {name}:
            if callable(getattr(pynvml, callee, None)):
                symbols |= set(_LOOKUP.findall(inspect.getsource(getattr(pynvml, callee))))
        missing = symbols - implemented
        assert not missing, f"{name} looks up {sorted(missing)}, which the simulated NVML does not implement"


def test_simulated_symbols_are_ones_pynvml_looks_up() -> None:
    looked_up = set(_LOOKUP.findall(Path(pynvml.__file__).read_text()))
    assert SimulatedNvml.implemented_symbols() - looked_up == set()


def test_event_constants_match_pynvml() -> None:
    from backends.nvidia.health_rules import NO_INSTANCE, WATCHED_EVENTS, EventType
    from simulator.nvml import events as simulated

    assert EventType.XID == simulated.EVENT_XID == pynvml.nvmlEventTypeXidCriticalError
    assert EventType.DOUBLE_BIT_ECC == simulated.EVENT_DOUBLE_BIT_ECC == pynvml.nvmlEventTypeDoubleBitEccError
    assert EventType.SINGLE_BIT_ECC == simulated.EVENT_SINGLE_BIT_ECC == pynvml.nvmlEventTypeSingleBitEccError
    assert WATCHED_EVENTS == simulated.SUPPORTED_EVENTS
    assert NO_INSTANCE == simulated.NO_INSTANCE == 0xFFFFFFFF
