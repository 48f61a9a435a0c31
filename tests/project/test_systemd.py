"""The systemd unit under systemd/: valid for systemd-analyze with the documented drop-in, hardened, and its
environment file naming only settings the agent reads. (The notification protocol the unit's Type=notify relies
on: tests/agent/test_notify.py and tests/end_to_end/test_run_process.py.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from agent.settings import unknown_environment
from tests.support.repository import ROOT

UNIT = ROOT / "systemd" / "dra-agent.service"
ENV = ROOT / "systemd" / "dra-agent.env"
DOC = ROOT / "docs" / "systemd.md"


def test_unit_passes_systemd_analyze_verify(scratch: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is needed (apt-get install systemd)"
    binary = Path(sys.executable).parent / "dra-agent"
    unit = scratch / "dra-agent.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/dra-agent", str(binary)))
    done = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True)
    assert done.returncode == 0 and "dra-agent.service" not in done.stderr, done.stderr


def test_the_documented_network_drop_in_passes_verify(scratch: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is needed (apt-get install systemd)"
    (drop_in,) = re.findall(r"```ini\n# /etc/systemd/system/dra-agent\.service\.d/network\.conf\n(.*?)```",
                            DOC.read_text(), re.S)
    binary = Path(sys.executable).parent / "dra-agent"
    unit = scratch / "dra-agent.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/dra-agent", str(binary)) + "\n" + drop_in)
    done = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True)
    assert done.returncode == 0 and "dra-agent.service" not in done.stderr, done.stderr
    assert "IPAddressDeny=any" in drop_in


def test_the_environment_file_names_only_settings() -> None:
    """Every variable the environment file shows (commented out) is one the agent reads, KUBECONFIG among them:
    the unit's ProtectHome=yes hides ~/.kube/config."""
    names = re.findall(r"^#?([A-Z_]+)=", ENV.read_text(), re.M)
    assert "KUBECONFIG" in names and "NODE_NAME" in names
    assert unknown_environment({name: "" for name in names}) == []
    assert "ProtectHome=yes" in UNIT.read_text().splitlines()


def test_unit_settings() -> None:
    text = UNIT.read_text()
    for line in ("Type=notify", "Restart=on-failure", "WatchdogSec=30", "KillSignal=SIGTERM", "NoNewPrivileges=yes",
                 "ProtectSystem=strict", "After=network-online.target kubelet.service", "KillMode=process",
                 "RestrictNamespaces=mnt"):
        assert line in text.splitlines()
