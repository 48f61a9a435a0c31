"""Broken and hostile claims through `dra-agent run`, as a buggy scheduler or a user with claim-writing rights could
leave them: malformed claims, unknown UIDs, invalid opaque configuration, bad capacity amounts, hostile
identities, an API server that fails, plus a few hundred generated claims. Every text a user meets — the kubelet's
per-claim errors, the claims' status entries, the Events — says what is wrong in the domain's words: none names a
Python exception class, shows a traceback or an errno, or passes on the interpreter's advice."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import uuid
from collections.abc import Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from backends.contract import ClaimRef
from simulator.apiserver.server import TestApiServer
from simulator.kubelet import KubeletSimulator
from simulator.kubelet_connection import Plugin
from tests.support.agent_env import NODE, AgentProcess, settings_for, wait_until
from tests.support.claim_strategies import requests
from tests.support.timing import scaled

GPU = "gpu.nvidia.com"
GPU_0 = "gpu-0000-18-00-0"
SHARING = {"nvidia-gpu": {"sharing": {"byMemory": True}}}
PYTHON_INTERNALS = re.compile(r"\b\w*(?:Error|Exception)\b|Traceback|Errno|set_int_max_str_digits|\bNone\b")
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"


def gpu_config(parameters: Any) -> list[dict[str, Any]]:
    return [{"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": GPU, "parameters": parameters}}]


def result(device: str = GPU_0, **extra: Any) -> dict[str, Any]:
    return {"request": "gpu", "driver": GPU, "pool": NODE, "device": device, **extra}


def share(memory: Any) -> dict[str, Any]:
    return result(shareID=str(uuid.uuid4()), consumedCapacity={"memory": memory})


def allocated(results: Any = None, config: Any = None, **status: Any) -> dict[str, Any]:
    """A claim's status with an allocation of `results` (one whole GPU unless given) and `config`."""
    devices = {"results": [result()] if results is None else results, "config": config or []}
    return {"allocation": {"devices": devices}, **status}


# Claim status bodies a scheduler, a webhook or a user could have left: name → status.
MALFORMED: dict[str, Any] = {
    "no-status": None,
    "status-a-list": [],
    "allocation-a-string": {"allocation": "yes"},
    "devices-null": {"allocation": {"devices": None}},
    "results-a-map": allocated(results={"0": result()}),
    "result-a-number": allocated(results=[7]),
    "result-without-device": allocated(results=[{"request": "gpu", "driver": GPU, "pool": NODE}]),
    "device-a-number": allocated(results=[result(device=12)]),  # type: ignore[arg-type]
    "device-a-list": allocated(results=[result(device=["a"])]),  # type: ignore[arg-type]
    "device-of-300-chars": allocated(results=[result(device="g" * 300)]),
    "device-with-nul": allocated(results=[result(device="gpu\x00-0")]),
    "unknown-device": allocated(results=[result(device="gpu-0000-ff-00-0")]),
    "other-pool": allocated(results=[{**result(), "pool": "node-b"}]),
    "request-a-map": allocated(results=[{**result(), "request": {"a": 1}}]),
    "config-a-string": allocated(config="all"),
    "parameters-a-list": allocated(config=gpu_config([1, 2])),
    "parameters-unknown-kind": allocated(config=gpu_config({"apiVersion": "dra-agent.io/v1alpha1", "kind": "Nope"})),
    "parameters-unknown-version": allocated(config=gpu_config({"apiVersion": "dra-agent.io/v9", "kind": "GpuConfig"})),
    "parameters-unknown-field": allocated(config=gpu_config(
        {"apiVersion": "dra-agent.io/v1alpha1", "kind": "GpuConfig", "bogus": 1})),
    "capabilities-a-string": allocated(config=gpu_config(
        {"apiVersion": "dra-agent.io/v1alpha1", "kind": "GpuConfig", "driverCapabilities": "compute"})),
    "capabilities-unknown": allocated(config=gpu_config(
        {"apiVersion": "dra-agent.io/v1alpha1", "kind": "GpuConfig", "driverCapabilities": ["x" * 5000]})),
    "sharing-a-number": allocated(config=gpu_config(
        {"apiVersion": "dra-agent.io/v1alpha1", "kind": "GpuConfig", "sharing": 3})),
    "sharing-bad-strategy": allocated(config=gpu_config(
        {"apiVersion": "dra-agent.io/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "Everything"}})),
    "vfio-config-on-a-gpu": allocated(config=gpu_config({"apiVersion": "dra-agent.io/v1alpha1", "kind": "VfioConfig",
                                                         "iommuFd": "maybe"})),
    "nested-too-deep": allocated(config=gpu_config(json.loads("[" * 500 + "]" * 500))),
    "huge-integer": allocated(config=gpu_config(
        {"apiVersion": "dra-agent.io/v1alpha1", "kind": "GpuConfig", "driverCapabilities": [10**4000]})),
}
# Capacity amounts of shares: refused or not as the sharing policy says (what is refused must be worded well).
AMOUNTS: dict[str, Any] = {
    "memory-1e1000": allocated(results=[share("1e1000")]),
    "memory-5000-digit-exponent": allocated(results=[share("1e" + "9" * 5000)]),
    "memory-5000-digits": allocated(results=[share("9" * 5000)]),
    "memory-negative": allocated(results=[share("-40Gi")]),
    "memory-words": allocated(results=[share("forty gigabytes")]),
    "memory-empty": allocated(results=[share("")]),
    "memory-a-float": allocated(results=[share(1.5)]),
    "memory-null": allocated(results=[share(None)]),
    "memory-a-map": allocated(results=[share({"Gi": 40})]),
    "capacity-a-list": allocated(results=[result(shareID=str(uuid.uuid4()), consumedCapacity=["memory"])]),
    "share-id-not-a-uuid": allocated(results=[result(shareID="../../etc", consumedCapacity={"memory": "1Gi"})]),
    "share-id-a-number": allocated(results=[result(shareID=5, consumedCapacity={"memory": "1Gi"})]),
}

# References the kubelet could send: (uid, namespace, name), for claims that are stored under another UID or not
# at all, and identities no API object can have.
HOSTILE_REFS = [
    ("not-a-uid", "default", "fine"),
    ("", "default", "fine"),
    ("../../x", "default", "fine"),
    (str(uuid.uuid4()), "default", "never-stored"),
    (str(uuid.uuid4()), "../../../../tmp/x-ns", "fine"),
    (str(uuid.uuid4()), "default/resourceclaims/x/../../../../../api/v1/nodes/x-node#", "fine"),
    (str(uuid.uuid4()), "/etc/x", "fine"),
    (str(uuid.uuid4()), "../../x", "fine"),
    (str(uuid.uuid4()), "%2F", "fine"),
    (str(uuid.uuid4()), "default", "a\x00b"),
    (str(uuid.uuid4()), "default", "x" * 300),
    (str(uuid.uuid4()), "défault", "fine"),
    (str(uuid.uuid4()), "default", "fine/../../x"),
]

# How the API server fails a claim's GET: name → (status, message).
API_FAILURES = {
    "api-500": (500, "etcdserver: request timed out"),
    "api-503": (503, None),
    "api-403": (403, 'resourceclaims.resource.k8s.io "api-403" is forbidden: User "system:node:x" cannot get it'),
    "api-429": (429, None),
    "api-404": (404, None),
    "api-410": (410, None),
}


@dataclass
class Texts:
    """Every text the run gave a user, by where it was seen."""

    kubelet: list[tuple[str, str]] = field(default_factory=list)  # (what was asked, the error)

    def note(self, what: str, errors: dict[str, str]) -> None:
        self.kubelet += [(what, error) for error in errors.values() if error]


@dataclass
class Run:
    server: TestApiServer
    agent: AgentProcess
    plugin: Plugin
    stack: AsyncExitStack


async def start(scratch: Path) -> Run:
    stack = AsyncExitStack()
    server = await stack.enter_async_context(TestApiServer())
    server.add_node(NODE)
    settings = settings_for(scratch, server.write_kubeconfig(scratch / "kubeconfig"), "dgx-h100",
                            backends=("nvidia-gpu",), device_metadata=True)
    agent = AgentProcess(settings, {"DRA_AGENT_BACKEND_CONFIG": json.dumps(SHARING)})
    await agent.start()
    stack.push_async_callback(agent.stop)
    kubelet = await stack.enter_async_context(KubeletSimulator(settings.registry_dir))
    try:
        plugin = await kubelet.wait_for_plugin(GPU, timeout=scaled(30))
        await wait_until(lambda: server.objects("resourceslices"), timeout=scaled(30))
    except BaseException:
        print(agent.output())
        await stack.aclose()
        raise
    return Run(server, agent, plugin, stack)


def store(server: TestApiServer, name: str, status: Any, uid: str | None = None) -> ClaimRef:
    uid = uid or str(uuid.uuid4())
    body: dict[str, Any] = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                            "metadata": {"name": name, "namespace": "default", "uid": uid}}
    if status is not None:
        body["status"] = status
    server.put_claim(body)
    return ClaimRef(uid, "default", name)


async def both_ways(plugin: Plugin, texts: Texts, what: str, refs: list[ClaimRef]) -> dict[str, str]:
    """Prepare the claims, then unprepare them; the prepare errors."""
    prepared = {uid: r.error for uid, r in (await plugin.prepare(refs)).items()}
    texts.note(f"prepare {what}", prepared)
    texts.note(f"unprepare {what}", await plugin.unprepare(refs))
    return prepared


async def handpicked(run: Run, texts: Texts) -> None:
    server, plugin = run.server, run.plugin
    refs = [store(server, name, status) for name, status in MALFORMED.items()]
    errors = await both_ways(plugin, texts, "malformed claims", refs)
    refused = {ref.name for ref in refs if errors[ref.uid]}
    assert refused == set(MALFORMED), f"prepared: {set(MALFORMED) - refused}"
    for name, status in AMOUNTS.items():  # one by one: a share prepared must not block the next
        await both_ways(plugin, texts, "capacity amounts", [store(server, name, status)])

    fine = store(server, "fine", allocated())
    await both_ways(plugin, texts, "a claim asked for under another UID",
                    [ClaimRef(str(uuid.uuid4()), "default", "fine")])
    hostile = [ClaimRef(*ref) for ref in HOSTILE_REFS]
    errors = await both_ways(plugin, texts, "hostile references", hostile)
    assert all(errors.values()), errors
    # A sound claim beside them prepares, and stays prepared: its status entry is read at the end.
    assert (await plugin.prepare([fine]))[fine.uid].error == ""

    for name, (status, message) in API_FAILURES.items():
        ref = store(server, name, allocated())
        server.fail("GET", f"{CLAIMS}/{name}", status, times=None, message=message)
        errors = await both_ways(plugin, texts, f"a claim the API server answers {status} for", [ref])
        assert errors[ref.uid], name
    unreachable = store(server, "unreachable", allocated())
    await server.refuse_connections()
    try:
        await both_ways(plugin, texts, "a claim while the API server is unreachable", [unreachable])
    finally:
        await server.accept_connections()
    slow = store(server, "slow", allocated())
    server.delay("GET", f"{CLAIMS}/slow", scaled(60), times=None)
    await both_ways(plugin, texts, "a claim the API server does not answer for", [slow])
    server.clear_faults()


def generated(run: Run, runner: asyncio.Runner, texts: Texts) -> None:
    """Claims from the preparer's own fuzz strategies, through the agent's sockets."""
    gpus = [d["name"] for s in run.server.objects("resourceslices") for d in s["spec"].get("devices") or ()]

    @settings(max_examples=150, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.lists(requests(gpus), max_size=4, unique_by=lambda r: r[0].uid))
    def check(batch: list[tuple[ClaimRef, dict[str, Any] | None]]) -> None:
        # A claim that itself holds such a word (Hypothesis also draws strings from the constants of loaded code,
        # "NvmlError" among them) is quoted back in its refusal, rightly: the grep could not tell it from a leak.
        supplied = [(ref.uid, ref.namespace, ref.name, body) for ref, body in batch]
        assume(not PYTHON_INTERNALS.search(json.dumps(supplied, default=str)))
        for ref, body in batch:
            storable = body is not None and isinstance(body.get("status", {}), dict)
            if storable and re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", ref.name) and len(ref.name) <= 253:
                assert body is not None
                body = {**body, "metadata": {**(body.get("metadata") or {}), "name": ref.name,
                                             "namespace": "default"}}
                run.server.put_claim(body)
        runner.run(both_ways(run.plugin, texts, "generated claims", [ref for ref, _ in batch]))

    check()


def seen(run: Run, texts: Texts) -> Iterator[tuple[str, str]]:
    """(where, text) of every text the run gave a user."""
    yield from ((f"kubelet: {what}", error) for what, error in texts.kubelet)
    for claim in run.server.objects("resourceclaims"):
        for entry in (claim.get("status") or {}).get("devices") or ():
            for condition in entry.get("conditions") or ():
                yield f"status of claim {claim['metadata']['name']}", json.dumps(condition)
    for event in run.server.events():
        yield f"event {event.get('reason')}", event.get("note") or ""


def test_every_refusal_through_dra_agent_run_speaks_the_domains_words(scratch: Path) -> None:
    texts = Texts()
    with asyncio.Runner() as runner:
        run = runner.run(start(scratch))
        try:
            runner.run(handpicked(run, texts))
            generated(run, runner, texts)
            runner.run(run.agent.signal(signal.SIGTERM))  # the queued Events are written before it exits
            assert runner.run(run.agent.wait(timeout=scaled(30))) == 0, run.agent.output()[-3000:]
        finally:
            runner.run(run.stack.aclose())
    everything = list(seen(run, texts))
    assert len(texts.kubelet) > 200, "the run met enough refusals for the grep to bite"
    assert {where.split()[0] for where, _ in everything} == {"kubelet:", "status", "event"}
    leaks = sorted({f"{where}: {text}" for where, text in everything if PYTHON_INTERNALS.search(text)})
    assert leaks == [], "\n".join(leaks)
