"""What the real kernel's sysfs shows of a device's network interface that lives in another network namespace, on
which `backends.sriov.vf_netdev` tells "in the host's namespace", "in another one" and "none" apart.

The machine's own interfaces with a parent device (a NIC's, e.g. virtio-net's `eth0`) cannot be moved away for a
test without cutting the machine off; the same view is had the other way round: a sysfs mounted from a fresh
network namespace shows the interface's parent from a namespace that does not hold it, as the host's sysfs shows a
VF whose interface a container runtime moved into a pod.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backends.sriov.vf_netdev import read_vf_interface
from tests.support.repository import ROOT

# In a new network and mount namespace: sysfs mounted there, the parent's net/ folder listed, and the agent's own
# reading of it. argv: folder, the parent device's path below /sys.
_CHILD = """
import json, os, subprocess, sys
from pathlib import Path
from backends.sriov.vf_netdev import read_vf_interface
folder, parent = sys.argv[1:3]
subprocess.run(["mount", "-t", "sysfs", "sysfs", folder], check=True)
seen = Path(folder, parent)
vf = read_vf_interface(seen, "x")
print(json.dumps({"exists": (seen / "net").is_dir(), "listed": sorted(os.listdir(seen / "net")),
                  "links": os.stat(seen / "net").st_nlink, "elsewhere": vf.elsewhere, "name": vf.name}))
"""


def _interface_with_a_parent() -> tuple[str, Path] | None:
    """An interface of this machine below a device (not a virtual one), and its parent's path below /sys."""
    for entry in sorted(Path("/sys/class/net").iterdir()):
        real = entry.resolve()
        if "/virtual/" not in str(real) and real.parent.name == "net":
            return entry.name, real.parent.parent.relative_to("/sys")
    return None


def test_an_interface_in_another_namespace_leaves_its_parents_net_folder_empty(tmp_path: Path) -> None:
    found = _interface_with_a_parent()
    if found is None:
        pytest.skip("this machine has no network interface below a device")
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("mounting sysfs in a network namespace of its own needs root and util-linux's unshare")
    name, parent = found
    here = read_vf_interface(Path("/sys", parent), "x")
    assert (here.name, here.elsewhere) == (name, False), "in this namespace's sysfs the interface is listed"
    child = subprocess.run(
        ["unshare", "--net", "--mount", "--propagation", "private", sys.executable, "-c", _CHILD, str(tmp_path),
         str(parent)],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    if child.returncode != 0 and ("Operation not permitted" in child.stderr or "Permission denied" in child.stderr):
        pytest.skip(f"cannot mount sysfs in a namespace of its own here: {child.stderr.strip()[-200:]}")
    assert child.returncode == 0, child.stderr
    seen = json.loads(child.stdout)
    assert seen["exists"] and seen["listed"] == [], "the folder stays, its entry of another namespace is hidden"
    assert seen["links"] > 2, "the hidden interface still counts as a subfolder"
    assert (seen["name"], seen["elsewhere"]) == (None, True)
