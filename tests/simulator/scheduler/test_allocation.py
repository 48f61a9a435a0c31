"""The pure structured allocation: requests, selectors, constraints, counters, taints, admin access, pools, the
status it writes, and the words it explains itself with; on the slices the agent publishes where that is cheap."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulator.scheduler.allocation import Allocation, Unallocatable, allocate
from simulator.scheduler.cel import CelError
from tests.support.allocation_env import (
    claim,
    device,
    device_class,
    device_classes,
    discovered,
    exactly,
    example_claim,
    held_by,
    resource_slice,
)
from tests.support.mig_env import dgx_h100_in_mig_mode

ROOT_ATTR = "resource.kubernetes.io/pcieRoot"
MIG_DYNAMIC = {"nvidia-mig": {"mode": "dynamic"}}
GPU_CLASS = device_class("gpu", 'device.attributes["x.example.com"].kind == "gpu"')
NIC_CLASS = device_class("nic", 'device.attributes["x.example.com"].kind == "nic"')
CLASSES = [GPU_CLASS, NIC_CLASS]


def gpu(name: str, root: str = "pci0000:15", *, taints: list[dict[str, Any]] | None = None,
        consumes: dict[str, dict[str, str]] | None = None, **attributes: Any) -> dict[str, Any]:  # fmt: skip
    return device(name, {"kind": "gpu", ROOT_ATTR: root, **attributes}, taints=taints, consumes=consumes)


def nic(name: str, root: str = "pci0000:15") -> dict[str, Any]:
    return device(name, {"kind": "nic", ROOT_ATTR: root})


def node_slice(*devices: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    return resource_slice(kwargs.pop("name", "slice-a"), *devices, **kwargs)


def run(c: dict[str, Any], slices: list[dict[str, Any]], *, classes: list[dict[str, Any]] = CLASSES,
        allocated: list[dict[str, Any]] | None = None, node: str | dict[str, Any] = "node-a",
        ) -> Allocation:  # fmt: skip
    return allocate(c, classes=classes, slices=slices, allocated=allocated or [], node=node)


def refused(c: dict[str, Any], slices: list[dict[str, Any]], **kwargs: Any) -> list[str]:
    with pytest.raises(Unallocatable) as caught:
        run(c, slices, **kwargs)
    return caught.value.reasons


def devices_of(allocation: Allocation) -> list[tuple[str, str]]:
    return [(r.request, r.device) for r in allocation.results]


# --- the shipped examples on the agent's own slices -------------------------------------------------------------


@pytest.fixture(scope="module")
def dgx() -> list[dict[str, Any]]:
    return discovered("dgx-h100")


def test_all_gpus_gets_every_gpu_of_a_dgx(dgx: list[dict[str, Any]]) -> None:
    allocation = run(example_claim("all-gpus"), dgx, classes=device_classes(), node="dgx-h100")
    gpus = [d["name"] for s in dgx if s["spec"]["driver"] == "gpu.nvidia.com" for d in s["spec"]["devices"]]
    assert devices_of(allocation) == [("gpus", name) for name in gpus]
    assert allocation.status["devices"]["config"] == [{
        "source": "FromClass", "requests": ["gpus"],
        "opaque": {"driver": "gpu.nvidia.com", "parameters": {"apiVersion": "dra-agent.io/v1alpha1",
                                                              "kind": "GpuConfig",
                                                              "driverCapabilities": ["compute", "utility"]}}}]
    assert allocation.status["nodeSelector"] == {
        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["dgx-h100"]}]}]}


@pytest.mark.parametrize(("example", "attribute"), [
    ("gpu-rdma-same-pcie-root", ROOT_ATTR), ("gpu-rdma-same-pcie-switch", "dra-agent.io/pcieSwitch")])
def test_a_gpu_and_an_rdma_vf_below_one_root_or_switch(dgx: list[dict[str, Any]], example: str, attribute: str) -> None:
    # As the examples' own note says: an H100 80GB reports 81559Mi, below 80Gi; their lower bound takes it.
    c = example_claim(example)
    selector = c["spec"]["devices"]["requests"][0]["exactly"]["selectors"][0]["cel"]
    reasons = refused(c, dgx, classes=device_classes(), node="dgx-h100")
    assert reasons == [f"request gpu: needs 1 device(s); 8 devices of class gpu.nvidia.com on node dgx-h100, "
                       f"0 of 8 match selector {selector['expression']!r}"]
    selector["expression"] = selector["expression"].replace("80Gi", "79Gi")
    allocation = run(c, dgx, classes=device_classes(), node="dgx-h100")
    assert devices_of(allocation) == [("gpu", "gpu-0000-18-00-0"), ("nic", "vf-0000-19-00-1")]
    by_name = {d["name"]: d for s in dgx for d in s["spec"]["devices"]}
    values = {by_name[r.device]["attributes"][attribute]["string"] for r in allocation.results}
    assert len(values) == 1
    assert f"matchAttribute {attribute} = {values.pop()} for gpu, nic" in allocation.explanation


def test_two_gpus_on_a_t4_node_and_not_three() -> None:
    slices = discovered("gke-n1-t4x2")
    two = claim("two", exactly("gpus", "gpu.nvidia.com", count=2))
    assert [r.device for r in run(two, slices, classes=device_classes(), node="gke-n1-t4x2").results] == [
        d["name"] for d in slices[0]["spec"]["devices"]]
    three = claim("three", exactly("gpus", "gpu.nvidia.com", count=3))
    assert refused(three, slices, classes=device_classes(), node="gke-n1-t4x2") == [
        "request gpus: needs 3 device(s); 2 devices of class gpu.nvidia.com on node gke-n1-t4x2"]
    assert refused(two, slices, classes=device_classes(), node="other-node") == [
        "request gpus: no device of class gpu.nvidia.com on node other-node (of 0 devices there)"]


def test_tpu_host_takes_every_chip() -> None:
    slices = discovered("tpu-v5e-8")
    allocation = run(example_claim("tpu-host"), slices, classes=device_classes(), node="tpu-v5e-8")
    assert len(allocation.results) == 8
    assert {r.driver for r in allocation.results} == {"tpu.google.com"}


def mig_claim(name: str, profile: str, gpu_index: int = 0) -> dict[str, Any]:
    return claim(name, exactly("mig", "mig.nvidia.com",
                               f'device.attributes["gpu.nvidia.com"].profile == "{profile}" && '
                               f'device.attributes["gpu.nvidia.com"].parentIndex == {gpu_index}'))  # fmt: skip


@pytest.fixture(scope="module")
def mig_slices(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return discovered(str(dgx_h100_in_mig_mode(Path(tmp_path_factory.mktemp("mig")))), MIG_DYNAMIC)


def test_seven_1g_placements_fill_a_gpu_and_a_7g_fits_only_when_all_are_released(
    mig_slices: list[dict[str, Any]],
) -> None:
    node, classes = "dgx-h100-mig", device_classes()
    held: list[dict[str, Any]] = []
    for index in range(7):
        c = mig_claim(f"small-{index}", "1g.10gb")
        allocation = run(c, mig_slices, classes=classes, allocated=held, node=node)
        assert devices_of(allocation) == [("mig", f"gpu-0000-18-00-0-mig-1g10gb-19-{index}")]
        held.append(held_by(c, allocation))
    assert ("counters gpu-0000-18-00-0-counters (pool dgx-h100-mig): copy-engines 1 (1 left), decoders 1 (0 left), "
            "jpeg-engines 1 (0 left), memory 9984Mi (11Gi left), memory-slice-6 1 (0 left), "
            "multiprocessors 16 (20 left)") in allocation.explanation
    reasons = refused(mig_claim("small-7", "1g.10gb"), mig_slices, classes=classes, allocated=held, node=node)
    assert reasons[0] == ("request mig: needs 1 device(s); 7 match its class and selectors, 0 available "
                          "(7 in use by default/small-0, default/small-1, default/small-2, default/small-3 and 3 more)")
    for keep in range(7):
        reasons = refused(mig_claim("big", "7g.80gb"), mig_slices, classes=classes, allocated=held[keep:], node=node)
        assert reasons[0] == ("request mig: needs 1 device(s); 1 match its class and selectors, 0 available "
                              "(1 without the counters they need)")
        assert reasons[1].startswith("counters: gpu-0000-18-00-0-counters (pool dgx-h100-mig): ")
        assert reasons[1].endswith(f"exhausted by claims {', '.join(f'default/small-{i}' for i in range(keep, 7))}"
                                   if 7 - keep <= 4 else "and 3 more" if keep == 0 else "more")
    allocation = run(mig_claim("big", "7g.80gb"), mig_slices, classes=classes, node=node)
    assert devices_of(allocation) == [("mig", "gpu-0000-18-00-0-mig-7g80gb-0-0")]
    # Another GPU's counters are its own.
    other = run(mig_claim("big-1", "7g.80gb", 1), mig_slices, classes=classes, allocated=held, node=node)
    assert devices_of(other) == [("mig", "gpu-0000-1c-00-0-mig-7g80gb-0-0")]


def test_counters_are_shared_within_a_claim(mig_slices: list[dict[str, Any]]) -> None:
    one = mig_claim("x", "4g.40gb")["spec"]["devices"]["requests"][0]
    two = claim("two-4g", {**one, "name": "a"}, {**one, "name": "b"})
    reasons = refused(two, mig_slices, classes=device_classes(), node="dgx-h100-mig")
    assert reasons == ["no combination of the candidates satisfies the constraints and counters together "
                       "(tried 2 device placements)"]
    pair = claim("pair", exactly("mig", "mig.nvidia.com", 'device.attributes["gpu.nvidia.com"].profile == "3g.40gb" && '
                                 'device.attributes["gpu.nvidia.com"].parentIndex == 0', count=2))
    allocation = run(pair, mig_slices, classes=device_classes(), node="dgx-h100-mig")
    assert [r.device for r in allocation.results] == ["gpu-0000-18-00-0-mig-3g40gb-9-0",
                                                      "gpu-0000-18-00-0-mig-3g40gb-9-4"]


# --- requests --------------------------------------------------------------------------------------------------


def test_exact_count_takes_devices_in_slice_order() -> None:
    slices = [node_slice(gpu("g2"), name="b", count=2), node_slice(gpu("g0"), gpu("g1"), name="a", count=2)]
    assert devices_of(run(claim("c", exactly("gpus", "gpu", count=2)), slices)) == [("gpus", "g0"), ("gpus", "g1")]


def test_all_mode_needs_every_matching_device_free() -> None:
    slices = [node_slice(gpu("g0"), gpu("g1"), nic("n0"))]
    every = claim("every", exactly("gpus", "gpu", mode="All"))
    assert devices_of(run(every, slices)) == [("gpus", "g0"), ("gpus", "g1")]
    one = claim("one", exactly("gpu", "gpu"))
    held = [held_by(one, run(one, slices))]
    assert refused(every, slices, allocated=held) == [
        "request gpus: needs all matching devices; 2 match its class and selectors, 1 available "
        "(1 in use by default/one)"]
    assert refused(claim("none", exactly("gpus", "gpu", 'device.attributes["x.example.com"].kind == "tpu"',
                                         mode="All")), slices) == [
        "request gpus: needs all matching devices; 2 devices of class gpu on node node-a, "
        """0 of 2 match selector 'device.attributes["x.example.com"].kind == "tpu"'"""]


def test_first_available_takes_the_first_sub_request_that_can_be_satisfied() -> None:
    slices = [node_slice(gpu("g0", size="small"), gpu("g1", size="small"))]
    request = {"name": "gpu", "firstAvailable": [
        {"name": "big", "deviceClassName": "gpu", "selectors": [
            {"cel": {"expression": 'device.attributes["x.example.com"].size == "big"'}}]},
        {"name": "two-small", "deviceClassName": "gpu", "count": 2},
    ]}
    config: list[dict[str, Any]] = [
        {"requests": ["gpu/two-small"], "opaque": {"driver": "x.example.com", "parameters": {"small": True}}},
        {"requests": ["gpu/big"], "opaque": {"driver": "x.example.com", "parameters": {"big": True}}},
        {"opaque": {"driver": "x.example.com", "parameters": {"every": True}}}]
    allocation = run(claim("c", request, config=config), slices)
    assert devices_of(allocation) == [("gpu/two-small", "g0"), ("gpu/two-small", "g1")]
    assert allocation.status["devices"]["config"] == [{"source": "FromClaim", **config[0]},
                                                      {"source": "FromClaim", **config[2]}]
    assert allocation.explanation[0].startswith("request gpu/two-small: sub-request 2 of 2 (the ones before cannot")
    slices[0]["spec"]["devices"][1]["attributes"]["size"] = {"string": "big"}
    assert devices_of(run(claim("c", request), slices)) == [("gpu/big", "g1")]


def test_class_config_names_the_requests_of_that_class() -> None:
    config = [{"opaque": {"driver": "x.example.com", "parameters": {"mode": "fast"}}}]
    classes = [device_class("gpu", 'device.attributes["x.example.com"].kind == "gpu"', config=config), NIC_CLASS]
    slices = [node_slice(gpu("g0"), gpu("g1"), nic("n0"))]
    allocation = run(claim("c", exactly("a", "gpu"), exactly("n", "nic"), exactly("b", "gpu")), slices,
                     classes=classes)  # fmt: skip
    assert allocation.status["devices"]["config"] == [{"source": "FromClass", "requests": ["a", "b"], **config[0]}]


# --- constraints -----------------------------------------------------------------------------------------------


def test_match_attribute_keeps_devices_on_one_root_and_says_why_not() -> None:
    slices = [node_slice(gpu("g0", "pci0000:15"), gpu("g1", "pci0000:36"), nic("n0", "pci0000:a0"),
                         nic("n1", "pci0000:36"))]  # fmt: skip
    together = claim("c", exactly("gpu", "gpu"), exactly("nic", "nic"),
                     constraints=[{"requests": ["gpu", "nic"], "matchAttribute": ROOT_ATTR}])
    allocation = run(together, slices)
    assert devices_of(allocation) == [("gpu", "g1"), ("nic", "n1")]
    assert f"matchAttribute {ROOT_ATTR} = pci0000:36 for gpu, nic" in allocation.explanation
    on_36 = 'device.attributes["resource.kubernetes.io"].pcieRoot == "pci0000:36"'
    taken = claim("other", exactly("nic", "nic", on_36))
    held = [held_by(taken, run(taken, slices))]
    assert refused(together, slices, allocated=held) == [
        f"request nic: 1 candidate devices; none on the same {ROOT_ATTR} as a free gpu "
        "(gpus on pci0000:15, pci0000:36; free nics on pci0000:a0)"]


def test_constraints_without_requests_cover_every_request() -> None:
    slices = [node_slice(gpu("g0", "r1"), gpu("g1", "r2"), nic("n0", "r2"))]
    allocation = run(claim("c", exactly("gpu", "gpu"), exactly("nic", "nic"),
                           constraints=[{"matchAttribute": ROOT_ATTR}]), slices)  # fmt: skip
    assert devices_of(allocation) == [("gpu", "g1"), ("nic", "n0")]


def test_distinct_attribute_spreads_devices() -> None:
    slices = [node_slice(gpu("g0", "r1"), gpu("g1", "r1"), gpu("g2", "r2"), gpu("g3", "r3"))]
    spread = claim("c", exactly("gpus", "gpu", count=3), constraints=[{"distinctAttribute": ROOT_ATTR}])
    allocation = run(spread, slices)
    assert devices_of(allocation) == [("gpus", "g0"), ("gpus", "g2"), ("gpus", "g3")]
    assert f"distinctAttribute {ROOT_ATTR} = r1, r2, r3 for gpus" in allocation.explanation
    four = claim("c", exactly("gpus", "gpu", count=4), constraints=[{"distinctAttribute": ROOT_ATTR}])
    assert refused(four, slices) == [
        f"distinctAttribute {ROOT_ATTR} over gpus: 4 devices need different values, the candidates have 3 (r1, r2, r3)"]


def test_a_device_without_the_attribute_never_satisfies_a_constraint() -> None:
    slices = [node_slice(device("g0", {"kind": "gpu"}), gpu("g1", "r1"))]
    c = claim("c", exactly("gpus", "gpu", count=2), constraints=[{"matchAttribute": ROOT_ATTR}])
    assert refused(c, slices) == [
        f"request gpus: needs 2 device(s) with one {ROOT_ATTR}; no value has that many available "
        "(r1; 1 lack the attribute)"]


# --- taints and admin access -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("effect", "toleration", "allowed"), [
    ("NoSchedule", None, False),
    ("NoExecute", None, False),
    ("None", None, True),
    ("SomethingNew", None, True),
    ("NoSchedule", {"key": "x.example.com/xid", "operator": "Exists"}, True),
    ("NoSchedule", {"key": "x.example.com/xid", "operator": "Equal", "value": "79"}, True),
    ("NoSchedule", {"key": "x.example.com/xid", "value": "48"}, False),
    ("NoSchedule", {"operator": "Exists"}, True),
    ("NoExecute", {"operator": "Exists", "effect": "NoSchedule"}, False),
    ("NoExecute", {"key": "x.example.com/xid", "operator": "Exists", "effect": "NoExecute"}, True),
])  # fmt: skip
def test_taints_need_a_toleration(effect: str, toleration: dict[str, str] | None, allowed: bool) -> None:
    taint = {"key": "x.example.com/xid", "value": "79", "effect": effect}
    slices = [node_slice(gpu("g0", taints=[taint]))]
    c = claim("c", exactly("gpu", "gpu", tolerations=[toleration] if toleration else []))
    if allowed:
        allocation = run(c, slices)
        assert devices_of(allocation) == [("gpu", "g0")]
        assert allocation.status["devices"]["results"][0].get("tolerations") == ([toleration] if toleration else None)
    else:
        assert refused(c, slices) == [
            "request gpu: needs 1 device(s); 1 match its class and selectors, 0 available "
            f"(1 tainted and not tolerated: g0 (x.example.com/xid=79:{effect}))"]


def test_admin_access_uses_devices_in_use_and_holds_nothing() -> None:
    counters = {"gpu-0-counters": {"memory": "80Gi"}}
    slices = [node_slice(gpu("g0", consumes={"gpu-0-counters": {"memory": "80Gi"}}), counters=counters)]
    user = claim("user", exactly("gpu", "gpu"))
    held = [held_by(user, run(user, slices))]
    admin = claim("admin", exactly("gpu", "gpu", adminAccess=True))
    allocation = run(admin, slices, allocated=held)
    assert allocation.status["devices"]["results"] == [
        {"request": "gpu", "driver": "x.example.com", "pool": "node-a", "device": "g0", "adminAccess": True}]
    assert allocation.results[0].admin_access
    # An admin allocation neither holds the device nor draws its counters.
    assert devices_of(run(claim("next", exactly("gpu", "gpu")), slices, allocated=[held_by(admin, allocation)])) == [
        ("gpu", "g0")]


def test_admin_access_is_not_allowed_in_a_sub_request() -> None:
    request = {"name": "gpu", "firstAvailable": [{"name": "a", "deviceClassName": "gpu", "adminAccess": True}]}
    assert refused(claim("c", request), [node_slice(gpu("g0"))]) == [
        "request gpu/a: adminAccess is not allowed in a sub-request"]


# --- pools and nodes -------------------------------------------------------------------------------------------


def test_an_incomplete_pool_is_not_used_until_it_is_complete() -> None:
    first = node_slice(gpu("g0"), name="a", generation=2, count=2)
    stale = node_slice(gpu("old"), name="z", generation=1, count=1)
    c = claim("c", exactly("gpu", "gpu"))
    assert refused(c, [first, stale]) == [
        "request gpu: no device of class gpu on node node-a (of 0 devices there)",
        "pool x.example.com/node-a is incomplete: 1 of 2 slices of generation 2 published; its devices are not "
        "used until the rest arrive"]
    assert refused(claim("all", exactly("gpus", "gpu", mode="All")), [first])[0] == (
        "request gpus: asks for all devices, but a pool is incomplete")
    second = node_slice(gpu("g1"), name="b", generation=2, count=2)
    assert devices_of(run(c, [first, stale, second])) == [("gpu", "g0")]


def test_an_invalid_pool_is_not_used() -> None:
    slices = [node_slice(gpu("g0"), name="a", count=2), node_slice(gpu("g0"), name="b", count=2)]
    reasons = refused(claim("c", exactly("gpu", "gpu")), slices)
    assert reasons[-1] == "pool x.example.com/node-a is invalid: device g0 appears twice; its devices are not used"
    missing = node_slice(gpu("g0", consumes={"nope": {"memory": "1"}}))
    assert refused(claim("c", exactly("gpu", "gpu")), [missing])[-1] == (
        "pool x.example.com/node-a is invalid: device g0 consumes counter set nope, which the pool does not have; "
        "its devices are not used")


def test_node_selector_and_all_nodes_slices() -> None:
    labelled = node_slice(gpu("g0"), node=None, nodeSelector={"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}, pool="zone-a")
    everywhere = node_slice(nic("n0"), name="b", node=None, allNodes=True, pool="shared")
    node = {"metadata": {"name": "node-a", "labels": {"zone": "a"}}}
    allocation = run(claim("c", exactly("gpu", "gpu"), exactly("nic", "nic")), [labelled, everywhere], node=node)
    assert devices_of(allocation) == [("gpu", "g0"), ("nic", "n0")]
    assert allocation.status["nodeSelector"] == {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}
    assert "nodeSelector" not in run(claim("c", exactly("nic", "nic")), [everywhere]).status
    elsewhere = {"metadata": {"name": "node-b", "labels": {"zone": "b"}}}
    assert refused(claim("c", exactly("gpu", "gpu")), [labelled], node=elsewhere)[0].startswith(
        "request gpu: no device of class gpu on node node-b")


# --- bad input and limits --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("requests", "constraints", "reason"), [
    ([exactly("a", "gpu"), exactly("a", "gpu")], None, "request a: the name is used twice"),
    ([{"name": "a"}], None, "request a: needs exactly one of 'exactly' and 'firstAvailable'"),
    ([exactly("a", "gpu", count=0)], None, "request a: count must be a positive integer, not 0"),
    ([exactly("a", "gpu", mode="Some")], None, "request a: allocationMode 'Some' is not supported (ExactCount or All)"),
    ([exactly("a", "")], None, "request a: deviceClassName is required"),
    ([exactly("a", "gpu", capacity={"requests": {"memory": "lots"}})], None,
     'request a: capacity request memory: invalid quantity "lots": expected an optionally signed decimal number '
     "followed by an optional suffix: Ki, Mi, Gi, Ti, Pi, Ei, n, u, m, k, M, G, T, P, E, or e<integer>"),
    ([exactly("a", "gpu", capacity={"memory": "1Gi"})], None,
     "request a: capacity must be {requests: {<name>: <quantity>}}"),
    ([exactly("a", "gpu")], [{"requests": ["b"], "matchAttribute": ROOT_ATTR}],
     "constraint #0: names request 'b', which the claim does not have"),
    ([exactly("a", "gpu")], [{"matchAttribute": "pcieRoot"}],
     "constraint #0: matchAttribute must be a fully qualified name (domain/name), not 'pcieRoot'"),
    ([exactly("a", "gpu")], [{}], "constraint #0: needs exactly one of matchAttribute and distinctAttribute"),
    ([exactly("a", "tpu")], None, "device class tpu does not exist"),
])  # fmt: skip
def test_bad_claims_get_a_clear_reason(requests: list[dict[str, Any]], constraints: list[dict[str, Any]] | None,
                                       reason: str) -> None:  # fmt: skip
    assert refused(claim("c", *requests, constraints=constraints), [node_slice(gpu("g0"))]) == [reason]


def test_a_selector_that_does_not_compile_is_a_cel_error() -> None:
    with pytest.raises(CelError, match=r"function lowerAscii\(\) is not supported"):
        run(claim("c", exactly("gpu", "gpu", 'lowerAscii(device.driver) == "x"')), [node_slice(gpu("g0"))])


def test_selector_runtime_errors_are_reported_when_nothing_matched() -> None:
    expression = 'device.attributes["x.example.com"].model == "h100"'
    reasons = refused(claim("c", exactly("gpu", "gpu", expression)), [node_slice(gpu("g0"), gpu("g1"))])
    assert reasons[-1] == f"request gpu: selector {expression!r} failed on 2 device(s): no such key: 'model' (on g0)"


def test_a_pathological_claim_runs_out_of_steps() -> None:
    slices = [node_slice(*(gpu(f"g{i}", f"r{i % 4}") for i in range(40)))]
    c = claim("c", exactly("gpus", "gpu", count=8), exactly("nics", "gpu", count=1),
              constraints=[{"requests": ["gpus"], "distinctAttribute": ROOT_ATTR}])
    with pytest.raises(Unallocatable) as caught:
        allocate(c, classes=CLASSES, slices=slices, node="node-a", max_steps=2000)
    assert caught.value.reasons == ["too many combinations: gave up after trying 2000 device placements; "
                                    "narrow the selectors or constraints"]
    assert refused(c, slices)[0] == (f"distinctAttribute {ROOT_ATTR} over gpus: 8 devices need different values, "
                                     "the candidates have 4 (r0, r1, r2, r3)")  # fmt: skip


def test_a_claim_gets_at_most_32_devices() -> None:
    slices = [node_slice(*(gpu(f"g{i}") for i in range(40)))]
    assert refused(claim("c", exactly("gpus", "gpu", mode="All")), slices) == [
        "request gpus: asks for all 40 matching devices; a claim can be given at most 32"]
    with pytest.raises(Unallocatable):
        run(claim("c", exactly("gpus", "gpu", count=33)), slices)
    assert refused(claim("c", exactly("gpus", "gpu", count=33)), slices) == [
        "request gpus: asks for 33 devices; a claim can be given at most 32"]


# --- every allocation found is valid, and one is found whenever one exists -------------------------------------

ROOTS = ("r1", "r2")


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]], int]:
    """A node of up to 7 devices (kind, root, size, maybe a taint, maybe drawing units from one counter set),
    devices other claims hold, and a claim of 1 to 3 requests with selectors, modes and constraints."""
    units = draw(st.integers(0, 6))
    devices = []
    for index in range(draw(st.integers(1, 7))):
        attrs = {"kind": draw(st.sampled_from(["gpu", "nic"])), ROOT_ATTR: draw(st.sampled_from(ROOTS)),
                 "size": draw(st.integers(1, 3))}  # fmt: skip
        taints = [{"key": "x.example.com/bad", "effect": "NoSchedule"}] if draw(st.booleans()) else None
        draws = draw(st.integers(0, 3))
        devices.append(device(f"d{index}", attrs, taints=taints,
                              consumes={"set": {"units": str(draws)}} if draws else None))  # fmt: skip
    held = draw(st.lists(st.sampled_from([d["name"] for d in devices]), unique=True, max_size=3))
    allocated = [{"devices": {"results": [{"request": "r", "driver": "x.example.com", "pool": "node-a", "device": name}
                                          for name in held]}}]  # fmt: skip
    requests = []
    for index in range(draw(st.integers(1, 3))):
        selectors = [f'device.attributes["x.example.com"].size >= {draw(st.integers(1, 3))}'] if draw(
            st.booleans()) else []
        all_mode = draw(st.integers(0, 5)) == 0
        extra: dict[str, Any] = {}
        if draw(st.booleans()):
            extra["tolerations"] = [{"key": "x.example.com/bad", "operator": "Exists"}]
        if draw(st.integers(0, 5)) == 0:
            extra["adminAccess"] = True
        requests.append(exactly(f"q{index}", draw(st.sampled_from(["gpu", "nic"])), *selectors,
                                count=None if all_mode else draw(st.integers(1, 2)),
                                mode="All" if all_mode else None, **extra))  # fmt: skip
    constraints = []
    if draw(st.integers(0, 2)):
        names = [r["name"] for r in requests]
        scope = draw(st.lists(st.sampled_from(names), unique=True, max_size=len(names)))
        kind = draw(st.sampled_from(["matchAttribute", "distinctAttribute"]))
        constraints.append({"requests": scope, kind: ROOT_ATTR} if scope else {kind: ROOT_ATTR})
    c = claim("c", *requests, constraints=constraints)
    return [node_slice(*devices, counters={"set": {"units": str(units)}})], c, allocated, units


def _usable(request: dict[str, Any], dev: dict[str, Any]) -> bool:
    """Whether a device matches a request's class and selectors (not whether it is free)."""
    spec = request["exactly"]
    attrs = {k: next(iter(v.values())) for k, v in dev["attributes"].items()}
    minimum = int(spec["selectors"][0]["cel"]["expression"].rsplit(" ", 1)[1]) if spec.get("selectors") else 0
    kind: str = attrs["kind"]
    size: int = attrs["size"]
    return kind == spec["deviceClassName"] and size >= minimum


def _valid(c: dict[str, Any], devices: list[dict[str, Any]], held: set[str], units: int,
           assignment: list[list[dict[str, Any]]]) -> bool:  # fmt: skip
    """Whether picking `assignment[i]` for request i is a valid allocation, checked from first principles."""
    requests = c["spec"]["devices"]["requests"]
    names = [d["name"] for picked in assignment for d in picked]
    if len(names) != len(set(names)) or len(names) > 32:
        return False
    drawn = sum(int(d["consumesCounters"][0]["counters"]["units"]["value"])
                for d in devices if d["name"] in held and d.get("consumesCounters"))  # fmt: skip
    for request, picked in zip(requests, assignment, strict=True):
        spec = request["exactly"]
        matching = [d for d in devices if _usable(request, d)]
        if spec.get("allocationMode") == "All":
            if not matching or [d["name"] for d in picked] != [d["name"] for d in matching]:
                return False
        elif len(picked) != spec.get("count", 1) or not all(_usable(request, d) for d in picked):
            return False
        for d in picked:
            if d.get("taints") and not spec.get("tolerations"):
                return False
            if not spec.get("adminAccess"):
                if d["name"] in held:
                    return False
                if d.get("consumesCounters"):
                    drawn += int(d["consumesCounters"][0]["counters"]["units"]["value"])
    if drawn > units and any(not r["exactly"].get("adminAccess") and any(d.get("consumesCounters") for d in p)
                             for r, p in zip(requests, assignment, strict=True)):  # fmt: skip
        return False
    for constraint in c["spec"]["devices"].get("constraints") or ():
        scope = constraint.get("requests") or [r["name"] for r in requests]
        values = [d["attributes"][ROOT_ATTR]["string"] for r, p in zip(requests, assignment, strict=True)
                  if r["name"] in scope for d in p]  # fmt: skip
        if "matchAttribute" in constraint and len(set(values)) > 1:
            return False
        if "distinctAttribute" in constraint and len(set(values)) != len(values):
            return False
    return True


def _options(request: dict[str, Any], devices: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    matching = [d for d in devices if _usable(request, d)]
    if request["exactly"].get("allocationMode") == "All":
        return [matching]
    return [list(p) for p in itertools.combinations(matching, request["exactly"].get("count", 1))]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_allocations_are_valid_and_found_whenever_one_exists(
    scenario: tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]], int],
) -> None:
    slices, c, allocated, units = scenario
    devices = slices[0]["spec"]["devices"]
    held = {r["device"] for r in allocated[0]["devices"]["results"]}
    requests = c["spec"]["devices"]["requests"]
    exists = any(_valid(c, devices, held, units, list(combo))
                 for combo in itertools.product(*(_options(r, devices) for r in requests)))  # fmt: skip
    try:
        allocation = run(c, slices, allocated=allocated)
    except Unallocatable as e:
        assert not exists, f"an allocation exists, but: {e.reasons}"
        assert e.reasons and all(e.reasons)
        return
    by_name = {d["name"]: d for d in devices}
    assignment = [[by_name[r.device] for r in allocation.results if r.request == request["name"]]
                  for request in requests]  # fmt: skip
    assert _valid(c, devices, held, units, assignment), allocation.results
    assert [r.admin_access for r in allocation.results] == [
        bool(next(q for q in requests if q["name"] == r.request)["exactly"].get("adminAccess"))
        for r in allocation.results]


def test_mig_example_gets_an_existing_1g_device(tmp_path: Path) -> None:
    # Static MIG: the two GPUs of the first root complex each have a 1g.10gb device at placement 3.
    slices = discovered(str(dgx_h100_in_mig_mode(tmp_path, {0: [{"profile": "1g.10gb", "start": 3}]})))
    held: list[dict[str, Any]] = []
    for namespace, gpu_address in (("a", "18"), ("b", "1c")):
        c = example_claim("mig-1g10gb", namespace=namespace)
        allocation = run(c, slices, classes=device_classes(), allocated=held, node="dgx-h100-mig")
        assert devices_of(allocation) == [("mig", f"gpu-0000-{gpu_address}-00-0-mig-1g10gb-19-3")]
        held.append(held_by(c, allocation))
    reasons = refused(example_claim("mig-1g10gb", namespace="c"), slices, classes=device_classes(),
                      allocated=held, node="dgx-h100-mig")  # fmt: skip
    assert reasons == ["request mig: needs 1 device(s); 2 match its class and selectors, 0 available "
                       "(2 in use by a/mig-1g10gb, b/mig-1g10gb)"]
