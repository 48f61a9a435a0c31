"""Benchmark: what a library would cost where the agent has hand-written code (rtnetlink, quantities, settings).

Three parts, each measured against the hand-written code back to back:

- imports: in fresh interpreters that have loaded what `dra-agent run` loads (bench/imports.py's list), the time,
  the modules and the resident memory that importing each candidate adds, the variants alternating run by run
  (pydantic-settings is on that path since the agent uses it: the settings part measures it);
- rtnetlink: opening a socket bound to link changes (ours, pyroute2's `IPRoute` + `bind`), the memory that adds,
  and decoding the link messages of a real dump of this namespace's links (ours, pyroute2's `MarshalRtnl`);
- settings: importing agent.settings and resolving a config file, the environment and flags, against another
  checkout's (`--baseline DIR`, e.g. a `git worktree` of the commit before pydantic-settings);
- quantities: the time per call of `parse_quantity` on the texts the agent reads (ours, the Kubernetes client's),
  and the texts on which the two disagree about what is a quantity or what it is worth.

    python bench/libraries.py [--runs 11] [--part imports|rtnetlink|quantities|settings]
                                [--baseline DIR]

pyroute2 and pydantic-settings are not the agent's dependencies: `pip install pyroute2 pydantic-settings` first.
The rtnetlink part opens netlink sockets of this process's network namespace (no privilege needed).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.imports import RUN_PATH
from bench.machine import conditions

IMPORTS: dict[str, tuple[str | None, str]] = {
    # name: (package set up without its __init__.py first, module imported)
    "pyroute2 (whole package)": (None, "pyroute2"),
    "pyroute2 IPRoute only (package __init__ skipped)": ("pyroute2", "pyroute2.iproute.linux"),
    "pyroute2 link message parser only (package __init__ skipped)": ("pyroute2", "pyroute2.netlink.rtnl.marshal"),
    "kubernetes.utils.quantity": (None, "kubernetes.utils.quantity"),
    "kubernetes.utils.quantity (kubernetes.utils __init__ skipped)": ("kubernetes.utils", "kubernetes.utils.quantity"),
}

_CHILD = """
import json, sys, time
import {run_path}
import importlib.util
def _package_without_its_init(name):
    # Registers the package without running its __init__.py, so its submodules import alone: what skipping the
    # package's own imports would save.
    if name not in sys.modules:
        sys.modules[name] = importlib.util.module_from_spec(importlib.util.find_spec(name))
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
before_modules, before_rss = len(sys.modules), rss()
began, cpu = time.perf_counter(), time.process_time()
if {bypass!r} is not None:
    _package_without_its_init({bypass!r})
import {module}
took, cpu = time.perf_counter() - began, time.process_time() - cpu
print(json.dumps({{"ms": took * 1000, "cpu": cpu * 1000, "modules": len(sys.modules) - before_modules,
                  "kb": rss() - before_rss}}))
"""


def median(values: list[float]) -> float:
    return statistics.median(values)


def imports(runs: int) -> None:
    results: dict[str, list[dict[str, float]]] = {name: [] for name in IMPORTS}
    for _ in range(runs):
        for name, (bypass, module) in IMPORTS.items():  # alternating: each run measures every variant once
            code = _CHILD.format(run_path=", ".join(RUN_PATH), bypass=bypass, module=module)
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            results[name].append(json.loads(done.stdout))
    print(f"\nimports on top of what `run` loads, {runs} fresh interpreters each, alternating (median, min-max):")
    for name, rows in results.items():
        ms, cpu = [r["ms"] for r in rows], [r["cpu"] for r in rows]
        print(f"  {name}: {median(ms):.1f} ms ({min(ms):.1f}-{max(ms):.1f}; CPU {median(cpu):.1f}), "
              f"{median([r['modules'] for r in rows]):.0f} modules, "
              f"RSS +{median([r['kb'] for r in rows]) / 1024:.1f} MB")


def _timed(work: Callable[[], Any], repeat: int) -> float:
    """Median microseconds of `work()` over `repeat` calls."""
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        work()
        times.append(time.perf_counter() - began)
    return median(times) * 1e6


def _link_dump() -> bytes:
    """The RTM_NEWLINK messages of a dump of this namespace's links, as the kernel sends them."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
    try:
        # nlmsghdr (RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP) + an empty ifinfomsg
        import struct

        sock.send(struct.pack("=IHHII", 32, 18, 0x301, 1, 0) + bytes(16))
        data = b""
        while True:
            chunk = sock.recv(65536)
            if struct.unpack_from("=H", chunk, 4)[0] == 3:  # NLMSG_DONE
                return data
            data += chunk
    finally:
        sock.close()


_RSS_CHILD = """
import json, sys
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
import {run_path}
{imports}
before = rss()
{opens}
print(json.dumps({{"kb": rss() - before}}))
"""


def rtnetlink(runs: int) -> None:
    from pyroute2.iproute.linux import IPRoute
    from pyroute2.netlink.rtnl.marshal import MarshalRtnl

    from agent.node.link_monitor import RTMGRP_LINK, _open_socket, link_changes

    def ours() -> None:
        _open_socket().close()

    def theirs() -> None:
        ipr = IPRoute()
        ipr.bind(groups=RTMGRP_LINK)
        ipr.close()

    opened = {"ours": [], "pyroute2": []}  # type: dict[str, list[float]]
    for _ in range(runs):
        opened["ours"].append(_timed(ours, 20))
        opened["pyroute2"].append(_timed(theirs, 20))
    print("\nrtnetlink: open a socket bound to link changes and close it (median of medians of 20, µs): "
          + ", ".join(f"{k} {median(v):.0f}" for k, v in opened.items()))

    memory: dict[str, list[float]] = {"ours": [], "pyroute2": []}
    ours_code = _RSS_CHILD.format(run_path=", ".join(RUN_PATH), imports="from agent.node.link_monitor import "
                                  "open_link_monitor", opens="m = open_link_monitor()")
    theirs_code = _RSS_CHILD.format(run_path=", ".join(RUN_PATH), imports="from pyroute2 import IPRoute",
                                    opens="ipr = IPRoute(); ipr.bind(groups=1)")
    for _ in range(runs):
        for name, code in (("ours", ours_code), ("pyroute2", theirs_code)):
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            memory[name].append(json.loads(done.stdout)["kb"] / 1024)
    print("rtnetlink: RSS added by opening it, after the imports (median, MB): "
          + ", ".join(f"{k} {median(v):.2f}" for k, v in memory.items()))

    data = _link_dump()
    messages = len(link_changes(data))
    marshal = MarshalRtnl()

    def decode_ours() -> None:
        link_changes(data)

    def decode_theirs() -> None:
        for msg in marshal.parse(data):
            msg.get_attr("IFLA_IFNAME")
            msg["flags"]

    decoded = {"ours": [], "pyroute2": []}  # type: dict[str, list[float]]
    for _ in range(runs):
        decoded["ours"].append(_timed(decode_ours, 50) / messages)
        decoded["pyroute2"].append(_timed(decode_theirs, 50) / messages)
    print(f"rtnetlink: decode a dump of {messages} links, {len(data)} bytes (per link message, µs): "
          + ", ".join(f"{k} {median(v):.1f}" for k, v in decoded.items()))


# What the agent reads: counters and capacities it published (format_quantity's output) and the API server's
# canonical forms in consumedCapacity.
SAMPLES = ["80Gi", "1", "8", "250m", "1536Mi", "40Gi", "85899345920", "100", "1Ki", "500m"]
# Texts either side may judge differently: the tests' refused forms and a few the Decimal constructor takes.
PROBES = ["", " ", " 1", "1 ", "1 Gi", "1.2.3", "5KB", "Gi", "Ki", "+", "-", ".", "+.", "1e", "1e+", "1e1.5", "1ki",
          "1K", "1Kib", "1gi", "1Gi3", "e3", "1ee3", "abc", "1\n", "\u0661", "--1", "1_000", "0x10", "1m3", "1Ki+3",
          "NaN", "Infinity", "-inf", "sNaN", "1e3k", "1.5e1Mi", "1e1000000000", "7", "+7", "1.", ".5", "80Gi",
          "12E-2", "-0.5e-1", "1n", "2Ei", "123456789012345678901234567890Ki", "0.1234567890123456789012345678901"]


def quantities(runs: int) -> None:
    from kubernetes.utils.quantity import parse_quantity as theirs

    from agent.kube.quantity import parse_quantity as ours

    per_call = {"ours": [], "kubernetes": []}  # type: dict[str, list[float]]
    for _ in range(runs):
        per_call["ours"].append(_timed(lambda: [ours(t) for t in SAMPLES], 200) / len(SAMPLES))
        per_call["kubernetes"].append(_timed(lambda: [theirs(t) for t in SAMPLES], 200) / len(SAMPLES))
    print(f"\nquantities: parse_quantity per call on {SAMPLES} (median, µs): "
          + ", ".join(f"{k} {median(v):.2f}" for k, v in per_call.items()))

    def verdict(parse: Callable[[str], Any], text: str) -> str:
        try:
            value = parse(text)
        except (ValueError, ArithmeticError) as e:
            return f"refused ({type(e).__name__})"
        if isinstance(value, Decimal) and (not value.is_finite() or abs(value.adjusted()) > 100):
            return str(value)  # not a number, or too large to turn into a fraction here
        return str(Fraction(value))

    print("quantities: where the two differ (text: ours | kubernetes):")
    for text in PROBES:
        a, b = verdict(ours, text), verdict(theirs, text)
        same = a == b or (a.startswith("refused") and b.startswith("refused"))
        if not same:
            print(f"  {text!r}: {a[:40]} | {b[:40]}")


_SETTINGS_CHILD = """
import json, os, statistics, sys, tempfile, time
from pathlib import Path
began, cpu = time.perf_counter(), time.process_time()
import {run_path}
imported, imported_cpu = time.perf_counter() - began, time.process_time() - cpu
import agent.settings as settings
config = Path(tempfile.mkdtemp()) / "agent.yaml"
config.write_text({config!r})
environ = dict(os.environ) | {environ!r}
flags = {{"log_level": "info", "sysfs_root": None, "host_netns": None}}
began = time.perf_counter()
settings.load_settings(flags, environ, config)
first = time.perf_counter() - began
later = []
for _ in range(50):
    began = time.perf_counter()
    settings.load_settings(flags, environ, config)
    later.append(time.perf_counter() - began)
os.unlink(config)
print(json.dumps({{"file": settings.__file__, "import": imported * 1000, "cpu": imported_cpu * 1000,
                  "first": first * 1000,
                  "later": statistics.median(later) * 1000}}))
"""
# docs/configuration.md's example file, and what a DaemonSet sets
_CONFIG = """node_name: gpu-node-17
log_level: info
backends: [nvidia-gpu, nvidia-mig, sriov-nic]
driver_names:
  gpu.nvidia.com: gpu.example.org
backend_config:
  nvidia-gpu:
    ignoredXids: [13, 31, 43, 45, 68, 109, 94]
  nvidia-mig:
    mode: static
"""
_ENVIRON = {"NODE_NAME": "gpu-node-17", "DRA_AGENT_HOST_ROOT": "/host", "DRA_AGENT_SYSFS_ROOT": "/host/sys",
            "DRA_AGENT_NO_EXECUTE": "gpu-lost,xid", "DRA_AGENT_BACKEND_CONFIG": '{"nvidia-mig": {"mode": "static"}}'}


def settings_cost(runs: int, baseline: Path | None) -> None:
    """Import what `run` loads and resolve a config file, the environment and flags, in fresh interpreters; with
    `baseline`, alternating with that source tree's agent (another checkout of the repository). Both trees are
    found through PYTHONPATH, the same way; compile both trees' bytecode first (`python -m compileall -q agent`),
    as an installed package has it."""
    trees: dict[str, Path | None] = {"this tree": Path(__file__).resolve().parent.parent}
    if baseline is not None:
        trees["baseline"] = baseline
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    code = _SETTINGS_CHILD.format(run_path=", ".join(RUN_PATH), config=_CONFIG, environ=_ENVIRON)
    for _ in range(runs):
        for name, tree in trees.items():
            env = dict(os.environ)
            if tree is not None:
                env["PYTHONPATH"] = str(tree)
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                                  cwd=tempfile.gettempdir())
            results[name].append(json.loads(done.stdout))
    print(f"\nsettings: import what `run` loads, then load_settings (file, environment, flags), {runs} fresh "
          "interpreters each, alternating (median, ms):")
    for name, rows in results.items():
        print(f"  {name} ({rows[0]['file']}): import {median([r['import'] for r in rows]):.1f} "
              f"(CPU {median([r['cpu'] for r in rows]):.1f}), first "
              f"load_settings {median([r['first'] for r in rows]):.2f}, later ones "
              f"{median([r['later'] for r in rows]):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=11)
    parser.add_argument("--part", choices=("all", "imports", "rtnetlink", "quantities", "settings"), default="all")
    parser.add_argument("--baseline", type=Path, help="settings part: also measure this checkout's agent/settings.py")
    args = parser.parse_args()
    print(conditions())
    if args.part in ("all", "imports"):
        imports(args.runs)
    if args.part in ("all", "rtnetlink"):
        rtnetlink(args.runs)
    if args.part in ("all", "quantities"):
        quantities(args.runs)
    if args.part in ("all", "settings"):
        settings_cost(args.runs, args.baseline)
    print(conditions())


if __name__ == "__main__":
    main()
