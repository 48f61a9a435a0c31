"""The one-shot commands: `discover` (what would be published) and `backends` (what is installed and found).

Each returns an exit status: 0 when it did its job, even with warnings about single devices or backends;
1 when it could not do its job at all (no backend usable); 2 for bad input (settings, profile).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any, TextIO

from agent.logs import get_logger
from agent.node.host import HostError, open_host, resolve_node_name
from agent.node.inventory import Survey, merge_pools, stop_all, survey
from agent.settings import Settings
from agent.slices.build import pool_slices

__all__ = ["backends_command", "check_command", "discover_command", "run_command"]

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


@dataclass(frozen=True)
class _NodeSurvey:
    node: str
    survey: Survey


async def _survey_node(settings: Settings, err: TextIO) -> _NodeSurvey | None:
    """Survey the real or simulated node once, stopping its backends; None (after saying why) when it cannot
    be opened."""
    try:
        with open_host(settings) as host:
            node = resolve_node_name(settings, host)
            found = await survey(settings, host)
            await stop_all(found.started)
            return _NodeSurvey(node, found)
    except HostError as e:
        print(f"dra-agent: {e}", file=err)
        return None


async def discover_command(settings: Settings, output: str, out: TextIO, err: TextIO) -> int:
    """Print the ResourceSlices the agent would publish for this node."""
    from agent.commands.output import render_slices  # the one-shot commands' output: not loaded for `run`

    node_survey = await _survey_node(settings, err)
    if node_survey is None:
        return EXIT_BAD_INPUT
    node, survey = node_survey.node, node_survey.survey
    log = get_logger("discovery")
    slices: list[dict[str, Any]] = []
    for pool in merge_pools(survey.reports):
        for problem in pool.problems:
            log.warning("device conflict", driver=pool.driver, problem=problem)
        if not pool.devices and not pool.counter_sets:
            continue
        published = pool_slices(pool.driver, node, pool.devices, pool.counter_sets)
        for reason in published.rejected:
            log.error("device not publishable", driver=pool.driver, reason=reason)
        slices.extend(published.slices)
    usable = [r for r in survey.reports if r.inventory is not None]
    if not usable:
        print("dra-agent: no backend could run; see the messages above", file=err)
        return EXIT_FAILED
    if not slices:
        names = ", ".join(r.name for r in usable)
        print(f"No supported devices found on node {node} (backends: {names}).", file=err)
    text = render_slices(slices, output)
    if text:
        print(text, file=out)
    return EXIT_OK


async def backends_command(settings: Settings, output: str, out: TextIO, err: TextIO) -> int:
    """List installed backends with version, driver name and whether each found hardware."""
    from agent.commands.output import BackendRow, render_backends

    node_survey = await _survey_node(settings, err)
    if node_survey is None:
        return EXIT_BAD_INPUT
    survey = node_survey.survey
    reports = {r.name: r for r in survey.reports}
    loaded = {p.found.name: p for p in survey.loaded}
    listed = {(p.name, p.distribution) for p in survey.found}
    failed = {f.name: f for f in survey.failures if (f.name, f.distribution) in listed}
    rows: list[BackendRow] = []
    for plugin in survey.found:
        name = plugin.name
        enabled = settings.backends is None or name in settings.backends
        driver = settings.driver_name(loaded[name].backend.driver) if name in loaded else None
        devices: int | None = None
        if not enabled:
            status = "disabled"
        elif name in failed:
            status = f"failed: {failed[name].message}"
        elif name in survey.start_errors:
            status = f"failed to start: {survey.start_errors[name]}"
        elif name in reports and reports[name].inventory is not None:
            inventory = reports[name].inventory
            assert inventory is not None
            devices = len(inventory.devices)
            status = f"{devices} device(s)" if devices else "no hardware found"
            unserved = [f"cannot serve {len(u.devices)} device(s): {u.reason}" for u in inventory.unserved]
            if unserved:
                status = "; ".join([f"{devices} device(s)", *unserved] if devices else unserved)
        else:
            status = f"failed: {reports[name].error}" if name in reports else "not run"
        rows.append(BackendRow(name, plugin.distribution, plugin.version, driver, enabled, devices, status))
    for failure in survey.failures:
        if (failure.name, failure.distribution) in listed:
            continue  # already shown on its backend's row
        rows.append(BackendRow(failure.name, failure.distribution, "?", None, True, None,
                               f"failed: {failure.message}"))
    print(render_backends(rows, output), file=out)
    return EXIT_OK


async def check_command(settings: Settings, output: str, out: TextIO, err: TextIO) -> int:
    """Check every enabled backend against the contract and print what each must fix (`backends --check`)."""
    from agent.commands.backend_check import check_backends  # the checks load the slice and CDI rules: only here

    return await check_backends(settings, output, out, err)


async def run_command(settings: Settings, output: str, out: TextIO, err: TextIO) -> int:
    """Run the node agent until stopped."""
    # Start-up makes tens of thousands of objects that live as long as the process (modules, classes, the node's
    # devices) and little garbage, which the cyclic collector would walk again and again: some 80 collections and
    # 20-30 ms in the daemon's and the backends' imports alone. It stays off until the agent serves
    # (agent.daemon.run turns it back on).
    gc.disable()
    try:
        from agent.daemon import run  # the daemon needs the Kubernetes client and gRPC: load them only here

        return await run(settings)
    finally:
        gc.enable()
