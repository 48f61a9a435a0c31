"""Full GPUs shared by memory (`backend_config.nvidia-gpu.sharing.byMemory`), end to end through the agent: the slice
it publishes, shares allocated by the scheduler's consumable capacity, each share prepared with its own CDI
device, checkpoint record and share id; compute modes kept while a share remains; refusals that leave nothing
behind; shares surviving a crash."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pynvml
import pytest

from backends.contract import ClaimRef
from backends.nvidia.nvml import nvml_session
from simulator.apiserver.server import TestApiServer
from simulator.kubelet import KubeletSimulator
from simulator.kubelet_connection import KubeletError
from simulator.scheduler.allocation import Unallocatable, allocate
from tests.support.agent_env import (
    NODE,
    agent_in_process,
    journal_entries,
    plugin_after_restart,
    simulated_nvml,
    two_agents,
    wait_until,
)
from tests.support.agent_env import allocate as put_allocated
from tests.support.allocation_env import claim, device_classes, exactly
from tests.support.gpu_share_env import (
    BUS_ID,
    DEVICE,
    GPU,
    ON_GPU_0,
    SHARING,
    backend_journal,
    published_gpu,
    records,
    share,
    sharing_agent,
    slices,
    spec_of,
)
from tests.support.timing import scaled

GIB = 2**30
DEFAULT, EXCLUSIVE_PROCESS = pynvml.NVML_COMPUTEMODE_DEFAULT, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS


def result_shares(server: TestApiServer, name: str) -> list[str]:
    stored = server.get_object("resourceclaims", name)
    assert stored is not None
    return [r["shareID"] for r in stored["status"]["allocation"]["devices"]["results"]]


async def test_the_gpu_is_published_shareable_by_memory_only_when_the_setting_is_on(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100", backends=("nvidia-gpu",), backend_config=SHARING) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        await sharing_agent(env, kubelet)
        memory = published_gpu(env.server)["capacity"]["memory"]
        assert memory == {"value": "81559Mi", "requestPolicy": {
            "default": "79Gi", "validRange": {"min": "1Gi", "max": "79Gi", "step": "1Gi"}}}
    (scratch / "off").mkdir()
    async with agent_in_process(scratch / "off", "dgx-h100", backends=("nvidia-gpu",)) as env:
        await wait_until(lambda: any(s["spec"].get("devices") for s in slices(env.server)), scaled(10))
        plain = published_gpu(env.server)
        assert "allowMultipleAllocations" not in plain and plain["capacity"]["memory"] == {"value": "81559Mi"}


async def test_two_claims_share_one_gpu_and_each_share_is_its_own(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100", backends=("nvidia-gpu",), backend_config=SHARING) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await sharing_agent(env, kubelet)
        first, second = share(env.server, "first", "30Gi"), share(env.server, "second", "40G")
        (first_share,), (second_share,) = result_shares(env.server, "first"), result_shares(env.server, "second")
        answers = await plugin.prepare([first, second])
        for ref, share_id in ((first, first_share), (second, second_share)):
            (device,) = answers[ref.uid].devices
            assert answers[ref.uid].error == ""
            assert device.device == DEVICE and device.share_id == share_id
            assert device.cdi_device_ids == (f"k8s.{GPU}/claim={ref.uid}-{DEVICE}-{share_id}",)
        assert records(env) == {first.uid: [(DEVICE, first_share)], second.uid: [(DEVICE, second_share)]}
        for ref, memory in ((first, 30 * GIB), (second, 38 * GIB)):  # 40G rounded up to whole GiB
            spec = spec_of(env, ref.uid)
            assert spec is not None
            (cdi_device,) = spec["devices"]
            assert cdi_device["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia0"}]
            assert cdi_device["containerEdits"]["env"] == [f"DRA_AGENT_GPU_SHARE_MEMORY={memory}"]
        assert len(backend_journal(env.settings.state_dir, "gpu-shares.json")) == 2

        # Of 81559Mi, 68Gi are taken, a third claim of 30Gi does not fit beside them.
        with pytest.raises(Unallocatable, match=r"without enough capacity left: gpu-0000-18-00-0: memory 30Gi "
                                                r"asked, 11927Mi left \(shared by default/first, default/second\)"):
            share(env.server, "third", "30Gi")

        assert (await plugin.unprepare([first]))[first.uid] == ""
        assert records(env) == {second.uid: [(DEVICE, second_share)]}
        assert spec_of(env, first.uid) is None and spec_of(env, second.uid) is not None
        again = (await plugin.prepare([second]))[second.uid]
        assert again == answers[second.uid], "the share that stays is still prepared"
        assert list(backend_journal(env.settings.state_dir, "gpu-shares.json")) == [
            f"{second.uid}/{DEVICE}/{second_share}"]


async def test_one_claim_holds_two_shares_of_one_gpu(scratch: Path) -> None:
    """Two requests of one claim, two shares of one GPU: two records, two CDI devices. A claim naming no amount
    would get the policy's default, the whole usable memory, which no longer fits."""
    async with agent_in_process(scratch, "dgx-h100", backends=("nvidia-gpu",), backend_config=SHARING) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await sharing_agent(env, kubelet)
        ref = share(env.server, "both", "10Gi", "20Gi")
        shares = result_shares(env.server, "both")
        answer = (await plugin.prepare([ref]))[ref.uid]
        assert answer.error == ""
        assert sorted(d.share_id or "" for d in answer.devices) == sorted(shares)
        assert sorted(records(env)[ref.uid]) == sorted((DEVICE, s) for s in shares)
        spec = spec_of(env, ref.uid)
        assert spec is not None and sorted(d["name"] for d in spec["devices"]) == sorted(
            f"{ref.uid}-{DEVICE}-{s}" for s in shares)
        with pytest.raises(Unallocatable, match="memory 79Gi asked, 50839Mi left"):
            share(env.server, "whole-default", None)
        assert (await plugin.unprepare([ref]))[ref.uid] == ""
        assert records(env) == {} and backend_journal(env.settings.state_dir, "gpu-shares.json") == {}


async def test_time_slicing_shares_keep_the_compute_mode_until_the_last_goes(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100", backends=("nvidia-gpu",), backend_config=SHARING) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await sharing_agent(env, kubelet)
        nvml = simulated_nvml(env)
        nvml.set_compute_mode(0, EXCLUSIVE_PROCESS)  # as an operator left it
        sliced = {"strategy": "TimeSlicing"}
        first, second = share(env.server, "a", "8Gi", sharing=sliced), share(env.server, "b", "8Gi", sharing=sliced)
        plain = share(env.server, "c", "8Gi")
        answers = await plugin.prepare([first, second])
        assert [answers[r.uid].error for r in (first, second)] == ["", ""]
        assert nvml.compute_mode(0) == DEFAULT
        modes = backend_journal(env.settings.state_dir, "compute-modes.json")
        assert sorted(e["original"] for e in modes.values()) == [EXCLUSIVE_PROCESS] * 2

        refused = (await plugin.prepare([plain]))[plain.uid].error
        assert refused.endswith(f"{DEVICE}: this share's sharing strategy is none, but a share of the GPU prepared "
                                f"for claim {first.uid} uses TimeSlicing; the shares of one GPU must use the same "
                                "strategy") or refused.endswith(f"claim {second.uid} uses TimeSlicing; the shares of "
                                                                "one GPU must use the same strategy"), refused
        assert plain.uid not in records(env) and spec_of(env, plain.uid) is None

        assert (await plugin.unprepare([first]))[first.uid] == ""
        assert nvml.compute_mode(0) == DEFAULT, "the other share still runs time-sliced"
        assert (await plugin.unprepare([second]))[second.uid] == ""
        assert nvml.compute_mode(0) == EXCLUSIVE_PROCESS, "the last share gives the GPU its mode back"
        assert backend_journal(env.settings.state_dir, "compute-modes.json") == {}
        assert backend_journal(env.settings.state_dir, "gpu-shares.json") == {}


@pytest.mark.parametrize("strategy", ["ExclusiveProcess", "MPS"])
async def test_an_exclusive_process_or_mps_share_is_refused_and_leaves_nothing(scratch: Path, strategy: str) -> None:
    async with agent_in_process(scratch, "dgx-h100", backends=("nvidia-gpu",), backend_config=SHARING) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await sharing_agent(env, kubelet)
        ref = share(env.server, "exclusive", "8Gi", sharing={"strategy": strategy})
        error = (await plugin.prepare([ref]))[ref.uid].error
        assert f"{DEVICE}: sharing strategy {strategy} cannot be used on a share of a GPU" in error
        assert records(env) == {} and spec_of(env, ref.uid) is None
        assert simulated_nvml(env).compute_mode(0) == DEFAULT
        assert backend_journal(env.settings.state_dir, "compute-modes.json") == {}
        assert backend_journal(env.settings.state_dir, "gpu-shares.json") == {}


async def test_whole_gpu_claims_and_shares_do_not_mix_on_a_gpu(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100", backends=("nvidia-gpu",), backend_config=SHARING) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await sharing_agent(env, kubelet)
        # Allocations the scheduler would not make together; the agent must not prepare them together either.
        shared, another = share(env.server, "shared", "8Gi"), share(env.server, "another", "8Gi")
        whole = put_allocated(env.server, "whole", [("gpu", GPU, DEVICE)])  # e.g. allocated before sharing was on
        assert (await plugin.prepare([shared]))[shared.uid].error == ""
        error = (await plugin.prepare([whole]))[whole.uid].error
        assert error == (f"device {DEVICE} is prepared as a share for claim default/shared ({shared.uid}); a claim "
                         "that holds it whole must wait until no share of it is prepared")
        assert whole.uid not in records(env)
        assert (await plugin.unprepare([shared]))[shared.uid] == ""
        assert (await plugin.prepare([whole]))[whole.uid].error == ""
        error = (await plugin.prepare([another]))[another.uid].error
        assert error == (f"device {DEVICE} is prepared whole for claim default/whole ({whole.uid}); a share of it "
                         "must wait until that claim is unprepared")


async def test_a_share_of_a_gpu_in_mig_mode_is_refused(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100", backends=("nvidia-gpu",), backend_config=SHARING) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await sharing_agent(env, kubelet)
        ref = share(env.server, "late", "8Gi")
        with nvml_session():  # an operator turns MIG mode on after the GPU was published and allocated
            assert pynvml.nvmlDeviceSetMigMode(pynvml.nvmlDeviceGetHandleByIndex(0), 1) == pynvml.NVML_SUCCESS
        error = (await plugin.prepare([ref]))[ref.uid].error
        assert (f"GPU {BUS_ID} is in MIG mode (or about to be): its memory belongs to MIG devices (nvidia-mig); "
                "a share of the full GPU is refused") in error or f"{DEVICE} not found on this node" in error, error
        assert records(env) == {} and spec_of(env, ref.uid) is None
        assert backend_journal(env.settings.state_dir, "gpu-shares.json") == {}


async def test_shares_outlive_a_crash(scratch: Path) -> None:
    env = {"DRA_AGENT_BACKEND_CONFIG": json.dumps(SHARING)}
    async with two_agents(scratch, "dgx-h100", backends=("nvidia-gpu",), env=env) as run:
        server, settings, kubelet = run.server, run.settings, run.kubelet
        plugin = await kubelet.wait_for_plugin(GPU, timeout=scaled(30))
        await wait_until(lambda: published_gpu(server).get("allowMultipleAllocations") is True, scaled(10))
        first, second = share(server, "first", "16Gi"), share(server, "second", "16Gi")
        answers = await plugin.prepare([first, second])
        assert [answers[r.uid].error for r in (first, second)] == ["", ""]
        await run.first.signal(signal.SIGKILL)
        assert await run.first.wait() == -signal.SIGKILL
        await run.second.start()
        plugin = await plugin_after_restart(kubelet, plugin)
        again = await plugin.prepare([first, second])
        assert again == answers, "both shares are still prepared, with their share ids"
        assert len(journal_entries(settings.state_dir / "backends/nvidia-gpu/gpu-shares.json")) == 2
        assert (await plugin.unprepare([first]))[first.uid] == ""
        assert (await plugin.prepare([second]))[second.uid] == answers[second.uid]


async def test_a_share_cut_short_by_a_crash_is_undone_at_restart_and_the_other_stays(scratch: Path) -> None:
    env = {"DRA_AGENT_BACKEND_CONFIG": json.dumps(SHARING)}
    async with two_agents(scratch, "dgx-h100", backends=("nvidia-gpu",), env=env,
                          failpoint="prepare-after-backends") as run:
        server, settings, kubelet = run.server, run.settings, run.kubelet
        plugin = await kubelet.wait_for_plugin(GPU, timeout=scaled(30))
        await wait_until(lambda: published_gpu(server).get("allowMultipleAllocations") is True, scaled(10))
        sliced = {"strategy": "TimeSlicing"}
        cut = share(server, "cut", "16Gi", sharing=sliced)
        with pytest.raises(KubeletError):
            await plugin.prepare([cut])
        assert await run.first.wait() == -signal.SIGKILL
        shares_file = settings.state_dir / "backends/nvidia-gpu/gpu-shares.json"
        assert len(journal_entries(shares_file)) == 1, "the share was recorded before the crash"
        await run.second.start()
        plugin = await plugin_after_restart(kubelet, plugin)
        await wait_until(lambda: journal_entries(shares_file) == {}, scaled(10))
        modes = settings.state_dir / "backends/nvidia-gpu/compute-modes.json"
        assert journal_entries(modes) == {}, "the mode set for the share was put back"
        other = share(server, "other", "16Gi")  # no strategy: it would clash with a share left behind
        assert (await plugin.prepare([other]))[other.uid].error == ""
        assert (await plugin.prepare([cut]))[cut.uid].error.endswith(
            f"this share's sharing strategy is TimeSlicing, but a share of the GPU prepared for claim {other.uid} "
            "uses none; the shares of one GPU must use the same strategy")


def share_counted_alone(server: TestApiServer, name: str, memory: str, consumed: str | None = None) -> ClaimRef:
    """A share of GPU 0 allocated as if no other claim held any of it (a scheduler that lost count), its
    consumedCapacity optionally rewritten (an allocation written by hand)."""
    wanted = claim(name, exactly("gpu", GPU, ON_GPU_0, capacity={"requests": {"memory": memory}}))
    allocation = allocate(wanted, classes=device_classes(), slices=slices(server), allocated=[], node=NODE)
    status = json.loads(json.dumps(allocation.status))
    if consumed is not None:
        status["devices"]["results"][0]["consumedCapacity"]["memory"] = consumed
    wanted["metadata"]["uid"] = uid = f"00000000-0000-4000-9000-{len(server.objects('resourceclaims')) + 1:012d}"
    server.put_claim({**wanted, "status": {"allocation": status}})
    return ClaimRef(uid, "default", name)


async def test_shares_that_would_overcommit_the_gpu_are_refused_and_leave_nothing(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100", backends=("nvidia-gpu",), backend_config=SHARING) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await sharing_agent(env, kubelet)
        first = share(env.server, "first", "50Gi")
        assert (await plugin.prepare([first]))[first.uid].error == ""
        # The scheduler would not allocate these; the agent must not prepare them either.
        late = share_counted_alone(env.server, "late", "40Gi")
        huge = share_counted_alone(env.server, "huge", "8Gi", consumed="90Gi")
        answers = await plugin.prepare([late, huge])
        assert answers[late.uid].error.endswith(f"{DEVICE}: this share's 40Gi of memory does not fit: the shares "
                                                "prepared on the GPU hold 50Gi of its 79.65Gi")
        assert answers[huge.uid].error == (
            "claim default/huge: status.allocation.devices.results[0].consumedCapacity.memory: \"90Gi\" is above "
            f"the maximum of {DEVICE}'s requestPolicy for memory (validRange: min 1Gi, max 79Gi, step 1Gi; default "
            "79Gi)")
        assert set(records(env)) == {first.uid}
        assert spec_of(env, late.uid) is None and spec_of(env, huge.uid) is None
        shares = backend_journal(env.settings.state_dir, "gpu-shares.json")
        assert [e["claim"] for e in shares.values()] == [first.uid]
        # Once the first share is gone, the 40Gi one fits.
        assert (await plugin.unprepare([first]))[first.uid] == ""
        assert (await plugin.prepare([late]))[late.uid].error == ""
