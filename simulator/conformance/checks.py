"""The kit's checks that drive the backend directly, each on a fresh simulated node (a `Bench`): what discover()
returns, name stability, idempotent prepare, unprepare restoring the node, restore records after a restart or a
crash, health events, and the event loop. Each returns the problems found, or raises CheckFailed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from agent.commands.backend_rules import health_problems, inventory_problems, name_changes, prepared_problems
from backends.plugin import (
    ClaimRef,
    ContainerEdits,
    Device,
    DevicesChanged,
    Inventory,
    Prepared,
    RecordsOwnChanges,
)
from simulator.conformance.bench import NODE, Bench, Instance, checkpointed
from simulator.conformance.node_state import NodeState, settled_state
from simulator.conformance.uevents import pci_uevent
from simulator.timing import scaled
from simulator.udev.hotplug import UdevInjector

__all__ = [
    "discovery",
    "health",
    "idempotent_prepare",
    "interrupted_prepare",
    "lifecycle",
    "restart_restore",
    "stable_names",
    "unprepare_restores",
]

# A backend's reaction to a uevent has no end to observe (it may rightly yield nothing), so the kit waits for a
# quiet spell: nothing yielded for _QUIET seconds, at most `longest`. Both stretch with the time factor.
_QUIET = scaled(0.2)
_HEALTH_END_SECONDS = scaled(5.0)


async def discovery(bench: Bench) -> list[str]:
    """discover() returns devices the API server accepts."""
    instance = await bench.start()
    inventory = await instance.call("discover", instance.backend.discover)
    problems = inventory_problems(inventory, instance.backend.driver, NODE)
    if isinstance(inventory, Inventory) and not inventory.devices:
        said = [*inventory.warnings, *(f"cannot serve {', '.join(u.devices)}: {u.reason}" for u in inventory.unserved)]
        warned = f" (it warned: {'; '.join(said)})" if said else ""
        problems.append(f"discover() found no devices on profile {bench.target.profile}{warned}: describe your "
                        "hardware in the profile and match it in the backend's settings (Target.config)")
    await instance.stop()
    return problems


async def stable_names(bench: Bench) -> list[str]:
    """The same devices, names and attributes from two discoveries and across a restart."""
    first_instance = await bench.start()
    first = await first_instance.discover("first discover")
    second = await first_instance.discover("second discover")
    problems = name_changes(first, second, "between two discoveries")
    await first_instance.stop()
    restarted = await bench.start()
    third = await restarted.discover("discover after a restart")
    problems += name_changes(first, third, "across a restart of the backend")
    await restarted.stop()
    return problems


def _differences(first: Sequence[Prepared], second: Sequence[Prepared]) -> list[str]:
    by_device = {p.device: p for p in second}
    lines = []
    for p in first:
        other = by_device.get(p.device)
        if other is None:
            lines.append(f"{p.device} missing from the second answer")
            continue
        for what in ("edits", "common_edits", "restore"):
            if getattr(p, what) != getattr(other, what):
                lines.append(f"{p.device}.{what}: {getattr(p, what)!r} then {getattr(other, what)!r}")
    return lines


async def idempotent_prepare(bench: Bench) -> list[str]:
    """A second prepare of the same claim answers the same and changes nothing more."""
    instance = await bench.start()
    claim = bench.claim("idempotent")
    allocated = instance.allocate(await instance.devices())
    first = await instance.prepare(claim, allocated, "first prepare")
    problems = prepared_problems(allocated, first, claim.uid)
    after_first = await settled_state(bench.node)
    second = await instance.prepare(claim, allocated, "second prepare of the same claim")
    after_second = await settled_state(bench.node)
    differences = _differences(first, second)
    if differences:
        problems.append("a second prepare of the same claim answered differently (" + "; ".join(differences[:4])
                        + "). prepare must be idempotent: when the claim's devices are prepared already, return "
                        "the same answer without doing the work again (the kubelet retries prepare)")
    changes = after_second.changes_since(after_first)
    if changes:
        problems.append("a second prepare of the same claim changed the node again: " + "; ".join(changes)
                        + ". Check what exists for the claim before creating it")
    await instance.unprepare(claim, first)
    await instance.stop()
    return problems


async def unprepare_restores(bench: Bench) -> list[str]:
    """unprepare() puts the node back as it was before prepare(), a second unprepare is harmless, and the devices
    are still published."""
    instance = await bench.start()
    claim = bench.claim("restore")
    devices = await instance.devices()
    initial = await settled_state(bench.node)
    allocated = instance.allocate(devices)
    prepared = await instance.prepare(claim, allocated)
    problems = prepared_problems(allocated, prepared, claim.uid)
    await instance.unprepare(claim, prepared)
    problems += _left_changed(initial, await settled_state(bench.node), "unprepare",
                              "undo everything prepare did (drivers, device nodes, partitions, files)")
    await instance.unprepare(claim, prepared, "a second unprepare of the same claim")
    problems += _left_changed(initial, await settled_state(bench.node), "a second unprepare of the same claim",
                              "unprepare must succeed and change nothing when there is nothing left to undo")
    problems += _still_published(await instance.discover("discover after unprepare"), devices)
    await instance.stop()
    return problems


async def restart_restore(bench: Bench) -> list[str]:
    """Prepared devices stay prepared across a restart, and a new instance undoes them from the checkpointed
    records alone."""
    first = await bench.start()
    claim = bench.claim("restart")
    devices = await first.devices()
    initial = await settled_state(bench.node)
    prepared = await first.prepare(claim, first.allocate(devices))
    while_prepared = await settled_state(bench.node)
    await first.stop()
    problems = _left_changed(while_prepared, await settled_state(bench.node), "stop() with a claim prepared",
                             "prepared devices stay prepared while the agent restarts: containers keep using them")
    restarted = await bench.start()
    await restarted.discover("discover after a restart")
    await restarted.reconcile({claim.uid: devices})
    await restarted.unprepare(claim, checkpointed(prepared), "unprepare after a restart")
    problems += _left_changed(initial, await settled_state(bench.node), "unprepare after a restart",
                              "after a restart the backend has only the records the core checkpointed: put "
                              "everything undoing needs into Prepared.restore (plain JSON), or keep a journal in "
                              "ctx.state_dir")
    await restarted.stop()
    return problems


async def interrupted_prepare(bench: Bench) -> list[str]:
    """After a crash between the backend's prepare and the core's record, the core rolls back with the device
    names alone (empty edits and restore): the backend undoes whatever exists."""
    restarted, claim, devices, initial = await _prepared_then_restarted(bench, "rollback", "discover after a crash")
    bare = [Prepared(device=d, edits=ContainerEdits()) for d in devices]
    await restarted.unprepare(claim, bare, "unprepare with device names only (the roll-back after a crash)")
    await restarted.reconcile({})
    problems = _left_changed(initial, await settled_state(bench.node), "the roll-back after a crash",
                             "unprepare gets only the device names when the core crashed before recording the "
                             "answer: find what was made for the claim from the hardware or a journal in "
                             "ctx.state_dir, and undo it")
    backend = restarted.backend
    declared = isinstance(backend, RecordsOwnChanges) and backend.records_own_changes is True  # only True declares
    await restarted.stop()
    if declared:
        problems += await _lost_started_record(bench)
    return problems


async def _lost_started_record(bench: Bench) -> list[str]:
    """With `records_own_changes`, the core's `started` record is not synced, and a power cut may lose it: the
    backend's own records and `reconcile` alone must then undo the prepare."""
    restarted, _, _, initial = await _prepared_then_restarted(bench, "unrecorded",
                                                              "discover after a crash that lost the core's record")
    await restarted.reconcile({})
    problems = _left_changed(initial, await settled_state(bench.node), "reconcile after a prepare the core has no "
                             "record of", "declaring records_own_changes says that reconcile undoes every change made "
                             "for a claim the core does not hold: record each change in ctx.state_dir before "
                             "making it, and undo it in reconcile (or drop the declaration)")
    await restarted.stop()
    return problems


async def _prepared_then_restarted(bench: Bench, name: str, phase: str
                                  ) -> tuple[Instance, ClaimRef, list[str], NodeState]:
    """A claim prepared on all devices by one instance, which stops as a crash would leave it; a new instance,
    started and discovering (`phase`); the node's state from before the prepare."""
    first = await bench.start()
    claim = bench.claim(name)
    devices = await first.devices()
    initial = await settled_state(bench.node)
    await first.prepare(claim, first.allocate(devices))
    await first.stop()
    restarted = await bench.start()
    await restarted.discover(phase)
    return restarted, claim, devices, initial


async def health(bench: Bench) -> list[str]:
    """health() yields well-formed events, reacts to its devices' PCI functions going and coming back without
    renaming them, and ends with its subscriptions when the backend stops."""
    instance = await bench.start()
    inventory = await instance.discover()
    known = {d.name for d in inventory.devices}
    events: list[object] = []
    failures: list[str] = []
    collector = asyncio.create_task(_collect(instance, events, failures), name="conformance health")
    await _quiet(events)
    problems: list[str] = []
    device = _pci_device(inventory.devices)
    if device is not None and device.topology is not None and "pci" in instance.udev.subscribed():
        problems += await _hot_plug(bench, instance, device.name, device.topology.bus_id, events, known)
    await instance.stop()
    try:
        async with asyncio.timeout(_HEALTH_END_SECONDS):
            await asyncio.shield(collector)
    except TimeoutError:
        collector.cancel()
        problems.append(f"health() did not end within {_HEALTH_END_SECONDS:.0f} s of stop(): end the stream when "
                        "the backend stops (wait on a stop event together with your sources)")
    left = instance.udev.subscribed()
    if left:
        problems.append(f"after stop() the backend is still subscribed to udev events of {sorted(set(left))}: "
                        "call the function subscribe() returned when health() ends")
    return failures + problems + instance.udev.errors + health_problems(events, known)


async def _collect(instance: Instance, events: list[object], failures: list[str]) -> None:
    try:
        stream = instance.backend.health()
        async for event in stream:
            events.append(event)
    except Exception as e:
        failures.append(f"health() raised {type(e).__name__}: {e}; report problems as events and keep going")


async def _quiet(events: list[object], longest: float = scaled(3.0)) -> None:
    """Wait until the backend has yielded nothing for a while."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + longest
    seen = -1
    while len(events) != seen and loop.time() < deadline:
        seen = len(events)
        await asyncio.sleep(_QUIET)


async def _hot_plug(bench: Bench, instance: Instance, name: str, bus_id: str, events: list[object],
                    known: set[str]) -> list[str]:
    injector = UdevInjector(bench.node.root)
    removed = pci_uevent(bench.node.sysfs, bus_id, "remove")
    await asyncio.to_thread(injector.pci_remove, bus_id)
    start = len(events)
    await instance.udev.emit(removed)
    await _quiet(events)
    if any(isinstance(e, DevicesChanged) for e in events[start:]):
        known |= {d.name for d in (await instance.discover("discover after a PCI function was removed")).devices}
    await asyncio.to_thread(injector.pci_add, bus_id)
    await instance.udev.emit(pci_uevent(bench.node.sysfs, bus_id, "add"))
    await _quiet(events)
    back = await instance.discover("discover after the PCI function came back")
    known |= {d.name for d in back.devices}
    if name not in known or name not in {d.name for d in back.devices}:
        return [f"device {name} was not published under the same name after its PCI function {bus_id} was "
                "removed and added back: derive names from the PCI address or another hardware identity"]
    return []


def _pci_device(devices: Sequence[Device]) -> Device | None:
    with_pci = [d for d in sorted(devices, key=lambda d: d.name) if d.topology is not None]
    return with_pci[0] if with_pci else None


async def lifecycle(bench: Bench) -> None:
    """Every call of the contract once or twice, as the agent makes them (for the event-loop watch)."""
    instance = await bench.start()
    events: list[object] = []
    collector = asyncio.create_task(_collect(instance, events, []), name="conformance health")
    claim = bench.claim("loop")
    allocated = instance.allocate(await instance.devices("first discover"))
    await instance.discover("second discover")
    prepared = await instance.prepare(claim, allocated)
    await instance.prepare(claim, allocated, "second prepare")
    await instance.unprepare(claim, prepared)
    await instance.stop()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(_HEALTH_END_SECONDS):
            await asyncio.shield(collector)
    collector.cancel()


def _left_changed(before: NodeState, after: NodeState, what: str, fix: str) -> list[str]:
    changes = after.changes_since(before)
    if not changes:
        return []
    return [f"{what} left the node changed: " + "; ".join(changes) + f". {fix[0].upper()}{fix[1:]}"]


def _still_published(inventory: Inventory, devices: Sequence[str]) -> list[str]:
    missing = sorted(set(devices) - {d.name for d in inventory.devices})
    if missing:
        return [f"after unprepare, discover() no longer lists {missing}: an unprepared device must be published "
                "again as it was"]
    return []

