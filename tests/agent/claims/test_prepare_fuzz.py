"""1,000 generated prepare requests and opaque configurations: no crash, no corrupted state, no file name from
an invalid reference, and no configuration that puts a path of its choosing into a CDI spec."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.contract import ClaimRef
from simulator.node.node import SimulatedNode
from tests.support.claim_strategies import requests
from tests.support.prepare_env import prepare_env

GPU = "gpu.nvidia.com"
SPEC_NAME = re.compile(r"k8s\.gpu\.nvidia\.com-claim_[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}\.json")


def test_generated_requests(sim_node: Callable[[str], SimulatedNode], scratch: Path) -> None:
    node = sim_node("dgx-h100")
    with asyncio.Runner() as runner:
        env = runner.run(prepare_env(node, scratch, ("nvidia-gpu",)))
        gpus = env.devices(GPU)
        preparer = env.preparer(GPU)
        allowed_nodes = {f"/dev/nvidia{i}" for i in range(8)} | {"/dev/nvidiactl", "/dev/nvidia-uvm",
                                                                  "/dev/nvidia-uvm-tools"}
        allowed_mounts = {str(p.relative_to(node.root).as_posix()) for p in node.root.joinpath("usr").rglob("*")}
        examples = 0
        successes: list[int] = []

        @settings(max_examples=1000, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(st.lists(requests(gpus), max_size=4, unique_by=lambda r: r[0].uid))
        def check(batch: list[tuple[ClaimRef, dict[str, Any] | None]]) -> None:
            nonlocal examples
            examples += 1
            env.claims.claims = {(ref.namespace, ref.name): body for ref, body in batch if body is not None}
            refs = [ref for ref, _ in batch]
            results = runner.run(preparer.prepare(refs))
            assert set(results) == {ref.uid for ref in refs}
            for spec_file in env.cdi_dir.iterdir():
                assert SPEC_NAME.fullmatch(spec_file.name), spec_file.name
                spec = json.loads(spec_file.read_text())
                for edits in [spec.get("containerEdits", {}), *(d["containerEdits"] for d in spec["devices"])]:
                    assert not edits.get("hooks")
                    assert {n["path"] for n in edits.get("deviceNodes", [])} <= allowed_nodes
                    assert {m["hostPath"].lstrip("/") for m in edits.get("mounts", [])} <= allowed_mounts
            prepared = {uid for uid, r in results.items() if not r.error}
            successes.append(len(prepared))
            assert {c.uid for c in preparer.checkpoint.claims.values()} == prepared
            assert all(c.state == "completed" for c in preparer.checkpoint.claims.values())
            errors = runner.run(preparer.unprepare(refs))
            assert errors == {ref.uid: "" for ref in refs}
            assert preparer.checkpoint.claims == {}
            assert list(env.cdi_dir.iterdir()) == []

        try:
            check()
        finally:
            runner.run(env.close())
        assert examples >= 1000
        assert sum(successes) >= 100, "enough generated claims are valid for the spec checks to bite"
        reloaded = env.preparer(GPU)
        assert reloaded.checkpoint.claims == {}, "the journal reads back whole (a damaged one would raise)"
        assert sorted(p.name for p in (scratch / "state").rglob("*") if p.is_file()) == ["checkpoint.journal"]
