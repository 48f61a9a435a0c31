"""1,000 generated prepare requests and opaque configurations: no crash, no corrupted state, no file name from
an invalid reference, and no configuration that puts a path of its choosing into a CDI spec."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.contract import ClaimRef
from simulator.node.node import SimulatedNode
from tests.prepare_env import NODE, prepare_env

GPU = "gpu.nvidia.com"
SPEC_NAME = re.compile(r"k8s\.gpu\.nvidia\.com-claim_[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}\.json")
NASTY = ["../../etc/passwd", "/dev/sda", "a/b", "x\x00y", "..", "", "UPPER", "spaces are bad", "-leading", "a" * 300]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20) | st.sampled_from(NASTY),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.sampled_from(["deviceNodes", "mounts", "hooks", "path", "hostPath", "env", "driverCapabilities",
                         "apiVersion", "kind", "x"]), children, max_size=4),
    max_leaves=12,
)


@st.composite
def parameters(draw: st.DrawFn) -> Any:
    base = draw(st.sampled_from([
        {"apiVersion": "dra-agent.io/v1alpha1", "kind": "GpuConfig"},
        {"apiVersion": "dra-agent.io/v1alpha1", "kind": "GpuConfig",
         "driverCapabilities": draw(st.lists(st.sampled_from(["compute", "utility", "video", "graphics", "root"]),
                                             max_size=5))},
        {"apiVersion": draw(st.text(max_size=10)), "kind": "GpuConfig"},
        {},
    ]))
    extra = draw(st.dictionaries(st.sampled_from(["deviceNodes", "mounts", "hooks", "hostPath", "env"]), json_values,
                                 max_size=2))
    return draw(st.sampled_from([base, {**base, **extra}, draw(json_values)]))


@st.composite
def requests(draw: st.DrawFn, gpus: list[str]) -> tuple[ClaimRef, dict[str, Any] | None]:
    valid_uid = str(uuid.UUID(int=draw(st.integers(0, 2**128 - 1)), version=4))
    if draw(st.booleans()):  # a sound claim, possibly with odd configuration
        ref = ClaimRef(valid_uid, "default", draw(st.sampled_from(["train", "infer", "a.b"])))
        results = [{"request": "gpu", "driver": GPU, "pool": NODE, "device": draw(st.sampled_from(gpus))}]
        configs = [] if draw(st.booleans()) else [
            {"source": "FromClaim", "requests": [], "opaque": {"driver": GPU, "parameters": draw(parameters())}}]
        return ref, {"metadata": {"uid": valid_uid, "name": ref.name, "namespace": "default"},
                     "status": {"allocation": {"devices": {"results": results, "config": configs}}}}
    uid = draw(st.sampled_from([valid_uid, draw(st.sampled_from(NASTY)), draw(st.text(max_size=40))]))
    name = draw(st.sampled_from(["train", "a.b", draw(st.sampled_from(NASTY))]))
    namespace = draw(st.sampled_from(["default", "team-a", draw(st.sampled_from(NASTY))]))
    ref = ClaimRef(uid, namespace, name)
    if draw(st.integers(0, 9)) == 0:
        return ref, None  # the claim does not exist
    results = [
        {"request": draw(st.sampled_from(["gpu", "gpu/sub", "x"])),
         "driver": draw(st.sampled_from([GPU, GPU, "sriov.dra-agent.io"])),
         "pool": draw(st.sampled_from([NODE, NODE, "other-node"])),
         "device": draw(st.sampled_from([*gpus, "gpu-0000-ff-00-0", draw(st.sampled_from(NASTY))]))}
        for _ in range(draw(st.integers(0, 3)))
    ]
    configs = [
        {"source": draw(st.sampled_from(["FromClass", "FromClaim", "Bogus"])),
         "requests": draw(st.sampled_from([[], ["gpu"], ["x", "gpu"]])),
         "opaque": {"driver": draw(st.sampled_from([GPU, "other.example.com"])), "parameters": draw(parameters())}}
        for _ in range(draw(st.integers(0, 3)))
    ]
    body = {"metadata": {"uid": draw(st.sampled_from([uid, uid, valid_uid])), "name": name, "namespace": namespace},
            "status": {"allocation": {"devices": {"results": results, "config": configs}}}}
    return ref, draw(st.sampled_from([body, body, {"status": draw(json_values)}]))


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
