"""Generated prepare requests for fuzz tests: claim references (sound, odd and hostile identities) with the claim
the API server holds for each (or none), and opaque configurations that try to name paths of their own."""

from __future__ import annotations

import uuid
from typing import Any

from hypothesis import strategies as st

from backends.contract import ClaimRef
from tests.support.prepare_env import NODE

GPU = "gpu.nvidia.com"
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
    bases: list[dict[str, Any]] = [
        {"apiVersion": "dra-agent.io/v1alpha1", "kind": "GpuConfig"},
        {"apiVersion": "dra-agent.io/v1alpha1", "kind": "GpuConfig",
         "driverCapabilities": draw(st.lists(st.sampled_from(["compute", "utility", "video", "graphics", "root"]),
                                             max_size=5))},
        {"apiVersion": draw(st.text(max_size=10)), "kind": "GpuConfig"},
        {},
    ]
    base = draw(st.sampled_from(bases))
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
    body: dict[str, Any] = {
        "metadata": {"uid": draw(st.sampled_from([uid, uid, valid_uid])), "name": name, "namespace": namespace},
        "status": {"allocation": {"devices": {"results": results, "config": configs}}}}
    odd: dict[str, Any] = {"status": draw(json_values)}
    return ref, draw(st.sampled_from([body, body, odd]))
