"""Backend plugins: entry-point discovery without import, loading, contract checks, broken plugins skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from agent.node.plugins import check_backend, find_plugins, load_plugins
from tests.support.cli_env import CliResult
from tests.support.slice_checks import assert_valid_slices

BUILTINS = {"nvidia-gpu", "nvidia-mig", "sriov-nic", "tpu"}

# A third-party backend written only against the public contract: FPGA cards found by PCI vendor id.
FPGA_MODULE = '''
import asyncio
from backends.contract import Device, Inventory
from backends.sysfs import list_pci_devices, read_hex
from backends.topology import device_name

class FpgaBackend:
    name = "acme-fpga"
    driver = "fpga.acme.example"

    async def start(self, ctx):
        self.ctx = ctx

    async def discover(self):
        found = []
        for bus_id in list_pci_devices(self.ctx.sysfs_root):
            if read_hex(self.ctx.topology.device_dir(bus_id) / "vendor") == 0x1172:
                topo = self.ctx.topology.lookup(bus_id)
                found.append(Device(name=device_name("fpga", bus_id), attributes={"family": "agilex"},
                                    topology=topo))
        return Inventory(devices=tuple(found))

    async def health(self):
        await asyncio.Event().wait()
        yield

    async def prepare(self, claim, devices):
        return []

    async def unprepare(self, claim, prepared):
        return None

    async def stop(self):
        return None

class NotABackend:
    name = "bad-contract"
    driver = "Bad Driver!"
    def discover(self):
        return None

def exploding_factory():
    raise RuntimeError("licence server unreachable")
'''

FPGA_PROFILE = """
name: fpga-node
root_complexes:
  - numa_node: 0
    ports:
      - pci: {vendor: 0x1172, device: 0x5000, driver: acme_fpga, dev_nodes: [acme/fpga0]}
      - gpu: L4
"""


def install_distribution(site: Path, name: str, version: str, entry_points: dict[str, str]) -> None:
    """Write a minimal installed distribution (dist-info with METADATA and entry_points.txt)."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[dra_agent.backends]\n{lines}")


@pytest.fixture
def third_party(scratch: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    site = scratch / "site"
    site.mkdir()
    (site / "acme_fpga.py").write_text(textwrap.dedent(FPGA_MODULE))
    install_distribution(site, "acme-dra-fpga", "1.2.0", {"acme-fpga": "acme_fpga:FpgaBackend"})
    install_distribution(site, "broken-dra", "0.1", {
        "broken-import": "acme_missing_module:Backend",
        "bad-contract": "acme_fpga:NotABackend",
        "explodes": "acme_fpga:exploding_factory",
        "tpu": "acme_fpga:FpgaBackend",  # clashes with the built-in
    })
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "acme_fpga", raising=False)
    (scratch / "fpga.yaml").write_text(FPGA_PROFILE)
    return site


def test_builtins_are_found_through_the_entry_point_group() -> None:
    found, failures = find_plugins()
    assert {p.name for p in found} >= BUILTINS
    assert {p.distribution for p in found if p.name in BUILTINS} == {"dra-agent"}
    assert failures == []


def test_finding_does_not_import(third_party: Path) -> None:
    found, _ = find_plugins()
    assert "acme-fpga" in {p.name for p in found}
    assert "acme_fpga" not in sys.modules


def test_only_enabled_backends_are_loaded(third_party: Path) -> None:
    found, _ = find_plugins()
    loaded, failures = load_plugins(found, {"acme-fpga", "tpu"})
    assert sorted(p.found.name for p in loaded) == ["acme-fpga", "tpu"]
    assert failures == []
    assert "acme_missing_module" not in sys.modules


def test_broken_plugins_are_reported_with_their_distribution(third_party: Path) -> None:
    found, find_failures = find_plugins()
    loaded, failures = load_plugins(found)
    by_name = {f.name: f for f in failures + find_failures}
    assert {p.found.name for p in loaded} == BUILTINS | {"acme-fpga"}
    assert by_name["broken-import"].distribution == "broken-dra"
    assert by_name["broken-import"].message.endswith(
        "cannot import acme_missing_module:Backend: module acme_missing_module is not installed")
    assert "licence server unreachable" in by_name["explodes"].message
    contract = by_name["bad-contract"].message
    assert "attribute 'driver' is 'Bad Driver!'" in contract
    assert "'discover' must be an async method" in contract and "'health' must be" in contract
    assert by_name["tpu"].distribution == "broken-dra" and "already provided by dra-agent" in by_name["tpu"].message


def test_contract_check_accepts_builtins() -> None:
    found, _ = find_plugins()
    loaded, _ = load_plugins(found, BUILTINS)
    for plugin in loaded:
        assert check_backend(plugin.backend, plugin.found.name) == []


class AnswersEverything:
    """An object that has every attribute one asks for."""

    def __getattr__(self, name: str) -> object:
        return "fpga.acme.example"


class DeclaredOtherwise:
    """Meets the contract with a property, a static and a class method, and a method set on the instance."""

    driver = "fpga.acme.example"

    def __init__(self) -> None:
        async def prepare(claim: object, devices: object) -> list[object]:
            return []

        self.prepare = prepare

    @property
    def name(self) -> str:
        return "acme-fpga"

    @staticmethod
    async def start(ctx: object) -> None:
        return None

    @classmethod
    async def discover(cls) -> None:
        return None

    async def unprepare(self, claim: object, prepared: object) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def health(self) -> AsyncIterator[object]:
        yield None


def test_contract_check_reads_what_the_class_declares() -> None:
    problems = check_backend(AnswersEverything(), "acme-fpga")
    assert "attribute 'name' is None, expected the entry-point name 'acme-fpga'" in problems
    assert "'start' must be an async method" in problems, "a __getattr__ answering every name is no backend"
    assert check_backend(DeclaredOtherwise(), "acme-fpga") == []


def test_third_party_backend_is_listed(run_cli: Callable[..., CliResult], third_party: Path) -> None:
    result = run_cli("backends", "--simulate", str(third_party.parent / "fpga.yaml"), "-o", "json")
    assert result.code == 0, result.err
    listed = json.loads(result.out)
    rows = {r["name"]: r for r in listed if r["distribution"] in ("dra-agent", "acme-dra-fpga", "broken-dra")}
    rows |= {r["name"]: r for r in listed if r["distribution"] != "broken-dra"}
    assert rows["acme-fpga"] | {"status": None} == {
        "name": "acme-fpga", "distribution": "acme-dra-fpga", "version": "1.2.0", "driver": "fpga.acme.example",
        "enabled": True, "devices": 1, "status": None,
    }
    assert rows["nvidia-gpu"]["devices"] == 1 and rows["tpu"]["status"] == "no hardware found"
    assert rows["broken-import"]["status"].startswith("failed: cannot import")
    assert rows["bad-contract"]["distribution"] == "broken-dra"
    (clash,) = [r for r in listed if r["name"] == "tpu" and r["distribution"] == "broken-dra"]
    assert "already provided by dra-agent" in clash["status"]


def test_third_party_backend_is_used_by_discover(run_cli: Callable[..., CliResult], third_party: Path) -> None:
    result = run_cli("discover", "--simulate", str(third_party.parent / "fpga.yaml"), "-o", "json")
    assert result.code == 0, result.err
    slices = json.loads(result.out)
    assert_valid_slices(slices)
    (fpga_slice,) = [s for s in slices if s["spec"]["driver"] == "fpga.acme.example"]
    (fpga,) = fpga_slice["spec"]["devices"]
    assert fpga["attributes"]["family"] == {"string": "agilex"}
    assert fpga["attributes"]["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:00"}
    assert {s["spec"]["driver"] for s in slices} == {"fpga.acme.example", "gpu.nvidia.com"}
    assert "broken-import" in result.err and "Traceback" not in result.err


def test_installed_command_sees_third_party_backends(third_party: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(third_party)}
    out = subprocess.run(
        [sys.executable, "-m", "agent", "backends", "--simulate", "gke-g2-l4", "--log-level", "error"],
        capture_output=True, text=True, env=env, check=True,
    ).stdout
    assert "acme-fpga" in out and "acme-dra-fpga" in out and "no hardware found" in out
