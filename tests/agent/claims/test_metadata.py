"""Device metadata files (KEP-5304), the pure part and the files: the file's content, where it lives on the host and
in the container for direct and template claims, subrequests, the CDI spec that mounts it (checked against the CDI
JSON schema), the CDI IDs in the answer, atomic writes and removal that spares another claim's files."""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path, PurePath
from typing import Any

import pytest

from agent.claims.metadata import (
    API_VERSION,
    ClaimIdentity,
    MetadataError,
    container_path,
    decode_stream,
    request_files,
    with_metadata_ids,
)
from agent.claims.metadata_files import MetadataFiles
from agent.claims.read import ClaimAllocation, DeviceAllocation, read_allocation
from agent.claims.records import ClaimRecord, DeviceRecord
from agent.commands.cli import build_parser
from agent.settings import SettingsError, load_settings
from backends.attributes import Version
from backends.contract import ClaimRef, NetworkData
from cdi.names import validate_spec
from cdi.spec import Spec
from tests.support.cdi_schema import cdi_schema_errors

DRIVER = "gpu.nvidia.com"
UID = "0b6f4f4e-2c1a-4d8e-9a51-3f0c5d7e8a90"
CLAIM = ClaimIdentity(UID, "team-a", "vm-gpu")
FROM_TEMPLATE = ClaimIdentity(UID, "team-a", "launcher-7c9f-gpu-x2k4p", pod_claim_name="gpu")
PLUGIN_DIR = "/var/lib/kubelet/plugins/gpu.nvidia.com"
BDF = "resource.kubernetes.io/pciBusID"


def record(device: str, **facts: object) -> DeviceRecord:
    return DeviceRecord(device=device, backend="nvidia-gpu", requests=("gpu",),
                        cdi_ids=(f"k8s.{DRIVER}/claim={UID}-{device}",), facts=facts)  # type: ignore[arg-type]


def test_a_direct_claim_gets_one_file_per_request_at_the_paths_of_the_api_constants() -> None:
    records = [record("gpu-0", uuid="GPU-1", **{BDF: "0000:18:00.0"}), record("gpu-1"), record("gpu-2")]
    allocated = [("gpu", "gpu-0"), ("gpu", "gpu-1"), ("nic", "gpu-2")]
    files = request_files(DRIVER, "node-a", CLAIM, allocated, records, PLUGIN_DIR)
    assert [f.request for f in files] == ["gpu", "nic"]
    gpu = files[0]
    assert gpu.relative_path == PurePath("dra-device-metadata/team-a_vm-gpu/gpu/metadata.json")
    assert gpu.cdi_id == f"{DRIVER}/metadata={UID}_gpu"
    doc = gpu.spec.to_dict()
    assert doc == {
        "cdiVersion": "0.5.0",
        "kind": f"{DRIVER}/metadata",
        "devices": [{"name": f"{UID}_gpu", "containerEdits": {"mounts": [{
            "hostPath": f"{PLUGIN_DIR}/dra-device-metadata/team-a_vm-gpu/gpu/metadata.json",
            "containerPath": "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/vm-gpu/gpu/"
                             "gpu.nvidia.com-metadata.json",
            "options": ["ro", "bind"],
        }]}}],
    }
    assert validate_spec(gpu.spec) == []
    assert cdi_schema_errors(doc) == []
    assert gpu.content.endswith(b"\n") and gpu.content.count(b"\n") == 1, "a JSON stream: one object a line"
    assert decode_stream(gpu.content) == {
        "apiVersion": API_VERSION,
        "kind": "DeviceMetadata",
        "metadata": {"name": "vm-gpu", "namespace": "team-a", "uid": UID, "generation": 1},
        "requests": [{"name": "gpu", "devices": [
            {"driver": DRIVER, "pool": "node-a", "name": "gpu-0",
             "attributes": {BDF: {"string": "0000:18:00.0"}, "uuid": {"string": "GPU-1"}}},
            {"driver": DRIVER, "pool": "node-a", "name": "gpu-1"},
        ]}],
    }


def test_a_claim_from_a_template_is_found_under_the_pods_name_for_it() -> None:
    (f,) = request_files(DRIVER, "node-a", FROM_TEMPLATE, [("gpu", "gpu-0")], [record("gpu-0")], PLUGIN_DIR)
    (mount,) = f.spec.devices[0].container_edits.mounts
    assert mount.container_path == ("/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpu/gpu/"
                                    "gpu.nvidia.com-metadata.json")
    # On the host the file is the claim's own, by its generated name.
    assert mount.host_path == f"{PLUGIN_DIR}/dra-device-metadata/team-a_launcher-7c9f-gpu-x2k4p/gpu/metadata.json"
    assert decode_stream(f.content)["podClaimName"] == "gpu"
    assert "podClaimName" not in decode_stream(request_files(DRIVER, "n", CLAIM, [("gpu", "gpu-0")],
                                                             [record("gpu-0")], PLUGIN_DIR)[0].content)


def test_a_subrequest_names_itself_in_the_file_and_its_base_request_everywhere_else() -> None:
    (f,) = request_files(DRIVER, "node-a", CLAIM, [("gpu/h100", "gpu-0")], [record("gpu-0")], PLUGIN_DIR)
    assert f.request == "gpu"
    assert f.cdi_id.endswith(f"={UID}_gpu")
    assert f.relative_path.parts[-2] == "gpu"
    assert container_path(DRIVER, CLAIM, "gpu/h100").endswith("/resourceclaims/vm-gpu/gpu/gpu.nvidia.com-metadata.json")
    assert decode_stream(f.content)["requests"][0]["name"] == "gpu/h100"


def test_every_attribute_kind_and_the_network_data_are_in_the_api_form() -> None:
    rec = DeviceRecord(device="vf-0", backend="sriov-nic", requests=("nic",),
                       facts={"index": 3, "rdma": True, "firmware": Version("1.2.3"), "netdev": "net1"},
                       network=NetworkData("net1", "02:00:00:00:00:01", ("192.0.2.5/24",)))
    (f,) = request_files("sriov.dra-agent.io", "node-a", CLAIM, [("nic", "vf-0")], [rec], "/p")
    (device,) = decode_stream(f.content)["requests"][0]["devices"]
    assert device["attributes"] == {"index": {"int": 3}, "rdma": {"bool": True}, "firmware": {"version": "1.2.3"},
                                    "netdev": {"string": "net1"}}
    assert device["networkData"] == {"interfaceName": "net1", "ips": ["192.0.2.5/24"],
                                     "hardwareAddress": "02:00:00:00:00:01"}


def test_the_metadata_id_goes_with_the_first_device_of_each_request_once() -> None:
    records = [record("gpu-0"), record("gpu-1"), record("gpu-2")]
    allocated = [("gpu", "gpu-1"), ("gpu", "gpu-0"), ("other/a", "gpu-2")]
    files = request_files(DRIVER, "node-a", CLAIM, allocated, records, PLUGIN_DIR)
    first = with_metadata_ids(records, allocated, files)
    ids = {r.device: r.cdi_ids[1:] for r in first}
    assert ids == {"gpu-0": (), "gpu-1": (f"{DRIVER}/metadata={UID}_gpu",),
                   "gpu-2": (f"{DRIVER}/metadata={UID}_other",)}
    assert with_metadata_ids(first, allocated, files) == first, "adding them again changes nothing"


def test_a_stream_is_read_at_its_first_object_of_a_known_version() -> None:
    newer = {"apiVersion": "metadata.resource.k8s.io/v1", "kind": "DeviceMetadata", "requests": []}
    ours = {"apiVersion": API_VERSION, "kind": "DeviceMetadata", "requests": [{"name": "x"}]}
    stream = (json.dumps(newer) + "\n" + json.dumps(ours) + "\n").encode()
    assert decode_stream(stream) == ours
    with pytest.raises(MetadataError, match=re.escape("no metadata.resource.k8s.io/v1alpha1")):
        decode_stream((json.dumps(newer) + "\n").encode())
    with pytest.raises(MetadataError, match="not a JSON stream"):
        decode_stream(b'{"apiVersion": ')


def test_a_pod_claim_name_that_is_no_dns_label_is_refused() -> None:
    hostile = ClaimIdentity(UID, "team-a", "c", pod_claim_name="../../etc")
    with pytest.raises(MetadataError, match=re.escape("pod-claim-name '../../etc' is not a pod claim name")):
        request_files(DRIVER, "node-a", hostile, [("gpu", "gpu-0")], [record("gpu-0")], PLUGIN_DIR)


def test_a_driver_name_that_names_no_cdi_vendor_fails_the_claim_not_the_driver(tmp_path: Path) -> None:
    files = MetadataFiles("4gpu.example.com", "node-a", tmp_path / "plugin", tmp_path / "cdi", enabled=True)
    with pytest.raises(MetadataError, match="cannot name a CDI kind"):
        files.remove(UID, "ns", "c", None)
    with pytest.raises(MetadataError, match="cannot name a CDI kind"):
        request_files("4gpu.example.com", "node-a", CLAIM, [("gpu", "gpu-0")], [record("gpu-0")], "/p")


def test_read_allocation_carries_the_pod_claim_name_annotation() -> None:
    ref = ClaimRef(UID, "team-a", "c")
    claim: dict[str, Any] = {"metadata": {"uid": UID, "annotations": {"resource.kubernetes.io/pod-claim-name": "gpu"}},
             "status": {"allocation": {"devices": {"results": [
                 {"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-0"}]}}}}
    assert read_allocation(claim, ref, DRIVER).pod_claim_name == "gpu"
    del claim["metadata"]["annotations"]
    assert read_allocation(claim, ref, DRIVER).pod_claim_name is None


# --- the files --------------------------------------------------------------------------------------------------


def allocation(name: str = "vm-gpu", uid: str = UID, pod_claim_name: str | None = None) -> ClaimAllocation:
    return ClaimAllocation(ClaimRef(uid, "team-a", name), (DeviceAllocation("gpu", DRIVER, "node-a", "gpu-0"),), (),
                           pod_claim_name)


def completed(records: tuple[DeviceRecord, ...], name: str = "vm-gpu", uid: str = UID) -> ClaimRecord:
    return ClaimRecord(uid, "team-a", name, "completed", "boot", records)


def test_files_are_written_readable_removed_and_a_lost_spec_comes_back_from_the_host_file(tmp_path: Path) -> None:
    plugin, cdi = tmp_path / "plugins" / DRIVER, tmp_path / "cdi"
    files = MetadataFiles(DRIVER, "node-a", plugin, cdi, enabled=True)
    records, claim, wanted = files.prepared(allocation(pod_claim_name="gpu"), [record("gpu-0", uuid="GPU-1")])
    files.write(claim, wanted)
    host = plugin / "dra-device-metadata/team-a_vm-gpu/gpu/metadata.json"
    spec_file = cdi / f"{DRIVER}_metadata_{UID}_gpu.json"
    assert host.read_bytes() == wanted[0].content
    assert os.stat(host).st_mode & 0o777 == 0o644 and os.stat(host.parent).st_mode & 0o777 == 0o755
    assert Spec.from_json(spec_file.read_bytes()) == wanted[0].spec
    assert not list(host.parent.glob(".*")), "no temporary file left"

    spec_file.unlink()
    assert files.ensure(completed(records), None) == ["gpu"]
    assert Spec.from_json(spec_file.read_bytes()) == wanted[0].spec, "the same mount, template path included"
    host.unlink()
    assert files.ensure(completed(records), allocation(pod_claim_name="gpu")) == ["gpu"]
    assert host.read_bytes() == wanted[0].content
    assert files.ensure(completed(records), allocation(pod_claim_name="gpu")) == [], "nothing lost, nothing written"

    files.release(completed(records))
    assert not host.exists() and not (plugin / "dra-device-metadata/team-a_vm-gpu").exists()
    assert not spec_file.exists()
    files.release(completed(records))  # nothing left: fine


def test_a_prepare_cut_short_is_cleaned_by_uid_and_another_claims_files_stay(tmp_path: Path) -> None:
    plugin, cdi = tmp_path / "plugin", tmp_path / "cdi"
    files = MetadataFiles(DRIVER, "node-a", plugin, cdi, enabled=True)
    other_uid = "11111111-2222-4333-8444-555555555555"
    _, claim, wanted = files.prepared(allocation(), [record("gpu-0")])
    files.write(claim, wanted)
    _, other, theirs = files.prepared(allocation(name="other", uid=other_uid), [record("gpu-0")])
    files.write(other, theirs)
    started = ClaimRecord(UID, "team-a", "vm-gpu", "started", "boot", (DeviceRecord("gpu-0", "nvidia-gpu"),))
    files.release(started)
    assert not (plugin / "dra-device-metadata/team-a_vm-gpu").exists()
    assert sorted(p.name for p in cdi.iterdir()) == [f"{DRIVER}_metadata_{other_uid}_gpu.json"]
    # Known from its CDI spec alone (no name): every host folder whose file names the UID.
    files.write(claim, wanted)
    files.release(ClaimRecord(UID, "", "", "completed", "boot", (), recovered=True))
    assert [p.name for p in (plugin / "dra-device-metadata").iterdir()] == ["team-a_other"]
    assert sorted(p.name for p in cdi.iterdir()) == [f"{DRIVER}_metadata_{other_uid}_gpu.json"]


def test_a_write_that_fails_part_way_leaves_nothing_of_the_claim(tmp_path: Path) -> None:
    plugin, cdi = tmp_path / "plugin", tmp_path / "cdi"
    files = MetadataFiles(DRIVER, "node-a", plugin, cdi, enabled=True)
    two = ClaimAllocation(ClaimRef(UID, "team-a", "vm-gpu"), (DeviceAllocation("gpu", DRIVER, "node-a", "gpu-0"),
                                                             DeviceAllocation("nic", DRIVER, "node-a", "gpu-1")), ())
    _, claim, wanted = files.prepared(two, [record("gpu-0"), record("gpu-1")])
    # The second request's folder cannot be made: the first request's file and spec are written by then.
    blocker = plugin / "dra-device-metadata/team-a_vm-gpu/nic"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("")
    with pytest.raises(MetadataError, match="cannot write the device metadata"):
        files.write(claim, wanted)
    assert [p.name for p in blocker.parent.iterdir()] == ["nic"], "the first request's folder is gone"
    assert list(cdi.iterdir()) == []


def test_the_setting_is_off_by_default_and_comes_from_the_flag_environment_or_file(tmp_path: Path) -> None:
    assert load_settings({}, {}).device_metadata is False
    args = build_parser().parse_args(["run", "--device-metadata"])
    assert load_settings({"device_metadata": args.device_metadata}, {}).device_metadata is True
    assert build_parser().parse_args(["run"]).device_metadata is None, "no flag: the environment or file decides"
    assert load_settings({}, {"DRA_AGENT_DEVICE_METADATA": "true"}).device_metadata is True
    config = tmp_path / "agent.yaml"
    config.write_text("device-metadata: true\n")
    assert load_settings({}, {}, config).device_metadata is True
    args = build_parser().parse_args(["run", "--no-device-metadata"])
    assert load_settings({"device_metadata": args.device_metadata}, {"DRA_AGENT_DEVICE_METADATA": "1"},
                         config).device_metadata is False, "the flag wins"
    with pytest.raises(SettingsError, match="device_metadata = 'sometimes' \\(from environment"):
        load_settings({}, {"DRA_AGENT_DEVICE_METADATA": "sometimes"})


def test_at_start_files_of_unknown_claims_and_crash_leftovers_go_and_the_rest_stays(tmp_path: Path) -> None:
    plugin, cdi = tmp_path / "plugin", tmp_path / "cdi"
    files = MetadataFiles(DRIVER, "node-a", plugin, cdi, enabled=True)
    known, unknown = UID, "11111111-2222-4333-8444-555555555555"
    for name, uid in (("known", known), ("unknown", unknown)):
        _, claim, wanted = files.prepared(allocation(name=name, uid=uid), [record("gpu-0")])
        files.write(claim, wanted)
    root = plugin / "dra-device-metadata"
    temp = root / "team-a_known/gpu/.metadata.json.x1y2.tmp"
    temp.write_text("{")
    strange = root / "team-a_strange/gpu/metadata.json"  # tells no claim: left alone
    strange.parent.mkdir(parents=True)
    strange.write_text("not json")
    assert files.sweep({known}) == [unknown]
    assert sorted(p.name for p in root.iterdir()) == ["team-a_known", "team-a_strange"]
    assert not temp.exists() and (root / "team-a_known/gpu/metadata.json").exists()
    assert [p.name for p in cdi.iterdir()] == [f"{DRIVER}_metadata_{known}_gpu.json"]
    assert files.sweep({known}) == []


def test_a_claim_known_from_its_spec_alone_keeps_only_the_files_written_for_it(tmp_path: Path) -> None:
    files = MetadataFiles(DRIVER, "node-a", tmp_path / "plugin", tmp_path / "cdi", enabled=True)
    two = ClaimAllocation(ClaimRef(UID, "team-a", "vm-gpu"), (DeviceAllocation("gpu", DRIVER, "node-a", "gpu-0"),
                                                             DeviceAllocation("nic", DRIVER, "node-a", "gpu-1")), ())
    plain = [DeviceRecord("gpu-0", "nvidia-gpu"), DeviceRecord("gpu-1", "nvidia-gpu")]  # the facts are lost
    assert files.readopted(two, plain) == tuple(plain), "no file there: no metadata ID"
    _, claim, wanted = files.prepared(two, [record("gpu-0", uuid="GPU-1"), record("gpu-1")])
    files.write(claim, wanted[:1])  # only the first request's file survived
    readopted = files.readopted(two, plain)
    assert [r.cdi_ids for r in readopted] == [(f"{DRIVER}/metadata={UID}_gpu",), ()]
    # The kubelet's next prepare re-creates the lost spec and keeps the file with the facts.
    (tmp_path / "cdi" / f"{DRIVER}_metadata_{UID}_gpu.json").unlink()
    assert files.ensure(completed(readopted), two) == ["gpu"]
    host = tmp_path / "plugin/dra-device-metadata/team-a_vm-gpu/gpu/metadata.json"
    assert host.read_bytes() == wanted[0].content


@pytest.mark.parametrize("request_name", ["../../../etc", "gpu/../x", "GPU", "a/b/c", ""])
def test_a_request_name_no_api_server_allows_names_no_file(request_name: str) -> None:
    with pytest.raises(MetadataError, match="cannot name a metadata file"):
        request_files(DRIVER, "node-a", CLAIM, [(request_name, "gpu-0")], [record("gpu-0")], PLUGIN_DIR)


def test_a_repeated_prepare_takes_its_file_back_from_a_claim_of_the_same_name(tmp_path: Path) -> None:
    """A claim deleted and made again under its name: the new one's prepare wrote the shared path; the old one's
    repeated prepare (before its unprepare) writes its own file back, and the new one's unprepare spares it."""
    files = MetadataFiles(DRIVER, "node-a", tmp_path / "plugin", tmp_path / "cdi", enabled=True)
    newer = "11111111-2222-4333-8444-555555555555"
    records, claim, ours = files.prepared(allocation(), [record("gpu-0")])
    files.write(claim, ours)
    newer_records, newer_claim, theirs = files.prepared(allocation(uid=newer), [record("gpu-0")])
    files.write(newer_claim, theirs)
    host = tmp_path / "plugin/dra-device-metadata/team-a_vm-gpu/gpu/metadata.json"
    assert decode_stream(host.read_bytes())["metadata"]["uid"] == newer
    assert files.ensure(completed(records), allocation()) == ["gpu"]
    assert host.read_bytes() == ours[0].content
    files.release(completed(newer_records, uid=newer))
    assert host.read_bytes() == ours[0].content
    assert [p.name for p in (tmp_path / "cdi").iterdir()] == [f"{DRIVER}_metadata_{UID}_gpu.json"]


def test_two_shares_of_one_gpu_in_two_requests_each_get_their_file_and_id() -> None:
    a, b = "aaaaaaaa-0000-4000-8000-000000000001", "bbbbbbbb-0000-4000-8000-000000000002"
    records = [replace(record("gpu-0", uuid="GPU-1"), share_id=a, requests=("small",)),
               replace(record("gpu-0", uuid="GPU-1"), share_id=b, requests=("other",))]
    allocated = [("small", "gpu-0", a), ("other", "gpu-0", b)]
    files = request_files(DRIVER, "node-a", CLAIM, allocated, records, PLUGIN_DIR)
    assert [f.request for f in files] == ["small", "other"]
    for f in files:
        (device,) = decode_stream(f.content)["requests"][0]["devices"]
        assert device["name"] == "gpu-0"
    with_ids = with_metadata_ids(records, allocated, files)
    assert [r.cdi_ids[1:] for r in with_ids] == [(f"{DRIVER}/metadata={UID}_small",),
                                                (f"{DRIVER}/metadata={UID}_other",)]
