"""Events and faults of the simulated NVML: event sets, what tests inject (Xid, ECC, a lost GPU) and GPU reset.

The entry points follow nvml.h: `nvmlEventSetCreate`, `nvmlDeviceGetSupportedEventTypes`,
`nvmlDeviceRegisterEvents` (physical GPUs only; per-MIG-device registration does not exist),
`nvmlEventSetWait_v2` (blocks up to its timeout, wakes as soon as an event is injected, fills
`c_nvmlEventData_t`, returns NVML_ERROR_TIMEOUT when nothing came and NVML_ERROR_GPU_IS_LOST once a
registered GPU has fallen off the bus) and `nvmlEventSetFree`. An event reaches only the sets its GPU is
registered in for its type, whichever process made the set; a set belongs to the process that made it and goes
with its NVML shutdown or its end. Waiters sleep on the library's condition variable: no polling.

Other processes inject into a running simulated node through its control channel (`simulator.nvml.control`,
also a command: `python -m simulator.nvml.control --sim-root R xid 0 79`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from simulator.nvml.marshal import (
    Client,
    HandleKind,
    LibraryCore,
    Target,
    api,
    handle_value,
    on_handle,
    out,
    set_fields,
    store_handle,
    store_pointer_field,
    token,
    uint,
)
from simulator.nvml.state import NvmlReturn, SimGpu, SimulatedNvmlError, parse_bus_id

__all__ = [
    "EVENT_DOUBLE_BIT_ECC",
    "EVENT_SINGLE_BIT_ECC",
    "EVENT_XID",
    "NO_INSTANCE",
    "SUPPORTED_EVENTS",
    "XID_FALLEN_OFF_THE_BUS",
    "EventSymbols",
]

EVENT_SINGLE_BIT_ECC = 0x1  # nvmlEventTypeSingleBitEccError
EVENT_DOUBLE_BIT_ECC = 0x2  # nvmlEventTypeDoubleBitEccError
EVENT_XID = 0x8  # nvmlEventTypeXidCriticalError
SUPPORTED_EVENTS = EVENT_XID | EVENT_SINGLE_BIT_ECC | EVENT_DOUBLE_BIT_ECC
NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId/computeInstanceId of an event not attributable to a MIG instance
XID_FALLEN_OFF_THE_BUS = 79
_GPU, _MIG, _SET = HandleKind.GPU, HandleKind.MIG_DEVICE, HandleKind.EVENT_SET


class _Event(NamedTuple):
    gpu: int
    event_type: int
    data: int
    gi: int
    ci: int


@dataclass(eq=False)
class _EventSet:
    id: int
    owner: Client  # event sets are per process, as NVML's handles are pointers into the process
    masks: dict[int, int] = field(default_factory=dict)  # GPU index → registered event types
    queue: deque[_Event] = field(default_factory=deque)


class EventSymbols(LibraryCore):
    """Event sets, injected events and faults, and GPU reset."""

    def __init__(self, gpus: list[SimGpu]) -> None:
        super().__init__(gpus)
        self._event_sets: dict[int, _EventSet] = {}
        self._next_set = 1

    # -- test-facing controls ------------------------------------------------------------------------

    def gpu_index(self, ref: int | str) -> int:
        """The index of the GPU named by its index, UUID ('GPU-…') or PCI bus id; KeyError names the GPUs."""
        gpus = self._gpus
        if isinstance(ref, int) or ref.strip().isdigit():
            i = int(ref)
            if 0 <= i < len(gpus):
                return i
        else:
            text = ref.strip()
            for i, gpu in enumerate(gpus):
                if gpu.uuid.lower() == text.lower():
                    return i
            try:
                key = parse_bus_id(text)
            except ValueError:
                key = None
            for i, gpu in enumerate(gpus):
                if key is not None and parse_bus_id(gpu.bus_id) == key:
                    return i
        known = ", ".join(f"{i} ({g.uuid}, {g.bus_id})" for i, g in enumerate(gpus)) or "none"
        raise KeyError(f"no GPU {ref!r} on this node; GPUs: {known}")

    def reset_gpu(self, index: int) -> None:
        """Reset GPU `index`: it is back on the bus, events not yet read are gone, the pending MIG mode becomes
        current. GPU and compute instances are kept."""
        with self._lock:
            gpu = self._gpus[index]
            gpu.mig_enabled = gpu.mig_pending
            gpu.lost = False
            for s in self._event_sets.values():
                s.queue = deque(e for e in s.queue if e.gpu != index)
            self._changed.notify_all()

    def set_lost(self, index: int, lost: bool = True) -> None:
        """Make GPU `index` fall off the bus (every call on it returns GPU_IS_LOST) or come back."""
        with self._lock:
            self._gpus[index].lost = lost
            self._changed.notify_all()  # event waiters on this GPU must return GPU_IS_LOST now

    def inject_event(
        self, index: int, event_type: int, data: int = 0, gi: int = NO_INSTANCE, ci: int = NO_INSTANCE
    ) -> int:
        """Queue an event for every event set GPU `index` is registered in for `event_type`; wakes waiters.

        `gi`/`ci` attribute the event to a MIG instance (they must exist); a lost GPU reports nothing more
        (ValueError). Returns the number of event sets that received it.
        """
        with self._lock:
            self._check_attribution(self._gpus[index], gi, ci)
            return self._queue(_Event(index, event_type, data, gi, ci))

    def inject_xid(
        self, index: int, xid: int, gi: int = NO_INSTANCE, ci: int = NO_INSTANCE, lost: bool | None = None
    ) -> int:
        """Queue an Xid critical-error event (eventData = `xid`); see `inject_event`.

        As on hardware, Xid 79 ("GPU has fallen off the bus") leaves the GPU lost until `reset_gpu`; `lost`
        overrides that for any Xid.
        """
        with self._lock:
            self._check_attribution(self._gpus[index], gi, ci)
            delivered = self._queue(_Event(index, EVENT_XID, xid, gi, ci))
            if lost is None:
                lost = xid == XID_FALLEN_OFF_THE_BUS
            if lost:
                self._gpus[index].lost = True
                self._changed.notify_all()
            return delivered

    def inject_ecc(self, index: int, double_bit: bool = True) -> int:
        """Queue a double-bit (uncorrectable) or single-bit (corrected) ECC error event; see `inject_event`."""
        return self.inject_event(index, EVENT_DOUBLE_BIT_ECC if double_bit else EVENT_SINGLE_BIT_ECC)

    def registrations(self, index: int) -> int:
        """The event types GPU `index` is registered for, over all event sets."""
        with self._lock:
            mask = 0
            for s in self._event_sets.values():
                mask |= s.masks.get(index, 0)
            return mask

    def _check_attribution(self, gpu: SimGpu, gi: int, ci: int) -> None:
        if gpu.lost:
            raise ValueError(f"GPU {gpu.bus_id} is lost and reports nothing; reset it first")
        if gi == NO_INSTANCE:
            if ci != NO_INSTANCE:
                raise ValueError("a compute instance needs its GPU instance")
            return
        if not gpu.mig_enabled:
            raise ValueError(f"GPU {gpu.bus_id} is not in MIG mode: events cannot name a MIG instance")
        instance = gpu.gpu_instances.get(gi)
        if instance is None:
            raise ValueError(f"GPU {gpu.bus_id} has no GPU instance {gi}; it has {sorted(gpu.gpu_instances)}")
        if ci != NO_INSTANCE and ci not in instance.compute_instances:
            raise ValueError(f"GPU instance {gi} of GPU {gpu.bus_id} has no compute instance {ci}; "
                             f"it has {sorted(instance.compute_instances)}")

    def _queue(self, event: _Event) -> int:
        sets = [s for s in self._event_sets.values() if s.masks.get(event.gpu, 0) & event.event_type]
        for s in sets:
            s.queue.append(event)
        self._changed.notify_all()
        return len(sets)

    def _client_released(self, client: Client) -> None:
        """The client shut NVML down or is gone: its event sets are gone and its blocked waiters return."""
        self._event_sets = {i: s for i, s in self._event_sets.items() if s.owner is not client}
        self._changed.notify_all()

    # -- entry points --------------------------------------------------------------------------------

    def _event_set(self, handle: Any) -> _EventSet:
        value = handle_value(handle) or 0
        s = self._event_sets.get(value & 0xFFFFFFFF) if value >> 48 == _SET else None
        if s is None or s.owner is not self._client():
            raise SimulatedNvmlError(NvmlReturn.ERROR_INVALID_ARGUMENT, f"not an event set: {handle!r}")
        return s

    @api
    def nvmlEventSetCreate(self, event_set: Any) -> int:
        s = _EventSet(self._next_set, self._client())
        self._next_set += 1
        self._event_sets[s.id] = s
        store_handle(event_set, token(_SET) | s.id)
        return NvmlReturn.SUCCESS

    @on_handle(_GPU, _MIG)
    def nvmlDeviceGetSupportedEventTypes(self, t: Target, types: Any) -> int:
        out(types).value = SUPPORTED_EVENTS
        return NvmlReturn.SUCCESS

    @on_handle(_GPU, _MIG)
    def nvmlDeviceRegisterEvents(self, t: Target, types: Any, event_set: Any) -> int:
        s = self._event_set(event_set)
        mask = uint(types)
        if t.mig or mask & ~SUPPORTED_EVENTS:
            return NvmlReturn.ERROR_NOT_SUPPORTED  # per-MIG-device registration does not exist
        s.masks[t.index] = s.masks.get(t.index, 0) | mask
        return NvmlReturn.SUCCESS

    @api
    def nvmlEventSetWait_v2(self, event_set: Any, data: Any, timeout_ms: Any) -> int:
        s = self._event_set(event_set)
        client = s.owner
        record = out(data)
        deadline = time.monotonic() + uint(timeout_ms) / 1000
        for index in s.masks:
            code = self._gpus[index].faults.get("nvmlEventSetWait_v2", 0)
            if code:
                return code
        while True:
            if client.init_count == 0:
                return NvmlReturn.ERROR_UNINITIALIZED
            if self._event_sets.get(s.id) is not s:
                return NvmlReturn.ERROR_INVALID_ARGUMENT  # freed while waiting
            if s.queue:
                ev = s.queue.popleft()
                store_pointer_field(record, "device", token(_GPU, ev.gpu))
                set_fields(record, eventType=ev.event_type, eventData=ev.data,
                           gpuInstanceId=ev.gi, computeInstanceId=ev.ci)
                return NvmlReturn.SUCCESS
            if any(self._gpus[i].lost for i in s.masks):
                return NvmlReturn.ERROR_GPU_IS_LOST
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return NvmlReturn.ERROR_TIMEOUT
            self._changed.wait(remaining)  # releases the lock while sleeping

    @api
    def nvmlEventSetFree(self, event_set: Any) -> int:
        del self._event_sets[self._event_set(event_set).id]
        self._changed.notify_all()
        return NvmlReturn.SUCCESS

