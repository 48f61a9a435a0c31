"""The real API server's rules for a ResourceClaim's `status.devices` against the project's copy
(agent/claims/status_rules.py, served by the test API server): on a claim allocated devices of a made-up driver
on the node, every chosen set of entries, applied server-side on `/status` by the driver (and a few by merge
patch), gets the same verdict from both, refused with the same field paths and kinds of error, and the verdict of
the shared table (tests/claim_status_cases.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import pytest

from cluster.kubectl import KubectlError
from simulator.apiserver.resources import RESOURCE_CLAIMS
from simulator.apiserver.store import Store
from tests.claim_status_cases import ALLOCATION, APPLY_CASES, DRIVER, MERGE_CASES, POOL, StatusCase
from tests.real_cluster.cluster_env import NODE, RealCluster
from tests.verdicts import ACCEPTED, Verdict, from_kubectl, of_store

pytestmark = pytest.mark.xdist_group("real-cluster")

CLAIM = "c"


@asynccontextmanager
async def allocated_claim(cluster: RealCluster, prefix: str) -> AsyncIterator[str]:
    """A claim allocated the devices of the shared table, in a new namespace (its name yielded): a slice of the
    made-up driver on the node, the claim, and its allocation written on `/status` as the scheduler writes it."""
    ns = await cluster.namespace(prefix)
    slice_name = f"{ns}-{DRIVER}"
    await cluster.create({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": slice_name},
        "spec": {"driver": DRIVER, "nodeName": NODE, "pool": {"name": POOL, "generation": 1, "resourceSliceCount": 1},
                 "devices": [{"name": "dev-0"}, {"name": "dev-1"},
                             {"name": "dev-2", "allowMultipleAllocations": True}]},
    })  # fmt: skip
    try:
        await cluster.create({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": CLAIM, "namespace": ns},
            "spec": {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
        })  # fmt: skip
        await cluster.run("patch", "resourceclaim", CLAIM, "-n", ns, "--subresource=status", "--type=merge",
                          "-p", json.dumps({"status": {"allocation": ALLOCATION}}))
        yield ns
    finally:
        await cluster.run("delete", "resourceslice", slice_name, "--ignore-not-found")


async def verdict(cluster: RealCluster, *argv: str, body: Any = None) -> Verdict:
    try:
        await cluster.run(*argv, input=None if body is None else json.dumps(body))
    except KubectlError as error:
        return from_kubectl(error.stderr)
    return ACCEPTED


def apply_body(ns: str, devices: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": CLAIM, "namespace": ns},
            "status": {"devices": list(devices)}}


def disagreement(kind: str, case: StatusCase, server: Verdict, ours: Verdict) -> list[str]:
    if server == ours == case.verdict:
        return []
    return [f"{kind} {case.id}: real server {server}; test API server {ours}; table {case.verdict}"]


async def test_each_status_write_gets_the_verdict_of_the_project(real_cluster: RealCluster) -> None:
    async with allocated_claim(real_cluster, "claim-status") as ns:
        store = Store()
        store.put(RESOURCE_CLAIMS, await real_cluster.get("resourceclaim", CLAIM, "-n", ns))
        found: list[str] = []
        for case in APPLY_CASES:
            body = apply_body(ns, case.devices)
            server = await verdict(real_cluster, "apply", "--server-side", "--subresource=status",
                                   f"--field-manager={DRIVER}", "--dry-run=server", "-f", "-", body=body)
            ours = of_store(partial(store.apply_status, RESOURCE_CLAIMS, ns, CLAIM, body, DRIVER, dry_run=True))
            found += disagreement("apply", case, server, ours)
        for case in MERGE_CASES:
            patch = {"status": {"devices": list(case.devices)}}
            server = await verdict(real_cluster, "patch", "resourceclaim", CLAIM, "-n", ns, "--subresource=status",
                                   "--type=merge", "--dry-run=server", "-p", json.dumps(patch))
            ours = of_store(partial(store.patch, RESOURCE_CLAIMS, ns, CLAIM, patch, status=True, dry_run=True))
            found += disagreement("merge patch", case, server, ours)
    total = len(APPLY_CASES) + len(MERGE_CASES)
    assert not found, f"{len(found)} of {total} status writes disagree:\n" + "\n".join(found)

