"""`dra-agent backends --check`: the kit's static checks on installed backends, with what each must fix."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.cli_env import CliResult
from tests.support.repository import SUPPORT

BROKEN = SUPPORT / "conformance_broken"

VARIANTS = '''
from fpga_backends import BadAttributes, GoodFpga, UnstableNames, Untyped

class Unstable(UnstableNames):
    name = "kit-unstable"

class Rejected(BadAttributes):
    name = "kit-rejected"

class NoModel(Untyped):
    name = "kit-untyped"
'''


@pytest.fixture
def installed(scratch: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The test FPGA backends installed as a distribution (dist-info with entry points); returns the profile."""
    site = scratch / "site"
    site.mkdir()
    (site / "fpga_backends.py").write_text((BROKEN / "fpga_backends.py").read_text())
    (site / "kit_variants.py").write_text(VARIANTS)
    info = site / "kit_fpga-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kit-fpga\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[dra_agent.backends]\nkit-fpga = fpga_backends:GoodFpga\nkit-unstable = kit_variants:Unstable\n"
        "kit-rejected = kit_variants:Rejected\nkit-untyped = kit_variants:NoModel\n")
    monkeypatch.syspath_prepend(str(site))
    for module in ("fpga_backends", "kit_variants"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    yield BROKEN / "fpga-node.yaml"
    # Imported from a folder that goes with the test: left in sys.modules, a later test of this process importing
    # the same name would get code whose source file is gone.
    for module in ("fpga_backends", "kit_variants"):
        sys.modules.pop(module, None)


def test_builtin_backends_pass(run_cli: Callable[..., CliResult]) -> None:
    result = run_cli("backends", "--check", "--simulate", "mixed", "--backends", "nvidia-gpu,nvidia-mig,sriov-nic,tpu")
    assert result.code == 0, result.out + result.err
    assert "sriov-nic (dra-agent 0.1.0): ok, 10 device(s) on simulated node mixed" in result.out


def test_a_good_third_party_backend_passes(run_cli: Callable[..., CliResult], installed: Path) -> None:
    result = run_cli("backends", "--check", "--simulate", str(installed), "--backends", "kit-fpga")
    assert result.code == 0, result.out + result.err
    assert result.out == f"kit-fpga (kit-fpga 1.0): ok, 2 device(s) on simulated node {installed}\n"


def test_broken_backends_fail_with_what_to_fix(run_cli: Callable[..., CliResult], installed: Path) -> None:
    result = run_cli("backends", "--check", "--simulate", str(installed),
                     "--backends", "kit-fpga,kit-unstable,kit-rejected,kit-untyped")
    assert result.code == 1
    sections = {block.split(" ", 1)[0]: block for block in result.out.split("\n") if block and block[0] != " "}
    assert sections["kit-fpga"].endswith(": ok, 2 device(s) on simulated node " + str(installed))
    assert {name for name, line in sections.items() if line.endswith("FAILED")} == {
        "kit-unstable", "kit-rejected", "kit-untyped"}
    out = result.out
    assert "  - device names changed between two discoveries: gone [fpga0, fpga1], new [fpga2, fpga3]" in out
    assert '  - the API server would reject device fpga-0000-01-00-0: device.attributes: key "Vendor Name"' in out
    assert "  - no 'config_model': declare the backend's settings as a pydantic model" in out
    assert "3 of 4 backend(s) failed the checks: kit-rejected, kit-unstable, kit-untyped" in result.err


def test_settings_a_backend_refuses_stop_the_check(run_cli: Callable[..., CliResult], installed: Path,
                                                   scratch: Path) -> None:
    config = scratch / "settings.yaml"
    config.write_text("backend_config:\n  kit-fpga: {colour: blue}\n")
    result = run_cli("backends", "--check", "--simulate", str(installed), "--backends", "kit-fpga",
                     "--config", str(config))
    assert result.code == 2, "a mistake in the settings, named before any backend is checked"
    assert (f"backend_config.kit-fpga.colour (from config file {config}): unknown field of backend kit-fpga; "
            "its fields: none") in result.err
    assert not result.out


def test_an_unknown_profile_is_bad_input(run_cli: Callable[..., CliResult]) -> None:
    result = run_cli("backends", "--check", "--simulate", "no-such-node")
    assert result.code == 2 and "unknown profile 'no-such-node'" in result.err
