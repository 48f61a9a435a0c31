"""CDI spec model, JSON encoding, minimum versions, naming rules and validation, checked against the CDI schema."""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from pathlib import PurePosixPath
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdi import (
    CdiNameError,
    CdiSpecError,
    ContainerEdits,
    Device,
    DeviceNode,
    Hook,
    Mount,
    NetDevice,
    Spec,
    edits_from_dict,
    edits_to_dict,
    is_valid_class,
    is_valid_device_name,
    is_valid_vendor,
    minimum_version,
    parse_qualified_name,
    qualified_name,
    spec_file_name,
    validate_spec,
)
from cdi.names import HOOK_NAMES
from tests.support.cdi_schema import cdi_schema_errors, schema_example

KIND = "k8s.gpu.nvidia.com/claim"
UID = "0b6f4f4e-2c1a-4d8e-9a51-3f0c5d7e8a90"


def gpu_spec(**changes: Any) -> Spec:
    """A realistic per-claim spec: one GPU device plus common edits."""
    spec = Spec(
        kind=KIND,
        devices=(Device("gpu-0", ContainerEdits(device_nodes=(DeviceNode("/dev/nvidia0"),))),),
        container_edits=ContainerEdits(
            env=("NVIDIA_VISIBLE_DEVICES=void",),
            device_nodes=(DeviceNode("/dev/nvidiactl"),),
            mounts=(Mount("/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1"),),
            hooks=(Hook("createContainer", "/usr/bin/nvidia-cdi-hook", ("nvidia-cdi-hook", "update-ldcache")),),
        ),
    )
    return dataclasses.replace(spec, **changes)


FULL = Spec(
    kind="vendor.com/a.b",
    annotations={"a.example.com/x": "1"},
    devices=(
        Device(
            "0dev",
            ContainerEdits(
                device_nodes=(DeviceNode("/dev/x", "/host/x", "rw", "c", 195, 0, 0o666, 0, 44),),
                net_devices=(NetDevice("eth1", "net0"),),
            ),
            annotations={"k": "v"},
        ),
    ),
    container_edits=ContainerEdits(
        env=("A=1",),
        mounts=(Mount("/h", "/c", ("ro", "bind"), "none"),),
        hooks=(Hook("poststop", "/bin/h", ("h", "x"), ("E=1",), 5),),
        additional_gids=(44, 0),
    ),
)

FULL_JSON: dict[str, Any] = {
    "cdiVersion": "1.1.0",
    "kind": "vendor.com/a.b",
    "devices": [
        {
            "name": "0dev",
            "containerEdits": {
                "deviceNodes": [
                    {
                        "path": "/dev/x",
                        "hostPath": "/host/x",
                        "permissions": "rw",
                        "type": "c",
                        "major": 195,
                        "minor": 0,
                        "fileMode": 0o666,
                        "uid": 0,
                        "gid": 44,
                    }
                ],
                "netDevices": [{"hostInterfaceName": "eth1", "name": "net0"}],
            },
            "annotations": {"k": "v"},
        }
    ],
    "containerEdits": {
        "env": ["A=1"],
        "mounts": [{"hostPath": "/h", "containerPath": "/c", "options": ["ro", "bind"], "type": "none"}],
        "hooks": [{"hookName": "poststop", "path": "/bin/h", "args": ["h", "x"], "env": ["E=1"], "timeout": 5}],
        "additionalGids": [44, 0],
    },
    "annotations": {"a.example.com/x": "1"},
}


# --- JSON encoding ------------------------------------------------------------------------------


def test_every_field_has_its_cdi_key() -> None:
    assert FULL.to_dict() == FULL_JSON
    assert json.loads(FULL.to_json()) == FULL_JSON
    assert next(iter(FULL.to_dict())) == "cdiVersion"


def test_a_document_changed_by_its_reader_leaves_the_next_encodings_alone() -> None:
    # Spec.to_json encodes each edits object once and reuses it; to_dict must still hand out a copy of its own.
    before = FULL.to_json()
    document = FULL.to_dict()
    document["containerEdits"]["mounts"][0]["hostPath"] = "/changed"
    document["devices"][0]["containerEdits"].clear()
    assert FULL.to_json() == before
    assert FULL.to_dict() == FULL_JSON
    assert edits_to_dict(FULL.container_edits) == FULL_JSON["containerEdits"]


def test_round_trip() -> None:
    assert Spec.from_json(FULL.to_json()) == dataclasses.replace(FULL, cdi_version="1.1.0")
    assert Spec.from_json(gpu_spec().to_json()).to_dict() == gpu_spec().to_dict()


def test_empty_and_none_fields_are_left_out_but_required_ones_stay() -> None:
    spec = Spec(KIND, (Device("a", ContainerEdits(device_nodes=(DeviceNode("/dev/a", uid=0),))),))
    assert spec.to_dict() == {
        "cdiVersion": "0.3.0",
        "kind": KIND,
        "devices": [{"name": "a", "containerEdits": {"deviceNodes": [{"path": "/dev/a", "uid": 0}]}}],
    }
    bare = Spec(KIND, (Device("a", ContainerEdits(mounts=(Mount("", "/c", ()),))),))
    assert bare.to_dict()["devices"][0]["containerEdits"] == {"mounts": [{"hostPath": "", "containerPath": "/c"}]}


def test_debian_schema_example_round_trips() -> None:
    example = schema_example("good/spec-example.json")
    spec = Spec.from_dict(example)
    assert spec.to_dict() == example
    assert minimum_version(spec) == "0.5.0"  # it uses deviceNode hostPath


def test_container_edits_codec() -> None:
    edits = FULL.devices[0].container_edits
    assert edits_to_dict(edits) == FULL_JSON["devices"][0]["containerEdits"]
    assert edits_from_dict(edits_to_dict(edits)) == edits
    assert edits_from_dict({}) == ContainerEdits()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(extra=1), "unknown field(s) ['extra']"),
        (lambda d: d["devices"][0]["containerEdits"]["deviceNodes"][0].update(mode=1), "unknown field(s) ['mode']"),
        (lambda d: d["containerEdits"].update(intelRdt={"closID": "x"}), "unknown field(s) ['intelRdt']"),
        (lambda d: d["containerEdits"]["hooks"][0].update(hook_name="x"), "unknown field(s) ['hook_name']"),
        (lambda d: d.pop("cdiVersion"), "missing required field 'cdiVersion'"),
        (lambda d: d["devices"][0].pop("containerEdits"), "missing required field 'containerEdits'"),
        (lambda d: d["containerEdits"]["mounts"][0].pop("containerPath"), "missing required field 'containerPath'"),
        (lambda d: d["devices"][0]["containerEdits"]["deviceNodes"][0].update(uid="0"), "expected int"),
        (lambda d: d["devices"][0]["containerEdits"]["deviceNodes"][0].update(major=True), "expected int"),
        (lambda d: d["containerEdits"].update(env="A=1"), "expected a list"),
        (lambda d: d["containerEdits"].update(additionalGids=[1.5]), "expected int"),
        (lambda d: d.update(annotations={"a": 1}), "expected an object of strings"),
        (lambda d: d.update(devices={}), "expected a list"),
    ],
)
def test_strict_loading(mutate: Any, message: str) -> None:
    doc = json.loads(json.dumps(FULL_JSON))
    Spec.from_dict(doc)  # the unmodified document loads
    mutate(doc)
    with pytest.raises(CdiSpecError) as raised:
        Spec.from_dict(doc)
    assert message in str(raised.value)


def test_loading_rejects_non_json_and_non_objects() -> None:
    with pytest.raises(CdiSpecError, match="not valid JSON"):
        Spec.from_json("cdiVersion: 0.3.0\n")
    with pytest.raises(CdiSpecError, match="expected an object"):
        Spec.from_json("[]")


# --- model --------------------------------------------------------------------------------------


def test_merge_concatenates_in_order_and_drops_exact_duplicates() -> None:
    a = ContainerEdits(env=("A=1", "B=2"), device_nodes=(DeviceNode("/dev/a"),), additional_gids=(5,))
    b = ContainerEdits(
        env=("B=2", "A=3"),
        device_nodes=(DeviceNode("/dev/a", permissions="r"), DeviceNode("/dev/a")),
        mounts=(Mount("/h", "/c"),),
        hooks=(Hook("createContainer", "/bin/h"),),
        additional_gids=(5, 6),
        net_devices=(NetDevice("eth0", "n0"),),
    )
    merged = a.merge(b)
    assert merged.env == ("A=1", "B=2", "A=3")
    assert merged.device_nodes == (DeviceNode("/dev/a"), DeviceNode("/dev/a", permissions="r"))
    assert merged.mounts == b.mounts and merged.hooks == b.hooks and merged.net_devices == b.net_devices
    assert merged.additional_gids == (5, 6)
    assert ContainerEdits().merge(a) == a.merge(ContainerEdits()) == a


def test_model_is_frozen_and_hashable() -> None:
    spec = Spec(KIND, [Device("a", ContainerEdits(env=["A=1"]), annotations={"k": "v"})])  # type: ignore[arg-type]
    assert isinstance(spec.devices, tuple) and isinstance(spec.devices[0].container_edits.env, tuple)
    hash(spec)
    with pytest.raises(TypeError):
        spec.devices[0].annotations["k"] = "w"  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.kind = "x/y"  # type: ignore[misc]


# --- minimum versions ---------------------------------------------------------------------------

EDITS_CASES = [
    (ContainerEdits(mounts=(Mount("/h", "/c"),)), "0.3.0"),
    (ContainerEdits(mounts=(Mount("/h", "/c", type="bind"),)), "0.4.0"),
    (ContainerEdits(device_nodes=(DeviceNode("/dev/a", host_path="/dev/b"),)), "0.5.0"),
    (ContainerEdits(additional_gids=(44,)), "0.7.0"),
    (ContainerEdits(net_devices=(NetDevice("eth1", "net0"),)), "1.1.0"),
    (ContainerEdits(additional_gids=(44,), mounts=(Mount("/h", "/c", type="bind"),)), "0.7.0"),
]


@pytest.mark.parametrize(("edits", "version"), EDITS_CASES)
def test_minimum_version_of_edits(edits: ContainerEdits, version: str) -> None:
    at_spec = Spec(KIND, (Device("a"),), container_edits=edits)
    at_device = Spec(KIND, (Device("a"), Device("b", edits)))
    assert minimum_version(at_spec) == minimum_version(at_device) == version
    assert at_spec.to_dict()["cdiVersion"] == at_device.to_dict()["cdiVersion"] == version


@pytest.mark.parametrize(
    ("spec", "version"),
    [
        (Spec(KIND, (Device("gpu-0"),)), "0.3.0"),
        (Spec(KIND, (Device("gpu-0"), Device(f"{UID}-gpu-0"))), "0.5.0"),
        (Spec(KIND, (Device("gpu-0"),), annotations={"a": "b"}), "0.6.0"),
        (Spec(KIND, (Device("gpu-0", annotations={"a": "b"}),)), "0.6.0"),
        (Spec("k8s.gpu.nvidia.com/claim.v2", (Device("gpu-0"),)), "0.6.0"),
        (Spec("k8s.gpu.nvidia.com/claim", (Device("0", ContainerEdits(additional_gids=(1,))),)), "0.7.0"),
    ],
)
def test_minimum_version_of_names_and_annotations(spec: Spec, version: str) -> None:
    assert minimum_version(spec) == version
    assert spec.to_dict()["cdiVersion"] == version


def test_declared_version_is_kept_and_checked() -> None:
    spec = Spec(KIND, (Device(f"{UID}-gpu-0"),), cdi_version="1.0.0")
    assert spec.to_dict()["cdiVersion"] == "1.0.0"
    assert validate_spec(spec) == []
    assert validate_spec(dataclasses.replace(spec, cdi_version="v0.5.0")) == []
    too_low = validate_spec(dataclasses.replace(spec, cdi_version="0.4.0"))
    assert too_low == ["cdiVersion '0.4.0' is lower than '0.5.0', which this spec's content needs"]
    assert "not a known CDI version" in validate_spec(dataclasses.replace(spec, cdi_version="0.9.0"))[0]


# --- names --------------------------------------------------------------------------------------


@pytest.mark.parametrize("vendor", ["nvidia.com", "k8s.gpu.nvidia.com", "a", "A-b_c.d9", "x" * 253])
def test_valid_vendors(vendor: str) -> None:
    assert is_valid_vendor(vendor) and is_valid_class(vendor[:63])


@pytest.mark.parametrize("name", ["", "9abc", "-a", "a-", "a.", "a/b", "a=b", "a b", "é", "a:b", "x" * 254])
def test_invalid_vendors(name: str) -> None:
    assert not is_valid_vendor(name)
    assert not is_valid_class(name)


def test_class_length_limit() -> None:
    assert is_valid_class("c" * 63) and not is_valid_class("c" * 64)


@pytest.mark.parametrize("name", ["gpu-0", "0", f"{UID}-gpu-0", "a:b", "a.b_c", "Z"])
def test_valid_device_names(name: str) -> None:
    assert is_valid_device_name(name)


@pytest.mark.parametrize("name", ["", "-bad-", "a-", ":a", "a:", "a/b", "a=b", "a b", "a\n", "ü"])
def test_invalid_device_names(name: str) -> None:
    assert not is_valid_device_name(name)


def test_parse_and_build_qualified_names() -> None:
    assert parse_qualified_name(f"{KIND}={UID}-gpu-0") == ("k8s.gpu.nvidia.com", "claim", f"{UID}-gpu-0")
    assert qualified_name(KIND, "gpu-0") == f"{KIND}=gpu-0"
    assert parse_qualified_name(qualified_name("v.com/c", "d:1")) == ("v.com", "c", "d:1")


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("/dev/nvidia0", ["device path"]),
        ("vendor.com/class", ["no '='"]),
        ("vendorclass=dev", ["no '/'"]),
        ("-v/c=d", ["vendor '-v'", "starting with a letter"]),
        ("v/c!=d", ["class 'c!'", "letters, digits"]),
        ("v/c=-d-", ["device name '-d-'", "starting and ending with a letter or digit"]),
        ("v/c=", ["device name ''"]),
        ("/c=d", ["device path"]),
        ("v/=d", ["class ''"]),
    ],
)
def test_parse_errors_say_which_part_is_wrong(name: str, words: list[str]) -> None:
    with pytest.raises(CdiNameError) as raised:
        parse_qualified_name(name)
    for word in words:
        assert word in str(raised.value)


def test_qualified_name_refuses_bad_parts() -> None:
    with pytest.raises(CdiNameError, match="kind"):
        qualified_name("nokind", "a")
    with pytest.raises(CdiNameError, match="device name"):
        qualified_name(KIND, "a/b")


def test_spec_file_names() -> None:
    assert spec_file_name("k8s.gpu.nvidia.com", "claim", UID) == f"k8s.gpu.nvidia.com-claim_{UID}.json"
    assert spec_file_name("v.com", "c", "ns/pod", ".yaml") == "v.com-c_ns_pod.yaml"
    for bad in ("", "..", "../x", "a/../b", ".\0", "a b", "ü", "x" * 300):
        with pytest.raises(CdiNameError):
            spec_file_name("v.com", "c", bad)
    with pytest.raises(CdiNameError, match="vendor"):
        spec_file_name("v/x", "c", "id")


ID_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-/"


@settings(max_examples=300)
@given(st.one_of(st.text(), st.text(alphabet=ID_ALPHABET, min_size=1, max_size=40), st.uuids().map(str)))
def test_transient_ids_stay_inside_the_directory(transient_id: str) -> None:
    prefix = "k8s.gpu.nvidia.com-claim_"
    safe = transient_id.replace("/", "_")
    plain = bool(safe) and ".." not in safe and all(c in ID_ALPHABET for c in safe)
    try:
        name = spec_file_name("k8s.gpu.nvidia.com", "claim", transient_id)
    except CdiNameError:
        assert not plain, f"{transient_id!r} is plain and should be accepted"
        return
    assert plain
    assert name == f"{prefix}{safe}.json"
    assert "/" not in name and "\0" not in name and ".." not in name[len(prefix) : -len(".json")]
    directory = PurePosixPath("/var/run/cdi")
    target = PurePosixPath(os.path.normpath(directory / name))
    assert not PurePosixPath(name).is_absolute() and target.parent == directory


def test_claim_uids_are_plain_ids() -> None:
    for _ in range(20):
        uid = str(uuid.uuid4())
        assert spec_file_name("k8s.gpu.nvidia.com", "claim", uid).endswith(f"_{uid}.json")


# --- validation ---------------------------------------------------------------------------------


def test_realistic_spec_is_valid_for_both_checks() -> None:
    spec = gpu_spec()
    assert validate_spec(spec) == []
    assert cdi_schema_errors(spec.to_dict()) == []
    assert validate_spec(FULL) == []
    assert cdi_schema_errors(FULL.to_dict()) == []


def test_schema_misses_what_validate_spec_catches() -> None:
    spec = Spec("nokind", (Device("-bad-"),), cdi_version="zzz")
    assert cdi_schema_errors(spec.to_dict()) == []
    problems = validate_spec(spec)
    assert len(problems) == 3
    assert "kind 'nokind'" in problems[0]
    assert "device name '-bad-'" in problems[1]
    assert "cdiVersion 'zzz'" in problems[2]


def test_schema_rejects_missing_required_fields() -> None:
    doc = gpu_spec().to_dict()
    del doc["devices"][0]["containerEdits"]["deviceNodes"][0]["path"]
    assert any("'path' is a required property" in e for e in cdi_schema_errors(doc))


def edit(edits: ContainerEdits) -> Spec:
    return gpu_spec(devices=(Device("gpu-0", edits),))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (gpu_spec(kind="vendor.com"), "kind 'vendor.com' has no '/'"),
        (gpu_spec(kind="vendor.com/9c"), "class '9c'"),
        (gpu_spec(devices=()), "spec has no devices"),
        (gpu_spec(devices=(Device("a"), Device("a"))), "devices[1]: device name 'a' is used twice"),
        (gpu_spec(devices=(Device("a b"),)), "devices[0]: device name 'a b' is invalid"),
        (edit(ContainerEdits(env=("NOEQUALS",))), "devices[0].containerEdits.env[0] 'NOEQUALS'"),
        (edit(ContainerEdits(env=("1A=x",))), "env[0] '1A=x'"),
        (edit(ContainerEdits(env=("=x",))), "env[0] '=x'"),
        (edit(ContainerEdits(device_nodes=(DeviceNode("dev/a"),))), "deviceNodes[0].path 'dev/a' is not an absolute"),
        (edit(ContainerEdits(device_nodes=(DeviceNode("/dev/a", "a"),))), "deviceNodes[0].hostPath 'a'"),
        (edit(ContainerEdits(device_nodes=(DeviceNode("/a", type="x"),))), "deviceNodes[0].type 'x'"),
        (edit(ContainerEdits(device_nodes=(DeviceNode("/a", permissions="rx"),))), "permissions 'rx'"),
        (edit(ContainerEdits(device_nodes=(DeviceNode("/a", major=-1),))), "major/minor must be non-negative"),
        (edit(ContainerEdits(device_nodes=(DeviceNode("/a", file_mode=0o10000),))), "fileMode 4096"),
        (edit(ContainerEdits(device_nodes=(DeviceNode("/a", gid=2**32),))), "uid/gid must be within"),
        (edit(ContainerEdits(mounts=(Mount("/h", "c"),))), "mounts[0].containerPath 'c' is not an absolute"),
        (edit(ContainerEdits(mounts=(Mount("", "/c"),))), "mounts[0].hostPath is empty"),
        (edit(ContainerEdits(hooks=(Hook("prestartx", "/h"),))), "hooks[0].hookName 'prestartx'"),
        (edit(ContainerEdits(hooks=(Hook("poststop", "h"),))), "hooks[0].path 'h' is not an absolute"),
        (edit(ContainerEdits(hooks=(Hook("poststop", "/h", env=("X",)),))), "hooks[0].env[0] 'X'"),
        (edit(ContainerEdits(hooks=(Hook("poststop", "/h", timeout=0),))), "hooks[0].timeout 0 must be a positive"),
        (edit(ContainerEdits(additional_gids=(2**32,))), "additionalGids[0] 4294967296 is not within"),
        (edit(ContainerEdits(additional_gids=(-1,))), "additionalGids[0] -1 is not within"),
        (edit(ContainerEdits(net_devices=(NetDevice("eth0", "a/b"),))), "netDevices[0].name 'a/b'"),
        (edit(ContainerEdits(net_devices=(NetDevice("x" * 16, "n"),))), "netDevices[0].hostInterfaceName"),
        (gpu_spec(container_edits=ContainerEdits(env=("A",))), "containerEdits.env[0] 'A'"),
    ],
)
def test_validate_spec_reports(spec: Spec, message: str) -> None:
    problems = validate_spec(spec)
    assert len(problems) == 1, problems
    assert message in problems[0]


def test_all_oci_hook_names_are_allowed() -> None:
    assert {"createRuntime", "createContainer", "startContainer", "poststart", "poststop"} <= HOOK_NAMES
    for name in HOOK_NAMES:
        assert validate_spec(edit(ContainerEdits(hooks=(Hook(name, "/bin/h"),)))) == []


# --- generated specs ----------------------------------------------------------------------------

TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\0"), max_size=8)
KIND_PART = st.from_regex(r"[A-Za-z](?:[A-Za-z0-9_.-]{0,12}[A-Za-z0-9])?", fullmatch=True)
DEVICE_NAME = st.from_regex(r"[A-Za-z0-9](?:[A-Za-z0-9_.:-]{0,12}[A-Za-z0-9])?", fullmatch=True)
PATH = st.lists(
    st.text(st.characters(codec="utf-8", exclude_characters="/\0"), min_size=1, max_size=6), min_size=1, max_size=3
).map(lambda parts: "/" + "/".join(parts))
ENV = st.builds(lambda k, v: f"{k}={v}", st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True), TEXT)
UINT32 = st.integers(0, 2**32 - 1)
IFNAME = st.from_regex(r"[a-z][a-z0-9]{0,14}", fullmatch=True)
ANNOTATIONS = st.dictionaries(st.from_regex(r"[a-z0-9.]{1,10}(?:/[a-z]{1,5})?", fullmatch=True), TEXT, max_size=2)


def optional(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.none() | strategy


def tuples(strategy: st.SearchStrategy[Any], max_size: int = 2) -> st.SearchStrategy[tuple[Any, ...]]:
    return st.lists(strategy, max_size=max_size).map(tuple)


DEVICE_NODES = st.builds(
    DeviceNode,
    path=PATH,
    host_path=optional(PATH),
    permissions=optional(st.sampled_from(["r", "rw", "rwm", "m", "w"])),
    type=optional(st.sampled_from(["b", "c", "u", "p"])),
    major=optional(st.integers(0, 4095)),
    minor=optional(st.integers(0, 2**20 - 1)),
    file_mode=optional(st.integers(0, 0o7777)),
    uid=optional(UINT32),
    gid=optional(UINT32),
)
MOUNTS = st.builds(
    Mount,
    PATH,
    PATH,
    tuples(st.sampled_from(["ro", "rw", "bind", "rbind", "nosuid"]), 3),
    optional(st.sampled_from(["bind", "none", "tmpfs"])),
)
HOOKS = st.builds(
    Hook, st.sampled_from(sorted(HOOK_NAMES)), PATH, tuples(TEXT), tuples(ENV), optional(st.integers(1, 2**32 - 1))
)
EDITS = st.builds(
    ContainerEdits,
    env=tuples(ENV),
    device_nodes=tuples(DEVICE_NODES),
    mounts=tuples(MOUNTS),
    hooks=tuples(HOOKS),
    additional_gids=tuples(UINT32),
    # The CDI library refuses a host or container interface name twice in one containerEdits.
    net_devices=st.lists(st.builds(NetDevice, IFNAME, IFNAME), max_size=3,
                         unique_by=(lambda d: d.host_interface_name, lambda d: d.name)).map(tuple),
)
SPECS = st.builds(
    Spec,
    kind=st.builds(lambda v, c: f"{v}/{c}", KIND_PART, KIND_PART),
    devices=st.lists(
        st.builds(Device, DEVICE_NAME, EDITS, ANNOTATIONS), min_size=1, max_size=3, unique_by=lambda d: d.name
    ).map(tuple),
    container_edits=EDITS,
    annotations=ANNOTATIONS,
)


@settings(max_examples=150, deadline=None)
@given(SPECS)
def test_generated_specs_pass_the_schema_and_validation_and_round_trip(spec: Spec) -> None:
    doc = json.loads(spec.to_json())
    assert cdi_schema_errors(doc) == []
    assert validate_spec(spec) == []
    assert doc["cdiVersion"] == minimum_version(spec)
    loaded = Spec.from_json(spec.to_json())
    assert loaded == dataclasses.replace(spec, cdi_version=minimum_version(spec))
    assert validate_spec(loaded) == []
