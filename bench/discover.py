"""Benchmark: `dra-agent discover` wall time on dgx-h100 as the number of VFs per PF grows.

Runs the installed command as a user would, a fresh process each time, in two ways:

- "on the node": against a simulated node kept on disk (`--sim-root`), as on a real host where sysfs already
  exists: interpreter start, imports, backends reading sysfs and NVML, slices, JSON output;
- "from scratch": also building and removing the simulated node's sysfs tree in the same process.

Prints a Markdown table and a least-squares fit of time against device count, to show the cost is linear.

    python bench/discover.py [--runs 7] [--vfs 8,16,32,64]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from simulator.node.profile import load_profile


def profile_with_vfs(vfs: int, folder: Path) -> Path:
    """The dgx-h100 profile with `vfs` VFs enabled on each of its 8 ConnectX-7 PFs."""
    data = load_profile("dgx-h100").model_dump(exclude_defaults=False)
    data["name"] = f"dgx-h100-{vfs}vf"
    for root in data["root_complexes"]:
        for port in root["ports"]:
            for slot in port["switch"]:
                if slot.get("nic"):
                    slot["nic"]["sriov"] = {"total_vfs": 64, "num_vfs": vfs}
    path = folder / f"dgx-{vfs}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run_once(command: list[str]) -> tuple[float, int]:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    elapsed = time.perf_counter() - start
    devices = sum(len(s["spec"].get("devices", [])) for s in json.loads(done.stdout))
    return elapsed, devices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--vfs", default="8,16,32,64")
    args = parser.parse_args()
    exe = shutil.which("dra-agent") or str(Path(sys.executable).parent / "dra-agent")
    folder = Path(tempfile.mkdtemp(prefix="dra-bench-"))
    rows: list[tuple[int, int, float, float, float, float]] = []
    memory = Path(tempfile.mkdtemp(prefix="dra-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        for vfs in (int(v) for v in args.vfs.split(",")):
            profile = str(profile_with_vfs(vfs, folder))
            scratch = [exe, "discover", "--simulate", profile, "-o", "json", "--log-level", "error"]
            kept = [*scratch, "--sim-root", str(memory / f"node-{vfs}")]
            run_once(kept)  # builds the kept node, warms the page cache
            on_node, from_scratch, devices = [], [], 0
            for _ in range(args.runs):
                elapsed, devices = run_once(kept)
                on_node.append(elapsed)
                from_scratch.append(run_once(scratch)[0])
            rows.append((vfs, devices, statistics.median(on_node), max(on_node),
                         statistics.median(from_scratch), max(from_scratch)))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)
    print("| VFs per PF | devices | on the node: median (s) | max (s) | from scratch: median (s) | max (s) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for vfs, devices, median, worst, scratch_median, scratch_worst in rows:
        print(f"| {vfs} | {devices} | {median:.3f} | {worst:.3f} | {scratch_median:.3f} | {scratch_worst:.3f} |")
    xs = [float(r[1]) for r in rows]
    for label, column in (("on the node", 2), ("from scratch", 4)):
        ys = [r[column] for r in rows]
        slope, intercept = statistics.linear_regression(xs, ys)
        r = statistics.correlation(xs, ys) if len(rows) > 2 else 1.0
        print(f"\n{label}: {intercept * 1000:.0f} ms fixed + {slope * 1e6:.0f} µs per device (r² = {r * r:.4f})")


if __name__ == "__main__":
    main()
