"""`dra-agent demo` end to end: the seed scenarios on real agents, API server, kubelet simulator and allocator,
each scenario checked by what it showed; the command's exit status; the DeviceClasses it uses."""

from __future__ import annotations

import asyncio
import io
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from simulator.demo.claims import device_classes
from simulator.demo.cluster import DemoError
from simulator.demo.command import SCENARIOS, SEEDS, plan_for, run_demo
from simulator.demo.story import MAX_WIDTH, Story
from tests.support.agent_env import memory_dir
from tests.support.repository import ROOT
from tests.support.timing import scaled

pytestmark = pytest.mark.xdist_group("demo")


class Told:
    """A finished demo run: its exit status, its text and its checked steps by section."""

    def __init__(self, code: int, story: Story, text: str) -> None:
        self.code = code
        self.text = text
        self.checks = story.checks

    def section(self, scenario: str) -> list[tuple[bool, str]]:
        """The checks under the scenario's numbered heading."""
        title = SCENARIOS[scenario].title
        (found,) = [checks for heading, checks in self.checks.items() if heading.partition(". ")[2] == title]
        return found

    def passed(self, scenario: str) -> list[str]:
        checks = self.section(scenario)
        failed = [what for ok, what in checks if not ok]
        assert not failed, f"{scenario}: {failed}\n{self.text}"
        return [what for _, what in checks]


def tell(scenarios: tuple[str, ...], profile: str | None = None) -> Told:
    out = io.StringIO()
    story = Story(out, color=False, width=MAX_WIDTH)
    with memory_dir("dra-demo-t-") as folder:
        code = asyncio.run(run_demo(plan_for(profile, scenarios), story, workdir=folder))
    return Told(code, story, out.getvalue())


@pytest.fixture(scope="module")
def seeds() -> Iterator[Told]:
    """The demo's default run, once for the module: every seed scenario on seven simulated nodes."""
    yield tell(SEEDS)


def test_every_seed_scenario_behaves_and_the_demo_exits_0(seeds: Told) -> None:
    assert seeds.code == 0, seeds.text
    assert [h for h in seeds.checks if h[0].isdigit()] == [
        "1. Node readiness", "2. One compute class, many GPU nodes", "3. A big GPU with an aligned NIC",
        "4. MIG devices made to order", "5. A GPU and a VF handed to a VM and returned",
        "6. A GPU fails during a running claim", "7. A pod that asks nvidia.com/gpu: 1",
        "8. What a claim's status says after prepare", "9. A VM learns the PCI address of its GPU",
        "10. Two pods share one GPU by memory", "11. A VF's interface named net1 in the pod",
        "12. The pods of a claim share its GPU through CUDA MPS"]
    assert "every step behaved" in seeds.text


def test_no_line_of_the_default_demo_is_wider_than_100_columns(seeds: Told) -> None:
    """Paragraphs, tables (cells wrap within their column), checks and YAML documents all fit."""
    assert MAX_WIDTH == 100
    wide = [line for line in seeds.text.splitlines() if len(line) > MAX_WIDTH]
    assert not wide, "\n".join(wide)


def test_readiness_splits_the_simulated_node_set_up_from_the_agents_start(seeds: Told) -> None:
    """The time until ready counts from the launch of `dra-agent run`, building the simulated node included; the
    table shows that set-up apart from the agent's own start, which the checks quote."""
    assert "set-up  agent" in seeds.text
    assert re.search(r"dgx-h100: 2 pool\(s\) complete and registered with the kubelet \d+\.\d\d s after its "
                     r"start-up line", seeds.text), seeds.text
    assert "compiles the modules to bytecode and the simulated NVML library" in " ".join(seeds.text.split())


def test_f_every_node_is_ready_with_complete_pools(seeds: Told) -> None:
    checks = seeds.passed("readiness")
    assert len(checks) == 7, "one line per node"
    assert any(c.startswith("dgx-h100: 2 pool(s) complete and registered") for c in checks)
    assert any(c.startswith("gke-n1-p4x4: 1 pool(s) complete") for c in checks)


def test_a_one_all_claim_gets_each_gke_shapes_gpus(seeds: Told) -> None:
    checks = seeds.passed("all-gpus")
    for expected in ("2 x Tesla T4", "1 x NVIDIA L4", "4 x Tesla P4"):
        assert expected in checks
    assert sum(c.startswith("prepared on gke-") for c in checks) == 3
    assert seeds.text.count("unprepared: the CDI specs are gone") >= 3


def test_b_gpu_and_vf_share_a_root_or_a_switch_or_the_claim_waits_and_says_why(seeds: Told) -> None:
    checks = seeds.passed("aligned-nic")
    assert "not allocated: no GPU has 80Gi" in checks
    assert any(c.startswith("GPU and VF under one root complex: pci0000:") for c in checks)
    assert any(c.startswith("GPU and VF under one PCIe switch: 0000:") for c in checks)
    assert "not allocated, and the allocator names the unmet pcieRoot constraint" in checks


def test_c_seven_1g_devices_fill_a_gpu_the_eighth_waits_and_a_7g_fits_after(seeds: Told) -> None:
    checks = seeds.passed("mig")
    assert checks == [
        "the GPU holds seven 1g.10gb GPU instances, at placements 0-6",
        "not allocated: every other placement needs memory or compute slices the seven hold",
        "every MIG device is destroyed: nothing leaked",
        "prepared: the GPU is reused as one 7g.80gb device",
        "unprepared: the CDI specs are gone",
        "and destroyed again at unprepare",
    ]


def test_d_a_gpu_and_a_vf_go_to_vfio_pci_and_back(seeds: Told) -> None:
    checks = seeds.passed("vfio")
    assert "both devices are bound to vfio-pci" in checks
    assert "the container gets /dev/vfio/vfio and the groups' nodes" in checks
    assert any(c.startswith("the original drivers are back: 0000:") and "nvidia" in c and "mlx5_core" in c
               for c in checks)


def test_e_a_failed_gpu_is_reported_tainted_refused_and_recovers(seeds: Told) -> None:
    checks = seeds.passed("health")
    # Xid 79 takes the GPU off the bus: the Xid event or NVML finding the GPU lost is reported, whichever the
    # watcher sees first ("Xid 79: GPU has fallen off the bus" or "GPU has fallen off the bus: NVML reports it lost").
    assert any("is UNHEALTHY:" in c and "GPU has fallen off the bus" in c for c in checks)
    assert any(re.match(r"its ResourceSlice carries the taint gpu\.nvidia\.com/(xid=79|gpu-lost=?):NoSchedule", c)
               for c in checks)
    assert "not allocated: the claim does not tolerate the taint" in checks
    assert "the taint is gone from the ResourceSlice" in checks
    assert any(c.startswith("the waiting claim now gets gpu-") for c in checks)


def test_j_a_claims_status_has_each_drivers_entries_until_unprepare(seeds: Told) -> None:
    assert seeds.passed("claim-status") == [
        "prepared by both drivers",
        "one entry per device, each Ready=True, written by the driver that prepared it",
        "the entries carry the GPU's UUID and the VF's PCI address",
        "two field managers own them: gpu.nvidia.com, sriov.dra-agent.io",
        "unprepared: both drivers removed their entries",
    ]


def test_k_a_vm_reads_its_gpus_pci_address_from_the_metadata_file(seeds: Told) -> None:
    checks = seeds.passed("vm-metadata")
    assert checks[0] == "prepared: the GPU's CDI IDs include the metadata mount gpu.nvidia.com/metadata=<claim UID>_gpu"
    assert checks[1] == ("its CDI spec mounts the file at /var/run/kubernetes.io/dra-device-attributes/resourceclaims/"
                         "vm/gpu/gpu.nvidia.com-metadata.json")
    assert re.fullmatch(r"the file names the GPU's PCI address 0000:[0-9a-f]{2}:00\.0, as KubeVirt reads it", checks[2])
    assert checks[-2:] == ["unprepared: the CDI specs are gone", "the metadata file is gone with the claim"]


def test_i_two_pods_share_a_gpu_by_memory_and_a_third_share_does_not_fit(seeds: Told) -> None:
    checks = seeds.passed("gpu-shares")
    assert any(re.fullmatch(r"both share gpu-[0-9a-f-]+, each with its own shareID and CDI device", c) for c in checks)
    assert f"each container is told its share: DRA_AGENT_GPU_SHARE_MEMORY={30 * 2**30}" in checks
    assert "not allocated: the two shares leave less than 30Gi of the GPU's memory" in checks
    assert ("the other share stays prepared: its CDI spec is there and a repeated prepare answers the same share"
            in checks)
    assert "allowMultipleAllocations: true" in seeds.text and "validRange:" in seeds.text


def test_h_a_vf_interface_goes_into_the_pod_as_net1(seeds: Told) -> None:
    checks = seeds.passed("vf-interface")
    mac = r"([0-9a-f]{2}:){5}[0-9a-f]{2}"
    assert any(re.fullmatch(rf"status.devices\[\].networkData names net1 and the VF's MAC {mac}", c) for c in checks)
    assert any(re.fullmatch(r"the CDI spec \(cdiVersion 1\.1\.0\) moves \S+ into the pod as net1", c) for c in checks)
    # The CDI summary's cell may wrap between "interface" and the host name.
    assert re.search(r"interface\s+\S+ as net1", seeds.text), "the CDI summary shows the interface handed over"
    assert checks[-1] == "unprepared: the CDI specs are gone"


def test_i_the_pods_of_a_claim_share_its_gpu_through_its_own_mps_daemon(seeds: Told) -> None:
    checks = seeds.passed("mps")
    assert "the daemon serves the claim's limits: 50% of the SMs, 16384M of pinned memory per client" in checks
    assert any(re.fullmatch(r"GPU \S+ is in compute mode EXCLUSIVE_PROCESS: only the daemon's MPS server opens it", c)
               for c in checks)
    assert checks[-2:] == ["unprepared: the CDI specs are gone", "the daemon quit through its pipe, its folder is "
                           "gone and the GPU has its compute mode back"]


def test_g_a_pod_asking_nvidia_gpu_gets_a_gpu_and_too_much_or_unknown_is_refused(seeds: Told) -> None:
    checks = seeds.passed("extended-gpu")
    assert checks[:2] == ["the scheduler made a claim for the pod",
                          "one claim, annotated resource.kubernetes.io/extended-resource-claim, with request "
                          "container-0-request-0 for class gpu.nvidia.com"]  # fmt: skip
    assert any(re.fullmatch(r"allocated a whole GPU: gpu-[0-9a-f-]+", c) for c in checks)
    assert "NodePrepareResources on dgx-h100 succeeded for gpu.nvidia.com" in checks
    assert any(re.fullmatch(r"the container gets the GPU's device node /dev/nvidia\d+", c) for c in checks)
    assert checks[-3:] == [
        "unschedulable, the scheduler says why (needs 9 device(s)), and no claim is left behind",
        "unschedulable, the scheduler says why (no DeviceClass serves it), and no claim is left behind",
        "the pod is gone: its claim is unprepared, released and deleted",
    ]
    assert "requestMappings:\n" in seeds.text and "resourceName: nvidia.com/gpu" in seeds.text


def test_the_command_tours_a_node_and_fails_when_a_scenario_cannot_hold_there(tmp_path: Path) -> None:
    # A GKE L4 node: the tour prepares its GPU; it has no RDMA VF, so the aligned claim cannot be allocated, which
    # the demo must call a failure.
    done = subprocess.run([sys.executable, "-m", "agent", "demo", "--profile", "gke-g2-l4", "--scenario", "tour",
                           "--scenario", "aligned-nic", "--color", "never"],
                          capture_output=True, text=True, timeout=scaled(120), cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    sections = dict(re.findall(r"^\d\. ([^\n]+)\n-+\n(.*?)(?=^\d\. |^Summary)", done.stdout, re.M | re.S))
    tour, aligned = sections["One device of every driver"], sections["A big GPU with an aligned NIC"]
    assert "✓ NodePrepareResources on gke-g2-l4 succeeded for gpu.nvidia.com" in tour
    assert "✗" not in tour
    assert "✗" in aligned
    assert "1 step(s) did not behave" in done.stdout or "2 step(s) did not behave" in done.stdout
    assert "\033[" not in done.stdout, "no colour when asked for none"


def test_an_unknown_scenario_is_refused_with_the_choices() -> None:
    with pytest.raises(DemoError, match=r"unknown scenario.*choose from readiness, all-gpus"):
        plan_for(None, ["bogus"])


def test_the_demo_uses_the_device_classes_the_project_ships() -> None:
    shipped = [d for d in yaml.safe_load_all((ROOT / "deploy/base/30-deviceclasses.yaml").read_text()) if d]
    assert device_classes() == shipped
    assert {c["metadata"]["name"] for c in shipped} >= {"gpu.nvidia.com", "mig.nvidia.com",
                                                        "rdma-vf.sriov.dra-agent.io", "vf.sriov.dra-agent.io"}
