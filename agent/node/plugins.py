"""Backend plugins: find them through the `dra_agent.backends` entry-point group, load the enabled ones, check them.

Finding reads only package metadata; nothing is imported until a backend is enabled. Built-in backends are
registered through the same group as third-party ones. A plugin that fails to import, to construct, or to meet
the contract is reported with its distribution's name and skipped; the others keep working.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

from agent.kube.names import is_driver_name
from backends.contract import Backend

__all__ = ["GROUP", "FoundPlugin", "LoadedPlugin", "PluginFailure", "check_backend", "find_plugins", "load_plugins"]

GROUP = "dra_agent.backends"
_OWN = "dra-agent"


# Coroutine methods of the contract and the positional arguments each takes after self.
_ASYNC_METHODS = {"start": 1, "discover": 0, "prepare": 2, "unprepare": 2, "stop": 0}


@dataclass(frozen=True)
class FoundPlugin:
    """A backend advertised by an installed distribution, not yet imported."""

    name: str
    distribution: str
    version: str
    entry_point: EntryPoint


@dataclass(frozen=True)
class LoadedPlugin:
    """A backend that imported, constructed and passed the contract check."""

    found: FoundPlugin
    backend: Backend


@dataclass(frozen=True)
class PluginFailure:
    """A backend that cannot be used, and why, naming the distribution to blame."""

    name: str
    distribution: str
    message: str

    def __str__(self) -> str:
        return f"backend {self.name!r} from {self.distribution}: {self.message}"


def find_plugins() -> tuple[list[FoundPlugin], list[PluginFailure]]:
    """Every backend entry point of installed distributions, sorted by name; duplicates are failures."""
    found: dict[str, FoundPlugin] = {}
    failures: list[PluginFailure] = []
    # On a name clash the agent's own backend wins, then the alphabetically first distribution.
    candidates = sorted(entry_points(group=GROUP), key=lambda ep: (ep.name, _dist(ep)[0] != _OWN, _dist(ep)[0]))
    for ep in candidates:
        dist, version = _dist(ep)
        if ep.name in found:
            if found[ep.name].distribution != dist:
                failures.append(PluginFailure(
                    ep.name, dist, f"name already provided by {found[ep.name].distribution}; skipped"))
            continue  # the same distribution seen twice on sys.path
        found[ep.name] = FoundPlugin(ep.name, dist, version, ep)
    return list(found.values()), failures


def load_plugins(
    found: list[FoundPlugin], enabled: Collection[str] | None = None
) -> tuple[list[LoadedPlugin], list[PluginFailure]]:
    """Import and construct the enabled backends (all when `enabled` is None) and check each one."""
    by_name = {p.name: p for p in found}
    failures = [
        PluginFailure(name, "(not installed)", f"is enabled but no installed package provides it; "
                      f"installed backends: {', '.join(sorted(by_name)) or 'none'}")
        for name in sorted(set(enabled or ()) - by_name.keys())
    ]
    loaded: list[LoadedPlugin] = []
    for plugin in found:
        if enabled is not None and plugin.name not in enabled:
            continue
        try:
            factory = plugin.entry_point.load()
        except Exception as e:
            failures.append(PluginFailure(plugin.name, plugin.distribution,
                                          f"cannot import {plugin.entry_point.value}: {type(e).__name__}: {e}"))
            continue
        try:
            backend = factory()
        except Exception as e:
            failures.append(PluginFailure(plugin.name, plugin.distribution,
                                          f"constructing {plugin.entry_point.value} failed: {type(e).__name__}: {e}"))
            continue
        problems = check_backend(backend, plugin.name)
        if problems:
            failures.append(PluginFailure(plugin.name, plugin.distribution,
                                          "does not meet the backend contract: " + "; ".join(problems)))
            continue
        loaded.append(LoadedPlugin(plugin, backend))
    return loaded, failures


def check_backend(backend: object, entry_point_name: str) -> list[str]:
    """What a backend object lacks to meet the contract (empty when it meets it)."""
    problems: list[str] = []
    name = getattr(backend, "name", None)
    if name != entry_point_name:
        problems.append(f"attribute 'name' is {name!r}, expected the entry-point name {entry_point_name!r}")
    driver = getattr(backend, "driver", None)
    if not isinstance(driver, str) or not is_driver_name(driver) or driver != driver.lower():
        problems.append(f"attribute 'driver' is {driver!r}, expected a DRA driver name "
                        "(lower-case DNS subdomain of at most 63 characters)")
    for method, arity in _ASYNC_METHODS.items():
        fn = getattr(backend, method, None)
        if fn is None or not inspect.iscoroutinefunction(fn):
            problems.append(f"'{method}' must be an async method")
        elif not _accepts(fn, arity):
            problems.append(f"'{method}' must accept {arity} positional argument(s)")
    health = getattr(backend, "health", None)
    if health is None or not callable(health) or inspect.iscoroutinefunction(health):
        problems.append("'health' must be a method returning an async iterator (e.g. an async generator)")
    elif not _accepts(health, 0):
        problems.append("'health' must take no arguments")
    return problems


def _accepts(fn: object, arity: int) -> bool:
    try:
        inspect.signature(fn).bind(*([None] * arity))  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def _dist(ep: EntryPoint) -> tuple[str, str]:
    dist = ep.dist
    if dist is None:
        return "(unknown distribution)", "?"
    return dist.metadata["Name"] or dist.name, dist.version
