"""The card in `dra-agent demo`: allocated by a claim, prepared by the agent with its CDI spec, unprepared."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from simulator.conformance import scaled

PROFILE = Path(__file__).parent.parent / "acme-node.yaml"


def test_the_demo_prepares_a_card(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "agent", "demo", "--profile", str(PROFILE), "--color", "never"],
                          capture_output=True, text=True, timeout=scaled(180), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "✓ NodePrepareResources on acme-node succeeded for fpga.acme.example" in done.stdout
    assert "/dev/acme/fpga0" in done.stdout, "the CDI spec gives the container the card's node"
    assert "every step behaved" in done.stdout
