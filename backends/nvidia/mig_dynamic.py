"""Dynamic MIG: a MIG-enabled GPU offered as partitionable devices (the whole GPU and every profile at every
placement, see `mig_layout`), and the MIG device a claim was allocated made at prepare and unmade at unprepare.

Making one records the intent in the ledger first (claim, device, GPU, profile, placement), then creates the GPU
instance at exactly the allocated placement and its compute instance, and records their ids (the intent is
synced to disk before NVML is called; the ids need not be, see `mig_ledger`). A crash in between leaves the
intent, which names the placement; the instance found there is the one the agent made, as creating it required
the placement free. Unmaking destroys what the record names, if it is still the instance recorded, and drops the
record. Instances the agent did not create are never touched.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from structlog.typing import FilteringBoundLogger

from backends.contract import AttributeValue, CounterSet, Device, PrepareError
from backends.failpoints import failpoint
from backends.nvidia.mig_edits import MigEdits
from backends.nvidia.mig_layout import GiProfile, Placement, layout, mig_label
from backends.nvidia.mig_ledger import LedgerEntry, MigLedger
from backends.nvidia.nvml import GpuInfo, NvmlError, nvml_session
from backends.nvidia.nvml_mig import (
    INSUFFICIENT_RESOURCES,
    create_compute_instance,
    create_gpu_instance,
    destroy_mig,
    existing_compute_instance,
    find_gpu_instance,
    gpu_instance_profiles,
    mig_instance_exists,
)
from backends.topology import PciTopology, device_name
from cdi.spec import ContainerEdits

__all__ = ["MigMaker", "Offer", "dynamic_devices"]


@dataclass(frozen=True)
class Offer:
    """What a published dynamic device is on the hardware: its GPU, and the placement (None: the whole GPU)."""

    bus_id: str
    gpu_minor: int
    gpu_uuid: str
    placement: Placement | None


def dynamic_devices(gpu: GpuInfo, attributes: Mapping[str, AttributeValue], topology: PciTopology
                    ) -> tuple[list[Device], CounterSet, dict[str, Offer]]:
    """The whole GPU and its possible MIG devices, drawing from the GPU's counter set (reads NVML: blocking)."""
    gpu_name = device_name("gpu", gpu.bus_id)
    plan = layout(gpu_name, gpu_instance_profiles(gpu.bus_id))
    whole = Device(
        name=gpu_name,
        attributes={**attributes, "type": "gpu", "uuid": gpu.uuid, "index": gpu.index, "minor": gpu.minor,
                    "migCapable": True, "migEnabled": True},
        capacity={"memory": gpu.memory_bytes},
        topology=topology,
        consumes_counters=(plan.whole,),
    )
    devices = [whole]
    offers = {gpu_name: Offer(gpu.bus_id, gpu.minor, gpu.uuid, None)}
    for placement in plan.placements:
        profile = placement.profile
        name = f"{gpu_name}-mig-{mig_label(profile.name)}-{profile.id}-{placement.start}"
        devices.append(Device(
            name=name,
            attributes={**attributes, "type": "mig", "parentUUID": gpu.uuid, "parentIndex": gpu.index,
                        "profile": profile.name, "placementStart": placement.start, "placementSize": profile.size},
            capacity=_capacity(profile),
            topology=topology,
            consumes_counters=(placement.consumption(plan.counter_set.name),),
        ))
        offers[name] = Offer(gpu.bus_id, gpu.minor, gpu.uuid, placement)
    return devices, plan.counter_set, offers


def _capacity(profile: GiProfile) -> dict[str, int]:
    return {"memory": profile.memory_bytes, "multiprocessors": profile.multiprocessors,
            "copyEngines": profile.copy_engines, "decoders": profile.decoders, "encoders": profile.encoders,
            "jpegEngines": profile.jpeg_engines, "ofaEngines": profile.ofa_engines}


class MigMaker:
    """Makes and unmakes dynamic MIG devices for claims; blocking (NVML, fsync): call from a worker thread. One
    change at a time: NVML's placement rules are about the whole GPU, and the ledger is one file."""

    def __init__(self, ledger: MigLedger, edits: MigEdits, log: FilteringBoundLogger) -> None:
        self.ledger = ledger
        self._mig_edits = edits
        self._log = log
        self._lock = threading.Lock()

    def make(self, claim: str, device: str, offer: Offer) -> tuple[ContainerEdits, dict[str, Any]]:
        """The MIG device for (claim, device), made now or found made by an earlier call; its container edits and
        its restore record."""
        placement = offer.placement
        if placement is None:  # the whole GPU is taken out of MIG mode instead (`mig_whole`), not made
            raise PrepareError(f"{device} is a whole GPU, not a MIG device to make")
        with self._lock, nvml_session():
            entry = self.ledger.get(claim, device)
            if entry is not None and entry.compute_instance is not None and not self._exists(entry):
                self.ledger.remove(entry)  # destroyed behind our back: make it again
                entry = None
            fresh = entry is None
            if entry is None:
                # The intent first: a crash from here on leaves a record of what may exist and is ours.
                entry = self.ledger.put(LedgerEntry(claim, device, offer.bus_id, placement.profile.id, placement.start))
            if entry.compute_instance is None:
                entry = self._finish(entry, placement, adopt=not fresh)
        return self._edits(offer, entry), _restore(entry)

    def made_edits(self, device: str, offer: Offer) -> ContainerEdits | None:
        """The container edits of the MIG device `device` while a claim has it made (for admin access, which
        watches it and changes nothing); None when none has."""
        with self._lock:
            made = next((e for e in self.ledger if e.device == device and e.compute_instance is not None), None)
        if made is None or offer.placement is None:
            return None
        return self._edits(offer, made)

    def _finish(self, entry: LedgerEntry, placement: Placement, adopt: bool) -> LedgerEntry:
        """Create what the intent names; with `adopt` (an intent an earlier attempt left, cut short by a crash),
        first take over what that attempt created: at this placement nothing else can exist, as creating it
        required the placement free."""
        profile = placement.profile
        gi = find_gpu_instance(entry.bus_id, profile.id, placement.start) if adopt else None
        if gi is None:
            try:
                gi = create_gpu_instance(entry.bus_id, profile.id, placement.start, profile.size)
            except NvmlError as e:
                self.ledger.remove(entry)
                if e.code == INSUFFICIENT_RESOURCES:
                    raise PrepareError(f"MIG {profile.name} at placement {placement.start} overlaps a MIG "
                                       f"device that exists on GPU {entry.bus_id}") from None
                raise PrepareError(f"creating MIG {profile.name} at {placement.start} failed: {e}") from None
            failpoint("mig-after-gpu-instance")
        try:
            existing = existing_compute_instance(entry.bus_id, gi) if adopt else None
            created = existing or create_compute_instance(entry.bus_id, gi, profile.slices)
        except NvmlError as e:
            destroy_mig(entry.bus_id, gi)
            self.ledger.remove(entry)
            raise PrepareError(f"creating the compute instance failed: {e}") from None
        failpoint("mig-after-compute-instance")
        entry = self.ledger.update(entry, gpu_instance=gi, compute_instance=created.compute_instance_id,
                                   uuid=created.uuid)
        self._log.info("MIG device created", device=entry.device, claim=entry.claim, gpu=entry.bus_id,
                       gpu_instance=gi, compute_instance=created.compute_instance_id)
        return entry

    def unmake(self, claim: str, device: str) -> None:
        """Destroy the MIG device made for (claim, device), if it exists and is the one recorded (or, for an
        intent a crash cut short, the instance at its placement)."""
        with self._lock:
            entry = self.ledger.get(claim, device)
            if entry is None:
                return
            with nvml_session():
                if entry.gpu_instance is None:
                    gi = find_gpu_instance(entry.bus_id, entry.profile_id, entry.start)
                else:
                    gi = entry.gpu_instance if self._exists(entry) else None
                if gi is not None:
                    destroy_mig(entry.bus_id, gi)
                    self._log.info("MIG device destroyed", device=device, claim=claim, gpu=entry.bus_id,
                                   gpu_instance=gi)
            self.ledger.remove(entry)

    def _exists(self, entry: LedgerEntry) -> bool:
        assert entry.gpu_instance is not None
        return mig_instance_exists(entry.bus_id, entry.gpu_instance, entry.profile_id, entry.start)

    def _edits(self, offer: Offer, entry: LedgerEntry) -> ContainerEdits:
        assert entry.gpu_instance is not None and entry.compute_instance is not None
        return self._mig_edits.edits(offer.gpu_minor, entry.gpu_instance, entry.compute_instance)


def _restore(entry: LedgerEntry) -> dict[str, Any]:
    return {"busId": entry.bus_id, "gpuInstance": entry.gpu_instance, "computeInstance": entry.compute_instance,
            "profileId": entry.profile_id, "placementStart": entry.start, "uuid": entry.uuid}
