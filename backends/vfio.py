"""vfio-pci passthrough of a backend's PCI devices (GPUs, SR-IOV VFs): a claim whose configuration for a device
is `VfioConfig` gets the device's whole IOMMU group bound to vfio-pci and the group's VFIO nodes, for a VM or a
user-space driver in the container.

The IOMMU group is the unit of isolation: every member must be bound to vfio-pci before the group can be used, so
every member must be the device itself, another function of its card (a GPU's audio function), or a device the
backend publishes; PCI bridges need no driver and are left alone. A network function whose interface carries
the host's traffic is never taken.

Crash safety: before any driver changes, the original driver of every member is recorded in a journal in the
backend's state directory (the intent); once every member is on vfio-pci the entry is recorded again as bound.
Neither is synced to disk: a written record survives any crash of the agent, and a power cut, which may lose
it, reboots the node, which ends every binding and override with it (see `Journal`).
Unprepare, the core's rollback of a prepare a crash cut short, and `reconcile` at start all hand the members back
to their original drivers from that journal, and drop the entry.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar

from backends.base import BackendBase
from backends.config import CONFIG_API_VERSION, OpaqueConfig, Reconfiguration
from backends.contract import Allocated, BackendContext, Prepared, PrepareError
from backends.failpoints import failpoint
from backends.host_net import read_host_network
from backends.journal import Journal
from backends.sysfs import SysfsError, list_dir, read_hex, read_int, read_link_name
from backends.topology import PCI_BUS_ID
from backends.vfio_sysfs import VFIO_PCI, Deadline, Job, Rebinder, StuckError
from cdi.spec import ContainerEdits, DeviceNode

__all__ = ["CLAIM_SECONDS", "Passthrough", "PassthroughBackend", "VfioConfig", "wants_passthrough"]

CLAIM_SECONDS = 15.0
"""How long the driver changes of one claim may take before the claim fails."""

_NETWORK_CLASS = 0x02
_BRIDGE_CLASS = 0x0604


class VfioConfig(OpaqueConfig):
    """`apiVersion: dra-agent.io/v1alpha1`, `kind: VfioConfig`: pass the device through with vfio-pci.

    The container gets `/dev/vfio/vfio` and `/dev/vfio/<IOMMU group>` instead of the device's usual nodes; the
    device (and the rest of its IOMMU group) is back on its own driver once the claim is unprepared.
    """

    API_VERSION: ClassVar[str] = CONFIG_API_VERSION
    KIND: ClassVar[str] = "VfioConfig"
    RECONFIGURATIONS: ClassVar[tuple[Reconfiguration, ...]] = (
        Reconfiguration("VfioConfig", what="binds the device's whole IOMMU group to vfio-pci for the claim"),
    )


def wants_passthrough(allocated: Allocated) -> bool:
    """Whether the device is to be passed through. Admin access never reconfigures a device (other claims may use
    it meanwhile), so a VfioConfig for a device allocated with admin access is refused rather than ignored."""
    if not isinstance(allocated.config, VfioConfig):
        return False
    if allocated.admin_access:
        raise PrepareError(f"{allocated.device}: allocated with admin access, which never reconfigures a device; "
                           "VfioConfig is not applied to it (use a device class without it)")
    return True


class Passthrough:
    """One backend's vfio-pci bindings and their journal (`<state_dir>/vfio-ledger.json`).

    A claim's driver changes, with the journal records around them, run as one job of the rebinder's writer thread:
    one hand-over from the event loop and one back per claim. Changes are serialised: two claims never move
    drivers at the same time. A job given up on at its deadline (stuck in the kernel) is undone from a new writer
    thread; the stuck one, should the kernel ever return, writes nothing more."""

    def __init__(self, ctx: BackendContext, claim_seconds: float = CLAIM_SECONDS) -> None:
        self.ctx = ctx
        self.claim_seconds = claim_seconds
        self._rebinder = Rebinder(ctx.sysfs_root)
        # Not synced: bindings and overrides end with a reboot, as does a record lost to a power cut.
        self._journal = (Journal(ctx.state_dir / "vfio-ledger.json", durable=False) if ctx.state_dir is not None
                         else None)
        self._loaded = False
        self._lock = threading.Lock()  # the journal: used by writer threads (a stuck one's successor too) and the loop
        self._serial = asyncio.Lock()

    async def prepare(self, claim: str, targets: Sequence[tuple[str, str]], published: Collection[str],
                      notes: Mapping[str, Mapping[str, Any]] | None = None) -> list[Prepared]:
        """Bind each (device name, PCI address) and its IOMMU group to vfio-pci; all or nothing for the claim.
        `published` holds the PCI addresses of every device the backend publishes; `notes` (by device name) is
        kept with each entry for the backend (see `entries`)."""
        if not targets:
            return []
        if self._journal is None:
            raise PrepareError("vfio-pci passthrough is done only by `dra-agent run`, which records it")
        known, given = frozenset(published), notes or {}
        deadline = Deadline(self.claim_seconds)
        async with self._serial:
            try:
                done: list[Prepared] = await self._rebinder.run(
                    lambda job: self._prepare(job, claim, targets, known, given, deadline), deadline,
                    f"passing {', '.join(d for d, _ in targets)} through")
            except StuckError:
                # From a new writer thread; a failure is logged (the journal keeps the entries, so unprepare or the
                # next start finish the job).
                try:
                    await self._hand_back(claim, [(device, {}) for device, _ in targets],
                                          "handing back after a change that did not finish")
                except PrepareError as e:
                    self.ctx.log.error("cannot hand devices back from vfio-pci after a failed prepare", claim=claim,
                                       error=str(e))
                raise
        return done

    async def entries(self) -> list[dict[str, Any]]:
        """The devices bound (or being bound) for claims: claim, device, group, members, bound, and the backend's
        `notes`."""
        await self._load()
        if self._journal is None:
            return []
        with self._lock:
            return [dict(entry) for _, entry in self._journal]

    async def unprepare(self, claim: str, prepared: Sequence[Prepared]) -> None:
        """Hand back what was bound for the claim's devices, from the journal or the restore records."""
        await self._load()
        work = [(p.device, p.restore) for p in prepared if "vfio" in p.restore or self._entry(claim, p.device)]
        if work:
            async with self._serial:
                await self._hand_back(claim, work, f"handing {', '.join(d for d, _ in work)} back")

    async def reconcile(self, held: Mapping[str, Sequence[str]]) -> None:
        """Hand back what was bound for claims the core no longer holds."""
        await self._load()
        if self._journal is None:
            return
        with self._lock:
            entries = [entry for _, entry in self._journal]
        for entry in entries:
            if entry["device"] not in held.get(entry["claim"], ()):
                self.ctx.log.warning("returning a device bound to vfio-pci for a claim no longer prepared",
                                     device=entry["device"], claim=entry["claim"], members=entry["members"])
                async with self._serial:
                    await self._hand_back(str(entry["claim"]), [(str(entry["device"]), {})],
                                          f"handing {entry['device']} back")

    def close(self) -> None:
        if self._journal is not None:
            with self._lock:
                self._journal.close()

    async def _hand_back(self, claim: str, items: Sequence[tuple[str, Mapping[str, Any]]], what: str) -> None:
        """Hand `items` (device, restore record) of a claim back, as one job of the writer thread."""
        deadline = Deadline(self.claim_seconds)
        await self._rebinder.run(lambda job: self._undo(job, claim, items, deadline), deadline, what)

    async def _load(self) -> None:
        if not self._loaded and self._journal is not None and self._journal.path.exists():
            await asyncio.to_thread(self._load_now)

    def _load_now(self) -> None:
        with self._lock:
            if self._loaded or self._journal is None:
                return
            self._journal.load()
            for problem in self._journal.problems:
                self.ctx.log.error(problem)
            self._loaded = True

    def _entry(self, claim: str, device: str) -> dict[str, Any] | None:
        if self._journal is None:
            return None
        with self._lock:
            return self._journal.get(f"{claim}/{device}")

    # In the writer thread -----------------------------------------------------------------------------------------

    def _prepare(self, job: Job, claim: str, targets: Sequence[tuple[str, str]], published: frozenset[str],
                 notes: Mapping[str, Mapping[str, Any]], deadline: Deadline) -> list[Prepared]:
        self._load_now()
        done: list[Prepared] = []
        try:
            for device, bus_id in targets:
                done.append(self._prepare_one(job, claim, device, bus_id, published, deadline, notes.get(device)))
        except BaseException:
            # One claim is all or nothing: what this call bound for it goes back (given up on: the caller's job).
            if not job.abandoned:
                self._undo_quietly(job, claim, [(p.device, p.restore) for p in done])
            raise
        return done

    def _prepare_one(self, job: Job, claim: str, device: str, bus_id: str, published: frozenset[str],
                     deadline: Deadline, note: Mapping[str, Any] | None) -> Prepared:
        assert self._journal is not None
        key = f"{claim}/{device}"
        entry = self._entry(claim, device)
        try:
            group, members = self._group(bus_id, published)
            self._refuse_host_interfaces(members)
        except SysfsError as e:
            raise PrepareError(f"{device}: {e}") from None
        with self._lock:
            others = [(k, e) for k, e in self._journal if k != key]
        for _, other in others:
            taken = set(other["members"]) & set(members)
            if taken:
                raise PrepareError(f"{device}: {', '.join(sorted(taken))} of IOMMU group {group} is passed through "
                                   f"for claim {other['claim']} already")
        # An entry left by an attempt that did not finish knows the drivers from before it.
        current = {m: self._rebinder.driver(m) for m in members}
        originals: dict[str, str | None] = dict(entry["members"]) if entry is not None else current
        record: dict[str, Any] = {"claim": claim, "device": device, "group": group, "members": originals}
        if entry is not None and "notes" in entry:
            record["notes"] = entry["notes"]
        elif note is not None:
            record["notes"] = dict(note)
        with self._lock:
            self._journal.put(key, {**record, "bound": False})
        failpoint("vfio-after-intent")
        try:
            for member in members:
                self._rebinder.to_vfio_in(job, member, current[member], deadline)
        except BaseException:
            if not job.abandoned:
                self._undo_quietly(job, claim, [(device, {})])
            raise
        failpoint("vfio-after-binding")
        with self._lock:
            if job.abandoned:  # the caller is handing the members back meanwhile
                raise PrepareError(f"{device}: given up")
            self._journal.put(key, {**record, "bound": True})
        return Prepared(
            device=device,
            edits=ContainerEdits(device_nodes=(DeviceNode(f"/dev/vfio/{group}"),)),
            common_edits=ContainerEdits(device_nodes=(DeviceNode("/dev/vfio/vfio"),)),
            restore={"vfio": {"group": group, "members": originals}},
            # What a VM launcher needs to find the device it got (KubeVirt reads exactly this PCI attribute).
            facts={PCI_BUS_ID: bus_id, "iommuGroup": group},
        )

    def _group(self, bus_id: str, published: frozenset[str]) -> tuple[int, list[str]]:
        """The IOMMU group of `bus_id` and the members to bind; refuses a group with a member not ours."""
        folder = self._rebinder.folder(bus_id)
        group = read_link_name(folder / "iommu_group")
        if group is None or not group.isdigit():
            raise PrepareError(f"{bus_id} has no IOMMU group: the IOMMU is off or the device is not isolated, "
                               "so it cannot be passed through")
        slot = bus_id.rsplit(".", 1)[0]
        members: list[str] = []
        for member in list_dir(folder / "iommu_group/devices"):
            member_folder = self._rebinder.folder(member)
            if member == bus_id or member in published:
                members.append(member)
            elif (read_hex(member_folder / "class") or 0) >> 8 == _BRIDGE_CLASS:
                continue  # a bridge needs no driver for the group to be usable
            elif member.rsplit(".", 1)[0] == slot and not read_int(member_folder / "sriov_numvfs"):
                members.append(member)  # another function of the same card (not a PF whose VFs are in use)
            else:
                raise PrepareError(f"IOMMU group {group} also holds {member}, which dra-agent does not own")
        return int(group), members

    def _refuse_host_interfaces(self, members: Sequence[str]) -> None:
        host = None
        for member in members:
            folder = self._rebinder.folder(member)
            if (read_hex(folder / "class") or 0) >> 16 != _NETWORK_CLASS:
                continue
            host = host or read_host_network(self.ctx.host_root)
            for interface in list_dir(folder / "net"):
                reason = host.busy(interface)
                if reason is not None:
                    raise PrepareError(f"{member}: {reason}; it is left to the host")

    def _undo_quietly(self, job: Job, claim: str, items: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
        """Undo after a failed prepare; a failure here is logged, the prepare's own error is what the claim gets
        (the journal keeps the entry, so unprepare or the next start finish the job)."""
        try:
            self._undo(job, claim, items, Deadline(self.claim_seconds))
        except PrepareError as e:
            self.ctx.log.error("cannot hand devices back from vfio-pci after a failed prepare", claim=claim,
                               error=str(e))

    def _undo(self, job: Job, claim: str, items: Sequence[tuple[str, Mapping[str, Any]]], deadline: Deadline) -> None:
        """Members back to their original drivers, then the entries go (kept when that fails, for a retry)."""
        self._load_now()
        for device, restore in items:
            entry = self._entry(claim, device)
            members = entry["members"] if entry is not None else restore.get("vfio", {}).get("members")
            for member, original in (members or {}).items():
                if original != VFIO_PCI:  # a member vfio-pci held before stays there
                    self._rebinder.back_to_in(job, member, original, deadline)
            if self._journal is not None:
                with self._lock:
                    self._journal.remove(f"{claim}/{device}")


class PassthroughBackend(BackendBase):
    """Base of the backends whose devices can be passed through: their `Passthrough`, made on first use (its
    journal is read then), and closed when the backend stops."""

    _vfio: Passthrough | None = None

    def passthrough(self) -> Passthrough:
        if self._vfio is None:
            self._vfio = Passthrough(self.ctx)
        return self._vfio

    async def stop(self) -> None:
        await super().stop()
        if self._vfio is not None:
            self._vfio.close()
