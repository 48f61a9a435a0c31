"""What the conformance kit checks: one backend, named by its entry point or given as a factory, on one simulated
node, with its settings and the claim configuration to prepare with.

Loading goes through the agent's own plugin loader, so a backend that loads here loads in `dra-agent run`.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any, cast

from agent.node.plugins import GROUP, FoundPlugin, check_backend, find_plugins, load_plugins

__all__ = ["BadClaimConfig", "LoadError", "Target", "source_roots"]

Factory = Callable[[], object]


class LoadError(Exception):
    """The backend cannot be loaded or constructed, or misses the contract; the message says what to fix."""


@dataclass(frozen=True)
class BadClaimConfig:
    """Opaque parameters a claim may give that the backend must refuse for that claim alone; `expect` is a piece
    of the error message the kubelet should get (empty: any error)."""

    parameters: Mapping[str, Any]
    expect: str = ""


@dataclass(frozen=True)
class Target:
    """A backend to check and the node to check it on.

    `backend` is an entry-point name of the `dra_agent.backends` group (the installed plugin) or a factory (the
    class) for a backend under development. `profile` is a built-in profile name or a profile YAML path.
    `config` is the backend's section of `backend_config`. `claim_config` holds the opaque parameters the kit's
    claims give (None: none); `bad_claim_configs` adds parameters the backend itself must refuse per claim (the
    kit always tries an unknown kind and, for each of the backend's `config_types`, an unknown field).
    `devices_per_claim` is how many devices one claim gets (the first ones by name), unless `prepare_devices`
    names them.
    """

    backend: str | Factory
    profile: str | Path
    config: Mapping[str, Any] = field(default_factory=dict)
    claim_config: Mapping[str, Any] | None = None
    bad_claim_configs: Sequence[BadClaimConfig] = ()
    devices_per_claim: int = 1
    prepare_devices: Sequence[str] = ()

    @property
    def id(self) -> str:
        """A short name for test ids and messages."""
        if isinstance(self.backend, str):
            return self.backend
        return getattr(self.backend, "__qualname__", repr(self.backend))

    @property
    def profile_arg(self) -> str:
        """The profile as `--simulate` takes it."""
        return str(self.profile)

    def found(self) -> FoundPlugin:
        """The plugin as the agent finds it: its installed entry point, or one standing in for the factory."""
        if isinstance(self.backend, str):
            plugins, failures = find_plugins()
            for plugin in plugins:
                if plugin.name == self.backend:
                    return plugin
            for failure in failures:
                if failure.name == self.backend:
                    raise LoadError(str(failure))
            installed = ", ".join(p.name for p in plugins) or "none"
            raise LoadError(f"no installed package provides backend {self.backend!r} in the entry-point group "
                            f"{GROUP} (installed: {installed}); install your package (pip install -e .) and "
                            f"check [project.entry-points.\"{GROUP}\"] in its pyproject.toml")
        name = self._factory_name()
        return FoundPlugin(name, "(not installed)", "0", cast(EntryPoint, _FactoryEntryPoint(name, self.backend)))

    def _factory_name(self) -> str:
        try:
            name = getattr(self.backend, "name", None) or getattr(cast(Factory, self.backend)(), "name", None)
        except Exception as e:
            raise LoadError(f"constructing {self.id} failed: {type(e).__name__}: {e}") from None
        if not isinstance(name, str):
            raise LoadError(f"{self.id} has no 'name' attribute: give the backend the entry-point name it is "
                            "registered under, e.g. name = \"acme-fpga\"")
        return name

    def load(self) -> tuple[FoundPlugin, Factory]:
        """Load the plugin as the agent does and return it with a factory for fresh instances."""
        plugin = self.found()
        _, failures = load_plugins([plugin], {plugin.name})
        if failures:
            raise LoadError("; ".join(f.message for f in failures))
        return plugin, cast(Factory, plugin.entry_point.load())

    def new_backend(self, factory: Factory, name: str) -> Any:
        """A fresh instance, checked against the contract."""
        try:
            backend = factory()
        except Exception as e:
            raise LoadError(f"constructing backend {name} failed: {type(e).__name__}: {e}") from None
        problems = check_backend(backend, name)
        if problems:
            raise LoadError("does not meet the backend contract: " + "; ".join(problems))
        return backend


class _FactoryEntryPoint:
    """Stands in for an installed entry point when the backend is given as a factory (not yet installed)."""

    group = GROUP
    dist = None

    def __init__(self, name: str, factory: Factory) -> None:
        self.name = name
        self._factory = factory
        module = getattr(factory, "__module__", "?")
        self.value = f"{module}:{getattr(factory, '__qualname__', 'factory')}"

    def load(self) -> Factory:
        return self._factory


def source_roots(factory: object) -> tuple[Path, ...]:
    """Where the backend's code lives: its top-level package's folder, or its module's file when it has none."""
    module = inspect.getmodule(factory)
    if module is None:
        return ()
    top = sys.modules.get(module.__name__.partition(".")[0], module)
    paths = getattr(top, "__path__", None)
    if paths:
        return tuple(Path(p).resolve() for p in paths)
    file = getattr(top, "__file__", None)
    return (Path(file).resolve(),) if file else ()
