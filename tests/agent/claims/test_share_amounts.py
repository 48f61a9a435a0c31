"""The amounts a claim's shares take, without I/O: `consumedCapacity` read as the API server serves it, checked
against the request policy the device is published with, one `shareID` per share; and every amount the scheduler
writes passes those checks."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from agent.claims.plan import Owner, plan_claim
from agent.claims.read import ClaimError, read_allocation
from agent.slices.build import device_body
from backends.contract import CapacityPolicy, CapacityRange, ClaimRef, Device
from backends.nvidia.gpu_shares import memory_policy
from simulator.scheduler.allocation import Unallocatable, allocate
from tests.support.allocation_env import claim, device_class, exactly, resource_slice

DRIVER, POOL = "gpu.nvidia.com", "node-a"
UID = "6f1c1f0e-8f43-4c39-9d0b-8a0d3e3b0c11"
S1, S2 = "0b7c4a52-7b3e-4f70-9c4e-2d8f3c7d9a10", "1e2d3c4b-5a69-4788-8796-a5b4c3d2e1f0"
MI, GI = 2**20, 2**30
MEMORY = 81559 * MI  # an H100's
H100_POLICY = memory_policy(MEMORY, GI)
assert H100_POLICY is not None
GPU = Device("gpu-0", capacity={"memory": MEMORY}, allow_multiple_allocations=True,
             capacity_policies={"memory": H100_POLICY})
FIELD = "status.allocation.devices.results[0].consumedCapacity.memory"
POLICY = "gpu-0's requestPolicy for memory (validRange: min 1Gi, max 79Gi, step 1Gi; default 79Gi)"
INTERNALS = re.compile(r"[A-Z]\w*(Error|Exception)\b|Traceback|int_max_str_digits|\[Errno")


def owner_of(device: Device) -> Owner:
    return Owner("nvidia-gpu", None, (), device)  # type: ignore[arg-type]  # the backend is never called here


def plan_of(*results: dict[str, Any], device: Device = GPU) -> Any:
    wanted = {"metadata": {"uid": UID, "namespace": "default", "name": "c"},
              "status": {"allocation": {"devices": {"results": [
                  {"driver": DRIVER, "pool": POOL, "request": "gpu", "device": device.name, **r} for r in results]}}}}
    allocation = read_allocation(wanted, ClaimRef(UID, "default", "c"), DRIVER)
    return plan_claim(allocation, POOL, DRIVER, lambda name: owner_of(device) if name == device.name else None)


def refusal(*results: dict[str, Any], device: Device = GPU) -> str:
    with pytest.raises(ClaimError) as refused:
        plan_of(*results, device=device)
    message = str(refused.value)
    assert not INTERNALS.search(message), message
    return message


def share(memory: Any, share_id: str = S1) -> dict[str, Any]:
    return {"shareID": share_id, "consumedCapacity": {"memory": memory}}


@pytest.mark.parametrize(("amount", "problem"), [
    # As the API server would store them: the server checks no more than that a value is a quantity.
    ("-40Gi", 'quantity "-40Gi" is negative'),
    ("-1", 'quantity "-1" is negative'),
    (-1099511627776, 'quantity "-1099511627776" is negative'),
    ("1e1000", 'quantity "1e1000" is too large: an amount of capacity is at most 9223372036854775807'),
    ("9223372036854775808", 'quantity "9223372036854775808" is too large: an amount of capacity is at most '
                            "9223372036854775807"),
    ("1e" + "9" * 5000, f'quantity "{("1e" + "9" * 5000)[:32]}…" is too large'),
    ("lots", 'invalid quantity "lots": expected an optionally signed decimal number followed by an optional suffix: '
             "Ki, Mi, Gi, Ti, Pi, Ei, n, u, m, k, M, G, T, P, E, or e<integer>"),
    (1.5, 'must be a quantity such as "40Gi", not 1.5'),
    (True, 'must be a quantity such as "40Gi", not true'),
    # Not as the API server writes them: every quantity it stores, it writes back in its own form.
    ("1024Mi", 'quantity "1024Mi" is not as the API server writes it ("1Gi")'),
    ("1.0Gi", 'quantity "1.0Gi" is not as the API server writes it ("1Gi")'),
    ("1073741824000m", 'quantity "1073741824000m" is not as the API server writes it ("1073741824")'),
    # Amounts the server stores but the published policy does not allow: the scheduler never writes them.
    ("0", f'"0" is below the minimum of {POLICY}'),
    ("1", f'"1" is below the minimum of {POLICY}'),
    ("1m", f'"1m" is below the minimum of {POLICY}'),
    ("1536Mi", f'"1536Mi" is not the minimum plus whole steps of {POLICY}'),
    ("1073741825", f'"1073741825" is not the minimum plus whole steps of {POLICY}'),
    ("80Gi", f'"80Gi" is above the maximum of {POLICY}'),
    ("9223372036854775807", f'"9223372036854775807" is above the maximum of {POLICY}'),
])  # fmt: skip
def test_an_amount_the_server_or_the_policy_does_not_allow_is_refused_naming_the_field(amount: Any,
                                                                                     problem: str) -> None:
    message = refusal(share(amount))
    if "…" in problem:
        assert message.startswith(f"claim default/c: {FIELD}: {problem}"), message
    else:
        assert message == f"claim default/c: {FIELD}: {problem}"


def test_amounts_the_policy_allows_are_read_in_bytes() -> None:
    plan = plan_of(share("1Gi"), share("79Gi", S2), {"shareID": "2e2d3c4b-5a69-4788-8796-a5b4c3d2e1f0",
                                                     "consumedCapacity": {"memory": "38Gi"}})
    assert [dict(a.consumed) for a in plan.per_backend["nvidia-gpu"][1]] == [
        {"memory": GI}, {"memory": 79 * GI}, {"memory": 38 * GI}]


def test_policies_by_values_and_capacities_without_a_policy() -> None:
    by_values = Device("gpu-0", capacity={"memory": 80 * GI, "cores": 132}, allow_multiple_allocations=True,
                       capacity_policies={"memory": CapacityPolicy(default=8 * GI, valid_values=(8 * GI, 16 * GI))})
    assert plan_of(share("16Gi"), device=by_values)
    assert refusal(share("12Gi"), device=by_values) == (
        f'claim default/c: {FIELD}: "12Gi" is not one of the valid values of gpu-0\'s requestPolicy for memory '
        "(validValues: 8Gi, 16Gi; default 8Gi)")
    # A capacity without a policy takes any amount up to the device's: zero too, as the scheduler allows.
    assert plan_of({"shareID": S1, "consumedCapacity": {"memory": "8Gi", "cores": "0"}}, device=by_values)
    assert refusal({"shareID": S1, "consumedCapacity": {"memory": "8Gi", "cores": "133"}}, device=by_values) == (
        "claim default/c: status.allocation.devices.results[0].consumedCapacity.cores: \"133\" is more than "
        "device gpu-0 has of cores (132)")
    no_step = Device("gpu-0", capacity={"memory": 80 * GI}, allow_multiple_allocations=True,
                     capacity_policies={"memory": CapacityPolicy(default=GI, valid_range=CapacityRange(min=GI))})
    assert plan_of(share("1073741825"), device=no_step), "without a step, any amount from the minimum"
    assert refusal(share("81Gi"), device=no_step) == (
        f'claim default/c: {FIELD}: "81Gi" is more than device gpu-0 has of memory (80Gi)')


def test_one_share_id_twice_in_a_claim_is_refused() -> None:
    message = refusal(share("8Gi"), share("4Gi"))
    assert message == (f"claim default/c: status.allocation.devices.results[1].shareID: {S1} is the shareID of "
                       "results[0] too: the scheduler gives every share its own")
    assert plan_of(share("8Gi"), share("4Gi", S2)), "two shares, two shareIDs"


def test_the_field_names_the_result_among_all_drivers_results() -> None:
    other = {"driver": "other.example.com", "pool": POOL, "request": "x", "device": "nic-0"}
    wanted = {"metadata": {"uid": UID, "namespace": "default", "name": "c"},
              "status": {"allocation": {"devices": {"results": [
                  other, {"driver": DRIVER, "pool": POOL, "request": "gpu", "device": "gpu-0", **share("-1")}]}}}}
    with pytest.raises(ClaimError, match=re.escape("results[1].consumedCapacity.memory: quantity \"-1\" is negative")):
        read_allocation(wanted, ClaimRef(UID, "default", "c"), DRIVER)


# --- every amount the scheduler writes passes ---------------------------------------------------------------------


def request_texts(amount: int) -> list[str]:
    """Ways a user may write `amount` bytes in a claim's capacity request."""
    texts = [str(amount), f"{amount * 1000}m"]
    texts += [f"{amount // 1024**p}{s}" for p, s in ((1, "Ki"), (2, "Mi"), (3, "Gi")) if amount % 1024**p == 0]
    texts += [f"{amount // 10**p}{s}" for p, s in ((3, "k"), (6, "M"), (9, "G")) if amount % 10**p == 0]
    return texts


@settings(database=None, max_examples=300, deadline=None)
@given(memory=st.integers(min_value=2 * GI, max_value=192 * GI), step=st.sampled_from([MI, 256 * MI, GI, 2 * GI]),
       amounts=st.lists(st.none() | st.integers(min_value=0, max_value=200 * GI), min_size=1, max_size=3),
       form=st.integers(min_value=0, max_value=8))
def test_every_share_the_scheduler_allocates_passes_the_checks(memory: int, step: int, amounts: list[int | None],
                                                               form: int) -> None:
    policy = memory_policy(memory, step)
    if policy is None:
        return
    gpu = Device("gpu-0", {"kind": "gpu"}, capacity={"memory": memory}, allow_multiple_allocations=True,
                 capacity_policies={"memory": policy})
    requests = []
    for index, amount in enumerate(amounts):
        extra: dict[str, Any] = {} if amount is None else {
            "capacity": {"requests": {"memory": (texts := request_texts(amount))[form % len(texts)]}}}
        requests.append(exactly(f"r{index}", "gpu", **extra))
    try:
        allocation = allocate(claim("c", *requests), classes=[device_class("gpu", f'device.driver == "{DRIVER}"')],
                              slices=[resource_slice("s", device_body(gpu), driver=DRIVER, pool=POOL)],
                              node=POOL)
    except Unallocatable:
        event("not allocatable")
        return
    event(f"{len(amounts)} share(s) allocated")
    wanted = {"metadata": {"uid": UID, "namespace": "default", "name": "c"},
              "status": {"allocation": allocation.status}}
    plan = plan_claim(read_allocation(wanted, ClaimRef(UID, "default", "c"), DRIVER), POOL, DRIVER,
                      lambda name: owner_of(gpu))
    assert sum(a.consumed["memory"] for a in plan.per_backend["nvidia-gpu"][1]) <= memory
