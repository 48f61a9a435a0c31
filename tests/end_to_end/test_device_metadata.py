"""Device metadata files end to end, with `device_metadata` on: a VM's GPU on vfio-pci finds its PCI address in the
file the CDI spec mounts, the kubelet's answer names that spec, lost files come back at the next prepare, unprepare
removes them; a kubelet calling v1beta1 is refused per claim with nothing left; a crash after the files were
written leaves nothing once the agent is back and the claim unprepared."""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest

from agent.claims.metadata import decode_stream
from agent.settings import Settings
from backends.contract import ClaimRef
from backends.failpoints import METADATA_POINTS
from backends.nvidia.nvml import list_gpus, list_mig_devices, nvml_session
from simulator.apiserver.server import TestApiServer
from simulator.kubelet import KubeletSimulator
from simulator.kubelet_connection import KubeletError
from tests.support.agent_env import (
    NODE,
    agent_in_process,
    allocate,
    metadata_file,
    metadata_spec,
    plugin_after_restart,
    two_agents,
    wait_until,
)
from tests.support.cdi_schema import cdi_schema_errors
from tests.support.mig_env import DYNAMIC, dgx_h100_in_mig_mode
from tests.support.timing import scaled

GPU = "gpu.nvidia.com"
TPU = "tpu.google.com"
GPU_DEVICE, GPU_BDF, GPU_GROUP = "gpu-0000-18-00-0", "0000:18:00.0", 3
CONTAINER_ROOT = "/var/run/kubernetes.io/dra-device-attributes"


def passthrough(request: str = "dev") -> list[dict[str, Any]]:
    """The claim's configuration that asks for its GPU on vfio-pci (a VM's)."""
    return [{"source": "FromClaim", "requests": [request], "opaque": {
        "driver": GPU, "parameters": {"apiVersion": "dra-agent.io/v1alpha1", "kind": "VfioConfig"}}}]


def driver_of(settings: Settings, bus_id: str) -> str | None:
    link = (settings.sim_root or Path("/")) / "sys/bus/pci/devices" / bus_id / "driver"
    return os.path.basename(os.readlink(link)) if link.is_symlink() else None


def host_file(settings: Settings, namespace: str, name: str, request: str) -> Path:
    return metadata_file(settings, GPU, namespace, name, request)


def spec_file(settings: Settings, uid: str, request: str) -> Path:
    return metadata_spec(settings, GPU, uid, request)


def leftovers(settings: Settings, ref: ClaimRef) -> list[str]:
    """The claim's metadata specs and its host folder, if any is left."""
    found = [p.name for p in settings.cdi_dir.glob(f"{GPU}_metadata_{ref.uid}_*")]
    folder = settings.plugins_dir / GPU / "dra-device-metadata" / f"{ref.namespace}_{ref.name}"
    return [*found, *([str(folder)] if folder.exists() else [])]


def from_template(server: TestApiServer, name: str, pod_claim_name: str, request: str) -> ClaimRef:
    """A claim the resource claim controller made from a template for a pod that calls it `pod_claim_name`."""
    uid = str(uuid.uuid4())
    server.put_claim({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default", "uid": uid,
                     "annotations": {"resource.kubernetes.io/pod-claim-name": pod_claim_name}},
        "spec": {"devices": {"requests": [{"name": request, "exactly": {"deviceClassName": GPU}}]}},
        "status": {"allocation": {"devices": {
            "results": [{"request": request, "driver": GPU, "pool": NODE, "device": GPU_DEVICE}],
            "config": passthrough(request),
        }}},
    })
    return ClaimRef(uid, "default", name)


async def test_a_vm_finds_its_gpus_pci_address_in_the_mounted_file(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100", device_metadata=True) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        settings = env.settings
        plugin = await kubelet.wait_for_plugin(GPU)
        claim = allocate(env.server, "vm", [("dev", GPU, GPU_DEVICE)], passthrough())
        result = (await plugin.prepare([claim]))[claim.uid]
        assert result.error == ""
        assert driver_of(settings, GPU_BDF) == "vfio-pci"
        (device,) = result.devices
        assert device.cdi_device_ids[-1] == f"{GPU}/metadata={claim.uid}_dev"

        host = host_file(settings, "default", "vm", "dev")
        found = decode_stream(host.read_bytes())
        assert found["metadata"] == {"name": "vm", "namespace": "default", "uid": claim.uid, "generation": 1}
        ((request,),) = [[r] for r in found["requests"]]
        assert request["name"] == "dev"
        (entry,) = request["devices"]
        assert (entry["driver"], entry["pool"], entry["name"]) == (GPU, NODE, GPU_DEVICE)
        assert entry["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": GPU_BDF}
        assert entry["attributes"]["iommuGroup"] == {"int": GPU_GROUP}
        assert entry["attributes"]["uuid"]["string"].startswith("GPU-")

        spec = json.loads(spec_file(settings, claim.uid, "dev").read_text())
        assert cdi_schema_errors(spec) == []
        assert (spec["cdiVersion"], spec["kind"]) == ("0.5.0", f"{GPU}/metadata")
        (cdi_device,) = spec["devices"]
        assert cdi_device["name"] == f"{claim.uid}_dev"
        assert cdi_device["containerEdits"]["mounts"] == [{
            "hostPath": str(host.absolute()),
            "containerPath": f"{CONTAINER_ROOT}/resourceclaims/vm/dev/{GPU}-metadata.json",
            "options": ["ro", "bind"],
        }]

        # Lost (a wiped CDI tmpfs, a cleaned plugin folder): the kubelet's next prepare has them back, same answer.
        host.unlink()
        spec_file(settings, claim.uid, "dev").unlink()
        assert (await plugin.prepare([claim]))[claim.uid] == result
        assert decode_stream(host.read_bytes()) == found
        assert json.loads(spec_file(settings, claim.uid, "dev").read_text()) == spec

        assert await plugin.unprepare([claim]) == {claim.uid: ""}
        assert leftovers(settings, claim) == []
        assert driver_of(settings, GPU_BDF) == "nvidia"

        # A claim from a template: the pod finds it under its own name for the claim.
        made = from_template(env.server, "launcher-x2k4p-gpu-7c9f", "gpu", "vm-gpu")
        assert (await plugin.prepare([made]))[made.uid].error == ""
        mount = json.loads(spec_file(settings, made.uid, "vm-gpu").read_text())["devices"][0]["containerEdits"]
        assert mount["mounts"][0]["containerPath"] == (f"{CONTAINER_ROOT}/resourceclaimtemplates/gpu/vm-gpu/"
                                                       f"{GPU}-metadata.json")
        assert decode_stream(host_file(settings, "default", made.name, "vm-gpu").read_bytes())["podClaimName"] == "gpu"
        assert await plugin.unprepare([made]) == {made.uid: ""}
        assert leftovers(settings, made) == []

        # A pod claim name no API server would write fails the claim, and the GPU goes back.
        hostile = from_template(env.server, "hostile", "../../etc", "dev")
        error = (await plugin.prepare([hostile]))[hostile.uid].error
        assert "is not a pod claim name" in error
        assert leftovers(settings, hostile) == []
        assert driver_of(settings, GPU_BDF) == "nvidia"


async def test_a_kubelet_calling_v1beta1_is_refused_per_claim_and_nothing_is_left(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100", device_metadata=True) as env, \
            KubeletSimulator(env.settings.registry_dir, dra_versions=("v1beta1.DRAPlugin",)) as kubelet:
        settings = env.settings
        plugin = await kubelet.wait_for_plugin(GPU)
        assert plugin.version == "v1beta1"
        vm = allocate(env.server, "vm", [("dev", GPU, GPU_DEVICE)], passthrough())
        plain = allocate(env.server, "plain", [("gpu", GPU, GPU_DEVICE)])
        results = await plugin.prepare([vm, plain])
        for ref in (vm, plain):
            assert "setting device_metadata" in results[ref.uid].error
            assert "this kubelet called v1beta1" in results[ref.uid].error
            assert results[ref.uid].devices == ()
            assert leftovers(settings, ref) == []
            assert not list(settings.cdi_dir.glob(f"*{ref.uid}*"))
        assert driver_of(settings, GPU_BDF) == "nvidia"
        journal = settings.state_dir / GPU / "checkpoint.journal"
        assert vm.uid not in journal.read_text() and plain.uid not in journal.read_text()


async def test_with_the_setting_off_no_file_is_written_and_v1beta1_is_served(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100") as env, \
            KubeletSimulator(env.settings.registry_dir, dra_versions=("v1beta1.DRAPlugin",)) as kubelet:
        plugin = await kubelet.wait_for_plugin(GPU)
        vm = allocate(env.server, "vm", [("dev", GPU, GPU_DEVICE)], passthrough())
        result = (await plugin.prepare([vm]))[vm.uid]
        assert result.error == ""
        assert not any("/metadata=" in i for d in result.devices for i in d.cdi_device_ids)
        assert leftovers(env.settings, vm) == []
        assert await plugin.unprepare([vm]) == {vm.uid: ""}


@pytest.mark.parametrize("point", [*METADATA_POINTS, "prepare-after-cdi"])
async def test_a_crash_after_the_files_are_written_leaves_nothing_after_restart_and_unprepare(
        scratch: Path, point: str) -> None:
    async with two_agents(scratch, "dgx-h100", backends=("nvidia-gpu",), failpoint=point,
                          device_metadata=True) as run:
        settings, kubelet = run.settings, run.kubelet
        plugin = await kubelet.wait_for_plugin(GPU, timeout=scaled(30))
        ref = allocate(run.server, "vm", [("dev", GPU, GPU_DEVICE)], passthrough())
        with pytest.raises(KubeletError):
            await plugin.prepare([ref])
        assert await run.first.wait() == -signal.SIGKILL
        assert host_file(settings, "default", "vm", "dev").exists(), "the crash came after the files were written"
        assert spec_file(settings, ref.uid, "dev").exists()

        await run.second.start()
        plugin = await plugin_after_restart(kubelet, plugin)
        assert await plugin.unprepare([ref]) == {ref.uid: ""}
        assert leftovers(settings, ref) == []
        assert driver_of(settings, GPU_BDF) == "nvidia"
        # The kubelet may still ask again: the claim is prepared afresh, files and all.
        result = await plugin.prepare_or_raise([ref])
        assert result[ref.uid].devices[0].cdi_device_ids[-1] == f"{GPU}/metadata={ref.uid}_dev"
        assert host_file(settings, "default", "vm", "dev").exists()
        assert await plugin.unprepare([ref]) == {ref.uid: ""}
        assert leftovers(settings, ref) == []


def attributes_in_file(settings: Settings, driver: str, name: str, request: str) -> dict[str, Any]:
    path = metadata_file(settings, driver, "default", name, request)
    (device,) = decode_stream(path.read_bytes())["requests"][0]["devices"]
    attributes: dict[str, Any] = device["attributes"]
    return attributes


def published(server: TestApiServer, driver: str) -> dict[str, dict[str, Any]]:
    """Device name → its published attributes, of one driver's slices."""
    return {d["name"]: d.get("attributes", {}) for s in server.objects("resourceslices")
            if s["spec"]["driver"] == driver for d in s["spec"].get("devices", ())}


async def test_a_plain_gpu_and_a_made_mig_device_tell_their_uuids(scratch: Path) -> None:
    profile = dgx_h100_in_mig_mode(scratch)
    async with agent_in_process(scratch, str(profile), backend_config=DYNAMIC, device_metadata=True) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await kubelet.wait_for_plugin(GPU)
        mig = allocate(env.server, "mig", [("mig", GPU, f"{GPU_DEVICE}-mig-1g10gb-19-0")])
        assert (await plugin.prepare([mig]))[mig.uid].error == ""
        with nvml_session():
            gpus, _ = list_gpus()
            made = {m.uuid for g in gpus if g.bus_id == GPU_BDF for m in list_mig_devices(g)}
        facts = attributes_in_file(env.settings, GPU, "mig", "mig")
        assert facts == {"uuid": {"string": facts["uuid"]["string"]}} and facts["uuid"]["string"] in made
        assert facts["uuid"]["string"].startswith("MIG-")
        assert await plugin.unprepare([mig]) == {mig.uid: ""}

    (scratch / "plain").mkdir()
    async with agent_in_process(scratch / "plain", "dgx-h100", device_metadata=True) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await kubelet.wait_for_plugin(GPU)
        gpu = allocate(env.server, "gpu", [("gpu", GPU, GPU_DEVICE)])
        assert (await plugin.prepare([gpu]))[gpu.uid].error == ""
        uuid_published = published(env.server, GPU)[GPU_DEVICE]["uuid"]
        assert attributes_in_file(env.settings, GPU, "gpu", "gpu") == {
            "uuid": uuid_published, "resource.kubernetes.io/pciBusID": {"string": GPU_BDF}}


async def test_a_tpu_chip_tells_its_index(scratch: Path) -> None:
    async with agent_in_process(scratch, "tpu-v5e-8", device_metadata=True) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await kubelet.wait_for_plugin(TPU)
        chips = published(env.server, TPU)
        name, attributes = sorted(chips.items())[3]
        claim = allocate(env.server, "tpu", [("tpu", TPU, name)])
        assert (await plugin.prepare([claim]))[claim.uid].error == ""
        assert attributes_in_file(env.settings, TPU, "tpu", "tpu") == {"index": attributes["index"]}


async def test_at_start_a_lost_spec_comes_back_from_its_host_file(scratch: Path) -> None:
    async with two_agents(scratch, "dgx-h100", backends=("nvidia-gpu",), device_metadata=True) as run:
        settings, kubelet = run.settings, run.kubelet
        plugin = await kubelet.wait_for_plugin(GPU, timeout=scaled(30))
        ref = from_template(run.server, "launcher-x2k4p-gpu-7c9f", "gpu", "vm-gpu")
        await plugin.prepare_or_raise([ref])
        spec = spec_file(settings, ref.uid, "vm-gpu")
        written = spec.read_text()
        await run.first.stop()  # killed, as a node's agent pod is
        spec.unlink()  # and the CDI tmpfs emptied meanwhile

        await run.second.start()
        await wait_until(spec.exists, timeout=scaled(30))
        assert json.loads(spec.read_text()) == json.loads(written), "the template's path too"
        plugin = await plugin_after_restart(kubelet, plugin)
        assert await plugin.unprepare([ref]) == {ref.uid: ""}
        assert leftovers(settings, ref) == []


async def test_a_lost_journal_keeps_the_files_of_claims_known_from_their_spec_and_sweeps_the_rest(
        scratch: Path) -> None:
    async with two_agents(scratch, "dgx-h100", backends=("nvidia-gpu",), device_metadata=True) as run:
        settings, kubelet = run.settings, run.kubelet
        plugin = await kubelet.wait_for_plugin(GPU, timeout=scaled(30))
        await wait_until(lambda: len(published(run.server, GPU)) >= 2)
        first, second = sorted(published(run.server, GPU))[:2]
        kept = allocate(run.server, "kept", [("gpu", GPU, first)])
        gone = allocate(run.server, "gone", [("gpu", GPU, second)])
        answer = (await plugin.prepare_or_raise([kept]))[kept.uid]
        await plugin.prepare_or_raise([gone])
        kept_file = host_file(settings, "default", "kept", "gpu").read_bytes()
        await run.first.stop()
        (settings.state_dir / GPU / "checkpoint.journal").unlink()  # every record lost, the CDI specs not
        (settings.cdi_dir / f"k8s.{GPU}-claim_{gone.uid}.json").unlink()  # of this claim nothing says it was prepared

        await run.second.start()
        plugin = await plugin_after_restart(kubelet, plugin)
        await wait_until(lambda: leftovers(settings, gone) == [], timeout=scaled(30))
        assert host_file(settings, "default", "kept", "gpu").read_bytes() == kept_file
        again = (await plugin.prepare_or_raise([kept]))[kept.uid]
        assert again == answer, "the same answer, the metadata spec included"
        assert host_file(settings, "default", "kept", "gpu").read_bytes() == kept_file, "the facts are kept"
        assert await plugin.unprepare([kept]) == {kept.uid: ""}
        assert leftovers(settings, kept) == []
