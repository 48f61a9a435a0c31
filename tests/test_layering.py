"""Import layering, read from the source: the product (agent → backends → cdi) never reaches the simulator; the
parts of `agent` import each other only downwards; one module per outside library where the design says so.

The rules are the ones docs/architecture.md draws. Each test names the files that break a rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("agent", "backends", "cdi")
PACKAGES = (*PRODUCT, "simulator")

# The one module of the product that may reach the simulator, and only inside the functions a command calls.
SEAM = "agent/node/simulated.py"

# The parts of `agent`, and the parts each may import. The top-level modules (daemon, driver, cli, commands)
# wire the parts together; logs, metrics and settings are below every part.
AGENT_PARTS: dict[str, set[str]] = {
    "kube": set(),
    "node": {"kube"},
    "slices": {"kube", "node"},
    "claims": {"kube"},
    "kubelet": {"claims", "node"},
    "events": {"kube", "node", "slices"},
}
AGENT_BELOW_EVERY_PART = {"agent.logs", "agent.metrics", "agent.settings"}


def _modules(node: ast.AST) -> set[str]:
    """The modules an import statement names, with each imported name as a possible submodule."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return set()


def imports(*, top_level_only: bool = False) -> dict[str, set[str]]:
    """Modules imported by each source file of the project's packages (with `top_level_only`, only the imports
    that run when the file is imported, not those inside functions)."""
    found: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "_proto" in path.parts:
                continue  # generated code
            tree = ast.parse(path.read_text(), str(path))
            nodes = tree.body if top_level_only else list(ast.walk(tree))
            names: set[str] = set()
            for node in nodes:
                names |= _modules(node)  # with top_level_only, `if TYPE_CHECKING:` imports (never run) are skipped
            found[str(path.relative_to(ROOT))] = names
    return found


def _names(names: set[str], prefix: str) -> bool:
    return any(n == prefix or n.startswith(prefix + ".") for n in names)


def importers(prefix: str, *, top_level_only: bool = False) -> set[str]:
    return {f for f, names in imports(top_level_only=top_level_only).items() if _names(names, prefix)}


def product(files: set[str]) -> set[str]:
    return {f for f in files if f.split("/")[0] in PRODUCT}


def test_the_product_never_imports_the_simulator() -> None:
    offenders = product(importers("simulator")) - {SEAM}
    assert not offenders, f"only {SEAM} may reach the simulator: {sorted(offenders)}"
    assert SEAM not in importers("simulator", top_level_only=True), \
        f"{SEAM} imports the simulator only inside the functions that need it"


def test_backends_never_reach_up_or_out() -> None:
    for module in ("agent", "simulator", "kubernetes", "grpc"):
        offenders = {f for f in importers(module) if f.startswith("backends/")}
        assert not offenders, f"backends must not import {module}: {sorted(offenders)}"


def test_cdi_is_the_bottom_layer() -> None:
    for module in ("agent", "backends", "simulator", "kubernetes", "grpc", "pynvml"):
        offenders = {f for f in importers(module) if f.startswith("cdi/")}
        assert not offenders, f"cdi must not import {module}: {sorted(offenders)}"


def test_the_parts_of_the_agent_import_only_downwards() -> None:
    broken = []
    for file, names in imports().items():
        parts = file.split("/")
        if parts[0] != "agent" or len(parts) < 3 or parts[1] not in AGENT_PARTS:
            continue
        part = parts[1]
        allowed = {f"agent.{p}" for p in AGENT_PARTS[part] | {part}} | AGENT_BELOW_EVERY_PART
        for name in names:
            if name.startswith("agent.") and not any(_names({name}, a) for a in allowed):
                broken.append(f"{file} imports {name}")
    assert not broken, "\n".join(sorted(broken))


def test_nothing_imports_the_command_line() -> None:
    assert importers("agent.cli") <= {"agent/__main__.py"}


def test_only_the_nvml_modules_import_pynvml() -> None:
    allowed = {str(p.relative_to(ROOT)) for p in (ROOT / "backends/nvidia").glob("nvml*.py")}
    allowed |= {str(p.relative_to(ROOT)) for p in (ROOT / "simulator/nvml").glob("*.py")}
    assert importers("pynvml") <= allowed
    assert "backends/nvidia/nvml.py" in importers("pynvml")


def test_at_most_one_module_talks_to_the_api_server() -> None:
    assert product(importers("kubernetes")) <= {"agent/kube/client.py"}
