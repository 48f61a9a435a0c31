"""A simulated node with the backend under test on it: fresh backend instances started as the agent starts them
(its context, its state directory kept across restarts, a udev source the kit drives), each call bounded in time
and watched for blocking the event loop."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from agent.claims.records import DeviceRecord
from agent.commands.backend_rules import inventory_problems, typed
from agent.logs import get_logger
from backends.plugin import (
    Allocated,
    BackendContext,
    ClaimRef,
    DeviceEvents,
    HasConfigTypes,
    Inventory,
    Prepared,
    Reconciles,
    TopologyReader,
)
from simulator.conformance.loop_watch import LoopWatch
from simulator.conformance.target import Factory, Target
from simulator.conformance.uevents import KitDeviceEvents
from simulator.node.node import SimulatedNode
from simulator.timing import scaled

__all__ = ["NODE", "Bench", "CheckFailed", "Instance", "backend_context", "checkpointed", "pick"]

T = TypeVar("T")
NODE = "conformance-node"
CALL_SECONDS = scaled(30.0)
"""How long one backend call may take before the check fails."""


def backend_context(node: SimulatedNode, config: Mapping[str, Any] | None = None, *, name: str = "backend",
                    state_dir: Path | None = None, udev: DeviceEvents | None = None) -> BackendContext:
    """The context a backend is started with on a simulated node, as `dra-agent run` would give it there: the
    node's sysfs, /dev, host and driver roots, a topology reader, `config` (the backend's settings), a logger
    named `name`, and, when given, a state directory and a udev source."""
    return BackendContext(
        sysfs_root=node.sysfs, dev_root=node.dev, host_root=node.root, topology=TopologyReader(node.sysfs),
        config=dict(config or {}), log=get_logger(name), udev=udev, state_dir=state_dir,
        driver_root=node.driver_root,
    )


class CheckFailed(Exception):
    """A check cannot go on; `problems` say what is wrong and what to fix."""

    def __init__(self, *problems: str) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


@dataclass
class Bench:
    """One simulated node for one check."""

    target: Target
    name: str
    factory: Factory
    node: SimulatedNode
    state_dir: Path
    watch: LoopWatch | None = None
    instances: list[Instance] = field(default_factory=list)

    async def start(self) -> Instance:
        """A fresh backend instance, started with its context as `dra-agent run` starts it."""
        backend = self.target.new_backend(self.factory, self.name)
        udev = KitDeviceEvents()
        ctx = backend_context(self.node, self.target.config, name=self.name, state_dir=self.state_dir, udev=udev)
        instance = Instance(self, backend, udev)
        self.instances.append(instance)
        await instance.call("start", lambda: backend.start(ctx))
        return instance

    async def stop_all(self) -> None:
        for instance in self.instances:
            if not instance.stopped:
                await instance.stop()

    def claim(self, label: str) -> ClaimRef:
        return ClaimRef(str(uuid.uuid4()), "default", f"conformance-{label}")


@dataclass
class Instance:
    """One started backend instance."""

    bench: Bench
    backend: Any
    udev: KitDeviceEvents
    stopped: bool = False

    async def call(self, phase: str, work: Callable[[], Awaitable[T]], seconds: float = CALL_SECONDS) -> T:
        """Run one backend call; its failure or hang fails the check with what the backend said."""
        watch = self.bench.watch
        if watch is not None:
            watch.phase = phase
        try:
            async with asyncio.timeout(seconds):
                return await work()
        except TimeoutError:
            raise CheckFailed(f"{phase} did not return within {seconds:.0f} s: a backend call must finish or fail "
                              "with a BackendError (bound waits on hardware with deadlines)") from None
        except Exception as e:
            raise CheckFailed(f"{phase} raised {type(e).__name__}: {e}") from None
        finally:
            if watch is not None:
                watch.phase = "between calls"

    async def discover(self, phase: str = "discover") -> Inventory:
        inventory = await self.call(phase, self.backend.discover)
        problems = inventory_problems(inventory, self.backend.driver, NODE)
        if not isinstance(inventory, Inventory):
            raise CheckFailed(*problems)
        return inventory

    async def devices(self, phase: str = "discover") -> list[str]:
        """The devices one claim gets (see `pick`)."""
        inventory = await self.discover(phase)
        return pick(self.bench.target, [d.name for d in inventory.devices])

    def allocate(self, devices: Sequence[str]) -> list[Allocated]:
        types = tuple(self.backend.config_types) if isinstance(self.backend, HasConfigTypes) else ()
        config = typed(self.bench.target.claim_config, types)
        return [Allocated(device=d, request="conformance", config=config) for d in devices]

    async def prepare(self, claim: ClaimRef, allocated: Sequence[Allocated], phase: str = "prepare") -> list[Prepared]:
        result = await self.call(phase, lambda: self.backend.prepare(claim, list(allocated)))
        return list(result)

    async def unprepare(self, claim: ClaimRef, prepared: Sequence[Prepared], phase: str = "unprepare") -> None:
        await self.call(phase, lambda: self.backend.unprepare(claim, list(prepared)))

    async def reconcile(self, held: Mapping[str, Sequence[str]]) -> None:
        """What the core calls after a restart, when the backend defines it."""
        backend = self.backend
        if isinstance(backend, Reconciles):
            await self.call("reconcile", lambda: backend.reconcile(held))

    async def stop(self) -> None:
        self.stopped = True
        await self.call("stop", self.backend.stop)


def pick(target: Target, published: Sequence[str]) -> list[str]:
    """The devices the kit's claims get: `target.prepare_devices`, else the first published ones by name."""
    names = sorted(published)
    if target.prepare_devices:
        missing = sorted(set(target.prepare_devices) - set(names))
        if missing:
            raise CheckFailed(f"discover() did not publish {missing}, named in prepare_devices; it published "
                              f"{names[:8]}{' ...' if len(names) > 8 else ''}")
        return list(target.prepare_devices)
    wanted = target.devices_per_claim
    if len(names) < wanted:
        raise CheckFailed(f"discover() found {len(names)} device(s) on profile {target.profile}, the check needs "
                          f"{wanted}: describe your hardware in the profile and match it in the backend's settings "
                          "(Target.config)")
    return names[:wanted]


def checkpointed(prepared: Sequence[Prepared]) -> list[Prepared]:
    """The records as the core's checkpoint gives them back after a restart (through its JSON form)."""
    records = []
    for p in prepared:
        record = DeviceRecord(device=p.device, backend="kit", edits=p.edits, common_edits=p.common_edits,
                              restore=p.restore)
        back = DeviceRecord.from_json(json.loads(json.dumps(record.to_json())))
        records.append(Prepared(back.device, back.edits, back.common_edits, back.restore))
    return records
