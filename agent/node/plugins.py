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
from typing import Any, cast

from agent.kube.names import is_driver_name
from agent.unexpected import unexpected
from backends.contract import Backend

__all__ = ["GROUP", "FoundPlugin", "LoadedPlugin", "PluginFailure", "check_backend", "find_plugins", "load_plugins",
           "unknown_backends"]

GROUP = "dra_agent.backends"
_OWN = "dra-agent"

_ABSENT = object()


def _contract_methods() -> dict[str, tuple[bool, int]]:
    """The methods of the `Backend` protocol, read from the protocol itself: whether each is a coroutine method,
    and the positional arguments it takes after self. Coroutine methods first, as the check reports them."""
    methods = {
        member: (inspect.iscoroutinefunction(fn), len(inspect.signature(fn).parameters) - 1)
        for member, fn in vars(Backend).items()
        if inspect.isfunction(fn) and not member.startswith("_")
    }
    return dict(sorted(methods.items(), key=lambda item: not item[1][0]))


_METHODS = _contract_methods()


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


def unknown_backends(enabled: Collection[str] | None) -> str | None:
    """Why the enabled backend names cannot all be served, naming those no installed package provides and the
    installed ones; None when every name is installed (or none is given: every installed backend)."""
    if enabled is None:
        return None
    installed = {p.name for p in find_plugins()[0]}
    unknown = [name for name in enabled if name not in installed]
    if not unknown:
        return None
    return (f"unknown backend(s) {', '.join(unknown)}; installed backends: "
            f"{', '.join(sorted(installed)) or 'none'}")


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
                                          f"cannot import {plugin.entry_point.value}: {unexpected(e)}"))
            continue
        try:
            backend = factory()
        except Exception as e:
            failures.append(PluginFailure(plugin.name, plugin.distribution,
                                          f"constructing {plugin.entry_point.value} failed: {unexpected(e)}"))
            continue
        problems = check_backend(backend, plugin.name)
        if problems:
            failures.append(PluginFailure(plugin.name, plugin.distribution,
                                          "does not meet the backend contract: " + "; ".join(problems)))
            continue
        loaded.append(LoadedPlugin(plugin, backend))
    return loaded, failures


def check_backend(backend: object, entry_point_name: str) -> list[str]:
    """What a backend object lacks to meet the `Backend` protocol (empty when it meets it, and then
    `isinstance(backend, Backend)` holds).

    Member by member, so that a plugin's author reads what to fix rather than "not a Backend": the attributes
    with the values the agent relies on, then each method of the protocol, async where the protocol's is, taking
    the positional arguments the protocol's takes.
    """
    problems: list[str] = []
    name = _member(backend, "name")
    if name != entry_point_name:
        shown = None if name is _ABSENT else name
        problems.append(f"attribute 'name' is {shown!r}, expected the entry-point name {entry_point_name!r}")
    driver = _member(backend, "driver")
    if not isinstance(driver, str) or not is_driver_name(driver) or driver != driver.lower():
        shown = None if driver is _ABSENT else driver
        problems.append(f"attribute 'driver' is {shown!r}, expected a DRA driver name "
                        "(lower-case DNS subdomain of at most 63 characters)")
    for method, (is_async, arity) in _METHODS.items():
        fn = _member(backend, method)
        if is_async:
            if not inspect.iscoroutinefunction(fn):
                problems.append(f"'{method}' must be an async method")
            elif not _accepts(fn, arity):
                problems.append(f"'{method}' must accept {arity} positional argument(s)")
        elif not callable(fn) or inspect.iscoroutinefunction(fn):
            # health() is the one such method: an async generator is what a backend writes for it.
            problems.append(f"'{method}' must be a method returning an async iterator (e.g. an async generator)")
        elif not _accepts(fn, arity):
            problems.append(f"'{method}' must take no arguments" if arity == 0
                            else f"'{method}' must accept {arity} positional argument(s)")
    if not problems and not isinstance(backend, Backend):
        problems.append("it does not match the Backend protocol of backends.plugin")  # a member not checked above
    return problems


def _member(backend: object, member: str) -> object:
    """`backend.<member>` as a call would find it, or _ABSENT. Looked up statically (never through the object's
    own `__getattr__`, as `isinstance` with a runtime protocol looks from Python 3.12 on), so that an object that
    answers every name is not taken for a backend; a method or property found on the class comes back bound."""
    try:
        found = inspect.getattr_static(backend, member)
    except AttributeError:
        return _ABSENT
    on_class = inspect.getattr_static(type(backend), member, _ABSENT) is found
    if on_class and (inspect.isfunction(found) or inspect.ismethoddescriptor(found)
                     or inspect.isdatadescriptor(found)):
        try:
            return cast(Any, found).__get__(backend, type(backend))
        except AttributeError:  # a property that has nothing to give
            return _ABSENT
    return found


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
