"""The publisher's plan: matching by index, obsolete slices, the generation rules, minimal writes."""

from __future__ import annotations

import copy
from typing import Any

from agent.slices.build import pool_slices
from agent.slices.plan import plan_pool
from backends.contract import CounterConsumption, CounterSet, Device

DRIVER, NODE = "gpu.example.com", "node-a"
OWNER = [{"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "node-uid", "controller": True}]


def devices(n: int, memory: int = 80 << 30) -> list[Device]:
    return [Device(name=f"dev-{i:04d}", attributes={"index": i}, capacity={"memory": memory}) for i in range(n)]


def desired(n: int, **kwargs: Any) -> list[dict[str, Any]]:
    return [dict(s) for s in pool_slices(DRIVER, NODE, devices(n, **kwargs)).slices]


def stored(plan_bodies: list[dict[str, Any]], generation_from: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """What the server holds after the plan's creates and updates (names given, resourceVersions set)."""
    objects = []
    for i, body in enumerate(plan_bodies):
        obj = copy.deepcopy(body)
        meta = obj["metadata"]
        meta["name"] = meta.pop("generateName", "") + f"x{i:04d}" if "generateName" in meta else meta["name"]
        meta["resourceVersion"] = str(100 + i)
        meta["uid"] = f"uid-{meta['name']}"
        objects.append(obj)
    return objects


def publish(want: list[dict[str, Any]], have: list[dict[str, Any]]) -> tuple[Any, list[dict[str, Any]]]:
    plan = plan_pool(want, have, OWNER)
    kept = {o["metadata"]["name"]: o for o in have if o not in plan.deletes}
    for body in plan.updates:
        kept[body["metadata"]["name"]] = copy.deepcopy(body)
    return plan, list(kept.values()) + stored(list(plan.creates))


def test_first_publication_creates_every_slice_at_generation_zero() -> None:
    plan = plan_pool(desired(300), [], OWNER)
    assert (plan.generation, len(plan.creates), plan.updates, plan.deletes) == (0, 3, (), ())
    assert all(b["metadata"]["ownerReferences"] == OWNER for b in plan.creates)
    assert [b["spec"]["pool"]["resourceSliceCount"] for b in plan.creates] == [3, 3, 3]


def test_nothing_changed_means_no_writes() -> None:
    _, have = publish(desired(300), [])
    plan = plan_pool(desired(300), have, OWNER)
    assert plan.writes == 0 and plan.generation == 0


def test_one_changed_device_is_one_write_without_a_generation_bump() -> None:
    _, have = publish(desired(300), [])
    want = desired(300)
    want[1]["spec"]["devices"][5]["attributes"]["index"] = {"int": 9999}
    plan = plan_pool(want, have, OWNER)
    assert (plan.writes, len(plan.updates), plan.generation) == (1, 1, 0)
    assert plan.updates[0]["metadata"]["name"].startswith("00001-")
    assert plan.updates[0]["metadata"]["resourceVersion"]


def test_two_changed_slices_bump_the_generation_and_rewrite_all() -> None:
    _, have = publish(desired(300), [])
    want = desired(300)
    want[0]["spec"]["devices"][0]["attributes"]["index"] = {"int": -1}
    want[2]["spec"]["devices"][0]["attributes"]["index"] = {"int": -2}
    plan = plan_pool(want, have, OWNER)
    assert plan.generation == 1 and len(plan.updates) == 3
    assert {b["spec"]["pool"]["generation"] for b in plan.updates} == {1}


def test_a_deleted_slice_is_recreated_and_the_pool_bumped() -> None:
    _, have = publish(desired(300), [])
    plan = plan_pool(desired(300), [have[0], have[2]], OWNER)
    assert len(plan.creates) == 1 and plan.creates[0]["metadata"]["generateName"].startswith("00001-")
    assert plan.generation == 1 and len(plan.updates) == 2


def test_everything_deleted_starts_over() -> None:
    plan = plan_pool(desired(300), [], OWNER)
    assert plan.generation == 0 and len(plan.creates) == 3


def test_shrinking_pool_deletes_the_extra_slice() -> None:
    _, have = publish(desired(300), [])
    plan = plan_pool(desired(100), have, OWNER)
    assert len(plan.deletes) == 2 and {d["metadata"]["name"][:5] for d in plan.deletes} == {"00001", "00002"}
    assert len(plan.updates) == 1 and plan.updates[0]["spec"]["pool"]["resourceSliceCount"] == 1


def test_obsolete_slices_are_deleted() -> None:
    _, have = publish(desired(10), [])
    foreign = copy.deepcopy(have[0])
    foreign["metadata"].update(name="node-a-gpu.example.com-abcde", uid="u2", resourceVersion="7")
    duplicate = copy.deepcopy(have[0])
    duplicate["metadata"].update(name="00000-gpu.example.com-node-a-zzzzz", uid="u3", resourceVersion="8")
    old = copy.deepcopy(have[0])
    old["metadata"].update(name="00000-gpu.example.com-node-a-aaaaa", uid="u4", resourceVersion="9")
    old["spec"]["pool"]["generation"] = -1
    plan = plan_pool(desired(10), [*have, foreign, duplicate, old], OWNER)
    assert {d["metadata"]["name"] for d in plan.deletes} == {
        "node-a-gpu.example.com-abcde", "00000-gpu.example.com-node-a-zzzzz", "00000-gpu.example.com-node-a-aaaaa"}
    assert plan.updates == () and plan.creates == ()


def test_quantities_compare_by_value() -> None:
    _, have = publish(desired(2, memory=1000), [])
    have[0]["spec"]["devices"][0]["capacity"]["memory"]["value"] = "1k"  # how the server stores 1000
    assert plan_pool(desired(2, memory=1000), have, OWNER).writes == 0


def test_edit_from_outside_is_restored() -> None:
    _, have = publish(desired(3), [])
    have[0]["spec"]["devices"][1]["attributes"]["index"] = {"int": 42}
    plan = plan_pool(desired(3), have, OWNER)
    assert plan.writes == 1 and plan.updates[0]["spec"]["devices"][1]["attributes"]["index"] == {"int": 1}
    have[0]["spec"]["devices"][1]["attributes"]["index"] = {"int": 1}
    have[0]["metadata"]["labels"] = {}
    assert plan_pool(desired(3), have, OWNER).writes == 1, "our labels are put back too"


def test_owner_appearing_later_is_added_without_a_bump() -> None:
    first = plan_pool(desired(300), [], [])
    have = stored(list(first.creates))
    plan = plan_pool(desired(300), have, OWNER)
    assert len(plan.updates) == 3 and plan.generation == 0


def test_taints_keep_the_time_the_server_gave_them() -> None:
    taint = {"key": "gpu.example.com/xid", "value": "79", "effect": "NoSchedule"}
    want = [dict(s) for s in pool_slices(DRIVER, NODE, devices(2), taints={"dev-0001": [taint]}).slices]
    _, have = publish(want, [])
    have[0]["spec"]["devices"][1]["taints"][0]["timeAdded"] = "2026-11-21T10:00:00Z"  # server default
    assert plan_pool(want, have, OWNER).writes == 0
    changed = [dict(s) for s in pool_slices(DRIVER, NODE, devices(3), taints={"dev-0001": [taint]}).slices]
    plan = plan_pool(changed, have, OWNER)
    assert plan.updates[0]["spec"]["devices"][1]["taints"][0]["timeAdded"] == "2026-11-21T10:00:00Z"


def test_counters_live_in_their_own_slices() -> None:
    sets = [CounterSet(f"gpu-{i}", {"memory": 80 << 30}) for i in range(3)]
    parts = [Device(name=f"gpu-{i}-part", consumes_counters=(CounterConsumption(f"gpu-{i}", {"memory": 1 << 30}),))
             for i in range(3)]
    want = [dict(s) for s in pool_slices(DRIVER, NODE, parts, sets).slices]
    plan = plan_pool(want, [], OWNER)
    assert [("sharedCounters" in b["spec"], "devices" in b["spec"]) for b in plan.creates] == [
        (True, False), (False, True)]
    _, have = publish(want, [])
    assert plan_pool(want, have, OWNER).writes == 0
