"""Prepare and unprepare on a simulated node with the real backends: idempotence, per-claim errors,
conflicts, roll-back, recovery after restarts and reboots."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from agent.claims.checkpoint import Checkpoint
from agent.claims.records import DeviceRecord
from agent.claims.recovery import recover
from backends.contract import Allocated, ClaimRef, Prepared, PrepareError
from simulator.node.node import SimulatedNode
from tests.support.cdi_schema import cdi_schema_errors
from tests.support.prepare_env import PrepareEnv, prepare_env

GPU = "gpu.nvidia.com"
TPU = "tpu.google.com"
NIC = "sriov.dra-agent.io"


@pytest.fixture
async def env(sim_node: Callable[[str], SimulatedNode], scratch: Path) -> AsyncIterator[PrepareEnv]:
    environment = await prepare_env(sim_node("dgx-h100"), scratch)
    yield environment
    await environment.close()


def spec_json(env: PrepareEnv, driver: str, uid: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((env.cdi_dir / f"k8s.{driver}-claim_{uid}.json").read_text())
    return data


async def test_prepare_a_gpu(env: PrepareEnv) -> None:
    gpu = env.devices(GPU)[3]
    ref = env.claims.add("train", [("gpu", GPU, gpu)])
    preparer = env.preparer(GPU)
    result = (await preparer.prepare([ref]))[ref.uid]
    assert result.error == ""
    (device,) = result.devices
    assert (device.pool, device.device, device.request_names) == ("node-a", gpu, ("gpu",))
    assert device.cdi_device_ids == (f"k8s.gpu.nvidia.com/claim={ref.uid}-{gpu}",)
    spec = spec_json(env, GPU, ref.uid)
    assert cdi_schema_errors(spec) == []
    assert spec["kind"] == "k8s.gpu.nvidia.com/claim"
    assert spec["devices"] == [
        {"name": f"{ref.uid}-{gpu}", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia3"}]}}]
    common = spec["containerEdits"]
    assert [n["path"] for n in common["deviceNodes"]] == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    mounts = {m["containerPath"] for m in common["mounts"]}
    assert {"/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
            "/usr/bin/nvidia-smi"} <= mounts
    assert "/usr/lib/x86_64-linux-gnu/libnvcuvid.so.1" not in mounts, "video is not a default capability"
    assert preparer.checkpoint.claims[ref.uid].state == "completed"


async def test_prepare_is_idempotent_and_restores_a_lost_spec(env: PrepareEnv) -> None:
    ref = env.claims.add("train", [("gpu", GPU, env.devices(GPU)[0])])
    preparer = env.preparer(GPU)
    first = await preparer.prepare([ref])
    spec = env.cdi_dir / f"k8s.gpu.nvidia.com-claim_{ref.uid}.json"
    before = spec.read_text()
    assert await preparer.prepare([ref]) == first
    spec.unlink()  # /var/run/cdi is a tmpfs: gone after a reboot while the checkpoint survives
    assert await preparer.prepare([ref]) == first
    assert spec.read_text() == before


async def test_empty_request_and_unknown_claim(env: PrepareEnv) -> None:
    preparer = env.preparer(GPU)
    assert await preparer.prepare([]) == {}
    assert await preparer.unprepare([]) == {}
    ghost = ClaimRef("0b7c8c5e-6f0a-4b8e-9d2a-1c3e5f7a9b0d", "default", "ghost")
    assert await preparer.unprepare([ghost]) == {ghost.uid: ""}


async def test_bad_claims_fail_alone(env: PrepareEnv) -> None:
    gpus = env.devices(GPU)
    good = env.claims.add("good", [("gpu", GPU, gpus[0])])
    missing = ClaimRef("0b7c8c5e-6f0a-4b8e-9d2a-1c3e5f7a9b0d", "default", "missing")
    renamed = env.claims.add("renamed", [("gpu", GPU, gpus[1])])
    stale = ClaimRef("1b7c8c5e-6f0a-4b8e-9d2a-1c3e5f7a9b0d", renamed.namespace, renamed.name)
    other = env.claims.add("nic-only", [("nic", NIC, env.devices(NIC)[0])])
    bad_config = env.claims.add("bad-config", [("gpu", GPU, gpus[2])], configs=[{
        "source": "FromClaim", "requests": ["gpu"],
        "opaque": {"driver": GPU, "parameters": {"apiVersion": "dra-agent.io/v1alpha1", "kind": "GpuConfig",
                                                 "driverCapabilities": ["mining"]}}}])
    not_here = env.claims.add("elsewhere", [("gpu", GPU, "gpu-0000-ff-00-0")])
    bad_uid = ClaimRef("../../etc", "default", "x")
    refs = [good, missing, stale, other, bad_config, not_here, bad_uid]
    results = await env.preparer(GPU).prepare(refs)
    assert list(results) == [r.uid for r in refs]
    assert results[good.uid].error == "" and len(results[good.uid].devices) == 1
    assert results[missing.uid].error == "claim default/missing not found"
    assert "deleted and created again" in results[stale.uid].error
    assert "no device allocated by driver gpu.nvidia.com" in results[other.uid].error
    assert "GpuConfig.driverCapabilities.0: Input should be" in results[bad_config.uid].error
    assert "gpu-0000-ff-00-0 is not a device of driver gpu.nvidia.com" in results[not_here.uid].error
    assert "is not a Kubernetes UID" in results[bad_uid.uid].error
    assert [p.name for p in env.cdi_dir.iterdir()] == [f"k8s.gpu.nvidia.com-claim_{good.uid}.json"]


async def test_api_failure_is_per_claim(env: PrepareEnv) -> None:
    ref = env.claims.add("train", [("gpu", GPU, env.devices(GPU)[0])])
    env.claims.failing = "connection refused"
    result = (await env.preparer(GPU).prepare([ref]))[ref.uid]
    assert result.error == "cannot read claim default/train: connection refused"


async def test_device_prepared_for_another_claim_is_refused(env: PrepareEnv) -> None:
    gpu = env.devices(GPU)[0]
    first = env.claims.add("first", [("gpu", GPU, gpu)])
    second = env.claims.add("second", [("gpu", GPU, gpu)])
    preparer = env.preparer(GPU)
    assert (await preparer.prepare([first]))[first.uid].error == ""
    error = (await preparer.prepare([second]))[second.uid].error
    assert f"device {gpu} is already prepared for claim default/first ({first.uid})" in error
    assert await preparer.unprepare([first]) == {first.uid: ""}
    assert (await preparer.prepare([second]))[second.uid].error == ""


async def test_unprepare_removes_everything(env: PrepareEnv) -> None:
    ref = env.claims.add("train", [("gpu", GPU, env.devices(GPU)[0])])
    preparer = env.preparer(GPU)
    await preparer.prepare([ref])
    del env.claims.claims[("default", "train")]  # unprepare must not need the claim
    assert await preparer.unprepare([ref]) == {ref.uid: ""}
    assert list(env.cdi_dir.iterdir()) == []
    assert preparer.checkpoint.claims == {}
    assert env.preparer(GPU).checkpoint.claims == {}, "durably gone"


async def test_many_claims_in_one_batch_and_concurrently(env: PrepareEnv) -> None:
    preparer = env.preparer(NIC)
    refs = [env.claims.add(f"c{i}", [("nic", NIC, vf)]) for i, vf in enumerate(env.devices(NIC))]
    half = len(refs) // 2
    batches = await asyncio.gather(preparer.prepare(refs[:half]), preparer.prepare(refs[half:]))
    results = {**batches[0], **batches[1]}
    assert all(r.error == "" for r in results.values())
    assert len(list(env.cdi_dir.iterdir())) == len(refs)
    assert len(preparer._locks) == 0, "no lock outlives its holders"


async def test_vf_gets_its_rdma_device(env: PrepareEnv) -> None:
    vf = env.devices(NIC)[0]
    ref = env.claims.add("rdma", [("nic", NIC, vf)])
    assert (await env.preparer(NIC).prepare([ref]))[ref.uid].error == ""
    spec = spec_json(env, NIC, ref.uid)
    assert cdi_schema_errors(spec) == []
    assert spec["devices"][0]["containerEdits"]["deviceNodes"][0]["path"].startswith("/dev/infiniband/uverbs")
    assert spec["containerEdits"]["deviceNodes"] == [{"path": "/dev/infiniband/rdma_cm"}]


class Exploding:
    """Wraps a backend: prepare fails after the real one succeeded for some devices, counting unprepares."""

    def __init__(self, inner: Any, fail_on: str) -> None:
        self.inner, self.fail_on, self.unprepared = inner, fail_on, 0

    async def prepare(self, claim: ClaimRef, devices: Sequence[Allocated]) -> Sequence[Prepared]:
        if any(a.device == self.fail_on for a in devices):
            raise PrepareError(f"{self.fail_on}: the driver refused")
        result: Sequence[Prepared] = await self.inner.prepare(claim, devices)
        return result

    async def unprepare(self, claim: ClaimRef, prepared: Sequence[Prepared]) -> None:
        self.unprepared += 1
        await self.inner.unprepare(claim, prepared)


async def test_failed_backend_leaves_nothing(sim_node: Callable[[str], SimulatedNode], scratch: Path) -> None:
    env = await prepare_env(sim_node("mixed"), scratch)
    try:
        preparer = env.preparer(GPU)
        gpu = env.devices(GPU)[0]
        exploding = Exploding(preparer.owner_of(gpu).backend, gpu)  # type: ignore[union-attr]
        real_owner = preparer.owner_of
        preparer.owner_of = lambda d: (o.__class__(o.name, exploding, o.config_types)  # type: ignore[arg-type]
                                        if (o := real_owner(d)) else None)
        ref = env.claims.add("broken", [("gpu", GPU, gpu)])
        assert (await preparer.prepare([ref]))[ref.uid].error == f"{gpu}: the driver refused"
        assert preparer.checkpoint.claims == {}
        assert list(env.cdi_dir.iterdir()) == []
    finally:
        await env.close()


async def test_recovery_rolls_back_started_and_keeps_specs_it_cannot_account_for(env: PrepareEnv) -> None:
    gpus = env.devices(GPU)
    done = env.claims.add("done", [("gpu", GPU, gpus[0])])
    cut = env.claims.add("cut", [("gpu", GPU, gpus[1])])
    preparer = env.preparer(GPU)
    await preparer.prepare([done])
    # A crash after `started` was written: the claim's spec may or may not exist.
    preparer.checkpoint.start(cut.uid, "default", "cut", ((gpus[1], "nvidia-gpu"),))
    (env.cdi_dir / f"k8s.gpu.nvidia.com-claim_{cut.uid}.json").write_text("{}")
    unreadable = env.cdi_dir / "k8s.gpu.nvidia.com-claim_00000000-0000-0000-0000-00000000dead.json"
    unreadable.write_text('{"cdiVersion": "0.3.0", "kind": "k8s.gpu.nvidia.com/claim", "devices": []}')
    foreign = env.cdi_dir / "nvidia.com-gpu.yaml"
    foreign.write_text("kind: nvidia.com/gpu\n")
    (env.cdi_dir / f"k8s.gpu.nvidia.com-claim_{done.uid}.json").unlink()
    preparer.checkpoint.close()

    restarted = env.preparer(GPU)
    await recover(restarted)
    assert set(restarted.checkpoint.claims) == {done.uid}
    assert sorted(p.name for p in env.cdi_dir.iterdir()) == sorted(
        [f"k8s.gpu.nvidia.com-claim_{done.uid}.json", unreadable.name, "nvidia.com-gpu.yaml"]), (
        "a spec that names no claim's device is not deleted on a guess")
    assert (await restarted.prepare([cut]))[cut.uid].error == "", "the kubelet's retry succeeds"


async def test_a_lost_journal_keeps_its_claims_prepared_from_their_specs(env: PrepareEnv) -> None:
    gpus = env.devices(GPU)
    ref = env.claims.add("train", [("gpu", GPU, gpus[0])])
    preparer = env.preparer(GPU)
    first = await preparer.prepare([ref])
    spec = env.cdi_dir / f"k8s.gpu.nvidia.com-claim_{ref.uid}.json"
    before = spec.read_text()
    preparer.checkpoint.close()
    preparer.checkpoint.path.unlink()  # moved aside by an operator, or lost

    restarted = env.preparer(GPU)
    await recover(restarted)
    assert spec.read_text() == before, "the spec of a claim it cannot account for stays"
    record = restarted.checkpoint.claims[ref.uid]
    assert record.recovered and [d.device for d in record.devices] == [gpus[0]]
    other = env.claims.add("other", [("gpu", GPU, gpus[0])])
    refused = (await restarted.prepare([other]))[other.uid].error
    assert f"device {gpus[0]} is already prepared for claim with UID {ref.uid}" in refused
    # The kubelet asks again (it does after its own restart): the same answer, request names and all.
    assert await restarted.prepare([ref]) == first
    assert not restarted.checkpoint.claims[ref.uid].recovered
    assert await restarted.unprepare([ref]) == {ref.uid: ""}
    assert not spec.exists()
    assert (await restarted.prepare([other]))[other.uid].error == ""


async def test_a_recovered_claim_unprepared_without_asking_again_is_released(env: PrepareEnv) -> None:
    gpus = env.devices(GPU)
    ref = env.claims.add("train", [("gpu", GPU, gpus[2])])
    preparer = env.preparer(GPU)
    await preparer.prepare([ref])
    preparer.checkpoint.close()
    preparer.checkpoint.path.unlink()
    restarted = env.preparer(GPU)
    await recover(restarted)
    assert await restarted.unprepare([ref]) == {ref.uid: ""}
    assert restarted.checkpoint.claims == {} and list(env.cdi_dir.iterdir()) == []


async def test_claims_from_before_a_reboot_are_prepared_again(env: PrepareEnv) -> None:
    ref = env.claims.add("train", [("gpu", GPU, env.devices(GPU)[0])])
    preparer = env.preparer(GPU)
    first = await preparer.prepare([ref])
    preparer.checkpoint.close()
    for spec in env.cdi_dir.iterdir():
        spec.unlink()  # tmpfs after a reboot
    new_boot = env.node.reboot()
    after = env.preparer(GPU)
    await recover(after)
    assert after.checkpoint.claims[ref.uid].boot_id != new_boot
    assert list(env.cdi_dir.iterdir()) == [], "nothing re-created from a previous boot's state"
    assert await after.prepare([ref]) == first
    assert after.checkpoint.claims[ref.uid].boot_id == new_boot


async def test_tpu_environment_names_the_allocated_chips(sim_node: Callable[[str], SimulatedNode],
                                                         scratch: Path) -> None:
    env = await prepare_env(sim_node("tpu-v5e-8"), scratch, ("tpu",))
    try:
        chips = env.devices(TPU)
        ref = env.claims.add("tpu", [("tpu", TPU, chip) for chip in chips[:4]])
        assert (await env.preparer(TPU).prepare([ref]))[ref.uid].error == ""
        spec = spec_json(env, TPU, ref.uid)
        assert cdi_schema_errors(spec) == []
        assert sorted(spec["containerEdits"]["env"]) == [
            "TPU_CHIPS_PER_PROCESS_BOUNDS=2,2,1", "TPU_PROCESS_BOUNDS=1,1,1", "TPU_VISIBLE_CHIPS=0,1,2,3"]
        assert spec["containerEdits"]["deviceNodes"] == [{"path": "/dev/vfio/vfio"}]
        groups = [d["containerEdits"]["deviceNodes"][0]["path"] for d in spec["devices"]]
        assert all(g.startswith("/dev/vfio/") and g != "/dev/vfio/vfio" for g in groups) and len(set(groups)) == 4
    finally:
        await env.close()


def test_device_record_round_trip() -> None:
    record = DeviceRecord(device="d", backend="b", requests=("r",), cdi_ids=("v/c=n",), restore={"x": [1, 2]})
    assert DeviceRecord.from_json(json.loads(json.dumps(record.to_json()))) == record


async def test_without_driver_files_a_gpu_gets_device_nodes_only(sim_node: Callable[[str], SimulatedNode],
                                                                scratch: Path) -> None:
    import shutil

    from structlog.testing import capture_logs

    node = sim_node("gke-n1-t4x2")
    # A driver with NVML and nothing else: the video libraries a claim asks for are not there.
    libraries = node.driver_root / "usr/lib/x86_64-linux-gnu"
    for path in libraries.iterdir():
        if not path.name.startswith(("libnvidia-ml.", ".")):
            path.unlink()
    shutil.rmtree(node.root / "usr/bin")
    video = [{"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": GPU, "parameters": {
        "apiVersion": "dra-agent.io/v1alpha1", "kind": "GpuConfig", "driverCapabilities": ["video"]}}}]
    env = await prepare_env(node, scratch, ("nvidia-gpu",))
    try:
        preparer = env.preparer(GPU)
        assert env.devices(GPU)
        refs = [env.claims.add(f"c{i}", [("gpu", GPU, gpu)], video) for i, gpu in enumerate(env.devices(GPU))]
        with capture_logs() as logs:
            for ref in refs:
                assert (await preparer.prepare([ref]))[ref.uid].error == ""
        for ref in refs:
            spec = spec_json(env, GPU, ref.uid)
            assert "mounts" not in spec["containerEdits"]
            assert [n["path"] for n in spec["containerEdits"]["deviceNodes"]] == [
                "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
        warnings = [e for e in logs if "no NVIDIA driver libraries" in e["event"]]
        assert len(warnings) == 1, "said once, not per claim"
    finally:
        await env.close()


class Watching:
    """Wraps a backend: notes, when its prepare runs, how many times the checkpoint was synced and what its file
    holds; declares `records_own_changes` only when told to."""

    def __init__(self, inner: Any, journal: Path, syncs: list[int], declared: bool) -> None:
        self.inner, self.journal, self.syncs = inner, journal, syncs
        self.seen: tuple[int, bytes] | None = None
        if declared:
            self.records_own_changes = True

    async def prepare(self, claim: ClaimRef, devices: Sequence[Allocated]) -> Sequence[Prepared]:
        self.seen = (len(self.syncs), self.journal.read_bytes())
        result: Sequence[Prepared] = await self.inner.prepare(claim, devices)
        return result

    async def unprepare(self, claim: ClaimRef, prepared: Sequence[Prepared]) -> None:
        await self.inner.unprepare(claim, prepared)


@pytest.mark.parametrize("declared", [True, False])
async def test_the_started_record_waits_for_the_disk_only_for_backends_that_keep_no_records(
        env: PrepareEnv, monkeypatch: pytest.MonkeyPatch, declared: bool) -> None:
    preparer = env.preparer(GPU)
    gpus = env.devices(GPU)
    warm = env.claims.add("warm", [("gpu", GPU, gpus[0])])
    assert (await preparer.prepare([warm]))[warm.uid].error == ""  # the journal is open from now on
    journal = preparer.checkpoint.path
    syncs: list[int] = []
    real_sync = os.fdatasync

    def sync(fd: int) -> None:
        if os.fstat(fd).st_ino == journal.stat().st_ino:
            syncs.append(fd)
        real_sync(fd)

    monkeypatch.setattr(os, "fdatasync", sync)
    watching = Watching(preparer.owner_of(gpus[1]).backend, journal, syncs, declared)  # type: ignore[union-attr]
    real_owner = preparer.owner_of
    preparer.owner_of = lambda d: (o.__class__(o.name, watching, o.config_types)  # type: ignore[arg-type]
                                    if (o := real_owner(d)) else None)
    ref = env.claims.add("train", [("gpu", GPU, gpus[1])])
    assert (await preparer.prepare([ref]))[ref.uid].error == ""
    assert watching.seen is not None
    synced_before, in_file = watching.seen
    assert f'"uid":"{ref.uid}"'.encode() in in_file and b'"started"' in in_file, "written before the backend ran"
    assert synced_before == (0 if declared else 1)
    assert len(syncs) == (1 if declared else 2), "the completed record is synced in any case"
    assert preparer.checkpoint.claims[ref.uid].state == "completed"
    assert reopened_state(journal, ref.uid) == "completed"


def reopened_state(journal: Path, uid: str) -> str | None:
    again = Checkpoint(journal, "unused")
    again.load()
    record = again.claims.get(uid)
    return record.state if record else None


async def test_one_uid_twice_in_a_request_gets_one_consistent_answer(env: PrepareEnv) -> None:
    gpus = env.devices(GPU)
    ref = env.claims.add("train", [("gpu", GPU, gpus[0])])
    preparer = env.preparer(GPU)
    same = await preparer.prepare([ref, ref])
    assert list(same) == [ref.uid] and same[ref.uid].error == ""
    assert await preparer.prepare([ref]) == same

    renamed = ClaimRef(ref.uid, ref.namespace, "impostor")
    other = env.claims.add("other", [("gpu", GPU, gpus[1])])
    answers = await preparer.prepare([ref, renamed, other])
    assert answers[ref.uid].error == (f"claim UID {ref.uid} appears in one request as default/impostor and "
                                      "default/train; not prepared")
    assert answers[other.uid].error == "", "the rest of the request is prepared"
    assert preparer.checkpoint.claims[ref.uid].state == "completed", "what was prepared stays prepared"
    assert (await preparer.unprepare([ref, renamed]))[ref.uid].endswith("not unprepared")
    assert ref.uid in preparer.checkpoint.claims
    assert await preparer.unprepare([ref, ref, other]) == {ref.uid: "", other.uid: ""}
    assert preparer.checkpoint.claims == {}


async def test_a_claim_read_that_never_returns_fails_within_its_own_deadline(env: PrepareEnv) -> None:
    ref = env.claims.add("train", [("gpu", GPU, env.devices(GPU)[0])])
    preparer = env.preparer(GPU, read_seconds=0.05)
    env.claims.hanging = True
    result = (await preparer.prepare([ref]))[ref.uid]
    assert result.error == "cannot read claim default/train: no answer from the API server within 0.05 s"
    assert preparer.checkpoint.claims == {}
    env.claims.hanging = False
    assert (await preparer.prepare([ref]))[ref.uid].error == "", "the kubelet's retry succeeds"

