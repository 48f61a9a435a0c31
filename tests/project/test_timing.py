"""Every real-time wait of the tests scales from one factor (DRA_AGENT_TEST_TIME_FACTOR): no timeout, deadline or
sleep in the tests, the test doubles and kits of simulator, or the example plugin's tests is a bare number of
seconds; each is written `scaled(seconds)` (tests/support/timing.py, simulator/timing.py)."""

from __future__ import annotations

import ast

import pytest

import simulator.timing as kit_timing
import tests.support.timing as suite_timing
from tests.support.repository import ROOT

SCANNED = ("tests", "simulator", "examples/acme-fpga/tests")
SLEEP_LIMIT = 0.05
"""Seconds a bare sleep may last: a poll interval, not a wait for something to happen."""
NOT_WAITS = {
    ("tests/support/conformance_broken/fpga_backends.py", "Blocking.prepare"): "the blocking call the kit must find",
}
"""Sleeps that are the behaviour under test, not waits: (file, function) → why."""


def _seconds(node: ast.expr) -> float | None:
    """The value of a numeric literal other than 0 (a timeout of 0 does not wait); None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return float(node.value) if node.value else None
    return None


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


class _BareWaits(ast.NodeVisitor):
    def __init__(self) -> None:
        self.scope: list[str] = []
        self.found: list[tuple[int, str, str]] = []  # (line, function, what)

    def _add(self, node: ast.AST, what: str) -> None:
        self.found.append((getattr(node, "lineno", 0), ".".join(self.scope), what))

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        args = node.args
        positional = args.posonlyargs + args.args
        defaults = list(zip(positional[len(positional) - len(args.defaults):], args.defaults, strict=True))
        defaults += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None]
        for arg, default in defaults:
            if arg.arg == "timeout" and _seconds(default) is not None:
                self._add(default, f"def {node.name}(timeout={_seconds(default):g})")
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Call(self, node: ast.Call) -> None:
        name = _name(node.func)
        for keyword in node.keywords:
            if keyword.arg == "timeout" and (value := _seconds(keyword.value)) is not None:
                self._add(node, f"{name}(timeout={value:g})")
        if name in ("wait_for", "wait_until") and len(node.args) >= 2 and (value := _seconds(node.args[1])):
            self._add(node, f"{name}(..., {value:g})")
        if name in ("timeout", "settimeout", "wait", "join") and len(node.args) == 1 and (
                value := _seconds(node.args[0])) is not None:
            self._add(node, f"{name}({value:g})")
        if name == "sleep" and node.args and (value := _seconds(node.args[0])) is not None and value > SLEEP_LIMIT:
            self._add(node, f"sleep({value:g})")
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        if isinstance(node.op, ast.Add):
            for clock, offset in ((node.left, node.right), (node.right, node.left)):
                if (isinstance(clock, ast.Call) and _name(clock.func) in ("monotonic", "time", "perf_counter")
                        and (value := _seconds(offset)) is not None):
                    self._add(node, f"{_name(clock.func)}() + {value:g}")
        self.generic_visit(node)


def bare_waits(source: str) -> list[tuple[int, str, str]]:
    """Waits in `source` whose length is a bare number: (line, enclosing function, the call)."""
    finder = _BareWaits()
    finder.visit(ast.parse(source))
    return finder.found


def test_no_wait_of_the_tests_is_a_bare_number() -> None:
    found = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            found += [f"{relative}:{line}: {what}" for line, function, what in bare_waits(path.read_text())
                      if (relative, function) not in NOT_WAITS]
    assert found == [], "write these as scaled(seconds) (tests/support/timing.py, simulator/timing.py):\n" + "\n".join(
        found)


@pytest.mark.parametrize("source", [
    "await kubelet.wait_for_plugin(GPU, timeout=20)",
    "subprocess.run(['true'], timeout=2.5)",
    "await asyncio.wait_for(task, 5)",
    "await wait_until(lambda: done, 10)",
    "async with asyncio.timeout(30):\n    pass",
    "await asyncio.sleep(0.5)",
    "time.sleep(1)",
    "event.wait(5)",
    "deadline = time.monotonic() + 10",
    "def wait(timeout: float = 15) -> None: ...",
    "async def until(check, *, timeout=3.0): ...",
])
def test_a_bare_wait_is_found(source: str) -> None:
    assert len(bare_waits(source)) == 1


@pytest.mark.parametrize("source", [
    "await kubelet.wait_for_plugin(GPU, timeout=scaled(20))",
    "await asyncio.wait_for(task, scaled(5))",
    "await asyncio.sleep(0.02)",  # a poll interval
    "await asyncio.sleep(0)",
    "pynvml.nvmlEventSetWait(event_set, 0)",
    "Hook(path='/bin/true', timeout=0)",  # zero waits for nothing
    "def wait(timeout: float = scaled(15)) -> None: ...",
    "' '.join(words)",
])
def test_a_scaled_wait_or_a_poll_is_not(source: str) -> None:
    assert bare_waits(source) == []


def test_the_suite_and_the_kits_share_one_factor() -> None:
    assert suite_timing.scaled is kit_timing.scaled and suite_timing.FACTOR == kit_timing.FACTOR
    assert kit_timing.scaled(2) == 2 * kit_timing.FACTOR


@pytest.mark.parametrize(("value", "factor"), [(None, 1.0), ("", 1.0), ("3", 3.0), (" 1.5 ", 1.5), ("0.5", 0.5)])
def test_the_factor_is_read_from_the_environment(value: str | None, factor: float) -> None:
    environ = {} if value is None else {kit_timing.ENV: value}
    assert kit_timing.factor(environ) == factor


@pytest.mark.parametrize("value", ["fast", "0", "-2", "inf", "nan"])
def test_a_factor_that_is_no_positive_number_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match=kit_timing.ENV):
        kit_timing.factor({kit_timing.ENV: value})
