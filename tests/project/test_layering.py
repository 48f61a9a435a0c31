"""Import layering, read from the source: the product (agent → backends → cdi) never reaches the simulator; the
parts of `agent` import each other only downwards; one module per outside library where the design says so; a
backend plugin and the conformance kit see the backends through `backends.plugin` only; no module imports itself
through a circle; no test module imports another, tests/support imports no test, and the tests' folders mirror the
packages they check.

The rules are the ones docs/architecture.md draws. Each test names the files that break a rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.repository import ROOT

PRODUCT = ("agent", "backends", "cdi")
PACKAGES = (*PRODUCT, "simulator")

# The one module a backend plugin imports from the project (its tests add the conformance kit).
PLUGIN_SURFACE = "backends.plugin"
EXAMPLE_PLUGIN = ROOT / "examples" / "acme-fpga"
KIT = "simulator/conformance/"

# The one module of the product that may reach the simulator, and only inside the functions a command calls.
SEAM = "agent/node/simulated.py"

# The parts of `agent`, and the parts each may import. The daemon and the driver (top-level modules) and the
# command layer (`agent/commands/`) wire the parts together; logs, metrics and settings are below every part.
AGENT_PARTS: dict[str, set[str]] = {
    "kube": set(),
    "node": {"kube"},
    "slices": {"kube", "node"},
    "claims": {"kube"},
    "kubelet": {"claims", "node"},
    "events": {"kube", "node", "slices"},
    "admission": {"node"},
}
AGENT_BELOW_EVERY_PART = {"agent.logs", "agent.metrics", "agent.settings", "agent.unexpected"}


def _modules(node: ast.AST) -> set[str]:
    """The modules an import statement names, with each imported name as a possible submodule."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return set()


def file_imports(path: Path, *, top_level_only: bool = False) -> set[str]:
    """Modules one file imports (with `top_level_only`, only the imports that run when the file is imported)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names: set[str] = set()
    for node in nodes:
        names |= _modules(node)  # with top_level_only, `if TYPE_CHECKING:` imports (never run) are skipped
    return names


def imports(*, top_level_only: bool = False) -> dict[str, set[str]]:
    """Modules imported by each source file of the project's packages (with `top_level_only`, only the imports
    that run when the file is imported, not those inside functions)."""
    found: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "_proto" in path.parts:
                continue  # generated code
            found[str(path.relative_to(ROOT))] = file_imports(path, top_level_only=top_level_only)
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


# The command layer's static checks of a backend, which the conformance kit shares: pure, so they may reach only
# the API's formats, the slice rules, the plugin surface and the CDI rules.
BACKEND_RULES = "agent/commands/backend_rules.py"
BACKEND_RULES_MAY_IMPORT = ("agent.kube", "agent.slices", PLUGIN_SURFACE, "cdi")


def test_nothing_imports_the_command_layer() -> None:
    """The daemon's parts never import the commands; `python -m agent` reaches the command line; the conformance
    kit shares the backend checks and nothing else of the command layer."""
    found = imports()
    outside = {f for f, names in found.items()
               if _names(names, "agent.commands.handlers") and not f.startswith("agent/commands/")}
    kit_uses = {f for f in outside if f.startswith(KIT)}
    assert outside - kit_uses <= {"agent/__main__.py"}, sorted(outside - kit_uses)
    wrong = sorted(f"{f} imports {n}" for f in kit_uses for n in found[f]
                   if _names({n}, "agent.commands.handlers") and not _names({n}, "agent.commands.backend_rules"))
    assert not wrong, "the conformance kit takes only the backend checks from the command layer:\n" + "\n".join(wrong)
    assert importers("agent.commands.cli") <= {"agent/__main__.py"}


def test_the_backend_checks_are_pure() -> None:
    names = imports()[BACKEND_RULES]
    project = {n for n in names if n.split(".")[0] in PACKAGES}
    wrong = {n for n in project if not any(_names({n}, allowed) for allowed in BACKEND_RULES_MAY_IMPORT)}
    assert not wrong, f"{BACKEND_RULES} may import only {BACKEND_RULES_MAY_IMPORT}: {_outermost(wrong)}"


def test_a_backend_package_never_imports_another_backend() -> None:
    """The GPU and the SR-IOV backends share only the modules at the top of `backends/` (vfio, the host network
    namespace, sysfs, the contract); each backend package is its own."""
    packages = sorted(p.name for p in (ROOT / "backends").iterdir() if (p / "__init__.py").exists())
    broken = []
    for file, names in imports().items():
        parts = file.split("/")
        if parts[0] != "backends":
            continue
        home = parts[1] if len(parts) > 2 else None
        broken += [f"{file} imports {n}" for n in _outermost(names) for other in packages
                   if other != home and _names({n}, f"backends.{other}")]
    assert not broken, "\n".join(sorted(broken))


def test_only_the_nvml_modules_import_pynvml() -> None:
    allowed = {str(p.relative_to(ROOT)) for p in (ROOT / "backends/nvidia").glob("nvml*.py")}
    allowed |= {str(p.relative_to(ROOT)) for p in (ROOT / "simulator/nvml").glob("*.py")}
    assert importers("pynvml") <= allowed
    assert "backends/nvidia/nvml.py" in importers("pynvml")


def test_at_most_one_module_talks_to_the_api_server() -> None:
    assert product(importers("kubernetes")) <= {"agent/kube/client.py"}


def test_backends_are_seen_through_the_plugin_module_by_plugins_and_the_kit() -> None:
    """The example plugin imports from the project only `backends.plugin` (its tests add `simulator.conformance`);
    the conformance kit reaches the backends only through `backends.plugin` too (the agent and the CDI rules it
    runs a backend against are its to import)."""
    broken = []
    for path in sorted(EXAMPLE_PLUGIN.rglob("*.py")):
        allowed = {PLUGIN_SURFACE}
        if "tests" in path.relative_to(EXAMPLE_PLUGIN).parts:
            allowed.add("simulator.conformance")
        wrong = {n for n in file_imports(path)
                 if n.split(".")[0] in PACKAGES and not any(_names({n}, a) for a in allowed)}
        broken += [f"{path.relative_to(ROOT)} imports {name}" for name in _outermost(wrong)]
    for file, names in imports().items():
        if file.startswith(KIT):
            wrong = {n for n in names if _names({n}, "backends") and not _names({n}, PLUGIN_SURFACE)}
            broken += [f"{file} imports {name}" for name in _outermost(wrong)]
    assert not broken, "import what a plugin uses from backends.plugin:\n" + "\n".join(broken)


# A backend's optional members, each with a protocol in backends/capabilities.py (a config kind's class variables
# are declared on OpaqueConfig).
OPTIONAL_MEMBERS = {"config_types", "config_model", "reconcile", "records_own_changes", "RECONFIGURATIONS"}


def test_the_agent_asks_for_optional_members_through_their_protocols() -> None:
    """`isinstance(backend, HasConfigTypes)` says what a backend offers in one typed place; a `getattr` probe with a
    default hides a misspelt member from mypy and from the reader."""
    broken = []
    for path in sorted((ROOT / "agent").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value in OPTIONAL_MEMBERS):
                broken.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    assert not broken, "use the protocols of backends/capabilities.py:\n" + "\n".join(broken)


def _outermost(names: set[str]) -> list[str]:
    """The names without those below another of them (`backends.base`, not also `backends.base.BackendBase`)."""
    return sorted(n for n in names if not any(n.startswith(other + ".") for other in names))


def _module_name(file: str) -> str:
    parts = file.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_circles() -> None:
    """No module reaches itself through the modules it imports, counting every import: inside functions and
    under TYPE_CHECKING too (a circle of types is still one to untangle before moving either module). The one
    exception is the seam: `agent/node/simulated.py` calls into the simulator, inside functions, by design."""
    found = imports()
    modules = {_module_name(f) for f in found}
    graph: dict[str, set[str]] = {}
    for file, names in found.items():
        module = _module_name(file)
        # A module's parent packages are imported before it anyway: an edge to one of them is no circle of ours.
        edges = {n for n in names if n in modules and n != module and not module.startswith(n + ".")}
        if file == SEAM:
            edges = {n for n in edges if not _names({n}, "simulator")}
        graph[module] = edges
    circles = _circles(graph)
    assert not circles, "import circles:\n" + "\n".join(" ↔ ".join(c) for c in circles)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


TESTS = ROOT / "tests"
TEST_SUPPORT = TESTS / "support"
# The folders whose tests sit at the path of the package or module they check (tests/agent/node/ for agent/node/).
MIRRORED = ("agent", "backends", "cdi", "simulator", "cluster")


def _imported_by(path: Path) -> set[str]:
    """Every module one file imports, relative imports resolved against the file's package, with each imported
    name as a possible submodule."""
    module = _module_name(str(path.relative_to(ROOT)))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *filter(None, [node.module])])
            names |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return names


def _test_module(name: str) -> str | None:
    """The test module (a tests/**/test_*.py file) a dotted name is or is inside, if any."""
    parts = name.split(".")
    for end in range(2, len(parts) + 1):
        file = ROOT.joinpath(*parts[:end]).with_suffix(".py")
        if parts[0] == "tests" and parts[end - 1].startswith("test_") and file.is_file():
            return ".".join(parts[:end])
    return None


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_test_module_imports_another() -> None:
    """What tests share lives in tests/support or in conftest fixtures: importing a test module runs its
    module-level code and mixes its tests' fixtures into the importer's. Every folder of the tests is read."""
    broken = []
    for path in _test_files():
        named = {m for m in map(_test_module, _imported_by(path)) if m}
        broken += [f"{path.relative_to(ROOT)} imports {name}" for name in sorted(named)]
    assert not broken, "move what they share into tests/support:\n" + "\n".join(broken)


def test_the_tests_support_imports_only_itself_from_the_tests() -> None:
    """tests/support is below every test: it imports no test module, no conftest and no other folder of tests/,
    so a helper never drags a test's module-level code or fixtures into another test."""
    broken = []
    for path in sorted(TEST_SUPPORT.rglob("*.py")):
        names = {n for n in _imported_by(path) if _names({n}, "tests")}
        wrong = {n for n in names if not _names({n}, "tests.support") and n != "tests"}
        broken += [f"{path.relative_to(ROOT)} imports {name}" for name in _outermost(wrong)]
    assert not broken, "tests/support may import only tests/support:\n" + "\n".join(broken)


def test_the_tests_mirror_packages_and_modules_that_exist() -> None:
    """A test folder under tests/agent, tests/backends, tests/cdi, tests/simulator or tests/cluster names a package
    (a folder with __init__.py) or a module of the project at the same path: a reader finds a module's tests from
    its path, and the tests of a package that was removed or renamed do not linger under its old name."""
    broken = []
    for top in MIRRORED:
        for folder in sorted(p for p in (TESTS / top).rglob("*") if p.is_dir() and p.name != "__pycache__"):
            source = ROOT / folder.relative_to(TESTS)
            if not (source / "__init__.py").is_file() and not source.with_suffix(".py").is_file():
                broken.append(f"{folder.relative_to(ROOT)}: no package {source.relative_to(ROOT)}/ "
                              f"and no module {source.relative_to(ROOT)}.py")
    assert not broken, "move these tests beside what they check:\n" + "\n".join(broken)


def test_every_folder_of_tests_is_a_package() -> None:
    """Each folder that holds test modules, and each folder above it, has an __init__.py: the test modules' names
    are then their paths (tests.agent.claims.test_checkpoint), so two folders may each have a test_checkpoint.py."""
    folders = {parent for p in TESTS.rglob("test_*.py") for parent in p.relative_to(TESTS).parents}
    missing = sorted(str(Path("tests", f)) for f in folders if not (TESTS / f / "__init__.py").is_file())
    assert not missing, f"add an __init__.py to {missing}"
