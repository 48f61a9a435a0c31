"""A claim holding shares of devices, without I/O: its plan keyed by device and share, which other claims' records
block it, and its records rebuilt from its CDI spec after the checkpoint was lost."""

from __future__ import annotations

from typing import Any

import pytest

from agent.claims.cdi import claim_spec
from agent.claims.holding import held_elsewhere, with_shares
from agent.claims.plan import Owner, plan_claim
from agent.claims.read import ClaimError, read_allocation
from agent.claims.records import ClaimRecord, DeviceRecord
from agent.claims.recovery import records_from_spec
from backends.contract import Allocated, ClaimRef, Prepared
from cdi.names import validate_spec
from cdi.spec import ContainerEdits

DRIVER, POOL = "gpu.nvidia.com", "node-a"
UID = "6f1c1f0e-8f43-4c39-9d0b-8a0d3e3b0c11"
S1, S2 = "0b7c4a52-7b3e-4f70-9c4e-2d8f3c7d9a10", "1e2d3c4b-5a69-4788-8796-a5b4c3d2e1f0"
OWNER = Owner("nvidia-gpu", None)  # type: ignore[arg-type]  # never called here


def allocated_claim(*results: dict[str, Any], uid: str = UID) -> Any:
    claim = {"metadata": {"uid": uid, "namespace": "default", "name": "c"},
             "status": {"allocation": {"devices": {"results": [
                 {"driver": DRIVER, "pool": POOL, **r} for r in results]}}}}
    return read_allocation(claim, ClaimRef(uid, "default", "c"), DRIVER)


def plan_of(*results: dict[str, Any]) -> Any:
    return plan_claim(allocated_claim(*results), POOL, DRIVER, lambda device: OWNER)


def test_two_shares_of_one_device_are_two_entries_of_the_plan() -> None:
    plan = plan_of({"request": "a", "device": "gpu-0", "shareID": S1, "consumedCapacity": {"memory": "8Gi"}},
                   {"request": "b", "device": "gpu-0", "shareID": S2, "consumedCapacity": {"memory": "4Gi"}})
    assert plan.requests == {("gpu-0", S1): ("a",), ("gpu-0", S2): ("b",)}
    assert plan.devices == ["gpu-0"] and plan.shared == {"gpu-0"}
    allocated = plan.per_backend["nvidia-gpu"][1]
    assert [(a.device, a.share_id, dict(a.consumed)) for a in allocated] == [
        ("gpu-0", S1, {"memory": 8 << 30}), ("gpu-0", S2, {"memory": 4 << 30})]


def test_a_device_both_whole_and_shared_in_one_claim_is_refused() -> None:
    with pytest.raises(ClaimError, match="device gpu-0 is allocated to the claim both whole and as a share"):
        plan_of({"request": "a", "device": "gpu-0"}, {"request": "b", "device": "gpu-0", "shareID": S1})


def record(uid: str, *devices: tuple[str, str | None], admin: bool = False) -> ClaimRecord:
    return ClaimRecord(uid, "default", f"claim-{uid[:4]}", "completed", "boot", tuple(
        DeviceRecord(device=d, backend="nvidia-gpu", share_id=s, admin_access=admin) for d, s in devices))


OTHER = "aaaaaaaa-8f43-4c39-9d0b-8a0d3e3b0c11"


@pytest.mark.parametrize(("mine", "theirs", "blocked"), [
    ({"device": "gpu-0", "shareID": S1}, ("gpu-0", S2), ""),
    ({"device": "gpu-0", "shareID": S1}, ("gpu-0", None), "is prepared whole for claim"),
    ({"device": "gpu-0"}, ("gpu-0", S2), "is prepared as a share for claim"),
    ({"device": "gpu-0"}, ("gpu-0", None), "is already prepared for claim"),
    ({"device": "gpu-0", "shareID": S1}, ("gpu-1", None), ""),
])  # fmt: skip
def test_shares_block_only_whole_claims_and_the_other_way_round(mine: dict[str, Any], theirs: tuple[str, str | None],
                                                                blocked: str) -> None:  # fmt: skip
    plan = plan_of({"request": "a", **mine})
    found = held_elsewhere(UID, plan, [record(OTHER, theirs)])
    assert (blocked in found) if blocked else found == ""
    assert held_elsewhere(UID, plan, [record(OTHER, theirs, admin=True)]) == "", "admin access holds nothing"
    assert held_elsewhere(UID, plan, [record(UID, theirs)]) == "", "the claim's own record does not block it"


def test_a_backend_answering_per_device_gets_its_share_filled_in() -> None:
    allocated = [Allocated("gpu-0", "a", share_id=S1), Allocated("gpu-1", "a")]
    answered = with_shares(allocated, [Prepared("gpu-0", ContainerEdits()), Prepared("gpu-1", ContainerEdits())])
    assert [p.share_id for p in answered] == [S1, None]
    two = [Allocated("gpu-0", "a", share_id=S1), Allocated("gpu-0", "b", share_id=S2)]
    assert [p.share_id for p in with_shares(two, [Prepared("gpu-0", ContainerEdits())])] == [None], (
        "which of two shares it answered for cannot be guessed")


def test_shares_are_known_again_from_the_claim_s_cdi_spec() -> None:
    mig = f"mig-{S2}"  # a device whose own name ends in a UUID is no share
    devices = (DeviceRecord("gpu-0", "nvidia-gpu", share_id=S1, edits=ContainerEdits(env=("A=1",))),
               DeviceRecord("gpu-0", "nvidia-gpu", share_id=S2), DeviceRecord("gpu-1", "nvidia-gpu"),
               DeviceRecord(mig, "nvidia-mig"))
    spec = claim_spec(DRIVER, UID, devices)
    assert validate_spec(spec) == []
    assert [d.name for d in spec.devices] == [f"{UID}-gpu-0-{S1}", f"{UID}-gpu-0-{S2}", f"{UID}-gpu-1", f"{UID}-{mig}"]
    owners = {"gpu-0": "nvidia-gpu", "gpu-1": "nvidia-gpu", mig: "nvidia-mig"}
    rebuilt = records_from_spec(DRIVER, UID, spec, "boot", lambda name: owners.get(name, ""))
    assert rebuilt is not None
    assert [(d.device, d.share_id, d.backend, d.cdi_ids) for d in rebuilt.devices] == [
        ("gpu-0", S1, "nvidia-gpu", (f"k8s.{DRIVER}/claim={UID}-gpu-0-{S1}",)),
        ("gpu-0", S2, "nvidia-gpu", (f"k8s.{DRIVER}/claim={UID}-gpu-0-{S2}",)),
        ("gpu-1", None, "nvidia-gpu", (f"k8s.{DRIVER}/claim={UID}-gpu-1",)),
        (mig, None, "nvidia-mig", (f"k8s.{DRIVER}/claim={UID}-{mig}",)),
    ]
    assert rebuilt.devices[0].edits == ContainerEdits(env=("A=1",))
