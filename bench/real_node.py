"""Benchmark: the agent's share of pod start as the real kubelet (v1.37.2) and containerd see it.

Starts the real-cluster tier's node (control plane, containerd, the kubelet; `cluster/build.sh` must have built
them) and the agent on a simulated dgx-h100 whose GPUs are shared by memory, then:

1. pod start with and without a claim, pods started one at a time, alternating (a pod with a 10Gi share of a GPU
   from a ResourceClaimTemplate, then one without any claim), `--pairs` of each. A pod's start is what the kubelet
   spends on it: from its log line "SyncLoop ADD" for the pod to "Observed pod startup duration" (the pod seen
   running), both stamped by the kubelet to the microsecond; the API's own timestamps have whole seconds only;
2. a burst of `--burst` pods with a claim each, created at once: the kubelet's own DRA histograms
   (`dra_operations_duration_seconds`, all of a pod's claims; `dra_grpc_operations_duration_seconds`, the gRPC
   call to the agent) for PrepareResources while they start and UnprepareResources once they are deleted, read
   from the kubelet's /metrics before and after; and the time from creating the pods to the last one running.

Both parts also print the kubelet's DRA histograms over their pods and the agent's own time per claim
(`dra_agent_node_request_seconds`, from its /metrics). The kubelet's DRA buckets start at 0.1 s, so the means
(sum / count) are the figures; the buckets only say every call took less than the first bound.

    python bench/real_node.py [--pairs 10] [--burst 50]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client.parser import text_string_to_metric_families

import cluster
from bench.machine import conditions
from cluster.controlplane import ControlPlane
from cluster.incluster import apply_deploy
from cluster.kubectl import Kubectl
from cluster.processes import get
from cluster.worker import WorkerNode
from tests.real_cluster.cluster_env import GPU, NODE, RealCluster, poll
from tests.real_cluster.node_env import AgentOnRealNode, agent_on_real_node, running_pod, sleeper, start_agent_stand_in
from tests.real_cluster.objects import exactly, template
from tests.support.agent_env import memory_dir

ROOT = Path(__file__).resolve().parent.parent
SHARING = {"nvidia-gpu": {"sharing": {"byMemory": True}}}
SHARE = {"memory": "10Gi"}  # 8 per 80 GB GPU: 64 on the node
KUBELET_HISTOGRAMS = ("dra_operations_duration_seconds", "dra_grpc_operations_duration_seconds")
_STAMP = re.compile(r"^[IWE]\d{4} (\d\d:\d\d:\d\d\.\d{6})")


def kubelet_stamps(log: Path, marker: str) -> dict[str, float]:
    """Seconds of the day at which the kubelet logged `marker` for each pod (its first such line), by pod."""
    found: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        if marker not in line:
            continue
        stamp = _STAMP.match(line)
        pod = re.search(r'pods?=\[?"([^"]+)"', line)
        if stamp and pod and pod.group(1) not in found:
            when = datetime.strptime(stamp.group(1), "%H:%M:%S.%f")
            found[pod.group(1)] = when.hour * 3600 + when.minute * 60 + when.second + when.microsecond / 1e6
    return found


def start_times(log: Path, pods: list[str]) -> list[float]:
    """What the kubelet spent starting each pod (`ns/name`), in ms: its ADD to its pod seen running."""
    added = kubelet_stamps(log, '"SyncLoop ADD" source="api"')
    running = kubelet_stamps(log, '"Observed pod startup duration"')
    return [(running[p] - added[p]) * 1000 for p in pods]


def histograms(text: str, names: tuple[str, ...]) -> dict[tuple[str, ...], tuple[float, float]]:
    """(sum, count) of the named histograms in a /metrics page, by (name, operation or method, outcome)."""
    found: dict[tuple[str, ...], tuple[float, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in names:
            continue
        for sample in family.samples:
            labels = sample.labels
            key = (family.name, labels.get("operation_name") or labels.get("method_name", "").rpartition("/")[2]
                   or labels.get("operation", ""), labels.get("is_error") or labels.get("grpc_status_code", ""))
            total, count = found.get(key, (0.0, 0.0))
            if sample.name.endswith("_sum"):
                found[key] = (total + sample.value, count)
            elif sample.name.endswith("_count"):
                found[key] = (total, count + sample.value)
    return found


def dra_histograms(real: RealCluster, agent: AgentOnRealNode) -> dict[tuple[str, ...], tuple[float, float]]:
    """The kubelet's DRA histograms and the agent's own time per claim. The kubelet's are read from the kubelet
    itself with the cluster admin's certificate: the API server does not proxy to a node at a loopback address."""
    pki, worker = real.plane.pki, real.worker
    assert pki is not None and worker is not None and worker.kubelet is not None
    admin = pki.clients["admin"]
    status, body = get(f"https://127.0.0.1:{worker.kubelet.port}/metrics", ca=pki.server_ca.cert,
                       cert=(admin.cert, admin.key))
    if status != 200:
        raise RuntimeError(f"the kubelet's /metrics answered {status}: {body[:200]!r}")
    return {**histograms(body.decode(), KUBELET_HISTOGRAMS),
            **histograms(agent.scrape(), ("dra_agent_node_request_seconds",))}


def difference(after: Mapping[tuple[str, ...], tuple[float, float]],
               before: Mapping[tuple[str, ...], tuple[float, float]]) -> dict[tuple[str, ...], tuple[float, float]]:
    return {k: (s - before.get(k, (0.0, 0.0))[0], c - before.get(k, (0.0, 0.0))[1]) for k, (s, c) in after.items()
            if c - before.get(k, (0.0, 0.0))[1] > 0}


def gpu_pod(cluster_: RealCluster, ns: str, name: str) -> list[dict[str, Any]]:
    made = sleeper(cluster_, ns, name, {})
    made["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "share"}]
    made["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    return [made]


def summary(values: list[float]) -> str:
    ordered = sorted(values)
    return (f"p50 {statistics.median(ordered):7.1f}  p90 {ordered[int(0.9 * (len(ordered) - 1))]:7.1f}  "
            f"mean {statistics.fmean(ordered):7.1f}  max {ordered[-1]:7.1f}  (n={len(ordered)})")


async def measure(real: RealCluster, root: Path, pairs: int, burst: int) -> None:
    worker = real.worker
    assert worker is not None and worker.kubelet is not None
    log = worker.kubelet.log
    async with agent_on_real_node(real, root, backend_config=SHARING) as agent:
        ns = await real.namespace("bench")
        await real.apply(template(ns, "share", [exactly("gpu", GPU, capacity=SHARE)]))
        with_claim: list[str] = []
        without: list[str] = []
        before = dra_histograms(real, agent)
        for i in range(pairs):
            for name, objects in ((f"claim-{i}", gpu_pod(real, ns, f"claim-{i}")),
                                  (f"plain-{i}", [sleeper(real, ns, f"plain-{i}", {})])):
                await real.apply(objects)
                await running_pod(real, ns, name)
                (with_claim if name.startswith("claim") else without).append(f"{ns}/{name}")
                await real.run("delete", "pod", name, "-n", ns, "--wait=true")
        one_at_a_time = difference(dra_histograms(real, agent), before)
        claim_ms, plain_ms = start_times(log, with_claim), start_times(log, without)
        print(f"pod start, one at a time (kubelet ADD -> running), ms, {pairs} each, alternating:")
        print(f"  with a claim     {summary(claim_ms)}")
        print(f"  without a claim  {summary(plain_ms)}")
        print(f"  difference of the medians: {statistics.median(claim_ms) - statistics.median(plain_ms):.1f} ms")
        show(one_at_a_time)

        before = dra_histograms(real, agent)
        burst_ns = await real.namespace("burst")
        await real.apply(template(burst_ns, "share", [exactly("gpu", GPU, capacity=SHARE)]))
        names = [f"pod-{i}" for i in range(burst)]
        started = time.perf_counter()
        await real.apply([o for name in names for o in gpu_pod(real, burst_ns, name)])
        for name in names:
            await running_pod(real, burst_ns, name, timeout=600)
        wall = time.perf_counter() - started
        prepared = dra_histograms(real, agent)
        await real.run("delete", "pods", "--all", "-n", burst_ns, "--wait=true", "--timeout=600s")
        unprepare = ("dra_operations_duration_seconds", "UnprepareResources", "false")
        await poll(lambda: difference(dra_histograms(real, agent), prepared).get(unprepare, (0, 0))[1] >= burst
                   or None, timeout=120, what="every claim of the burst unprepared")
        burst_ms = start_times(log, [f"{burst_ns}/{n}" for n in names])
        print(f"\nburst of {burst} pods with a claim each: all running {wall:.1f} s after they were created")
        print(f"  pod start (kubelet ADD -> running), ms: {summary(burst_ms)}")
        show({**difference(prepared, before), **difference(dra_histograms(real, agent), prepared)})


def show(found: Mapping[tuple[str, ...], tuple[float, float]]) -> None:
    print("  the kubelet's DRA histograms and the agent's time per claim (mean = sum / count):")
    for key, (total, count) in sorted(found.items()):
        print(f"    {key[0]:<38} {key[1]:<22} {key[2]:<6} count {count:4.0f}  mean {total / count * 1000:7.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--burst", type=int, default=50)
    args = parser.parse_args()
    binaries, node_binaries = cluster.binaries("kubernetes"), cluster.binaries("node")
    if binaries is None or node_binaries is None:
        sys.exit("the cluster's binaries are not built: run cluster/build.sh")
    print(conditions())
    folder = Path(tempfile.mkdtemp(prefix="dra-rn-"))  # short: the shims' socket paths are below it
    plane = ControlPlane(folder, binaries, with_kubelet=True, node_name=NODE)
    worker = WorkerNode(plane, node_binaries)
    try:
        plane.start(timeout=120)
        worker.start(timeout=120)
        kubectl = Kubectl(binaries / "kubectl", plane.admin_kubeconfig)
        apply_deploy(kubectl, ROOT / "deploy")
        start_agent_stand_in(kubectl, worker)
        real = RealCluster(plane, kubectl, kubectl.get("node", NODE)["metadata"]["uid"], worker=worker)
        with memory_dir("dra-rn-") as root:
            asyncio.run(measure(real, root, args.pairs, args.burst))
    finally:
        worker.stop()
        plane.stop()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
