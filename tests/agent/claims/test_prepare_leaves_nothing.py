"""No input locks a device: for any claim the API server could hold (names up to 253 characters, namespaces up to
63) with device metadata, the claim's status and failure reports on, and a write or a step failing on the way,
prepare either succeeds or leaves nothing (no record, CDI spec, metadata file, status entry or hardware change),
and the device is free afterwards."""

from __future__ import annotations

import asyncio
import errno
import os
import uuid
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from unittest import mock

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from agent.claims.checkpoint import CheckpointError
from agent.claims.collaborators import Reporting
from agent.claims.preparer import Preparer
from agent.claims.status_writer import ClaimStatusWriter
from agent.kube.names import is_dns_label, is_dns_subdomain
from agent.logs import get_logger
from backends.contract import ClaimRef
from simulator.node.node import SimulatedNode
from tests.support.prepare_env import NODE, PrepareEnv, prepare_env
from tests.support.timing import scaled

GPU = "gpu.nvidia.com"
ALNUM = "abcdefghijklmnopqrstuvwxyz0123456789"
CONFIGS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "exclusive": {"apiVersion": "dra-agent.io/v1alpha1", "kind": "GpuConfig",
                  "sharing": {"strategy": "ExclusiveProcess"}},
    "vfio": {"apiVersion": "dra-agent.io/v1alpha1", "kind": "VfioConfig"},
}
FAULTS = {  # a step made to fail → the start of the claim's error
    "none": "",
    "metadata file": "cannot write the device metadata: No space left on device",
    "claim spec": "cannot write the CDI spec: No space left on device",
    "journal": "cannot write ",
    "bug after completed": "internal error while preparing",
}
NAME_MAX = 255  # bytes in a file name, on the file systems the tests run on (tmpfs, ext4)
PYTHON_WORDS = ("Errno", "Traceback", "OSError", "FileNotFoundError", "CheckpointError", "MetadataError")


def label_of(draw: st.DrawFn, size: int) -> str:
    """A DNS label of `size` characters (the 63-character limit is the caller's)."""
    if size == 1:
        return draw(st.sampled_from(ALNUM))
    middle = draw(st.text(ALNUM + "-", min_size=size - 2, max_size=size - 2))
    return draw(st.sampled_from(ALNUM)) + middle + draw(st.sampled_from(ALNUM))


@st.composite
def dns_labels(draw: st.DrawFn, max_size: int = 63) -> str:
    return label_of(draw, draw(st.integers(1, max_size)))


def subdomain_of(draw: st.DrawFn, size: int) -> str:
    """An object name of `size` characters: dot-separated labels (a subdomain's labels have no length limit of
    their own in Kubernetes' object names, only the whole name's 253)."""
    parts, left = [], size
    while left:
        part = draw(st.integers(1, left))
        if left - part == 1:  # no room for a dot and a label after it
            part = left
        parts.append(label_of(draw, part))
        left -= part + (1 if part < left else 0)
    return ".".join(parts)


@st.composite
def identities(draw: st.DrawFn) -> tuple[str, str]:
    """(namespace, claim name), often at the file system's limit for `<namespace>_<name>` or just over it."""
    namespace = draw(dns_labels())
    at_limit = NAME_MAX - 1 - len(namespace)
    size = draw(st.one_of(st.integers(1, 253), st.sampled_from([at_limit, at_limit + 1]).filter(lambda n: n <= 253)))
    name = subdomain_of(draw, size)
    assert is_dns_label(namespace) and is_dns_subdomain(name) and len(name) == size
    return namespace, name


class StatusApi:
    """The API server's end of the claim status writer: every apply, by claim UID."""

    def __init__(self) -> None:
        self.applied: dict[str, list[Mapping[str, Any]]] = {}

    async def apply_claim_status(self, namespace: str, name: str, body: Mapping[str, Any], field_manager: str,
                                 timeout: float) -> None:
        self.applied.setdefault(body["metadata"]["uid"], []).append(body)

    async def get_claim(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        return None


def bus_id(device: str) -> str:
    """`gpu-0000-18-00-0` → `0000:18:00.0`."""
    domain, bus, slot, function = device.removeprefix("gpu-").split("-")
    return f"{domain}:{bus}:{slot}.{function}"


def hardware(env: PrepareEnv, gpus: list[str]) -> list[tuple[str, str, int]]:
    """Each GPU's driver binding and compute mode: what a prepare changes on the hardware."""
    nvml = env.node.nvml
    drivers = [os.path.basename(os.readlink(env.node.sysfs / "bus/pci/devices" / bus_id(g) / "driver"))
               for g in gpus]
    return [(g, d, nvml.compute_mode(i)) for i, (g, d) in enumerate(zip(gpus, drivers, strict=True))]


def claim_body(ref: ClaimRef, request: str, device: str, config: dict[str, Any] | None,
               pod_claim_name: str | None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid}
    if pod_claim_name is not None:
        metadata["annotations"] = {"resource.kubernetes.io/pod-claim-name": pod_claim_name}
    configs = [] if config is None else [{"source": "FromClaim", "requests": [request.split("/")[0]],
                                          "opaque": {"driver": GPU, "parameters": config}}]
    return {"metadata": metadata, "status": {"allocation": {"devices": {
        "results": [{"request": request, "driver": GPU, "pool": NODE, "device": device}], "config": configs}}}}


def example_each_fault(device: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """An explicit example of a claim that fits, for each fault."""
    def add(test: Callable[..., None]) -> Callable[..., None]:
        for fault in FAULTS:
            test = example(identity=("team-a", "vm"), request="gpu", subrequest=None, pod_claim_name="gpu",
                           device=device, config="exclusive", fault=fault)(test)
        return test
    return add


def faulty(fault: str, preparer: Preparer, stack: ExitStack) -> None:
    """Make one step of the prepare fail, as a full disk or a defect would."""
    full = OSError(errno.ENOSPC, "No space left on device")
    if fault == "metadata file":
        stack.enter_context(mock.patch("agent.claims.metadata_files.write_atomically", side_effect=full))
    elif fault == "claim spec":
        stack.enter_context(mock.patch.object(preparer.store, "write", side_effect=full))
    elif fault == "journal":
        error = CheckpointError(f"cannot write {preparer.checkpoint.path}: No space left on device")
        stack.enter_context(mock.patch.object(preparer.checkpoint, "complete", side_effect=error))
    elif fault == "bug after completed":
        stack.enter_context(mock.patch.object(preparer, "_on_prepared", side_effect=RuntimeError("a defect")))


def test_prepare_succeeds_or_leaves_nothing_and_the_device_stays_free(
        sim_node: Callable[[str], SimulatedNode], scratch: Path) -> None:
    with asyncio.Runner() as runner:
        env = runner.run(prepare_env(sim_node("dgx-h100"), scratch, ("nvidia-gpu",), backend_state=True))
        gpus = env.devices(GPU)
        api, failures = StatusApi(), dict[str, str]()
        writer = ClaimStatusWriter(api, GPU, NODE, settle=0.0)
        reporting = Reporting(get_logger("test"), on_failure=lambda ref, error: failures.__setitem__(ref.uid, error),
                              on_prepared=writer.prepared, on_released=writer.released)
        preparer = env.preparer(GPU, device_metadata=True, reporting=reporting)
        clean = hardware(env, gpus)
        outcomes: dict[str, int] = {}

        async def written() -> None:
            async with asyncio.timeout(scaled(5)):
                while writer.pending:  # noqa: ASYNC110 - the writer's tasks end on their own
                    await asyncio.sleep(0.001)

        @settings(max_examples=300, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(identity=identities(), request=dns_labels(), subrequest=st.none() | dns_labels(),
               pod_claim_name=st.none() | dns_labels(), device=st.sampled_from(gpus),
               config=st.sampled_from(sorted(CONFIGS)), fault=st.just("none") | st.sampled_from(sorted(FAULTS)))
        # Each outcome at least once, whatever the random examples are: the longest names that fit (`n_<253>` is
        # 255 bytes), the longest there are (317 bytes), and each fault.
        @example(identity=("n", "c" * 251 + ".x"), request="r" * 63, subrequest="s" * 63, pod_claim_name="p" * 63,
                 device=gpus[0], config="vfio", fault="none")
        @example(identity=("n" * 63, "c" * 251 + ".x"), request="gpu", subrequest=None, pod_claim_name=None,
                 device=gpus[0], config="vfio", fault="none")
        @example_each_fault(gpus[1])
        def check(identity: tuple[str, str], request: str, subrequest: str | None, pod_claim_name: str | None,
                  device: str, config: str, fault: str) -> None:
            namespace, name = identity
            ref = ClaimRef(str(uuid.uuid4()), namespace, name)
            allocated = request if subrequest is None else f"{request}/{subrequest}"
            env.claims.claims = {(namespace, name): claim_body(ref, allocated, device, CONFIGS[config],
                                                               pod_claim_name)}
            with ExitStack() as stack:
                faulty(fault, preparer, stack)
                result = runner.run(preparer.prepare([ref]))[ref.uid]
            runner.run(written())
            fits = len(f"{namespace}_{name}".encode()) <= NAME_MAX
            outcome = "prepared" if not result.error else "refused: name" if not fits else f"failed: {fault}"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            if not result.error:
                assert fits and fault == "none"
                ids = [i for d in result.devices for i in d.cdi_device_ids]
                assert ids[-1] == f"{GPU}/metadata={ref.uid}_{request}"
                assert env.kept_of(preparer, ref) != []
                assert runner.run(preparer.unprepare([ref])) == {ref.uid: ""}
            else:
                assert failures.pop(ref.uid) == result.error
                if fits:
                    assert fault != "none" and result.error.startswith(FAULTS[fault]), result.error
                else:
                    assert "more than the 255 a file name may have" in result.error, result.error
                if fault != "bug after completed":
                    assert not any(word in result.error for word in PYTHON_WORDS), result.error
            # Left as it was, by the failed prepare itself: the kubelet need not unprepare a claim that failed.
            runner.run(written())
            assert env.kept_of(preparer, ref) == []
            assert hardware(env, gpus) == clean
            statuses = [body["status"].get("devices") for body in api.applied.pop(ref.uid, [])]
            assert not statuses or not statuses[-1], "the claim's status holds no device of it at the end"
            other = ClaimRef(str(uuid.uuid4()), "default", "other")
            env.claims.claims[("default", "other")] = claim_body(other, "gpu", device, None, None)
            assert runner.run(preparer.prepare([other]))[other.uid].error == "", "the device is free"
            assert runner.run(preparer.unprepare([other])) == {other.uid: ""}
            assert env.kept_of(preparer, other) == []
            if result.error:
                assert runner.run(preparer.unprepare([ref])) == {ref.uid: ""}, "and may: nothing to undo"

        try:
            check()
            runner.run(written())
        finally:
            runner.run(writer.close())
            runner.run(env.close())
        print(f"\nexamples: {sum(outcomes.values())}, by outcome: {dict(sorted(outcomes.items()))}")
        assert sum(outcomes.values()) >= 300
        assert {"prepared", "refused: name", *(f"failed: {f}" for f in FAULTS if f != "none")} <= set(outcomes)
