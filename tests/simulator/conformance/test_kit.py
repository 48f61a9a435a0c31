"""The conformance kit as a plugin author uses it: a test module subclassing `BackendSuite`, run by pytest with
the kit's plugin. A good backend passes every check; each broken one fails the check for its mistake, with a
message that says what to fix."""

from __future__ import annotations

import sys

import pytest

from tests.support.repository import SUPPORT

pytest_plugins = ["pytester"]

HERE = SUPPORT / "conformance_broken"

AUTHOR_MODULE = '''
from simulator.conformance import BackendSuite
from fpga_backends import {backend}

class TestFpga(BackendSuite):
    backend = {backend}
    profile = "fpga-node.yaml"
'''


@pytest.fixture
def author(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A plugin author's project: the backends, the node profile, and no other configuration."""
    monkeypatch.delitem(sys.modules, "fpga_backends", raising=False)  # this project's copy, not another test's
    pytester.makepyfile(fpga_backends=(HERE / "fpga_backends.py").read_text())
    pytester.makefile(".yaml", **{"fpga-node": (HERE / "fpga-node.yaml").read_text()})
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n"
                     "filterwarnings = ignore::pytest.PytestAssertRewriteWarning\n")
    pytester.syspathinsert()
    return pytester


def test_a_good_backend_passes_every_check(author: pytest.Pytester) -> None:
    author.makepyfile(test_fpga=AUTHOR_MODULE.format(backend="GoodFpga"))
    result = author.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=11)


# Each broken backend, the check its mistake must fail, and what the failure must say.
BROKEN = {
    ("UnstableNames", "test_device_names_stable"):
        ["device names changed between two discoveries", "derive them from the hardware (PCI address"],
    ("NotIdempotent", "test_prepare_idempotent"):
        ["a second prepare of the same claim answered differently", "prepare must be idempotent",
         "changed the node again: dev/fpga-session-fpga-0000-01-00-0-1: appeared"],
    ("Blocking", "test_event_loop_never_blocked"):
        ["prepare: the event loop was blocked for", "fpga_backends.py", "in prepare: `time.sleep(0.2)",
         "await asyncio.to_thread(...)"],
    ("BadAttributes", "test_discover_passes_server_rules"):
        ["the API server would reject device fpga-0000-01-00-0", 'attributes: key "Vendor Name" must be a C identifier',
         'attributes[bitstream].string: must be at most 64 bytes', "attribute and capacity names are C identifiers"],
    ("LeavesSession", "test_unprepare_restores_node"):
        ["unprepare left the node changed: dev/fpga-session-fpga-0000-01-00-0: appeared",
         "Undo everything prepare did"],
    ("LeavesSession", "test_restore_records_suffice_after_restart"):
        ["unprepare after a restart left the node changed", "put everything undoing needs into Prepared.restore"],
    ("ClaimsOwnRecords", "test_rollback_after_interrupted_prepare"):
        ["reconcile after a prepare the core has no record of left the node changed: "
         "dev/fpga-session-fpga-0000-01-00-0: appeared", "Declaring records_own_changes says that reconcile undoes"],
    ("Untyped", "test_contract"):
        ["no 'config_model': declare the backend's settings as a pydantic model",
         "start() accepted the unknown setting 'conformanceNoSuchSetting'"],
}


def test_broken_backends_fail_with_what_to_fix(author: pytest.Pytester) -> None:
    classes = sorted({backend for backend, _ in BROKEN})
    author.makepyfile(test_fpga="from simulator.conformance import BackendSuite\n"
                      f"from fpga_backends import {', '.join(classes)}\n" + "".join(
                          f"\nclass Test{c}(BackendSuite):\n    backend = {c}\n    profile = 'fpga-node.yaml'\n"
                          for c in classes))
    selected = " or ".join(f"(Test{backend} and {check})" for backend, check in BROKEN)
    result = author.runpytest_inprocess("-p", "no:cacheprovider", "-k", selected)
    result.assert_outcomes(failed=len(BROKEN))
    reports = _failure_reports(result.stdout.lines)
    missing = [f"Test{backend}.{check}: {text!r}" for (backend, check), texts in BROKEN.items()
               for text in texts if text not in reports.get(f"Test{backend}.{check}", "")]
    assert not missing, "\n".join(missing) + "\n\n" + result.stdout.str()


def _failure_reports(lines: list[str]) -> dict[str, str]:
    """The text of each failure section of a pytest run, by its heading (`TestClass.test_name`)."""
    reports: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in lines:
        heading = line.strip("_ ")
        if line.startswith("___") and heading.startswith("Test"):
            current = reports.setdefault(heading, [])
        elif line.startswith("===") or current is None:
            current = None if line.startswith("===") else current
        else:
            current.append(line)
    return {k: "\n".join(v) for k, v in reports.items()}


def test_a_suite_without_a_backend_says_what_to_set(author: pytest.Pytester) -> None:
    author.makepyfile(test_fpga="from simulator.conformance import BackendSuite\n\n"
                                "class TestFpga(BackendSuite):\n    pass\n")
    result = author.runpytest_inprocess("-k", "test_contract")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*set `backend` (entry-point name or class) and `profile`*"])


def test_an_uninstalled_entry_point_is_named(author: pytest.Pytester) -> None:
    author.makepyfile(test_fpga="from simulator.conformance import BackendSuite\n\n"
                                "class TestFpga(BackendSuite):\n    backend = 'no-such-backend'\n"
                                "    profile = 'fpga-node.yaml'\n")
    result = author.runpytest_inprocess("-k", "test_contract")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*no installed package provides backend 'no-such-backend'*pip install -e .*"])
