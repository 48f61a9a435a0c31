"""The real API server's rules for a ResourceClaim's `status.devices` against the project's copy
(agent/claims/status_rules.py, served by the test API server): on a claim allocated devices of a made-up driver
on the node, every chosen set of entries, applied server-side on `/status` by the driver (and a few by merge
patch), gets the same verdict from both, refused with the same field paths and kinds of error, and the verdict of
the shared table (tests/support/claim_status_cases.py); and a writer without the driver's per-node permission is refused
by both in the same words (simulator/apiserver/authorization.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from cluster.kubectl import Kubectl, KubectlError
from cluster.pki import write_kubeconfig
from simulator.apiserver.authorization import Caller
from simulator.apiserver.resources import RESOURCE_CLAIMS, ApiError
from simulator.apiserver.store import Store
from tests.real_cluster.cluster_env import NODE, RealCluster, poll
from tests.real_cluster.objects import pod
from tests.support.claim_status_cases import ALLOCATION, APPLY_CASES, DRIVER, MERGE_CASES, POOL, StatusCase, entry
from tests.support.timing import scaled
from tests.support.verdicts import ACCEPTED, Verdict, from_kubectl, of_store

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


async def test_a_write_without_the_drivers_permission_is_refused_in_the_test_api_servers_words(
        real_cluster: RealCluster, tmp_path: Path) -> None:
    """A service account allowed to write claim status but not for the driver is refused by both servers with the
    same words: with a token bound to a pod on the claim's node both per-node verbs are named, associated-node
    first; with a token of no node only arbitrary-node. Granted arbitrary-node for the driver, both accept."""
    async with allocated_claim(real_cluster, "status-authz") as ns:
        writer = f"system:serviceaccount:{ns}:writer"
        rules = [{"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims", "resourceclaims/status"],
                  "verbs": ["get", "patch", "update"]}]
        role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                "metadata": {"name": "writer", "namespace": ns}, "rules": rules}
        await real_cluster.apply([
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "writer", "namespace": ns}}, role,
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": "writer", "namespace": ns},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "writer"},
             "subjects": [{"kind": "ServiceAccount", "name": "writer", "namespace": ns}]},
        ])  # fmt: skip
        on_node = pod(ns, "on-node")
        on_node["spec"].update(nodeName=NODE, serviceAccountName="writer")
        created = await real_cluster.create(on_node)
        bound = await token(real_cluster, ns, tmp_path / "bound", "--bound-object-kind=Pod",
                            "--bound-object-name=on-node", f"--bound-object-uid={created['metadata']['uid']}")
        unbound = await token(real_cluster, ns, tmp_path / "unbound")
        store = Store()
        store.put(RESOURCE_CLAIMS, await real_cluster.get("resourceclaim", CLAIM, "-n", ns))
        body = apply_body(ns, [entry()])
        for kubectl, node in ((bound, NODE), (unbound, None)):
            store.caller = caller = Caller(writer, node, frozenset())
            server = await refusal(kubectl, body)
            with pytest.raises(ApiError) as ours:
                store.apply_status(RESOURCE_CLAIMS, ns, CLAIM, body, DRIVER, dry_run=True)
            assert ours.value.code == 422
            assert server == ours.value.message.split(" is invalid: ", 1)[1], caller

        driver_rule = {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/driver"],
                       "resourceNames": [DRIVER], "verbs": ["arbitrary-node:patch"]}
        await real_cluster.apply({**role, "rules": [*rules, driver_rule]})
        store.caller = Caller(writer, None, frozenset({DRIVER}))
        store.apply_status(RESOURCE_CLAIMS, ns, CLAIM, body, DRIVER, dry_run=True)
        await poll(lambda: _accepted(unbound, body), timeout=scaled(30), what="the write accepted once granted")


async def token(cluster: RealCluster, ns: str, path: Path, *argv: str) -> Kubectl:
    """kubectl with a token of the service account `writer` (made with `argv`) and nothing else."""
    issued = (await cluster.run("create", "token", "writer", "-n", ns, *argv)).strip()
    config = write_kubeconfig(path, cluster.plane.server, cluster.plane.ca, token=issued, user="writer")
    return Kubectl(cluster.kubectl.binary, config)


async def refusal(kubectl: Kubectl, body: dict[str, Any]) -> str:
    """What the real server says refusing a dry-run apply of `body` on `/status`, after "is invalid: "."""
    with pytest.raises(KubectlError) as refused:
        await asyncio.to_thread(kubectl.run, "apply", "--server-side", "--subresource=status",
                                f"--field-manager={DRIVER}", "--dry-run=server", "-f", "-", input=json.dumps(body))
    return refused.value.stderr.split(" is invalid: ", 1)[1].strip()


def _accepted(kubectl: Kubectl, body: dict[str, Any]) -> bool:
    try:
        kubectl.run("apply", "--server-side", "--subresource=status", f"--field-manager={DRIVER}",
                    "--dry-run=server", "-f", "-", input=json.dumps(body))
    except KubectlError:
        return False  # the role's new rule may not have reached the authorizer's cache yet
    return True
