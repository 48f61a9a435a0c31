"""The real API server's validation of events.k8s.io/v1 Events against the project's copy (agent/events/rules.py,
served by the test API server): every chosen create and update gets the same verdict from both, refused with the
same field paths and kinds of error, and the verdict of the shared table (tests/support/event_cases.py)."""

from __future__ import annotations

import copy
import json
from functools import partial
from typing import Any

import pytest

from cluster.kubectl import KubectlError
from simulator.apiserver.resources import EVENTS_V1
from simulator.apiserver.store import Store
from tests.real_cluster.cluster_env import RealCluster
from tests.support.event_cases import create_cases, update_cases
from tests.support.verdicts import ACCEPTED, Verdict, from_kubectl, of_store

pytestmark = pytest.mark.xdist_group("real-cluster")

EVENTS = "events.v1.events.k8s.io"


async def verdict(cluster: RealCluster, *argv: str, body: Any = None) -> Verdict:
    """The real server's verdict on one kubectl command (given `body` on its standard input)."""
    try:
        await cluster.run(*argv, input=None if body is None else json.dumps(body))
    except KubectlError as error:
        return from_kubectl(error.stderr)
    return ACCEPTED


def disagreement(case: str, server: Verdict, ours: Verdict, table: Verdict) -> list[str]:
    if server == ours == table:
        return []
    return [f"{case}: real server {server}; test API server {ours}; table {table}"]


async def test_each_create_gets_the_verdict_of_the_project(real_cluster: RealCluster) -> None:
    ns = await real_cluster.namespace("event-rules")
    store = Store()
    cases = create_cases(ns)
    found: list[str] = []
    for case in cases:
        server = await verdict(real_cluster, "create", "--dry-run=server", "-f", "-", body=case.event)
        ours = of_store(partial(store.create, EVENTS_V1, case.event["metadata"]["namespace"], copy.deepcopy(case.event),
                                dry_run=True))
        found += disagreement(case.id, server, ours, case.verdict)
    assert not found, f"{len(found)} of {len(cases)} creates disagree:\n" + "\n".join(found)


async def test_each_update_gets_the_verdict_of_the_project(real_cluster: RealCluster) -> None:
    ns = await real_cluster.namespace("event-updates")
    store = Store()
    cases = update_cases(ns)
    found: list[str] = []
    for case in cases:
        name = case.old["metadata"]["name"]
        await real_cluster.create(copy.deepcopy(dict(case.old)))
        store.create(EVENTS_V1, ns, copy.deepcopy(dict(case.old)))
        server = await verdict(real_cluster, "patch", EVENTS, name, "-n", ns, "--type=merge", "--dry-run=server",
                               "-p", json.dumps(case.patch))
        ours = of_store(partial(store.patch, EVENTS_V1, ns, name, copy.deepcopy(dict(case.patch)), dry_run=True))
        found += disagreement(case.id, server, ours, case.verdict)
    assert not found, f"{len(found)} of {len(cases)} updates disagree:\n" + "\n".join(found)

