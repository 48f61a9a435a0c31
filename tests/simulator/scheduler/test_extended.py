"""Extended-resource names on DeviceClasses (KEP-5004): the API server's check of the name, which class serves a
name, and the claim the scheduler makes for a pod that asks `nvidia.com/gpu: 1`, allocated through the test API
server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes.aio import client, config
from kubernetes.aio.client.exceptions import ApiException

from simulator.apiserver.deviceclasses import is_extended_resource_name
from simulator.apiserver.server import TestApiServer
from simulator.scheduler.allocation import Unallocatable
from simulator.scheduler.allocator import Allocator
from simulator.scheduler.cel import CelError
from simulator.scheduler.extended import ANNOTATION, class_mapping, plan_extended_claim
from simulator.scheduler.pods import release_pod, schedule_pod
from tests.support.allocation_env import device_classes, discovered
from tests.support.kube_models import as_sent, meta, spec_of

NODE = "dgx-h100"
# A 244-character domain is the longest whose quota form ("requests." + name) is still a DNS subdomain.
DOMAIN_244 = ".".join(["a" * 60] * 3 + ["b" * 61])


@pytest.mark.parametrize("name", ["nvidia.com/gpu", "google.com/tpu", "example.com/foo_bar.baz-1", "x/y",
                                  f"{DOMAIN_244}/gpu", "example.com/" + "g" * 63, "example/Gpu"])
def test_extended_resource_names(name: str) -> None:
    assert is_extended_resource_name(name)


@pytest.mark.parametrize("name", [
    "gpu",  # no domain: a native resource
    "kubernetes.io/gpu", "foo.kubernetes.io/gpu",  # the kubernetes.io namespace, wherever it appears
    "deviceclass.resource.kubernetes.io/gpu.nvidia.com",  # an implicit class name is not one to set
    "requests.example.com/gpu",  # would read as a quota of example.com/gpu
    "example.com/", "/gpu", "example.com/-gpu", "example.com/gpu-", "a/b/c", "example.com/g pu",
    "example.com/" + "g" * 64, f"{DOMAIN_244}b/gpu", "exa_mple.com/gpu", "Example.com/gpu", "",
])  # fmt: skip
def test_not_extended_resource_names(name: str) -> None:
    assert not is_extended_resource_name(name)


def device_class(name: str, extended: str | None = None, created: str = "2026-01-01T00:00:00Z") -> dict[str, Any]:
    spec: dict[str, Any] = {"selectors": [{"cel": {"expression": 'device.driver == "gpu.nvidia.com"'}}]}
    if extended is not None:
        spec["extendedResourceName"] = extended
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"name": name, "creationTimestamp": created}, "spec": spec}  # fmt: skip


# --- the API server ---------------------------------------------------------------------------------------


@pytest.fixture
async def resources(scratch: Path) -> AsyncIterator[tuple[TestApiServer, client.ResourceV1Api]]:
    async with TestApiServer() as server:
        api = await config.new_client_from_config(config_file=str(server.write_kubeconfig(scratch / "kubeconfig")))
        async with api:
            yield server, client.ResourceV1Api(api)


async def test_the_api_server_refuses_an_invalid_name_with_its_field(
        resources: tuple[TestApiServer, client.ResourceV1Api]) -> None:  # fmt: skip
    server, api = resources
    for bad in ("gpu", "kubernetes.io/gpu", "requests.example.com/gpu"):
        with pytest.raises(ApiException) as caught:
            await api.create_device_class(as_sent(client.V1DeviceClass, device_class("bad", bad)))
        assert caught.value.body is not None
        status = json.loads(caught.value.body)
        assert caught.value.status == 422 and status["reason"] == "Invalid"
        assert status["details"]["causes"] == [{"reason": "FieldValueInvalid", "field": "spec.extendedResourceName",
                                                "message": f'Invalid value: "{bad}": must be a valid extended '
                                                           "resource name"}]  # fmt: skip
        assert status["message"].startswith('DeviceClass.resource.k8s.io "bad" is invalid: spec.extendedResourceName')
    assert server.objects("deviceclasses") == []
    # An update is checked too; a valid name, and none at all, are accepted.
    await api.create_device_class(as_sent(client.V1DeviceClass, device_class("gpu.nvidia.com", "nvidia.com/gpu")))
    stored = await api.read_device_class("gpu.nvidia.com")
    assert spec_of(stored).extended_resource_name == "nvidia.com/gpu"
    spec_of(stored).extended_resource_name = "nvidia.com/"
    with pytest.raises(ApiException) as caught:
        await api.replace_device_class("gpu.nvidia.com", stored)
    assert caught.value.status == 422 and caught.value.body is not None
    assert "spec.extendedResourceName" in caught.value.body
    spec_of(stored).extended_resource_name = None
    await api.replace_device_class("gpu.nvidia.com", stored)
    kept = server.get_object("deviceclasses", "gpu.nvidia.com")
    assert kept is not None and "extendedResourceName" not in kept["spec"]


async def test_two_classes_may_share_a_name_and_a_number_is_not_a_name(
        resources: tuple[TestApiServer, client.ResourceV1Api]) -> None:  # fmt: skip
    server, api = resources
    # Names should be unique, but the API server does not check: the scheduler picks one class.
    await api.create_device_class(as_sent(client.V1DeviceClass, device_class("a.example.com", "example.com/gpu")))
    await api.create_device_class(as_sent(client.V1DeviceClass, device_class("b.example.com", "example.com/gpu")))
    assert len(server.objects("deviceclasses")) == 2
    number = {"metadata": {"name": "c"}, "spec": {"extendedResourceName": 7}}
    async with (aiohttp.ClientSession(server.url, headers=server.auth_headers) as http,
                http.post("/apis/resource.k8s.io/v1/deviceclasses", json=number) as response):
        assert response.status == 400
        assert "cannot unmarshal number" in (await response.json())["message"]


async def test_with_the_gate_off_the_name_is_dropped_unless_the_class_has_one(scratch: Path) -> None:
    async with TestApiServer(disabled_gates={"DRAExtendedResource"}) as server:
        api_client = await config.new_client_from_config(config_file=str(server.write_kubeconfig(scratch / "kc")))
        async with api_client:
            api = client.ResourceV1Api(api_client)
            # Dropped before validation: even a name that would be refused is not an error.
            for name, extended in (("new.example.com", "example.com/gpu"), ("bad.example.com", "gpu")):
                await api.create_device_class(as_sent(client.V1DeviceClass, device_class(name, extended)))
                stored = server.get_object("deviceclasses", name)
                assert stored is not None and "extendedResourceName" not in stored["spec"]
            # A class stored while the gate was on keeps its name through an update.
            server.put_object("deviceclasses", device_class("old.example.com", "example.com/old"))
            kept = await api.read_device_class("old.example.com")
            meta(kept).labels = {"touched": "yes"}
            spec_of(kept).extended_resource_name = "example.com/renamed"
            await api.replace_device_class("old.example.com", kept)
            stored = server.get_object("deviceclasses", "old.example.com")
            assert stored is not None and stored["spec"]["extendedResourceName"] == "example.com/renamed"


# --- which class serves a name ----------------------------------------------------------------------------


def test_the_newest_class_serves_a_shared_name_and_a_tie_goes_to_the_first_name() -> None:
    old, new = "2026-01-01T00:00:00Z", "2026-02-01T00:00:00Z"
    mapping = class_mapping([device_class("z-old", "example.com/gpu", old),
                             device_class("y-new", "example.com/gpu", new), device_class("b", "example.com/tie", new),
                             device_class("a", "example.com/tie", new), device_class("plain")])  # fmt: skip
    assert mapping["example.com/gpu"] == "y-new"
    assert mapping["example.com/tie"] == "a"
    # Every class keeps its implicit name, whether it has an explicit one or not.
    assert {k: v for k, v in mapping.items() if k.startswith("deviceclass.")} == {
        f"deviceclass.resource.kubernetes.io/{n}": n for n in ("z-old", "y-new", "b", "a", "plain")}
    # Reversed input order: the same answer.
    assert class_mapping(reversed([device_class("z-old", "example.com/gpu", old),
                                   device_class("y-new", "example.com/gpu", new)]))["example.com/gpu"] == "y-new"


def pod(name: str, *containers: dict[str, Any], init: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": list(containers)}
    if init:
        spec["initContainers"] = list(init)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "team-a", "uid": "u-1"},
            "spec": spec}  # fmt: skip


def container(name: str, requests: dict[str, str] | None = None,
              limits: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    resources = {k: v for k, v in (("requests", requests), ("limits", limits)) if v}
    return {"name": name, "image": "cuda", "resources": resources}


def test_the_claim_has_a_request_per_container_and_resource_named_by_position() -> None:
    classes = [*device_classes()]
    asked = pod("trainer",
                container("main", {"cpu": "2", "memory": "1Gi", "nvidia.com/gpu": "2"}),
                container("sidecar", limits={"deviceclass.resource.kubernetes.io/rdma-vf.sriov.dra-agent.io": "1"}),
                init=(container("setup", {"nvidia.com/gpu": "1"}),))  # fmt: skip
    plan = plan_extended_claim(asked, classes, NODE)
    assert plan is not None
    claim = plan.claim
    assert claim["metadata"]["generateName"] == "trainer-extended-resources-"
    assert claim["metadata"]["namespace"] == "team-a"
    assert claim["metadata"]["annotations"] == {ANNOTATION: "true"}
    assert claim["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Pod", "name": "trainer",
                                                     "uid": "u-1", "controller": True, "blockOwnerDeletion": True}]
    # Containers are counted init containers first; resources by their sorted position among all the container's
    # requests (cpu, memory, nvidia.com/gpu: the GPU is the third).
    assert claim["spec"]["devices"]["requests"] == [
        {"name": "container-0-request-0", "exactly": {"deviceClassName": "gpu.nvidia.com",
                                                      "allocationMode": "ExactCount", "count": 1}},
        {"name": "container-1-request-2", "exactly": {"deviceClassName": "gpu.nvidia.com",
                                                      "allocationMode": "ExactCount", "count": 2}},
        {"name": "container-2-request-0", "exactly": {"deviceClassName": "rdma-vf.sriov.dra-agent.io",
                                                      "allocationMode": "ExactCount", "count": 1}},
    ]  # fmt: skip
    assert [r.mapping() for r in plan.requests] == [
        {"containerName": "setup", "resourceName": "nvidia.com/gpu", "requestName": "container-0-request-0"},
        {"containerName": "main", "resourceName": "nvidia.com/gpu", "requestName": "container-1-request-2"},
        {"containerName": "sidecar", "resourceName": "deviceclass.resource.kubernetes.io/rdma-vf.sriov.dra-agent.io",
         "requestName": "container-2-request-0"},
    ]  # fmt: skip


def test_a_pod_without_dra_resources_gets_no_claim() -> None:
    assert plan_extended_claim(pod("web", container("c", {"cpu": "1", "nvidia.com/gpu": "0"})), device_classes(),
                               NODE) is None  # fmt: skip


def node_with(allocatable: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": NODE}, "status": {"allocatable": {"cpu": "64", **allocatable}}}


def test_a_device_plugin_on_the_node_serves_its_name_instead_of_dra() -> None:
    asked = pod("p", container("c", {"nvidia.com/gpu": "2", "example.com/fpga": "1"}))
    # nvidia.com/gpu is advertised by a device plugin there: DRA leaves it alone, and there is nothing left for it.
    assert plan_extended_claim(asked, device_classes(), node_with({"nvidia.com/gpu": "8", "example.com/fpga": "1"})) \
        is None
    with pytest.raises(Unallocatable) as caught:
        plan_extended_claim(asked, device_classes(), node_with({"nvidia.com/gpu": "1", "example.com/fpga": "1"}))
    assert caught.value.reasons == ["pod team-a/p: Insufficient nvidia.com/gpu: the pod asks 2, node dgx-h100 has 1 "
                                    "(served by a device plugin, not DRA)"]  # fmt: skip


def test_an_unknown_resource_is_left_to_the_node_and_refused_when_it_has_none() -> None:
    asked = pod("p", container("c", {"example.com/fpga": "1", "nvidia.com/gpu": "1"}))
    with pytest.raises(Unallocatable) as caught:
        plan_extended_claim(asked, device_classes(), NODE)
    (reason,) = caught.value.reasons
    assert reason.startswith("pod team-a/p: container c: example.com/fpga: no DeviceClass serves it")
    assert "node dgx-h100 does not have it in its allocatable (no device plugin advertises it)" in reason


@pytest.mark.parametrize(("requests", "limits", "problem"), [
    ({"nvidia.com/gpu": "500m"}, None, "requests 500m"),
    ({"nvidia.com/gpu": "1"}, {"nvidia.com/gpu": "2"}, "requests 1 and limits 2"),
    ({"nvidia.com/gpu": "lots"}, None, "invalid quantity"),
])  # fmt: skip
def test_a_bad_quantity_is_refused_with_the_container_and_resource(requests: dict[str, str],
                                                                   limits: dict[str, str] | None, problem: str) -> None:
    with pytest.raises(Unallocatable) as caught:
        plan_extended_claim(pod("p", container("c", requests, limits)), device_classes(), NODE)
    (reason,) = caught.value.reasons
    assert reason.startswith("pod team-a/p: container c: nvidia.com/gpu: ") and problem in reason


# --- against the API server -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dgx() -> list[dict[str, Any]]:
    return discovered(NODE)


@pytest.fixture
async def cluster(dgx: list[dict[str, Any]], scratch: Path) -> AsyncIterator[tuple[TestApiServer, Allocator]]:
    async with TestApiServer() as server:
        for obj in dgx:
            server.put_object("resourceslices", obj)
        for obj in device_classes():
            server.put_object("deviceclasses", obj)
        server.add_node(NODE)
        allocator = await Allocator.connect(server.write_kubeconfig(scratch / "kubeconfig"))
        try:
            yield server, allocator
        finally:
            await allocator.close()


async def test_a_pod_asking_one_gpu_gets_an_allocated_claim_reserved_for_it(
        cluster: tuple[TestApiServer, Allocator]) -> None:  # fmt: skip
    server, allocator = cluster
    scheduled = await schedule_pod(allocator, pod("trainer", container("main", {"nvidia.com/gpu": "1"})), node=NODE)
    name = scheduled.claim_name
    assert name is not None and name.startswith("trainer-extended-resources-") and len(name) == 32
    stored = server.get_object("resourceclaims", name, "team-a")
    assert stored is not None and stored["metadata"]["annotations"] == {ANNOTATION: "true"}
    (result,) = stored["status"]["allocation"]["devices"]["results"]
    assert result["request"] == "container-0-request-0" and result["driver"] == "gpu.nvidia.com"
    assert result["pool"] == NODE and result["device"].startswith("gpu-")
    assert stored["status"]["reservedFor"] == [{"resource": "pods", "name": "trainer", "uid": "u-1"}]
    # The class's configuration comes with the allocation, as for any claim of the class.
    assert [c["source"] for c in stored["status"]["allocation"]["devices"]["config"]] == ["FromClass"]
    assert scheduled.pod["spec"]["nodeName"] == NODE
    assert scheduled.pod["status"]["extendedResourceClaimStatus"] == {
        "resourceClaimName": name,
        "requestMappings": [{"containerName": "main", "resourceName": "nvidia.com/gpu",
                             "requestName": "container-0-request-0"}]}  # fmt: skip
    await release_pod(allocator, scheduled)
    assert server.get_object("resourceclaims", name, "team-a") is None


async def test_nine_gpus_on_an_eight_gpu_node_are_unschedulable_and_leave_nothing(
        cluster: tuple[TestApiServer, Allocator]) -> None:  # fmt: skip
    server, allocator = cluster
    with pytest.raises(Unallocatable) as caught:
        await schedule_pod(allocator, pod("greedy", container("main", {"nvidia.com/gpu": "9"})), node=NODE)
    (reason,) = caught.value.reasons
    assert reason.startswith("pod team-a/greedy: container main asks 9 nvidia.com/gpu (DeviceClass gpu.nvidia.com, "
                             "claim request container-0-request-0): needs 9 device(s)")
    assert "8 devices of class gpu.nvidia.com on node dgx-h100" in reason
    assert server.objects("resourceclaims") == [], "the claim made for the pod is deleted again"


async def test_an_unknown_resource_makes_no_claim(cluster: tuple[TestApiServer, Allocator]) -> None:
    server, allocator = cluster
    with pytest.raises(Unallocatable, match=r"example\.com/fpga: no DeviceClass serves it"):
        await schedule_pod(allocator, pod("fpga", container("main", {"example.com/fpga": "1"})), node=NODE)
    assert server.objects("resourceclaims") == []
    assert server.count_requests("POST", "*/resourceclaims") == 0
    # A pod DRA serves nothing of is placed without a claim.
    plain = await schedule_pod(allocator, pod("web", container("main", {"cpu": "1"})), node=NODE)
    assert plain.claim is None and plain.pod["spec"]["nodeName"] == NODE and "status" not in plain.pod
    assert server.count_requests("POST", "*/resourceclaims") == 0


async def test_a_class_whose_selector_does_not_compile_leaves_no_claim(
        cluster: tuple[TestApiServer, Allocator]) -> None:  # fmt: skip
    server, allocator = cluster
    broken = device_class("broken.example.com", "example.com/broken")
    broken["spec"]["selectors"] = [{"cel": {"expression": "device.driver.lowerAscii() == 'x'"}}]
    server.put_object("deviceclasses", broken)
    with pytest.raises(CelError):
        await schedule_pod(allocator, pod("b", container("main", {"example.com/broken": "1"})), node=NODE)
    assert server.count_requests("POST", "*/resourceclaims") == 1
    assert server.objects("resourceclaims") == [], "the claim made for the pod is deleted again"
