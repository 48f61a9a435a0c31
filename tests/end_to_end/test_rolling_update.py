"""A DaemonSet rolling update on a node with claims in flight: the old pod's agent prepares a burst of claims on
every backend that changes the hardware (dynamic MIG, compute mode, vfio-pci for GPUs and VFs, plain VFs), with
monitoring pods' admin-access claims on devices the workload claims hold; the new pod's agent starts before,
during or after the burst on the same state, the old one is ended by SIGTERM or SIGKILL, and the kubelet goes on
with the new one.

What must hold: no claim answered as prepared is lost or rolled back, asking again answers exactly the same, a
claim the old agent could not finish is prepared by the new one, and once everything is unprepared every change was
undone exactly once (MIG instances destroyed as often as made, vfio-pci bindings undone as often as made), the node
is as it was, and no record is left."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.claims.checkpoint import Checkpoint
from agent.claims.results import ClaimResult
from backends.contract import ClaimRef
from simulator.kubelet_connection import KubeletError, Plugin
from simulator.nvml.control import request
from tests.support.agent_env import allocate, journal_entries, wait_until
from tests.support.checkpoint_journal import journal_histories
from tests.support.surge_env import Surge, both_registered, made_on_node, surge_env
from tests.support.timing import scaled

GPU, NIC = "gpu.nvidia.com", "sriov.dra-agent.io"
MIG_GPUS = ("0000:18:00.0", "0000:1c:00.0", "0000:3a:00.0", "0000:3e:00.0")
EXCLUSIVE = {"apiVersion": "dra-agent.io/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "ExclusiveProcess"}}
VFIO = {"apiVersion": "dra-agent.io/v1alpha1", "kind": "VfioConfig"}
MAKE_GPU_INSTANCE = "nvmlDeviceCreateGpuInstanceWithPlacement"
ENV = {"DRA_AGENT_BACKEND_CONFIG": json.dumps({"nvidia-mig": {"mode": "dynamic"}})}

# name → (driver, device, opaque parameters or None)
FIRST_BURST: dict[str, tuple[str, str, dict[str, Any] | None]] = {
    "mig-a": (GPU, "gpu-0000-18-00-0-mig-1g10gb-19-0", None),
    "mig-b": (GPU, "gpu-0000-18-00-0-mig-1g10gb-19-1", None),
    "mig-c": (GPU, "gpu-0000-1c-00-0-mig-3g40gb-9-0", None),
    "mode-a": (GPU, "gpu-0000-9a-00-0", EXCLUSIVE),
    "mode-b": (GPU, "gpu-0000-9e-00-0", EXCLUSIVE),
    "vm-gpu": (GPU, "gpu-0000-bb-00-0", VFIO),
    "vm-vf": (NIC, "vf-0000-19-00-1", VFIO),
    "vf-a": (NIC, "vf-0000-19-00-2", None),
    "vf-b": (NIC, "vf-0000-19-00-3", None),
    # Monitoring pods' claims with admin access, on devices workload claims of the burst hold.
    "watch-mig": (GPU, "gpu-0000-18-00-0-mig-1g10gb-19-0", None),
    "watch-vf": (NIC, "vf-0000-19-00-1", None),
}
ADMIN = {"watch-mig", "watch-vf"}
SECOND_BURST: dict[str, tuple[str, str, dict[str, Any] | None]] = {
    "mig-d": (GPU, "gpu-0000-3a-00-0-mig-2g20gb-14-0", None),
    "mode-c": (GPU, "gpu-0000-bf-00-0", EXCLUSIVE),
    "vm-vf-2": (NIC, "vf-0000-19-00-4", VFIO),
    "vf-c": (NIC, "vf-0000-19-00-5", None),
}


def half_in_mig_mode(folder: Path) -> Path:
    """dgx-h100 with the GPUs of its first two root complexes in MIG mode (dynamic MIG's), the others whole."""
    from importlib import resources

    profile = yaml.safe_load((resources.files("simulator.node") / "profiles/dgx-h100.yaml").read_text())
    profile["name"] = "dgx-h100-half-mig"
    for complex_ in profile["root_complexes"][:2]:
        for port in complex_["ports"]:
            for entry in port["switch"]:
                if "gpu" in entry:
                    entry["gpu"] = {"model": entry["gpu"], "mig": {"instances": []}}
    path = folder / "dgx-h100-half-mig.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path


def claim_for(run: Surge, name: str, spec: tuple[str, str, dict[str, Any] | None]) -> ClaimRef:
    driver, device, parameters = spec
    configs = [{"source": "FromClaim", "requests": ["dev"], "opaque": {"driver": driver, "parameters": parameters}}]
    return allocate(run.server, name, [("dev", driver, device)], configs if parameters else None, admin=name in ADMIN)


def drivers_on_node(root: Path) -> dict[str, str]:
    devices = root / "sys/bus/pci/devices"
    return {d.name: os.readlink(d / "driver") if (d / "driver").exists() else "" for d in devices.iterdir()}


def compute_modes(root: Path) -> dict[str, int]:
    state = json.loads((root / ".sim/nvml-mig.json").read_text()) if (root / ".sim/nvml-mig.json").exists() else []
    return {g["bus_id"]: g["compute_mode"] for g in state}


async def prepare_one(plugin: Plugin, claim: ClaimRef) -> ClaimResult | KubeletError:
    try:
        return (await plugin.prepare([claim]))[claim.uid]
    except KubeletError as e:  # the agent went away in the middle of the call
        return e


@pytest.mark.parametrize(("moment", "ending"), [
    ("before", signal.SIGKILL), ("during", signal.SIGKILL), ("during", signal.SIGTERM), ("after", signal.SIGTERM),
])
async def test_a_rolling_update_with_claims_in_flight_loses_nothing_and_undoes_everything_once(
        scratch: Path, moment: str, ending: signal.Signals) -> None:
    profile = half_in_mig_mode(scratch)
    async with surge_env(scratch, str(profile), ENV, backends=("nvidia-gpu", "nvidia-mig", "sriov-nic")) as run:
        try:
            await _update_with_claims_in_flight(run, moment, ending)
        except BaseException:
            print(f"--- old agent\n{run.old.output()}\n--- new agent\n{run.new.output()}")
            raise


async def _update_with_claims_in_flight(run: Surge, moment: str, ending: signal.Signals) -> None:
    await run.old.start()
    old = {d: await run.kubelet.wait_for_plugin(d, timeout=scaled(60)) for d in (GPU, NIC)}
    await wait_until(lambda: {s["spec"]["driver"] for s in run.server.objects("resourceslices")} >= {GPU, NIC},
                     timeout=scaled(30))
    before = drivers_on_node(run.root)

    # Making a GPU instance takes real hardware its time: the old agent is in the middle of a prepare when the new
    # one starts and recovers, whichever moment it starts at.
    request(run.root, {"op": "slow", "symbol": MAKE_GPU_INSTANCE, "seconds": 1.0})
    claims = {name: claim_for(run, name, spec) for name, spec in FIRST_BURST.items()}
    if moment == "before":
        await run.new.start()
    first = {name: asyncio.create_task(prepare_one(old[FIRST_BURST[name][0]], ref)) for name, ref in claims.items()}
    if moment == "during":
        await asyncio.wait(first.values(), return_when=asyncio.FIRST_COMPLETED)
        await run.new.start()
    elif moment == "after":
        await asyncio.wait(first.values())
        await run.new.start()
    plugins = await both_registered(run.kubelet, (GPU, NIC))
    new = {d: plugins[d][1] for d in (GPU, NIC)}
    await run.old.signal(ending)  # whatever of the burst is still in flight meets it
    answers = {name: await task for name, task in first.items()}
    assert await run.old.wait(timeout=scaled(20)) == (0 if ending == signal.SIGTERM else -signal.SIGKILL)
    prepared = {name for name, answer in answers.items() if isinstance(answer, ClaimResult) and not answer.error}
    refused = {name: a.error for name, a in answers.items() if isinstance(a, ClaimResult) and a.error}
    assert refused == {}, "a claim the old agent answered was refused for a reason of its own"
    if moment == "after" or ending == signal.SIGTERM:
        assert prepared == set(FIRST_BURST), "a stopping agent finishes the calls it has begun"

    request(run.root, {"op": "slow", "symbol": MAKE_GPU_INSTANCE, "seconds": 0})
    # The kubelet goes on with the new agent: asking again answers exactly what was answered, and a claim whose
    # call the old agent never answered is prepared now.
    for name, ref in claims.items():
        again = (await new[FIRST_BURST[name][0]].prepare([ref]))[ref.uid]
        if name in prepared:
            assert again == answers[name], f"{name}: asked again, answered otherwise"
        else:
            assert again.error == "", f"{name}: {again.error}"
    for line in run.new.output().splitlines():
        if "rolling back a prepare that did not complete" in line:
            rolled = json.loads(line)["claim"]
            assert not any(claims[name].uid in rolled for name in prepared), f"a prepared claim was rolled back: {line}"
    more = {name: claim_for(run, name, spec) for name, spec in SECOND_BURST.items()}
    for name, ref in more.items():
        assert (await new[SECOND_BURST[name][0]].prepare([ref]))[ref.uid].error == "", name
    assert made_on_node(run.root, "0000:18:00.0") == [("1g.10gb", 0, 1), ("1g.10gb", 1, 1)]
    assert made_on_node(run.root, "0000:3a:00.0") == [("2g.20gb", 0, 1)]
    assert compute_modes(run.root)["0000:9a:00.0"] == 3  # EXCLUSIVE_PROCESS
    assert drivers_on_node(run.root)["0000:bb:00.0"].endswith("vfio-pci")

    everything = {**FIRST_BURST, **SECOND_BURST}
    for name, ref in {**claims, **more}.items():
        assert await new[everything[name][0]].unprepare([ref]) == {ref.uid: ""}, name

    # Everything undone, each change exactly once.
    assert drivers_on_node(run.root) == before
    assert set(compute_modes(run.root).values()) == {0}, "every GPU back in the DEFAULT compute mode it started in"
    assert all(made_on_node(run.root, bus_id) == [] for bus_id in MIG_GPUS)
    counts = request(run.root, {"op": "counts"})
    nvml, binds = counts["nvml"], counts["drivers"]
    assert nvml.get(MAKE_GPU_INSTANCE, 0) == nvml.get("nvmlGpuInstanceDestroy", 0) >= 4
    assert nvml.get("nvmlGpuInstanceCreateComputeInstance", 0) == nvml.get("nvmlComputeInstanceDestroy", 0)
    assert nvml.get("nvmlDeviceSetComputeMode", 0) % 2 == 0, "every compute mode set was put back once"
    vfio = {key.split()[0] for key in binds if key.endswith("vfio-pci")}
    assert vfio >= {"0000:bb:00.0", "0000:19:00.1", "0000:19:00.4"}
    for bus_id in vfio:
        made, undone = binds.get(f"{bus_id} bind vfio-pci", 0), binds.get(f"{bus_id} unbind vfio-pci", 0)
        assert made == undone >= 1, f"{bus_id}: bound to vfio-pci {made} times, handed back {undone} times"
    state = run.new.settings.state_dir
    # Each claim's preparation was begun once, or rolled back (begun by the old agent when it was killed) and begun
    # again by the new one: never begun again once completed, as a new agent that did not read what the old one
    # recorded in their shared checkpoint would.
    histories = {**journal_histories(state, GPU), **journal_histories(state, NIC)}
    once, rolled_back = ["started", "completed", "removed"], ["started", "removed", "started", "completed", "removed"]
    for name, ref in {**claims, **more}.items():
        allowed = [once] if name in prepared or name in more else [once, rolled_back]
        assert histories.get(ref.uid) in allowed, f"{name}: {histories.get(ref.uid)}"
    for driver in (GPU, NIC):
        checkpoint = Checkpoint(state / driver / "checkpoint.journal", "", driver=driver)
        checkpoint.refresh()
        assert checkpoint.claims == {}, f"{driver}: {checkpoint.claims}"
    assert list(run.new.settings.cdi_dir.iterdir()) == []
    for ledger in (state / "backends").rglob("*.json"):
        assert journal_entries(ledger) == {}, f"{ledger} still records {journal_entries(ledger)}"
