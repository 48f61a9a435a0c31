"""Consumable capacity without I/O: request policies as backends declare and publish them, the API server's rules
for them, the scheduler's rounding, and the allocator sharing a device by capacity between claims."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.slices.build import device_body, pool_slices
from agent.slices.device_rules import validate_device
from backends.contract import CapacityPolicy, CapacityRange, Device
from backends.nvidia.gpu_shares import memory_policy
from simulator.apiserver.objects import allocation_errors, drop_disabled_fields
from simulator.scheduler.allocation import Unallocatable, allocate
from simulator.scheduler.capacity import consumption, round_up
from tests.support.allocation_env import Obj, claim, device, device_class, exactly, held_by, resource_slice

GI = 2**30
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
CLASSES = [device_class("gpu", 'device.attributes["x.example.com"].kind == "gpu"')]


# --- declaring and publishing a policy -------------------------------------------------------------------------


def test_a_policy_has_exactly_one_of_values_or_range() -> None:
    with pytest.raises(ValueError, match="exactly one of valid_values or valid_range"):
        CapacityPolicy(default=1)
    with pytest.raises(ValueError, match="exactly one of valid_values or valid_range"):
        CapacityPolicy(default=1, valid_values=(1,), valid_range=CapacityRange(min=1))


def shared_gpu(policy: CapacityPolicy | None, *, multi: bool = True, memory: int = 80 * GI) -> Device:
    return Device("gpu-0", {"kind": "gpu"}, capacity={"memory": memory, "cores": 132},
                  allow_multiple_allocations=multi, capacity_policies={"memory": policy} if policy else {})


def test_the_slice_carries_the_device_s_sharing_and_policy() -> None:
    policy = CapacityPolicy(default=8 * GI, valid_range=CapacityRange(min=GI, max=64 * GI, step=GI))
    body = device_body(shared_gpu(policy))
    assert body["allowMultipleAllocations"] is True
    assert body["capacity"] == {
        "cores": {"value": "132"},
        "memory": {"value": "80Gi", "requestPolicy": {"default": "8Gi",
                                                      "validRange": {"min": "1Gi", "max": "64Gi", "step": "1Gi"}}},
    }
    assert validate_device(body) == []
    assert "allowMultipleAllocations" not in device_body(Device("plain", capacity={"memory": GI}))


@pytest.mark.parametrize(("gpu", "reason"), [
    (shared_gpu(CapacityPolicy(default=GI, valid_values=(GI,)), multi=False),
     'gpu-0: device.capacity[memory].requestPolicy: may only be set when the device sets allowMultipleAllocations '
     "to true"),
    (shared_gpu(CapacityPolicy(default=3 * GI, valid_range=CapacityRange(min=GI, max=2 * GI))),
     'gpu-0: device.capacity[memory].requestPolicy.validRange.default: must be <= max'),
    (shared_gpu(CapacityPolicy(default=GI, valid_values=(GI, 81 * GI))),
     'gpu-0: device.capacity[memory].requestPolicy.validValues[1]: must not exceed the capacity value, got "81Gi"'),
    (shared_gpu(CapacityPolicy(default=GI + 1, valid_range=CapacityRange(min=GI, step=GI))),
     'gpu-0: device.capacity[memory].requestPolicy.validRange.step: default minus min must be a multiple of step'),
    (Device("gpu-0", capacity={"memory": GI}, allow_multiple_allocations=True,
            capacity_policies={"cores": CapacityPolicy(default=1, valid_values=(1,))}),
     "gpu-0: request policies for capacities it does not have: cores"),
])  # fmt: skip
def test_a_device_with_a_bad_policy_is_left_out_with_the_reason(gpu: Device, reason: str) -> None:
    pool = pool_slices("x.example.com", "node-a", [gpu, Device("gpu-1")])
    assert pool.rejected == (reason,)
    assert [d["name"] for s in pool.slices for d in s["spec"].get("devices", ())] == ["gpu-1"]


def test_without_server_support_a_shareable_device_is_published_whole() -> None:
    policy = CapacityPolicy(default=GI, valid_values=(GI,))
    pool = pool_slices("x.example.com", "node-a", [shared_gpu(policy)], shares_supported=False)
    (body,) = pool.slices[0]["spec"]["devices"]
    assert pool.rejected == () and "allowMultipleAllocations" not in body
    assert body["capacity"]["memory"] == {"value": "80Gi"}


@given(memory=st.integers(min_value=1, max_value=2**44), step=st.sampled_from([2**20, 2**29, 2**30, 2**31]))
def test_the_gpu_memory_policy_is_always_one_the_api_server_accepts(memory: int, step: int) -> None:
    policy = memory_policy(memory, step)
    if memory < 2 * step:
        assert policy is None
        return
    assert policy is not None and policy.valid_range is not None and policy.valid_range.max is not None
    assert policy.default == policy.valid_range.max <= memory < policy.default + step
    assert validate_device(device_body(shared_gpu(policy, memory=memory))) == []


def test_the_test_api_server_drops_the_fields_with_the_gate_off_unless_already_used() -> None:
    policy = {"default": "1Gi", "validValues": ["1Gi"]}

    def sent() -> dict[str, Any]:
        return {"spec": {"devices": [{"name": "g", "allowMultipleAllocations": True,
                                      "capacity": {"memory": {"value": "1Gi", "requestPolicy": policy}}}]}}

    new = sent()
    drop_disabled_fields(new, None, {"DRAConsumableCapacity"})
    assert new["spec"]["devices"] == [{"name": "g", "capacity": {"memory": {"value": "1Gi"}}}]
    kept = sent()
    drop_disabled_fields(kept, sent(), {"DRAConsumableCapacity"})
    assert kept == sent()


def test_the_test_api_server_checks_share_ids_of_results() -> None:
    def with_share(share: Any) -> dict[str, Any]:
        return {"status": {"allocation": {"devices": {"results": [{"device": "g", "shareID": share}]}}}}

    assert allocation_errors(with_share("0b7c4a52-7b3e-4f70-9c4e-2d8f3c7d9a10")) == []
    assert allocation_errors(with_share("0B7C4A52-7B3E-4F70-9C4E-2D8F3C7D9A10")) == [
        'status.allocation.devices.results[0].shareID: Invalid value: "0B7C4A52-7B3E-4F70-9C4E-2D8F3C7D9A10": '
        "must be a lowercase UUID in 8-4-4-4-12 format"]
    assert len(allocation_errors(with_share(7))) == 1


# --- rounding ---------------------------------------------------------------------------------------------------


def test_rounding_up_by_values_and_by_range() -> None:
    values = {"default": "2Gi", "validValues": ["1Gi", "2Gi", "8Gi"]}
    assert [round_up(Fraction(q), values) for q in (1, GI, GI + 1, 3 * GI, 9 * GI)] == [GI, GI, 2 * GI, 8 * GI, 9 * GI]
    ranged = {"default": "4Gi", "validRange": {"min": "2Gi", "max": "16Gi", "step": "2Gi"}}
    assert [round_up(Fraction(q), ranged) for q in (0, 2 * GI, 3 * GI, 5 * GI)] == [2 * GI, 2 * GI, 4 * GI, 6 * GI]
    assert round_up(Fraction(3 * GI + 5), {"default": "4Gi", "validRange": {"min": "1Gi"}}) == 3 * GI + 5
    assert round_up(Fraction(5), None) == 5


@given(requested=st.integers(min_value=0, max_value=2**40), low=st.integers(1, 64), step=st.integers(1, 64))
def test_a_range_rounds_up_to_the_least_allowed_amount(requested: int, low: int, step: int) -> None:
    policy = {"default": str(low), "validRange": {"min": str(low), "step": str(step)}}
    amount = round_up(Fraction(requested), policy)
    assert amount >= requested and amount >= low and (amount - low) % step == 0
    assert amount == low or amount - step < requested, "the least such amount"


def test_what_a_share_consumes() -> None:
    dev = {"name": "g", "allowMultipleAllocations": True, "capacity": {
        "memory": {"value": "80Gi", "requestPolicy": {"default": "8Gi",
                                                      "validRange": {"min": "1Gi", "max": "40Gi", "step": "1Gi"}}},
        "cores": {"value": "132"}}}
    assert consumption({"memory": Fraction(GI // 2)}, dev) == {"memory": Fraction(GI), "cores": Fraction(132)}
    assert consumption({}, dev) == {"memory": Fraction(8 * GI), "cores": Fraction(132)}, (
        "the default; the whole of a capacity without")
    assert consumption({"cores": Fraction(10)}, dev) == {"memory": Fraction(8 * GI), "cores": Fraction(10)}
    assert consumption({"memory": Fraction(41 * GI)}, dev) == "memory 41Gi is more than the largest share, 40Gi"
    assert consumption({"memory": Fraction(GI), "cores": Fraction(200)}, dev) == (
        "cores 200 is more than the device has, 132")
    assert consumption({"disk": Fraction(1)}, dev) == "has no capacity disk"


# --- allocating shares ------------------------------------------------------------------------------------------


def gpu80(name: str = "g0", *, multi: bool = True) -> Obj:
    found = device(name, {"kind": "gpu"})
    found["capacity"] = {"memory": {"value": "80Gi"}}
    if multi:
        found["allowMultipleAllocations"] = True
        found["capacity"]["memory"]["requestPolicy"] = {
            "default": "80Gi", "validRange": {"min": "1Gi", "max": "80Gi", "step": "1Gi"}}
    return found


def memory_claim(name: str, *memories: str | None) -> Obj:
    requests = []
    for i, m in enumerate(memories):
        extra: Obj = {"capacity": {"requests": {"memory": m}}} if m else {}
        requests.append(exactly(f"r{i}", "gpu", **extra))
    return claim(name, *requests)


def run(wanted: Obj, devices: list[Obj], held: list[Obj] | None = None) -> Any:
    return allocate(wanted, classes=CLASSES, slices=[resource_slice("s", *devices)], allocated=held or [],
                    node="node-a")


def test_two_claims_of_40gi_share_an_80gi_gpu_and_a_third_does_not_fit() -> None:
    first = run(memory_claim("a", "40Gi"), [gpu80()])
    second = run(memory_claim("b", "40Gi"), [gpu80()], [held_by(memory_claim("a"), first)])
    held = [held_by(memory_claim("a"), first), held_by(memory_claim("b"), second)]
    shares = []
    for allocation in (first, second):
        (result,) = allocation.status["devices"]["results"]
        assert result["device"] == "g0" and result["consumedCapacity"] == {"memory": "40Gi"}
        assert UUID.fullmatch(result["shareID"])
        shares.append(result["shareID"])
        assert allocation.results[0].share_id == result["shareID"]
    assert shares[0] != shares[1], "every share has its own id"
    with pytest.raises(Unallocatable) as caught:
        run(memory_claim("c", "1Gi"), [gpu80()], held)
    assert caught.value.reasons == [
        "request r0: needs 1 device(s); 1 match its class and selectors, 0 available (1 without enough capacity "
        "left: g0: memory 1Gi asked, 0 left (shared by default/a, default/b))"]


def test_a_request_larger_than_the_device_is_refused_with_the_reason() -> None:
    with pytest.raises(Unallocatable) as caught:
        run(memory_claim("big", "81Gi"), [gpu80(), gpu80("g1", multi=False)])
    assert caught.value.reasons == [
        "request r0: needs 1 device(s); 2 devices of class gpu on node node-a, 0 of 2 can serve its capacity "
        "requests (g0 memory 81Gi is more than the largest share, 80Gi, g1 memory 81Gi is more than the device "
        "has, 80Gi)"]


def test_requests_are_rounded_up_and_the_default_is_taken_when_none_is_named() -> None:
    allocation = run(memory_claim("c", "1500Mi", None), [gpu80(), gpu80("g1")])
    results = allocation.status["devices"]["results"]
    assert [(r["device"], r["consumedCapacity"]) for r in results] == [
        ("g0", {"memory": "2Gi"}), ("g1", {"memory": "80Gi"})]


def test_one_claim_may_hold_two_shares_of_one_device() -> None:
    allocation = run(memory_claim("two", "30Gi", "50Gi"), [gpu80()])
    results = allocation.status["devices"]["results"]
    assert [r["device"] for r in results] == ["g0", "g0"]
    assert len({r["shareID"] for r in results}) == 2


def test_a_device_not_shareable_is_allocated_whole_as_before() -> None:
    allocation = run(memory_claim("whole", "10Gi"), [gpu80(multi=False)])
    (result,) = allocation.status["devices"]["results"]
    assert "shareID" not in result and "consumedCapacity" not in result
    with pytest.raises(Unallocatable, match="1 in use by default/whole"):
        run(memory_claim("next", "10Gi"), [gpu80(multi=False)], [held_by(memory_claim("whole"), allocation)])


def test_a_share_is_not_placed_on_a_device_someone_holds_whole() -> None:
    whole = {"devices": {"results": [{"request": "r0", "driver": "x.example.com", "pool": "node-a", "device": "g0"}]}}
    with pytest.raises(Unallocatable, match="1 in use by an allocation"):
        run(memory_claim("share", "1Gi"), [gpu80()], [whole])
