"""What a driver's checkpoint journal recorded of each claim, read from the file as an operator would: the tests'
check that a claim's preparation began once, or was rolled back and begun again, never begun twice."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["journal_histories"]


def journal_histories(state_dir: Path, driver: str) -> dict[str, list[str]]:
    """What the driver's checkpoint journal in `state_dir` recorded of each claim, in order (`started`,
    `completed`, `removed`)."""
    journal = state_dir / driver / "checkpoint.journal"
    histories: dict[str, list[str]] = {}
    for line in journal.read_text().splitlines() if journal.exists() else []:
        record = json.loads(line.partition(" ")[2])
        if record.get("op") == "claim":
            histories.setdefault(record["claim"]["uid"], []).append(record["claim"]["state"])
        elif record.get("op") == "removed":
            histories.setdefault(record["uid"], []).append("removed")
    return histories
