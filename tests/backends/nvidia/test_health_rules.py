"""The pure rules of GPU health: Xid meanings, event verdicts, and which devices a GPU's condition reaches."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from backends.contract import Health
from backends.nvidia.health_rules import (
    DEFAULT_IGNORED_XIDS,
    GPU_LOST,
    NO_INSTANCE,
    Condition,
    DeviceRef,
    EventType,
    GpuEvent,
    Ignored,
    Unit,
    classify,
    describe_xid,
    device_conditions,
    unit_of,
    unmonitored,
    worse,
)

GPU = "GPU-0a100000-0000-4000-8000-000000000001"
OTHER = "GPU-0b100000-0000-4000-8000-000000000002"
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_TAINT_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")


def test_xid_descriptions() -> None:
    assert describe_xid(79) == "Xid 79: GPU has fallen off the bus"
    assert describe_xid(48) == "Xid 48: double-bit ECC error"
    assert describe_xid(12345) == "Xid 12345"


def test_critical_and_ignored_xids() -> None:
    assert classify(GpuEvent(GPU, EventType.XID, 79), DEFAULT_IGNORED_XIDS) == Condition(
        Health.UNHEALTHY, "Xid 79: GPU has fallen off the bus", "xid", "79")
    for code in (13, 31, 43, 45, 68, 109):
        verdict = classify(GpuEvent(GPU, EventType.XID, code), DEFAULT_IGNORED_XIDS)
        assert isinstance(verdict, Ignored) and verdict.notable, code
    # The ignore list is the configuration's, all of it: 13 counts when the operator says so.
    assert isinstance(classify(GpuEvent(GPU, EventType.XID, 13), {79}), Condition)
    assert isinstance(classify(GpuEvent(GPU, EventType.XID, 79), {79}), Ignored)


def test_ecc_and_other_events() -> None:
    assert classify(GpuEvent(GPU, EventType.DOUBLE_BIT_ECC), ()) == Condition(
        Health.UNHEALTHY, "double-bit (uncorrectable) ECC error", "ecc")
    corrected = classify(GpuEvent(GPU, EventType.SINGLE_BIT_ECC), ())
    assert isinstance(corrected, Ignored) and not corrected.notable
    assert isinstance(classify(GpuEvent(GPU, 0x4), ()), Ignored)  # a P-state change


@given(
    event_type=st.integers(0, 0xFFFF),
    data=st.integers(0, 0xFFFFFFFF),
    gi=st.sampled_from([NO_INSTANCE, 0, 1, 5]),
    ci=st.sampled_from([NO_INSTANCE, 0, 2]),
    ignored=st.frozensets(st.integers(0, 200)),
)
def test_classification_of_any_event(event_type: int, data: int, gi: int, ci: int, ignored: frozenset[int]) -> None:
    verdict = classify(GpuEvent(GPU, event_type, data, gi, ci), ignored)
    is_xid = bool(event_type & EventType.XID)
    critical = (is_xid and data not in ignored) or (not is_xid and bool(event_type & EventType.DOUBLE_BIT_ECC))
    assert isinstance(verdict, Condition) == critical
    if isinstance(verdict, Condition):
        assert verdict.health is Health.UNHEALTHY
        assert _LABEL.fullmatch(verdict.cause) and _TAINT_VALUE.fullmatch(verdict.value)
        if is_xid:
            assert verdict.reason.startswith(f"Xid {data}") and verdict.value == str(data)
    else:
        assert verdict.notable == (is_xid and data in ignored)


def test_the_first_unhealthy_cause_stays() -> None:
    xid = Condition(Health.UNHEALTHY, "Xid 79: GPU has fallen off the bus", "xid", "79")
    assert worse(None, xid) == xid
    assert worse(xid, GPU_LOST) == xid
    assert worse(xid, unmonitored("NVML failed")) == xid
    assert worse(unmonitored("NVML failed"), GPU_LOST) == GPU_LOST
    assert worse(unmonitored("a"), unmonitored("b")) == unmonitored("b")
    assert unmonitored("x").health is Health.UNKNOWN and unmonitored("x").cause == "unmonitored"


def test_events_name_the_gpu_or_one_instance() -> None:
    assert unit_of(GpuEvent(GPU, EventType.XID, 79)) == (GPU, NO_INSTANCE, NO_INSTANCE)
    assert unit_of(GpuEvent(GPU, EventType.XID, 94, 1, 0)) == (GPU, 1, 0)
    assert unit_of(GpuEvent(GPU, EventType.XID, 94, 1)) == (GPU, 1, NO_INSTANCE)
    assert unit_of(GpuEvent(GPU, EventType.XID, 94, NO_INSTANCE, 3)) == (GPU, NO_INSTANCE, NO_INSTANCE)


DEVICES = {
    "full": DeviceRef(OTHER, "0000:9a:00.0"),
    "mig-1-0": DeviceRef(GPU, "0000:18:00.0", 1, 0),
    "mig-1-1": DeviceRef(GPU, "0000:18:00.0", 1, 1),
    "mig-2-0": DeviceRef(GPU, "0000:18:00.0", 2, 0),
}
ECC = Condition(Health.UNHEALTHY, "Xid 94: contained ECC error", "xid", "94")


def test_mig_devices_follow_their_gpu_or_their_own_instance() -> None:
    assert device_conditions({(GPU, NO_INSTANCE, NO_INSTANCE): GPU_LOST}, DEVICES) == {
        "mig-1-0": GPU_LOST, "mig-1-1": GPU_LOST, "mig-2-0": GPU_LOST}
    assert device_conditions({(GPU, 1, 1): ECC}, DEVICES) == {"mig-1-1": ECC}
    assert device_conditions({(GPU, 1, NO_INSTANCE): ECC}, DEVICES) == {"mig-1-0": ECC, "mig-1-1": ECC}
    # Unhealthy beats unknown, and the whole GPU's condition beats an instance's.
    units = {(GPU, NO_INSTANCE, NO_INSTANCE): unmonitored("NVML failed"), (GPU, 2, 0): ECC}
    assert device_conditions(units, DEVICES)["mig-2-0"] == ECC
    assert device_conditions(units, DEVICES)["mig-1-0"] == unmonitored("NVML failed")
    units = {(GPU, NO_INSTANCE, NO_INSTANCE): GPU_LOST, (GPU, 2, 0): ECC}
    assert device_conditions(units, DEVICES)["mig-2-0"] == GPU_LOST
    # A full-GPU device contains every instance of its GPU.
    assert device_conditions({(OTHER, 3, 0): ECC}, DEVICES) == {"full": ECC}


_units = st.dictionaries(
    st.tuples(st.sampled_from([GPU, OTHER]), st.sampled_from([NO_INSTANCE, 1, 2]),
              st.sampled_from([NO_INSTANCE, 0, 1])),
    st.sampled_from([GPU_LOST, ECC, unmonitored("NVML failed")]),
    max_size=6,
)


@given(_units)
def test_conditions_reach_exactly_the_devices_they_cover(units: dict[Unit, Condition]) -> None:
    result = device_conditions(units, DEVICES)
    for name, ref in DEVICES.items():
        covering = [c for (uuid, gi, ci), c in units.items() if uuid == ref.uuid and (
            gi == NO_INSTANCE or ref.gpu_instance == NO_INSTANCE
            or (gi == ref.gpu_instance and ci in (NO_INSTANCE, ref.compute_instance)))]
        if not covering:
            assert name not in result
            continue
        assert result[name] in covering
        unhealthy = any(c.health is Health.UNHEALTHY for c in covering)
        assert (result[name].health is Health.UNHEALTHY) == unhealthy
