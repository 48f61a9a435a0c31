"""MIG devices. Dynamic: the counters that let a scheduler pick placements NVML accepts, the published slices, and MIG
devices made at prepare with NVML's real placement rules (simulated), unmade at unprepare, undone after a crash.
Static: existing MIG devices handed out as they are."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
import pytest
import structlog
import yaml

from backends.contract import BackendContext
from backends.failpoints import MIG_POINTS
from backends.nvidia import mig_dynamic
from backends.nvidia.mig import NvidiaMigBackend
from backends.nvidia.mig_dynamic import MigMaker, dynamic_devices
from backends.nvidia.mig_edits import MigEdits
from backends.nvidia.mig_layout import GiProfile, Placement, layout, valid_combinations
from backends.nvidia.mig_ledger import LedgerEntry, MigLedger
from backends.nvidia.nvml import list_gpus, list_mig_devices, nvml_session
from backends.nvidia.nvml_mig import create_gpu_instance, gpu_instance_profiles
from backends.topology import TopologyReader
from simulator.kubelet import KubeletSimulator
from simulator.kubelet_connection import KubeletError, Plugin
from simulator.node.node import SimulatedNode, mig_minor
from tests.support.agent_env import agent_in_process, allocate, lose_claims, plugin_after_restart, two_agents
from tests.support.mig_env import DYNAMIC, dgx_h100_in_mig_mode
from tests.support.slice_checks import assert_valid_slices
from tests.support.surge_env import made_on_node
from tests.support.timing import scaled

GPU = "gpu.nvidia.com"

@pytest.fixture
def h100_profiles(sim_node: Callable[[str], SimulatedNode], tmp_path: Path) -> list[GiProfile]:
    node = sim_node(str(dgx_h100_in_mig_mode(tmp_path)))
    with nvml_session():
        return gpu_instance_profiles(node.plan.gpus[0].bus_id)


def fits(totals: dict[str, int], chosen: tuple[Placement, ...], counter_set: str) -> bool:
    used: dict[str, int] = {}
    for placement in chosen:
        for key, value in placement.consumption(counter_set).counters.items():
            used[key] = used.get(key, 0) + value
    return all(value <= totals.get(key, 0) for key, value in used.items())


def test_the_counters_admit_exactly_what_nvml_allows(h100_profiles: list[GiProfile]) -> None:
    assert {p.name for p in h100_profiles} == {"1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb",
                                               "7g.80gb"}
    plan = layout("gpu-x", h100_profiles)
    totals = dict(plan.counter_set.counters)
    name = plan.counter_set.name
    assert len(plan.placements) == 25 and len(totals) <= 32
    combinations = list(valid_combinations(h100_profiles))
    assert all(fits(totals, c, name) for c in combinations), "every combination NVML accepts fits the counters"
    assert max(len(c) for c in combinations) == 7
    # NVML's rules are pairwise (overlap) or per-profile counts, which pairs and triples exercise.
    valid = {frozenset(c) for c in combinations if len(c) <= 3}
    for size in (2, 3):
        for chosen in itertools.combinations(plan.placements, size):
            assert fits(totals, chosen, name) == (frozenset(chosen) in valid), chosen
    # The whole GPU draws everything: nothing fits beside it.
    assert plan.whole.counters == totals
    assert not any(fits({k: v - plan.whole.counters.get(k, 0) for k, v in totals.items()}, (p,), name)
                   for p in plan.placements)


def test_the_published_pool_passes_the_server_rules(run_cli: Callable[..., Any], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRA_AGENT_BACKEND_CONFIG", '{"nvidia-mig": {"mode": "dynamic"}}')
    result = run_cli("discover", "--simulate", str(dgx_h100_in_mig_mode(tmp_path)), "-o", "json")
    slices = [s for s in yaml.safe_load(result.out) if s["spec"]["driver"] == GPU]
    assert_valid_slices(slices)
    devices = [d for s in slices for d in s["spec"].get("devices", ())]
    assert len(devices) == 8 * 26, "each GPU whole and its 25 placements"
    counter_sets = [c for s in slices for c in s["spec"].get("sharedCounters", ())]
    assert len(counter_sets) == 8
    assert all(len(s["spec"].get("devices", ())) <= 64 for s in slices)


def mig_instances() -> dict[str, list[tuple[str, int]]]:
    """The MIG devices that exist, by parent bus id: (profile, placement start)."""
    with nvml_session():
        gpus, _ = list_gpus()
        return {g.bus_id: sorted((m.profile, m.placement_start) for m in list_mig_devices(g))
                for g in gpus if g.mig_enabled}


async def prepare(plugin: Plugin, env: Any, name: str, device: str) -> tuple[Any, Any]:
    claim = allocate(env.server, name, [("mig", GPU, device)])
    return claim, (await plugin.prepare([claim]))[claim.uid]


async def test_seven_1g_devices_fill_a_gpu_an_overlap_fails_and_release_leaves_it_whole(scratch: Path) -> None:
    profile = dgx_h100_in_mig_mode(scratch)
    async with agent_in_process(scratch, str(profile), backend_config=DYNAMIC) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await kubelet.wait_for_plugin(GPU)
        gpu = "gpu-0000-18-00-0"
        claims = []
        for start in range(7):  # as a scheduler would pick them: the counters leave exactly these
            claim, result = await prepare(plugin, env, f"small-{start}", f"{gpu}-mig-1g10gb-19-{start}")
            assert result.error == "", result.error
            claims.append(claim)
        assert mig_instances()["0000:18:00.0"] == [("1g.10gb", s) for s in range(7)]
        spec = yaml.safe_load(next(env.settings.cdi_dir.glob(f"*{claims[3].uid}*")).read_text())
        nodes = {n["path"] for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"]}
        gi = {m.placement_start: m.gpu_instance_id for m in _migs("0000:18:00.0")}[3]
        assert {"/dev/nvidia0", f"/dev/nvidia-caps/nvidia-cap{mig_minor(0, gi)}",
                f"/dev/nvidia-caps/nvidia-cap{mig_minor(0, gi, 0)}"} <= nodes

        _, result = await prepare(plugin, env, "overlapping", f"{gpu}-mig-2g20gb-14-2")
        assert result.error == (f"{gpu}-mig-2g20gb-14-2: MIG 2g.20gb at placement 2 overlaps a MIG device that "
                                "exists on GPU 0000:18:00.0")
        assert len(mig_instances()["0000:18:00.0"]) == 7, "a failed prepare leaves nothing behind"

        random.Random(7).shuffle(claims)
        for claim in claims:
            assert (await plugin.unprepare([claim]))[claim.uid] == ""
        assert mig_instances()["0000:18:00.0"] == []
        claim, result = await prepare(plugin, env, "big", f"{gpu}-mig-7g80gb-0-0")
        assert result.error == "" and mig_instances()["0000:18:00.0"] == [("7g.80gb", 0)]
        assert (await plugin.prepare([claim]))[claim.uid] == result, "prepare is idempotent"
        assert len(mig_instances()["0000:18:00.0"]) == 1
        assert (await plugin.unprepare([claim]))[claim.uid] == ""
        assert mig_instances()["0000:18:00.0"] == []


def _migs(bus_id: str) -> list[Any]:
    with nvml_session():
        gpus, _ = list_gpus()
        return [m for g in gpus if g.bus_id == bus_id for m in list_mig_devices(g)]


async def test_instances_the_agent_did_not_create_are_never_touched(scratch: Path) -> None:
    # The first switch entry of the profile stands for two switches: GPUs 0000:18:00.0 and 0000:1c:00.0.
    profile = dgx_h100_in_mig_mode(scratch, {0: [{"profile": "3g.40gb", "start": 0}]})
    async with agent_in_process(scratch, str(profile), backend_config=DYNAMIC) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await kubelet.wait_for_plugin(GPU)
        gpu = "gpu-0000-1c-00-0"
        _, result = await prepare(plugin, env, "on-top", f"{gpu}-mig-4g40gb-5-0")
        assert "overlaps a MIG device that exists on GPU 0000:1c:00.0" in result.error
        claim, result = await prepare(plugin, env, "beside", f"{gpu}-mig-3g40gb-9-4")
        assert result.error == ""
        assert mig_instances()["0000:1c:00.0"] == [("3g.40gb", 0), ("3g.40gb", 4)]
        assert (env.settings.state_dir / "backends/nvidia-mig/mig-ledger.json").exists()
        assert (await plugin.unprepare([claim]))[claim.uid] == ""
        assert mig_instances()["0000:1c:00.0"] == [("3g.40gb", 0)], "the operator's instance stays"


# Where a crash leaves the MIG device: made in part or whole, the claim `started` in the checkpoint either way.
CRASHES = {
    "mig-after-gpu-instance": [("1g.10gb", 2, 0)],
    "mig-after-compute-instance": [("1g.10gb", 2, 1)],
    "prepare-after-backends": [("1g.10gb", 2, 1)],
    "prepare-after-cdi": [("1g.10gb", 2, 1)],
}


@pytest.mark.parametrize("point", [*MIG_POINTS, "prepare-after-backends", "prepare-after-cdi"])
async def test_a_crash_while_making_a_mig_device_is_undone_at_restart(scratch: Path, point: str) -> None:
    profile = dgx_h100_in_mig_mode(scratch)
    env = {"DRA_AGENT_BACKEND_CONFIG": json.dumps(DYNAMIC)}
    async with two_agents(scratch, str(profile), backends=("nvidia-mig",), env=env, failpoint=point) as run:
        server, settings, kubelet = run.server, run.settings, run.kubelet
        crashing, restarted = run.first, run.second
        assert settings.sim_root is not None
        plugin = await kubelet.wait_for_plugin(GPU, timeout=scaled(30))
        device = "gpu-0000-18-00-0-mig-1g10gb-19-2"
        ref = allocate(server, "train", [("mig", GPU, device)])
        with pytest.raises(KubeletError):
            await plugin.prepare([ref])
        assert await crashing.wait() == -signal.SIGKILL
        assert made_on_node(settings.sim_root, "0000:18:00.0") == CRASHES[point]

        await restarted.start()
        plugin = await plugin_after_restart(kubelet, plugin)
        # Recovery rolled the claim back, and with it the MIG device the crash left.
        assert made_on_node(settings.sim_root, "0000:18:00.0") == []
        result = await plugin.prepare_or_raise([ref])  # the kubelet retries
        assert result[ref.uid].devices[0].device == device
        assert made_on_node(settings.sim_root, "0000:18:00.0") == [("1g.10gb", 2, 1)]
        assert await plugin.unprepare([ref]) == {ref.uid: ""}
        assert made_on_node(settings.sim_root, "0000:18:00.0") == []


async def test_a_static_mig_device_is_handed_out_and_left_in_place(scratch: Path) -> None:
    async with agent_in_process(scratch, "mixed") as env, KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await kubelet.wait_for_plugin(GPU)
        before = mig_instances()["0000:07:00.0"]
        assert before == [("1g.10gb", 6), ("2g.20gb", 4), ("3g.40gb", 0)]
        claim, result = await prepare(plugin, env, "static", "gpu-0000-07-00-0-mig-2g20gb-14-4")
        assert result.error == ""
        spec = yaml.safe_load(next(env.settings.cdi_dir.glob(f"*{claim.uid}*")).read_text())
        nodes = [n["path"] for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"]]
        gi = next(m.gpu_instance_id for m in _migs("0000:07:00.0") if m.placement_start == 4)
        assert nodes == ["/dev/nvidia1", f"/dev/nvidia-caps/nvidia-cap{mig_minor(1, gi)}",
                         f"/dev/nvidia-caps/nvidia-cap{mig_minor(1, gi, 0)}"]
        assert (await plugin.unprepare([claim]))[claim.uid] == ""
        assert mig_instances()["0000:07:00.0"] == before, "a static MIG device is not the agent's to destroy"


async def test_a_gpu_waiting_for_a_reset_to_leave_mig_mode_is_not_partitioned(
        sim_node: Callable[[str], SimulatedNode]) -> None:
    node = sim_node("mixed")
    with nvml_session():  # an operator asks the A100 to leave MIG mode: Ampere needs a reset for that
        handle = pynvml.nvmlDeviceGetHandleByIndex(1)
        for instance in node.nvml.instances(1):
            node.nvml.destroy_instance(1, instance.gi)
        assert pynvml.nvmlDeviceSetMigMode(handle, 0) == pynvml.NVML_ERROR_RESET_REQUIRED
    backend = NvidiaMigBackend()
    await backend.start(BackendContext(node.sysfs, node.dev, node.root, TopologyReader(node.sysfs),
                                       {"mode": "dynamic"}, structlog.get_logger("nvidia-mig"),
                                       driver_root=node.driver_root))
    inventory = await backend.discover()
    assert inventory.devices == () and inventory.counter_sets == ()
    assert any("MIG mode change pending a GPU reset" in w for w in inventory.warnings)
    await backend.stop()


async def test_at_start_mig_devices_no_claim_holds_any_more_are_destroyed(scratch: Path) -> None:
    """The checkpoint is lost (a disk replaced, a state folder wiped) while a MIG device the agent made exists:
    the ledger says it is the agent's, no claim holds it, so the next start destroys it."""
    env = {"DRA_AGENT_BACKEND_CONFIG": json.dumps(DYNAMIC)}
    async with two_agents(scratch, str(dgx_h100_in_mig_mode(scratch)), backends=("nvidia-mig",), env=env) as run:
        server, settings, kubelet = run.server, run.settings, run.kubelet
        first, second = run.first, run.second
        assert settings.sim_root is not None
        plugin = await kubelet.wait_for_plugin(GPU, timeout=scaled(30))
        ref = allocate(server, "train", [("mig", GPU, "gpu-0000-18-00-0-mig-2g20gb-14-2")])
        await plugin.prepare_or_raise([ref])
        await first.stop()  # killed
        assert made_on_node(settings.sim_root, "0000:18:00.0") == [("2g.20gb", 2, 1)]
        lose_claims(settings, GPU)
        await second.start()
        await plugin_after_restart(kubelet, plugin)
        assert made_on_node(settings.sim_root, "0000:18:00.0") == []
        assert "destroying a MIG device made for a claim no longer prepared" in second.output()


def test_an_intent_left_by_a_crash_is_finished_with_what_it_made(sim_node: Callable[[str], SimulatedNode],
                                                                  tmp_path: Path) -> None:
    """A prepare retried after a crash cut it short between the GPU instance and the record of its ids: the
    instance at the intent's placement is the one it made, and is finished rather than made twice."""
    node = sim_node(str(dgx_h100_in_mig_mode(tmp_path)))
    ledger = MigLedger(tmp_path / "ledger.json")
    ledger.load()
    maker = MigMaker(ledger, MigEdits(node.root), structlog.get_logger("nvidia-mig"))
    with nvml_session():
        gpu = next(g for g in list_gpus()[0] if g.bus_id == "0000:18:00.0")
        _, _, offers = dynamic_devices(gpu, {}, TopologyReader(node.sysfs).lookup(gpu.bus_id))
    device = "gpu-0000-18-00-0-mig-3g40gb-9-4"
    offer = offers[device]
    assert offer.placement is not None
    ledger.put(LedgerEntry("uid", device, "0000:18:00.0", offer.placement.profile.id, 4))
    node.nvml.create_instance(0, "3g.40gb", 4)  # what the cut-short attempt made, compute instance included
    edits, restore = maker.make("uid", device, offer)
    assert [(v.profile, v.start) for v in node.nvml.instances(0)] == [("3g.40gb", 4)], "nothing made twice"
    assert restore["gpuInstance"] == node.nvml.instances(0)[0].gi
    assert edits.device_nodes[0].path == "/dev/nvidia0"
    maker.unmake("uid", device)
    assert node.nvml.instances(0) == [] and list(ledger) == []


def test_the_ledger_is_written_before_nvml_and_never_waits_for_the_disk(
        sim_node: Callable[[str], SimulatedNode], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The intent is in the file before NVML creates anything, so a crash of the agent (which keeps what the
    process wrote) leaves enough to find the instance and destroy it. Nothing is synced: a power cut that could
    lose the record reboots the node, which takes the instance away too."""
    node = sim_node(str(dgx_h100_in_mig_mode(tmp_path)))
    path = tmp_path / "ledger.json"
    ledger = MigLedger(path)
    ledger.load()
    syncs: list[int] = []
    written_at_create: list[bytes] = []
    real_create = create_gpu_instance

    def create(*args: Any) -> int:
        written_at_create.append(path.read_bytes())
        return real_create(*args)

    monkeypatch.setattr(os, "fdatasync", syncs.append)
    monkeypatch.setattr(mig_dynamic, "create_gpu_instance", create)
    maker = MigMaker(ledger, MigEdits(node.root), structlog.get_logger("nvidia-mig"))
    with nvml_session():
        gpu = next(g for g in list_gpus()[0] if g.bus_id == "0000:18:00.0")
        _, _, offers = dynamic_devices(gpu, {}, TopologyReader(node.sysfs).lookup(gpu.bus_id))
    device = "gpu-0000-18-00-0-mig-1g10gb-19-2"
    maker.make("uid", device, offers[device])
    assert syncs == [], "no disk sync per make"
    assert device.encode() in written_at_create[0], "the intent was in the file before NVML"

    # A crash right after the GPU instance was made: the file as the intent left it.
    path.write_bytes(written_at_create[0])
    after = MigLedger(path)
    after.load()
    (entry,) = after
    assert entry.gpu_instance is None, "only the intent"
    MigMaker(after, MigEdits(node.root), structlog.get_logger("nvidia-mig")).unmake("uid", device)
    assert node.nvml.instances(0) == [] and list(after) == []
