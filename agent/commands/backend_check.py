"""`dra-agent backends --check`: the static checks of the conformance kit (agent/commands/backend_rules.py) on the
installed backends, on this host or a simulated node: the entry point loads and the object meets the contract,
typed and documented settings and claim parameters, start with the configured settings, discover's devices pass
the API server's rules, and two discoveries agree. Exit status 0 when every enabled backend passes, 1 when one
fails, 2 for bad input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TextIO

from agent.commands.backend_rules import config_problems, inventory_problems, name_changes
from agent.node.host import HostError, open_host, resolve_node_name
from agent.node.inventory import Survey, discover_all, stop_all, survey
from agent.settings import Settings

__all__ = ["check_backends"]

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


@dataclass
class _Verdict:
    name: str
    origin: str
    problems: list[str] = field(default_factory=list)
    devices: int | None = None


async def check_backends(settings: Settings, output: str, out: TextIO, err: TextIO) -> int:
    """Check every enabled backend and print what each must fix."""
    try:
        with open_host(settings) as host:
            node = resolve_node_name(settings, host)
            found = await survey(settings, host)
            try:
                verdicts = await _verdicts(settings, node, found)
            finally:
                await stop_all(found.started)
    except HostError as e:
        print(f"dra-agent: {e}", file=err)
        return EXIT_BAD_INPUT
    if not verdicts:
        print("dra-agent: no backend to check (none installed, or none enabled with --backends)", file=err)
        return EXIT_FAILED
    where = f"simulated node {settings.simulate}" if settings.simulate else f"node {node}"
    for verdict in verdicts:
        if verdict.problems:
            print(f"{verdict.name} ({verdict.origin}): FAILED", file=out)
            for problem in verdict.problems:
                print(f"  - {problem}", file=out)
        else:
            seen = f"{verdict.devices} device(s) on {where}" if verdict.devices else f"no hardware on {where}"
            print(f"{verdict.name} ({verdict.origin}): ok, {seen}", file=out)
    failed = [v.name for v in verdicts if v.problems]
    if failed:
        print(f"dra-agent: {len(failed)} of {len(verdicts)} backend(s) failed the checks: {', '.join(failed)}",
              file=err)
        return EXIT_FAILED
    return EXIT_OK


async def _verdicts(settings: Settings, node: str, found: Survey) -> list[_Verdict]:
    verdicts: dict[str, _Verdict] = {}
    for plugin in found.found:
        if settings.backends is None or plugin.name in settings.backends:
            verdicts[plugin.name] = _Verdict(plugin.name, f"{plugin.distribution} {plugin.version}")
    for failure in found.failures:
        verdict = verdicts.setdefault(failure.name, _Verdict(failure.name, failure.distribution))
        verdict.problems.append(failure.message)
    for loaded in found.loaded:
        verdicts[loaded.found.name].problems += config_problems(loaded.backend)
    for name, error in found.start_errors.items():
        verdicts[name].problems.append(f"start() with the configured settings failed: {error}")
    first = {r.name: r for r in found.reports}
    second = {r.name: r for r in await discover_all(found.started, settings.driver_name)}
    for name, report in first.items():
        verdict = verdicts[name]
        if report.inventory is None:
            verdict.problems.append(report.error or "discover() failed")
            continue
        verdict.devices = len(report.inventory.devices)
        verdict.problems += inventory_problems(report.inventory, report.driver, node)
        again = second[name].inventory
        if again is None:
            verdict.problems.append(f"a second discover() failed: {second[name].error}")
        else:
            verdict.problems += name_changes(report.inventory, again, "between two discoveries")
    return [verdicts[name] for name in sorted(verdicts)]
