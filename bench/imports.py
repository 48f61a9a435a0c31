"""Benchmark: what `dra-agent run` spends importing, from `python -X importtime` in fresh interpreters.

Imports the modules `run` loads before it serves (the command line, the daemon and the built-in backends), once per
run in a fresh interpreter, and prints the medians: the total, the time per top-level package (each module's own
time, its imports excluded), and the modules that take longest on their own.

    python bench/imports.py [--runs 9] [--top 15]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import conditions

RUN_PATH = ("agent.commands.cli", "agent.commands.handlers", "agent.daemon", "backends.nvidia.gpu",
            "backends.nvidia.mig", "backends.sriov.backend", "backends.tpu")
"""What `dra-agent run` imports on a node: the command, the daemon (all it serves with) and the backends."""
_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def one_run(modules: tuple[str, ...]) -> tuple[int, Counter[str], Counter[str]]:
    """Microseconds: the whole import, each top-level package's own time, each module's own time."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {', '.join(modules)}"],
                          capture_output=True, text=True, check=True)
    packages: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in done.stderr.splitlines():
        found = _LINE.match(line)
        if found is None:
            continue
        self_us, name = int(found[1]), found[4]
        total += self_us
        packages[name.split(".")[0]] += self_us
        own[name] += self_us
    return total, packages, own


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    print(conditions())
    totals: list[int] = []
    packages: dict[str, list[int]] = {}
    own: dict[str, list[int]] = {}
    for _ in range(args.runs):
        total, by_package, by_module = one_run(RUN_PATH)
        totals.append(total)
        for name, us in by_package.items():
            packages.setdefault(name, []).append(us)
        for name, us in by_module.items():
            own.setdefault(name, []).append(us)

    def median(values: list[int]) -> float:
        return statistics.median(values + [0] * (args.runs - len(values))) / 1000

    ours = sum(median(v) for k, v in packages.items() if k in ("agent", "backends", "cdi"))
    print(f"imports of `run` ({len(own)} modules), {args.runs} fresh interpreters: median {median(totals):.0f} ms, "
          f"min {min(totals) / 1000:.0f} ms; of which the project's own modules (agent, backends, cdi) "
          f"{ours:.0f} ms")
    ranked = sorted(packages, key=lambda k: -median(packages[k]))
    print("by package (own time of its modules, ms): " +
          ", ".join(f"{name} {median(packages[name]):.1f}" for name in ranked[: args.top]))
    ranked = sorted(own, key=lambda k: -median(own[k]))
    print("slowest modules on their own (ms): " +
          ", ".join(f"{name} {median(own[name]):.1f}" for name in ranked[: args.top]))
    print(conditions())


if __name__ == "__main__":
    main()
