"""The demo's MPS scenario: the pods of one claim share a GPU through CUDA MPS, with an MPS control daemon the agent
runs for the claim, the limits it was given, and what the containers get to reach it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from simulator.demo.claims import claim_spec, opaque, request, show_allocation, show_claim
from simulator.demo.cluster import DemoCluster
from simulator.demo.scenarios import GPU, show_prepared, unprepare_and_release
from simulator.demo.story import Story
from simulator.demo.workload import spec_env
from simulator.node.driver_install import MPS_CONTROL
from simulator.timing import scaled

MPS = {"apiVersion": "dra-agent.io/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "MPS", "mpsConfig": {
    "defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "16Gi"}}}
EXCLUSIVE_PROCESS = 3


def ask(program: Path, pipe: Path, *commands: str) -> list[str]:
    """What the claim's daemon answers on its pipe, as `echo <command> | nvidia-cuda-mps-control` shows it."""
    done = subprocess.run([str(program)], input="".join(f"{c}\n" for c in commands), capture_output=True, text=True,
                          env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)}, timeout=scaled(10),
                          check=False)
    return done.stdout.splitlines() if done.returncode == 0 else [done.stderr.strip()]


def compute_mode(sim_root: Path, bus_id: str) -> int | None:
    saved = sim_root / ".sim/nvml-mig.json"
    gpus = json.loads(saved.read_text()) if saved.exists() else []
    return next((g["compute_mode"] for g in gpus if g["bus_id"] == bus_id), None)


async def mps(cluster: DemoCluster, story: Story, node: str) -> None:
    story.say("CUDA MPS lets the processes of many containers run on one GPU at once, each bounded in compute (a "
              "percentage of the GPU's streaming multiprocessors) and in pinned device memory. With GpuConfig "
              "`sharing: {strategy: MPS, mpsConfig: ...}` (NVIDIA's own names) the agent sets the claim's GPU to "
              "compute mode EXCLUSIVE_PROCESS, starts one MPS control daemon for the claim from the driver's "
              "nvidia-cuda-mps-control, waits until its pipe answers, gives it the limits through the pipe, and "
              "mounts its pipe directory, log directory and shared memory into every container of the claim.")
    spec = claim_spec(request("gpu", "gpu.nvidia.com"), config=[opaque(GPU, ["gpu"], MPS)])
    show_claim(story, "inference", spec)
    cluster.create_claim("inference", spec)
    allocation = await cluster.allocate("inference", node)
    (picked,) = show_allocation(story, cluster, node, allocation, ("uuid", "resource.kubernetes.io/pciBusID"))
    answers = await cluster.prepare("inference", node)
    await show_prepared(cluster, story, node, "inference", answers)
    if answers[GPU].error:
        return
    here = cluster.nodes[node]
    uid = cluster.claim("inference")["metadata"]["uid"]
    attributes = picked.get("attributes") or {}
    uuid = str((attributes.get("uuid") or {}).get("string", ""))
    bus_id = str((attributes.get("resource.kubernetes.io/pciBusID") or {}).get("string", ""))
    env = {k: v for path in here.cdi_files(uid) for k, v in spec_env(here.read_cdi(path)).items()}
    story.check(env.get("CUDA_MPS_PIPE_DIRECTORY") == "/tmp/nvidia-mps"
                and env.get("CUDA_MPS_LOG_DIRECTORY") == "/var/log/nvidia-mps",
                "every container is pointed at the claim's daemon: CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps, "
                "CUDA_MPS_LOG_DIRECTORY=/var/log/nvidia-mps", otherwise=str(env))
    daemon = here.root / "state/backends/nvidia-gpu/mps" / uid
    program = here.sim_root / "usr/bin" / MPS_CONTROL
    story.step("Asking the claim's daemon through its pipe (<state>/backends/nvidia-gpu/mps/<claim UID>/pipe):")
    answers_now = ask(program, daemon / "pipe", "get_default_active_thread_percentage",
                      f"get_default_device_pinned_mem_limit {uuid}")
    story.detail(f"  get_default_active_thread_percentage → {answers_now[0] if answers_now else '-'}")
    story.detail(f"  get_default_device_pinned_mem_limit {uuid} → {answers_now[1] if len(answers_now) > 1 else '-'}")
    story.check(answers_now == ["50.0", "16384M"], "the daemon serves the claim's limits: 50% of the SMs, 16384M "
                "of pinned memory per client", otherwise=str(answers_now))
    story.check(compute_mode(here.sim_root, bus_id) == EXCLUSIVE_PROCESS,
                f"GPU {bus_id} is in compute mode EXCLUSIVE_PROCESS: only the daemon's MPS server opens it",
                otherwise=f"compute mode {compute_mode(here.sim_root, bus_id)}")
    await unprepare_and_release(cluster, story, "inference", node)
    gone = ask(program, daemon / "pipe", "get_default_active_thread_percentage")
    story.check(not daemon.exists() and gone == ["Cannot find MPS control daemon process"]
                and compute_mode(here.sim_root, bus_id) != EXCLUSIVE_PROCESS,
                "the daemon quit through its pipe, its folder is gone and the GPU has its compute mode back",
                otherwise=f"{gone} {daemon.exists()}")
