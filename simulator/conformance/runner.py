"""Running the kit's checks for one target: each check on a fresh simulated node in a fresh event loop, its
result a list of problems (empty when the backend passes)."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from agent.commands.backend_rules import config_problems
from backends.plugin import ConfigError, HasConfigTypes, OpaqueConfig
from simulator.conformance import agent_run, checks
from simulator.conformance.bench import Bench, CheckFailed, backend_context
from simulator.conformance.loop_watch import LoopWatch, Stall
from simulator.conformance.target import LoadError, Target, source_roots
from simulator.node.node import SimulatedNode, simulated_node
from simulator.node.profile import ProfileError
from simulator.timing import scaled

__all__ = ["Conformance"]

CHECKS = ("contract", "discovery", "stable_names", "idempotent_prepare", "unprepare_restores", "restart_restore",
          "interrupted_prepare", "health", "event_loop", "served_by_agent", "claim_config_errors")
"""Every check, in the order an author would fix them."""


class Conformance:
    """The checks of one target; each method returns the problems found."""

    def __init__(self, target: Target) -> None:
        self.target = target

    def run(self, check: str) -> list[str]:
        if check not in CHECKS:
            raise ValueError(f"unknown check {check!r}; checks: {', '.join(CHECKS)}")
        try:
            result: list[str] = getattr(self, check)()
        except (LoadError, CheckFailed) as e:
            return [str(e)]
        except ProfileError as e:
            return [f"the node profile cannot be used: {e}"]
        return result

    # Static ---------------------------------------------------------------------------------------------------

    def contract(self) -> list[str]:
        """Loads like the agent loads it; typed and documented settings and claim parameters; unknown settings
        refused at start."""
        plugin, factory = self.target.load()
        backend = self.target.new_backend(factory, plugin.name)
        problems = config_problems(backend)
        with self._node() as (node, _):
            problems += asyncio.run(_refuses_unknown_settings(backend, node))
        return problems

    # On the backend directly ------------------------------------------------------------------------------------

    def discovery(self) -> list[str]:
        return self._on_bench(checks.discovery)

    def stable_names(self) -> list[str]:
        return self._on_bench(checks.stable_names)

    def idempotent_prepare(self) -> list[str]:
        return self._on_bench(checks.idempotent_prepare)

    def unprepare_restores(self) -> list[str]:
        return self._on_bench(checks.unprepare_restores)

    def restart_restore(self) -> list[str]:
        return self._on_bench(checks.restart_restore)

    def interrupted_prepare(self) -> list[str]:
        return self._on_bench(checks.interrupted_prepare)

    def health(self) -> list[str]:
        return self._on_bench(checks.health)

    def event_loop(self) -> list[str]:
        """The backend never holds the event loop longer than the limit. A stall is reported only when the same
        backend line stalls in a second run too, so a busy machine cannot fail the check alone."""
        _, factory = self.target.load()
        roots = source_roots(factory)
        first = self._stalls(roots)
        if not first:
            return []
        again = {_where(s, roots) for s in self._stalls(roots)}
        return [s.describe(roots) + ". Run blocking work (file I/O, sleeps, subprocesses, vendor library calls) "
                "off the loop: `await asyncio.to_thread(...)`" for s in first if _where(s, roots) in again]

    def _stalls(self, roots: tuple[Path, ...]) -> list[Stall]:
        watched: list[Stall] = []

        async def watched_lifecycle(bench: Bench) -> list[str]:
            async with LoopWatch() as watch:
                bench.watch = watch
                try:
                    await checks.lifecycle(bench)
                finally:
                    bench.watch = None
            watched.extend(s for s in watch.stalls if s.frames_in(roots))
            return []

        problems = self._on_bench(watched_lifecycle)
        if problems:
            raise CheckFailed(*problems)
        return watched

    # Through the agent ----------------------------------------------------------------------------------------

    def served_by_agent(self) -> list[str]:
        plugin, _ = self.target.load()
        with self._node() as (node, work):
            return asyncio.run(_guarded(agent_run.served_by_agent(self.target, plugin, node, work)))

    def claim_config_errors(self) -> list[str]:
        plugin, factory = self.target.load()
        backend = self.target.new_backend(factory, plugin.name)
        declared = backend.config_types if isinstance(backend, HasConfigTypes) else ()
        types = [t for t in declared if isinstance(t, type) and issubclass(t, OpaqueConfig)]
        with self._node() as (node, work):
            return asyncio.run(_guarded(agent_run.claim_config_errors(self.target, plugin, node, work, types)))

    # Plumbing -------------------------------------------------------------------------------------------------

    def _on_bench(self, check: Callable[[Bench], Awaitable[list[str]]]) -> list[str]:
        plugin, factory = self.target.load()
        with self._node() as (node, work):
            bench = Bench(self.target, plugin.name, factory, node, work / "state")

            async def run() -> list[str]:
                try:
                    return await check(bench)
                finally:
                    await _stop_quietly(bench)

            return asyncio.run(_guarded(run()))

    @contextmanager
    def _node(self) -> Iterator[tuple[SimulatedNode, Path]]:
        """A fresh simulated node of the target's profile and a short-named work folder (unix sockets live there)."""
        shm = "/dev/shm"
        base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
        work = Path(tempfile.mkdtemp(prefix="dra-kit-", dir=base))
        try:
            with simulated_node(self.target.profile_arg, work / "node") as node:
                yield node, work
        finally:
            shutil.rmtree(work, ignore_errors=True)


async def _guarded(work: Awaitable[list[str]]) -> list[str]:
    try:
        return await work
    except CheckFailed as e:
        return e.problems


async def _stop_quietly(bench: Bench) -> None:
    """Stop what a failed check left running, so the next check starts clean."""
    for instance in bench.instances:
        if not instance.stopped:
            instance.stopped = True
            try:
                async with asyncio.timeout(scaled(10)):
                    await instance.backend.stop()
            except Exception:  # the check already failed for a reason worth more than this one
                pass


async def _refuses_unknown_settings(backend: Any, node: SimulatedNode) -> list[str]:
    ctx = backend_context(node, {"conformanceNoSuchSetting": 1}, name=str(backend.name))
    try:
        async with asyncio.timeout(scaled(30)):
            await backend.start(ctx)
    except ConfigError as e:
        if "conformanceNoSuchSetting" not in str(e):
            return [f"start() refused an unknown setting without naming it: {e}"]
        return []
    except Exception as e:
        return [f"start() with an unknown setting raised {type(e).__name__}: {e}; raise ConfigError (use "
                "backends.plugin.parse_config with your config_model)"]
    else:
        await backend.stop()
        return ["start() accepted the unknown setting 'conformanceNoSuchSetting': validate ctx.config against "
                "config_model (backends.plugin.parse_config) and raise ConfigError"]


def _where(stall: Stall, roots: tuple[Path, ...]) -> tuple[str, int | None]:
    frames = stall.frames_in(roots)
    frame = frames[-1]
    return frame.filename, frame.lineno
