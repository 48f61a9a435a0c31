"""Amounts of GPU shares (`sharing.byMemory`) through the running agent: allocations written by hand (as a buggy
scheduler or a user with claim-writing rights could) with amounts the API server would store but the scheduler never
writes are refused per claim, naming the field and the policy, and leave nothing; every amount the scheduler
writes prepares."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from backends.contract import ClaimRef
from simulator.apiserver.server import TestApiServer
from simulator.kubelet import KubeletSimulator
from simulator.scheduler.allocation import allocate
from tests.support.agent_env import NODE, agent_in_process
from tests.support.allocation_env import claim, device_classes, exactly
from tests.support.gpu_share_env import (
    DEVICE,
    GPU,
    ON_GPU_0,
    SHARING,
    backend_journal,
    records,
    share,
    sharing_agent,
    slices,
    spec_of,
)

GIB = 2**30
FIELD = "status.allocation.devices.results[0].consumedCapacity.memory"
POLICY = f"{DEVICE}'s requestPolicy for memory (validRange: min 1Gi, max 79Gi, step 1Gi; default 79Gi)"
INTERNALS = re.compile(r"[A-Z]\w*(Error|Exception)\b|Traceback|int_max_str_digits|\[Errno")


def written_by_hand(server: TestApiServer, name: str, *memories: str,
                    rewrite: Callable[[list[dict[str, Any]]], None]) -> ClaimRef:
    """A claim for shares of GPU 0 allocated as if no other claim held any of it, its results then rewritten."""
    requests = [exactly("gpu" if i == 0 else f"gpu{i}", GPU, ON_GPU_0, capacity={"requests": {"memory": m}})
                for i, m in enumerate(memories)]
    wanted = claim(name, *requests)
    allocation = allocate(wanted, classes=device_classes(), slices=slices(server), allocated=[], node=NODE)
    status = json.loads(json.dumps(allocation.status))
    rewrite(status["devices"]["results"])
    wanted["metadata"]["uid"] = uid = f"00000000-0000-4000-a000-{len(server.objects('resourceclaims')) + 1:012d}"
    server.put_claim({**wanted, "status": {"allocation": status}})
    return ClaimRef(uid, "default", name)


def consuming(amount: Any) -> Callable[[list[dict[str, Any]]], None]:
    def rewrite(results: list[dict[str, Any]]) -> None:
        results[0]["consumedCapacity"]["memory"] = amount
    return rewrite


HOSTILE = {
    "negative": ("-40Gi", 'quantity "-40Gi" is negative'),
    "minus-one": ("-1", 'quantity "-1" is negative'),
    "negative-number": (-1099511627776, 'quantity "-1099511627776" is negative'),
    "zero": ("0", f'"0" is below the minimum of {POLICY}'),
    "one": ("1", f'"1" is below the minimum of {POLICY}'),
    "milli": ("1m", f'"1m" is below the minimum of {POLICY}'),
    "off-step": ("1536Mi", f'"1536Mi" is not the minimum plus whole steps of {POLICY}'),
    "above-max": ("81408Mi", f'"81408Mi" is above the maximum of {POLICY}'),
    "huge": ("1e1000", 'quantity "1e1000" is too large: an amount of capacity is at most 9223372036854775807'),
    "huge-exponent": ("1e" + "9" * 5000, f'quantity "{("1e" + "9" * 5000)[:32]}…" is too large'),
    "not-served": ("1024Mi", 'quantity "1024Mi" is not as the API server writes it ("1Gi")'),
}


async def test_amounts_the_server_or_the_policy_does_not_allow_are_refused_and_leave_nothing(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100", backends=("nvidia-gpu",), backend_config=SHARING) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await sharing_agent(env, kubelet)
        refs = {name: written_by_hand(env.server, name, "40Gi", rewrite=consuming(amount))
                for name, (amount, _) in HOSTILE.items()}
        answers = await plugin.prepare(list(refs.values()))
        for name, (_, problem) in HOSTILE.items():
            error = answers[refs[name].uid].error
            assert error.startswith(f"claim default/{name}: {FIELD}: {problem}"), error
            assert not INTERNALS.search(error), error
            assert spec_of(env, refs[name].uid) is None
        assert records(env) == {} and backend_journal(env.settings.state_dir, "gpu-shares.json") == {}
        unprepared = await plugin.unprepare(list(refs.values()))
        assert set(unprepared.values()) == {""}, "nothing to undo"

        # None of them took memory from the GPU: the whole of it is still there for the shares that fit.
        whole = written_by_hand(env.server, "whole", "79Gi", rewrite=lambda results: None)
        assert (await plugin.prepare([whole]))[whole.uid].error == ""
        env_of_whole = spec_of(env, whole.uid)
        assert env_of_whole is not None
        assert env_of_whole["devices"][0]["containerEdits"]["env"] == [f"DRA_AGENT_GPU_SHARE_MEMORY={79 * GIB}"]
        late = written_by_hand(env.server, "late", "40Gi", rewrite=lambda results: None)
        assert (await plugin.prepare([late]))[late.uid].error.endswith(
            f"{DEVICE}: this share's 40Gi of memory does not fit: the shares prepared on the GPU hold 79Gi of its "
            "79.65Gi")
        assert [e["memory"] for e in backend_journal(env.settings.state_dir, "gpu-shares.json").values()] == [
            79 * GIB]


async def test_one_share_id_twice_in_a_claim_is_refused(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100", backends=("nvidia-gpu",), backend_config=SHARING) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await sharing_agent(env, kubelet)

        def same_share(results: list[dict[str, Any]]) -> None:
            results[1]["shareID"] = results[0]["shareID"]

        twice = written_by_hand(env.server, "twice", "40Gi", "39Gi", rewrite=same_share)
        stored = env.server.get_object("resourceclaims", "twice")
        assert stored is not None
        share_id = stored["status"]["allocation"]["devices"]["results"][0]["shareID"]
        error = (await plugin.prepare([twice]))[twice.uid].error
        assert error == (f"claim default/twice: status.allocation.devices.results[1].shareID: {share_id} is the "
                         "shareID of results[0] too: the scheduler gives every share its own")
        assert records(env) == {} and backend_journal(env.settings.state_dir, "gpu-shares.json") == {}


async def test_every_amount_the_scheduler_writes_prepares(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100", backends=("nvidia-gpu",), backend_config=SHARING) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await sharing_agent(env, kubelet)
        asked = {"one-byte": "1", "half": "0.5Gi", "decimal": "40G", "between": "1500Mi", "exact": "3Gi"}
        refs = {name: share(env.server, name, amount) for name, amount in asked.items()}
        answers = await plugin.prepare(list(refs.values()))
        assert {name: answers[ref.uid].error for name, ref in refs.items()} == dict.fromkeys(asked, "")
        given = {}
        for name, ref in refs.items():
            spec = spec_of(env, ref.uid)
            assert spec is not None
            given[name] = spec["devices"][0]["containerEdits"]["env"]
        assert given == {"one-byte": [f"DRA_AGENT_GPU_SHARE_MEMORY={GIB}"],
                         "half": [f"DRA_AGENT_GPU_SHARE_MEMORY={GIB}"],
                         "decimal": [f"DRA_AGENT_GPU_SHARE_MEMORY={38 * GIB}"],
                         "between": [f"DRA_AGENT_GPU_SHARE_MEMORY={2 * GIB}"],
                         "exact": [f"DRA_AGENT_GPU_SHARE_MEMORY={3 * GIB}"]}
        assert sum(e["memory"] for e in backend_journal(env.settings.state_dir, "gpu-shares.json").values()) == (
            45 * GIB)
