"""Import layering: agent → backends → cdi; one module per outside library where the design says so."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("agent", "backends", "cdi")


def imports() -> dict[str, set[str]]:
    """Top-level module names imported by each source file of the project's packages."""
    found: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "_proto" in path.parts:
                continue  # generated code
            names: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names.update(alias.name for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names.add(node.module)
            found[str(path.relative_to(ROOT))] = names
    return found


def importers(prefix: str) -> set[str]:
    return {f for f, names in imports().items() if any(n == prefix or n.startswith(prefix + ".") for n in names)}


def test_backends_never_reach_up_or_out() -> None:
    for module in ("agent", "kubernetes", "grpc"):
        offenders = {f for f in importers(module) if f.startswith("backends/")}
        assert not offenders, f"backends must not import {module}: {sorted(offenders)}"


def test_cdi_is_the_bottom_layer() -> None:
    for module in ("agent", "backends", "kubernetes", "grpc", "pynvml"):
        offenders = {f for f in importers(module) if f.startswith("cdi/")}
        assert not offenders, f"cdi must not import {module}: {sorted(offenders)}"


def test_only_the_nvml_modules_import_pynvml() -> None:
    allowed = {
        str(p.relative_to(ROOT)) for folder in ("backends/nvidia", "backends/simulation")
        for p in (ROOT / folder).glob("nvml*.py")
    }
    assert importers("pynvml") <= allowed
    assert "backends/nvidia/nvml.py" in importers("pynvml")


def test_at_most_one_module_talks_to_the_api_server() -> None:
    assert len(importers("kubernetes")) <= 1, sorted(importers("kubernetes"))
