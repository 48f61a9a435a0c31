"""What `dra-agent run` tells an operator at start and on /metrics: one start-up line with the version, node,
backends and directories; the process's own metrics beside the agent's, without `_created` series; every metric
the docs (and the README) name is one the agent serves, and every metric it serves is named in docs/health.md."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

from agent import __version__
from simulator.apiserver.server import TestApiServer
from tests.support.agent_env import NODE, AgentProcess, free_port, served_metrics, settings_for, wait_until
from tests.support.repository import ROOT
from tests.support.timing import scaled


def families(address: str) -> dict[str, str]:
    """The metric families /metrics declares (`# TYPE name kind`), with or without samples yet."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=scaled(5)) as response:
        text = response.read().decode()
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))


METRIC = re.compile(r"\b((?:dra_agent|process|python)_[a-z_]+)")
NOT_METRICS = {"process_vm_readv", "process_vm_writev"}  # system calls a doc names


def documented_metrics(*docs: Path) -> set[str]:
    """Metric names in the docs' text, code blocks and tables (by default every doc and the README); a name
    ending in `_` stands for the metrics it begins (`grep dra_agent_published_`)."""
    return {m for doc in docs or [*(ROOT / "docs").glob("*.md"), ROOT / "README.md"]
            for m in METRIC.findall(doc.read_text()) if m not in NOT_METRICS}


def family_of(name: str, declared: dict[str, str]) -> str | None:
    """The family a sample name belongs to (`x_total` of counter `x`, `x_bucket` of histogram `x`); for a name
    ending in `_`, the first family it begins."""
    if name in declared:
        return name
    if name.endswith("_"):
        return next((family for family in sorted(declared) if family.startswith(name)), None)
    for suffix in ("_total", "_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name.removesuffix(suffix) in declared:
            return name.removesuffix(suffix)
    return None


async def test_start_line_process_metrics_and_the_documented_names(scratch: Path) -> None:
    async with TestApiServer() as server:
        server.add_node(NODE)
        address = f"127.0.0.1:{free_port()}"
        settings = settings_for(scratch, server.write_kubeconfig(scratch / "kubeconfig"), "dgx-h100",
                                metrics_address=address, log_level="info")
        agent = AgentProcess(settings)
        try:
            await agent.start()
            await wait_until(lambda: served_metrics(address).get('dra_agent_published_slices{driver="gpu.nvidia.com"}'),
                             timeout=scaled(30))
            # The start line must come before the agent says it is ready: wait for that line too (a driver's
            # slices may be published while another driver is still starting).
            await wait_until(lambda: '"event": "ready"' in agent.output() or '"event":"ready"' in agent.output(),
                             timeout=scaled(30))
            samples = served_metrics(address)
            declared = families(address)
        finally:
            await agent.stop()

    assert samples["process_resident_memory_bytes"] > 10 * 2**20
    assert samples["process_cpu_seconds_total"] > 0
    assert samples["process_open_fds"] >= 3
    assert samples["process_max_fds"] >= samples["process_open_fds"]
    assert any(name.startswith("python_info{") for name in samples)
    assert not [name for name in samples if "_created" in name], "no _created series"
    assert declared["dra_agent_node_request_seconds"] == "histogram"
    assert declared["dra_agent_claim_status_writes_total"] == "counter"

    not_served = {name for name in documented_metrics() if family_of(name, declared) is None}
    assert not not_served, f"the docs name metrics the agent does not serve: {sorted(not_served)}"
    # Counters are served as `x_total` samples, which is what docs and queries name.
    in_health = {family_of(name, declared) for name in documented_metrics(ROOT / "docs" / "health.md")}
    undocumented = {family for family in declared if family not in in_health}
    assert not undocumented, f"docs/health.md does not name metrics the agent serves: {sorted(undocumented)}"

    lines = [json.loads(line) for line in agent.output().splitlines() if line.startswith("{")]
    (start,) = [line for line in lines if line.get("event") == "starting"]
    assert start["version"] == __version__
    assert start["node"] == NODE
    assert start["backends"] == "all installed"
    assert start["simulate"] == "dgx-h100"
    assert start["driver_root"] == start["host_root"] == str(settings.sim_root)
    for directory in ("state_dir", "cdi_dir", "plugins_dir", "registry_dir"):
        assert start[directory] == str(getattr(settings, directory))
    assert start["metrics_address"] == address
    assert start["claim_status"] is True and start["health_timeout"] == 30
    assert start["allowed_configs"] == ",".join(settings.allowed_configs), "what claims may ask this node for"
    assert lines.index(start) < [line.get("event") for line in lines].index("ready")
