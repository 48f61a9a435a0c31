"""The ledger of GPU shares (backends/nvidia/gpu_shares.py) over random sequences of prepares and unprepares, with
random amounts, hostile ones among them: what it records of a GPU never adds up to less than nothing or to more
than the GPU has, a refused share leaves nothing, and a restarted agent reads back what was recorded."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st

from agent.claims.plan import Owner, plan_claim
from agent.claims.read import ClaimError, read_allocation
from agent.logs import get_logger
from backends.contract import ClaimRef, Device, PrepareError
from backends.nvidia.gpu_shares import GpuShares, memory_policy

MI, GI = 2**20, 2**30
CAPACITY = {"gpu-0": 81559 * MI, "gpu-1": 40 * GI}
CLAIMS = [f"00000000-0000-4000-8000-{n:012d}" for n in range(4)]
SHARES = [f"5e2d3c4b-5a69-4788-8796-{n:012d}" for n in range(3)]
DRIVER, POOL = "gpu.nvidia.com", "node-a"
INTERNALS = re.compile(r"[A-Z]\w*(Error|Exception)\b|Traceback|int_max_str_digits|\[Errno")
LOG = get_logger("test")

HOSTILE_BYTES = st.sampled_from([-(10**5000), -(2**63), -1099511627776, -42949672960, -1, 0, 2**63 - 1, 2**63, 10**5000,
                                 CAPACITY["gpu-0"] + 1, CAPACITY["gpu-1"]])
BYTES = HOSTILE_BYTES | st.integers(min_value=-(2**64), max_value=2**64) | st.integers(min_value=1, max_value=100 * GI)


def recorded(ledger: GpuShares) -> dict[str, list[dict[str, Any]]]:
    return {device: sorted((dict(e) for e in ledger.shares_of(device)), key=lambda e: str(sorted(e.items())))
            for device in CAPACITY}


def check_within_the_gpus(ledger: GpuShares) -> None:
    for device, entries in recorded(ledger).items():
        amounts = [e["memory"] for e in entries]
        assert all(isinstance(a, int) and a >= 1 for a in amounts), amounts
        assert 0 <= sum(amounts) <= CAPACITY[device], (device, amounts)


def admitted(ledger: GpuShares, claim: str, device: str, share: str, strategy: str, memory: int) -> bool:
    """Admit the share as a prepare does; False (and nothing changed) when the ledger refuses it."""
    before = recorded(ledger)
    try:
        ledger.admit(claim, device, share, strategy, memory, CAPACITY[device])
    except PrepareError as e:
        assert not INTERNALS.search(str(e)), str(e)
        assert recorded(ledger) == before, "a refused share leaves nothing"
        event("a share refused by the ledger")
        return False
    event("a share admitted")
    return True


ADMIT = st.tuples(st.just("admit"), st.sampled_from(CLAIMS), st.sampled_from(sorted(CAPACITY)),
                  st.sampled_from(SHARES), st.sampled_from(["none", "TimeSlicing"]), BYTES)
RELEASE = st.tuples(st.just("release"), st.sampled_from(CLAIMS), st.sampled_from(sorted(CAPACITY)),
                    st.sampled_from(SHARES))


@settings(database=None, max_examples=400, deadline=None)
@given(st.lists(ADMIT | RELEASE, min_size=5, max_size=40))
def test_the_ledger_never_holds_less_than_nothing_or_more_than_the_gpu(operations: list[tuple[Any, ...]]) -> None:
    event(f"{len(operations) // 10 * 10}+ operations")
    with tempfile.TemporaryDirectory() as state_dir:
        ledger = GpuShares(Path(state_dir), LOG)
        for operation in operations:
            if operation[0] == "admit":
                _, claim, device, share, strategy, memory = operation
                if admitted(ledger, claim, device, share, strategy, memory):
                    assert {"claim": claim, "device": device, "share": share, "sharing": strategy,
                            "memory": memory} in recorded(ledger)[device]
            else:
                _, claim, device, share = operation
                ledger.release(claim, device, share)
                assert all(e["claim"] != claim or e["share"] != share for e in recorded(ledger)[device])
            check_within_the_gpus(ledger)
        kept = recorded(ledger)
        ledger.close()
        again = GpuShares(Path(state_dir), LOG)
        assert recorded(again) == kept, "a restarted agent reads back what was recorded"
        again.close()


# --- from the claim's text to the ledger ----------------------------------------------------------------------------

POLICY = memory_policy(CAPACITY["gpu-0"], GI)
assert POLICY is not None
GPU_0 = Device("gpu-0", capacity={"memory": CAPACITY["gpu-0"]}, allow_multiple_allocations=True,
               capacity_policies={"memory": POLICY})
AMOUNT_TEXTS = (
    st.integers(min_value=1, max_value=79).map(lambda n: f"{n}Gi")
    | st.sampled_from(["-40Gi", "-1", -1099511627776, "0", "1", "1m", "1e1000", "1e" + "9" * 5000, "9" * 5000,
                       "1024Mi", "1.0Gi", "80Gi", "1536Mi", "9223372036854775807", "8Ei", 1.5, True, "lots",
                       "+1Gi", "01Gi", "1e+3", "79Gi", "40G", "42949672960"])
    | st.from_regex(r"[+-]?[0-9]{1,22}(\.[0-9]{0,4})?([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]{1,4})?", fullmatch=True)
    | st.integers(min_value=-(2**70), max_value=2**70)
)
PREPARE = st.tuples(st.just("prepare"), st.sampled_from(CLAIMS), st.sampled_from(SHARES), AMOUNT_TEXTS)
UNPREPARE = st.tuples(st.just("unprepare"), st.sampled_from(CLAIMS), st.sampled_from(SHARES))


def prepared(ledger: GpuShares, uid: str, share: str, amount: Any) -> bool:
    """Read a claim holding one share of gpu-0 with `amount` as its consumedCapacity.memory, check it and admit
    it, as a prepare does; False (and nothing recorded) when the claim is refused."""
    claim = {"metadata": {"uid": uid, "namespace": "default", "name": "c"},
             "status": {"allocation": {"devices": {"results": [
                 {"driver": DRIVER, "pool": POOL, "request": "gpu", "device": "gpu-0", "shareID": share,
                  "consumedCapacity": {"memory": amount}}]}}}}
    try:
        plan = plan_claim(read_allocation(claim, ClaimRef(uid, "default", "c"), DRIVER), POOL, DRIVER,
                          lambda name: Owner("nvidia-gpu", None, (), GPU_0))  # type: ignore[arg-type]
    except ClaimError as e:
        assert not INTERNALS.search(str(e)), str(e)
        event("a claim refused when read")
        return False
    (allocated,) = plan.per_backend["nvidia-gpu"][1]
    memory = allocated.consumed["memory"]
    assert memory % GI == 0 and GI <= memory <= 79 * GI, f"{amount!r} passed as {memory}"
    return admitted(ledger, uid, "gpu-0", share, "none", memory)


@settings(database=None, max_examples=300, deadline=None)
@given(st.lists(PREPARE | UNPREPARE, min_size=5, max_size=30))
def test_shares_read_from_claims_never_overcommit_the_gpu(operations: list[tuple[Any, ...]]) -> None:
    event(f"{len(operations) // 10 * 10}+ operations")
    with tempfile.TemporaryDirectory() as state_dir:
        ledger = GpuShares(Path(state_dir), LOG)
        for operation in operations:
            if operation[0] == "prepare":
                prepared(ledger, *operation[1:])
            else:
                ledger.release(operation[1], "gpu-0", operation[2])
            check_within_the_gpus(ledger)
        ledger.close()
