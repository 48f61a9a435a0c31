"""`dra-agent demo`: the whole path of a claim on simulated nodes, told as it happens.

It starts the test API server, `dra-agent run` on each simulated node the chosen scenarios need, a kubelet
simulator per node and the structured allocator, then runs the scenarios: what was published, how each claim
was allocated and why, what prepare returned and the CDI spec behind it, a health event and its effect, and
unprepare. The exit status is 0 only if every checked step behaved.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from simulator.demo.claims import device_classes
from simulator.demo.cluster import DemoCluster, DemoError
from simulator.demo.extended import extended_gpu
from simulator.demo.health import HEALTH_CONFIG, gpu_failure
from simulator.demo.mps import mps
from simulator.demo.reconfig import MIG_CONFIG, dgx_h100_in_mig_mode, dynamic_mig, vfio
from simulator.demo.scenarios import GKE_NODES, aligned_nic, all_gpus, readiness, tour
from simulator.demo.story import Story
from simulator.demo.workload import SHARED_CONFIG, claim_status, gpu_shares, vf_interface, vm_metadata
from simulator.kubelet_connection import KubeletError
from simulator.node.profile import ProfileError, load_profile
from simulator.scheduler.allocation import Unallocatable

DEFAULT_PROFILE = "dgx-h100"
MIG_NODE = "dgx-h100-mig"
SHARED_NODE = "dgx-h100-shared"
VM_NODE = "dgx-h100-vm"


@dataclass(frozen=True)
class NodeSpec:
    """A node a scenario runs on: its name, its profile (a built-in name or a YAML file) and backend config."""

    name: str
    profile: str | Callable[[Path], str]
    config: dict[str, Any]
    settings: Mapping[str, str] = field(default_factory=dict)  # agent settings as DRA_AGENT_* variables


@dataclass(frozen=True)
class Plan:
    """What this run does: the scenarios, in order, and the profile of the main node."""

    scenarios: tuple[str, ...]
    profile: str

    @property
    def main_node(self) -> NodeSpec:
        name = re.sub(r"[^a-z0-9-]+", "-", Path(self.profile).stem.lower()).strip("-")[:63] or "node"
        return NodeSpec(name, self.profile, dict(HEALTH_CONFIG))


ScenarioRun = Callable[[DemoCluster, Story, Plan], Awaitable[None]]


@dataclass(frozen=True)
class Scenario:
    title: str
    nodes: Callable[[Plan], list[NodeSpec]]
    run: ScenarioRun


def _main(plan: Plan) -> list[NodeSpec]:
    return [plan.main_node]


SCENARIOS: dict[str, Scenario] = {
    "readiness": Scenario("Node readiness", _main, lambda c, s, p: asyncio.sleep(0)),
    "all-gpus": Scenario("One compute class, many GPU nodes",
                         lambda p: [NodeSpec(name, name, {}) for name, _, _ in GKE_NODES],
                         lambda c, s, p: all_gpus(c, s)),
    "aligned-nic": Scenario("A big GPU with an aligned NIC", _main,
                            lambda c, s, p: aligned_nic(c, s, p.main_node.name)),
    "mig": Scenario("MIG devices made to order", lambda p: [NodeSpec(MIG_NODE, dgx_h100_in_mig_mode, MIG_CONFIG)],
                    lambda c, s, p: dynamic_mig(c, s, MIG_NODE)),
    "vfio": Scenario("A GPU and a VF handed to a VM and returned", _main,
                     lambda c, s, p: vfio(c, s, p.main_node.name)),
    "health": Scenario("A GPU fails during a running claim", _main,
                       lambda c, s, p: gpu_failure(c, s, p.main_node.name)),
    "tour": Scenario("One device of every driver", _main, lambda c, s, p: tour(c, s, p.main_node.name)),
    "extended-gpu": Scenario("A pod that asks nvidia.com/gpu: 1", _main,
                             lambda c, s, p: extended_gpu(c, s, p.main_node.name)),
    "claim-status": Scenario("What a claim's status says after prepare", _main,
                             lambda c, s, p: claim_status(c, s, p.main_node.name)),
    "vm-metadata": Scenario("A VM learns the PCI address of its GPU",
                            lambda p: [NodeSpec(VM_NODE, "dgx-h100", {}, {"DRA_AGENT_DEVICE_METADATA": "true"})],
                            lambda c, s, p: vm_metadata(c, s, VM_NODE)),
    "gpu-shares": Scenario("Two pods share one GPU by memory",
                           lambda p: [NodeSpec(SHARED_NODE, "dgx-h100", SHARED_CONFIG)],
                           lambda c, s, p: gpu_shares(c, s, SHARED_NODE)),
    "vf-interface": Scenario("A VF's interface named net1 in the pod", _main,
                             lambda c, s, p: vf_interface(c, s, p.main_node.name)),
    "mps": Scenario("The pods of a claim share its GPU through CUDA MPS", _main,
                    lambda c, s, p: mps(c, s, p.main_node.name)),
}
SEEDS = ("readiness", "all-gpus", "aligned-nic", "mig", "vfio", "health", "extended-gpu", "claim-status",
         "vm-metadata", "gpu-shares", "vf-interface", "mps")

INTRO = ("Kubernetes Dynamic Resource Allocation in a few words: a node agent publishes its devices as "
         "ResourceSlices; a DeviceClass names a kind of device; a pod's ResourceClaim asks for devices of "
         "classes, with CEL selectors and constraints; the scheduler allocates devices to the claim; then the "
         "kubelet asks the node agent to prepare them, and the agent answers with CDI device IDs that tell the "
         "container runtime what to give the container. Here everything runs for real on simulated nodes: "
         "dra-agent processes, a test API server, a kubelet simulator (gRPC over unix sockets) and a small "
         "allocator in place of the scheduler.")


def plan_for(profile: str | None, scenarios: Sequence[str]) -> Plan:
    """Seed scenarios by default; with only a profile, its readiness and a tour of its devices."""
    chosen = tuple(scenarios) or (("readiness", "tour") if profile else SEEDS)
    unknown = [s for s in chosen if s not in SCENARIOS]
    if unknown:
        raise DemoError(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    if profile is not None:
        try:  # before anything starts: an agent on an unknown profile would only fail later, less clearly
            load_profile(profile)
        except ProfileError as e:
            raise DemoError(str(e)) from None
    return Plan(tuple(dict.fromkeys(chosen)), profile or DEFAULT_PROFILE)


async def run_demo(plan: Plan, story: Story, *, workdir: Path | None = None) -> int:
    """Run the plan's scenarios, telling them to `story`; 0 when every checked step behaved."""
    began = time.monotonic()
    story.title("dra-agent demo: the path of a ResourceClaim, on simulated nodes")
    story.say(INTRO)
    specs: dict[str, NodeSpec] = {}
    for key in plan.scenarios:
        for spec in SCENARIOS[key].nodes(plan):
            specs.setdefault(spec.name, spec)
    async with DemoCluster.open(workdir) as cluster:
        cluster.apply_classes(device_classes())
        story.heading("Starting the nodes")
        story.say(f"dra-agent run on {len(specs)} simulated node(s): " + ", ".join(
            f"{s.name} ({s.profile if isinstance(s.profile, str) else 'derived profile'})" for s in specs.values())
            + f". Their files (agent logs, CDI specs) are in {cluster.workdir}"
            + (" until the demo ends (--keep DIR keeps them)." if workdir is None else "."))
        try:
            nodes = await cluster.add_nodes([(s.name, s.profile(cluster.workdir) if callable(s.profile)
                                              else s.profile, s.config) for s in specs.values()],
                                            {s.name: s.settings for s in specs.values()})
        except DemoError as e:
            story.fail(str(e))
            return _summary(story, began)
        story.heading(f"1. {SCENARIOS['readiness'].title}")
        await readiness(cluster, story, nodes)
        for number, key in enumerate((k for k in plan.scenarios if k != "readiness"), start=2):
            scenario = SCENARIOS[key]
            story.heading(f"{number}. {scenario.title}")
            try:
                await scenario.run(cluster, story, plan)
            except (DemoError, KubeletError, Unallocatable, TimeoutError) as e:
                reason = "; ".join(e.reasons) if isinstance(e, Unallocatable) else str(e) or type(e).__name__
                story.fail(f"scenario {key} stopped: {reason}")
    return _summary(story, began)


def _summary(story: Story, began: float) -> int:
    story.heading("Summary")
    seconds = time.monotonic() - began
    if story.failures:
        story.check(False, f"{len(story.failures)} step(s) did not behave, in {seconds:.1f} s:")
        for failure in story.failures[:-1]:
            story.detail(failure)
        return 1
    story.check(True, f"every step behaved, in {seconds:.1f} s")
    return 0


def main(profile: str | None, scenarios: Sequence[str], *, color: bool | None, keep: Path | None) -> int:
    try:
        plan = plan_for(profile, scenarios)
    except DemoError as e:
        print(f"dra-agent demo: {e}", file=sys.stderr)
        return 2
    return asyncio.run(run_demo(plan, Story(sys.stdout, color=color), workdir=keep))
