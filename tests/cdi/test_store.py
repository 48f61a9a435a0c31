"""The CDI spec directory: atomic writes, failures leave no debris, the sweep touches only this kind's orphans."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from cdi import CdiNameError, CdiSpecError, ContainerEdits, Device, DeviceNode, Hook, Mount, Spec, SpecStore
from tests.support.cdi_schema import cdi_schema_errors

VENDOR, CLASS = "k8s.gpu.nvidia.com", "claim"
KIND = f"{VENDOR}/{CLASS}"
UID = "5d3c8a1e-7f2b-4c6d-9e0a-1b2c3d4e5f60"


def claim_spec(uid: str, minor: int = 0, kind: str = KIND) -> Spec:
    node = DeviceNode(f"/dev/nvidia{minor}")
    return Spec(kind, (Device(f"{uid}-gpu-{minor}", ContainerEdits(device_nodes=(node,))),))


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def store(scratch: Path) -> SpecStore:
    return SpecStore(scratch / "cdi", VENDOR, CLASS)


def files(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def put(directory: Path, name: str, content: Any) -> None:
    text = content if isinstance(content, str) else json.dumps(content)
    (directory / name).write_text(text)


def test_write_is_atomic_and_readable(store: SpecStore) -> None:
    spec = claim_spec(UID)
    with umask(0o077):
        path = store.write(UID, spec)
    assert path == store.directory / f"{VENDOR}-{CLASS}_{UID}.json"
    assert files(store.directory) == [path.name]  # no temporary file left behind
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    doc = json.loads(path.read_text())
    assert doc["cdiVersion"] == "0.5.0"  # the device name starts with a digit of the claim UID
    assert cdi_schema_errors(doc) == []
    assert store.read(UID) == Spec.from_dict(doc)
    assert store.exists(UID)
    assert store.list_ids() == [UID]


def test_write_replaces_the_previous_spec(store: SpecStore) -> None:
    store.write(UID, claim_spec(UID, 0))
    store.write(UID, claim_spec(UID, 1))
    read = store.read(UID)
    assert read is not None and read.devices[0].name == f"{UID}-gpu-1"
    assert files(store.directory) == [f"{VENDOR}-{CLASS}_{UID}.json"]


def test_directory_is_created_0755(scratch: Path) -> None:
    directory = scratch / "run" / "cdi"
    with umask(0o077):
        SpecStore(directory, VENDOR, CLASS)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o755


def test_directory_emptied_while_running_is_recreated(store: SpecStore) -> None:
    store.directory.rmdir()
    store.write(UID, claim_spec(UID))
    assert store.exists(UID)


def test_crash_before_rename_keeps_previous_spec_and_leaves_no_temp(
    store: SpecStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = claim_spec(UID, 0)
    store.write(UID, old)

    def crash(src: Any, dst: Any) -> None:
        assert str(src).endswith(".tmp") and Path(src).exists()  # the data is in the temporary file
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        store.write(UID, claim_spec(UID, 1))
    monkeypatch.undo()
    assert store.read(UID) == Spec.from_json(old.to_json())
    assert files(store.directory) == [f"{VENDOR}-{CLASS}_{UID}.json"]


def test_failed_write_of_a_new_spec_leaves_nothing(store: SpecStore, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_fsync(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        store.write(UID, claim_spec(UID))
    monkeypatch.undo()
    assert files(store.directory) == []
    assert not store.exists(UID) and store.read(UID) is None


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (Spec(KIND, (Device("-bad-"),)), "device name '-bad-'"),
        (claim_spec(UID, kind="k8s.other.com/claim"), "is not this directory's kind"),
        (Spec(KIND, (Device("a"),), cdi_version="0.3.0", annotations={"a": "b"}), "lower than '0.6.0'"),
    ],
)
def test_invalid_specs_are_refused_before_writing(store: SpecStore, spec: Spec, message: str) -> None:
    with pytest.raises(CdiSpecError, match="refusing to write") as raised:
        store.write(UID, spec)
    assert message in str(raised.value)
    assert files(store.directory) == []


@pytest.mark.parametrize("bad_id", ["", "..", "../../etc/passwd", "a b", "x\0"])
def test_unsafe_ids_are_refused(store: SpecStore, bad_id: str) -> None:
    with pytest.raises(CdiNameError):
        store.write(bad_id, claim_spec(UID))
    with pytest.raises(CdiNameError):
        store.delete(bad_id)
    assert files(store.directory) == []


def test_slash_in_id_becomes_underscore(store: SpecStore) -> None:
    path = store.write("ns/pod", claim_spec(UID))
    assert path.name == f"{VENDOR}-{CLASS}_ns_pod.json"
    assert store.list_ids() == ["ns_pod"]
    assert store.sweep(keep={"ns/pod"}) == []
    assert store.exists("ns/pod")


def test_delete(store: SpecStore) -> None:
    assert store.delete(UID) is False  # missing is fine
    store.write(UID, claim_spec(UID))
    assert store.delete(UID) is True
    assert not store.exists(UID) and store.read(UID) is None
    assert files(store.directory) == []


def test_yaml_spec_of_the_same_id_is_replaced_and_deleted(store: SpecStore) -> None:
    yaml_name = f"{VENDOR}-{CLASS}_{UID}.yaml"
    put(store.directory, yaml_name, f"---\ncdiVersion: 0.5.0\nkind: {KIND}\n")
    assert store.exists(UID) and store.list_ids() == [UID]
    # Two files defining the same devices would conflict, and the runtime drops both.
    store.write(UID, claim_spec(UID))
    assert files(store.directory) == [f"{VENDOR}-{CLASS}_{UID}.json"]
    put(store.directory, yaml_name, f"kind: {KIND}\n")
    assert store.delete(UID)
    assert files(store.directory) == []


def test_read_of_a_corrupt_spec_raises(store: SpecStore) -> None:
    put(store.directory, f"{VENDOR}-{CLASS}_{UID}.json", "{not json")
    with pytest.raises(CdiSpecError):
        store.read(UID)


def test_list_and_sweep_touch_only_this_kinds_orphans(store: SpecStore) -> None:
    d = store.directory
    for uid in ("keep-1", "orphan-1", "orphan-2"):
        store.write(uid, claim_spec(uid))
    put(d, f"{VENDOR}-{CLASS}_orphan-3.yaml", f"---\ncdiVersion: 0.3.0\nkind: {KIND}\ndevices: []\n")
    put(d, f"{VENDOR}-{CLASS}_orphan-4.json", "{truncated")  # ours by name, unreadable: swept
    put(d, f"{VENDOR}-{CLASS}_orphan-1.a1b2c3.tmp", "{")  # leftover of an interrupted write
    others = {
        "k8s.other.com-claim_orphan-1.json": claim_spec("x", kind="k8s.other.com/claim").to_dict(),
        f"{VENDOR}-vf_orphan-1.json": claim_spec("x", kind=f"{VENDOR}/vf").to_dict(),
        f"{VENDOR}-{CLASS}.json": claim_spec("x").to_dict(),  # a static spec of this kind, not transient
        # Same name prefix, other kind (class "claim_ext"): told apart by the kind inside the file.
        f"{VENDOR}-{CLASS}_ext_orphan-9.json": claim_spec("x", kind=f"{VENDOR}/{CLASS}_ext").to_dict(),
        f"{VENDOR}-{CLASS}_ext_orphan-8.yaml": f"cdiVersion: 0.3.0\nkind: {VENDOR}/{CLASS}_ext\n",
        f"{VENDOR}-{CLASS}_notes.txt": "not a spec",
        f"{VENDOR}-{CLASS}_bad..id.json": claim_spec("x").to_dict(),  # not a name this store writes
        "spec.123456.tmp": "{",  # another writer's temporary file
        "k8s.other.com-claim_z.abc.tmp": "{",
        "README": "hello",
    }
    for name, content in others.items():
        put(d, name, content)
    (d / f"{VENDOR}-{CLASS}_dir.json").mkdir()

    assert store.list_ids() == ["keep-1", "orphan-1", "orphan-2", "orphan-3", "orphan-4"]
    assert store.sweep(keep=["keep-1", "never-written"]) == ["orphan-1", "orphan-2", "orphan-3", "orphan-4"]
    expected = sorted([*others, f"{VENDOR}-{CLASS}_keep-1.json", f"{VENDOR}-{CLASS}_dir.json"])
    assert files(d) == expected
    for name, content in others.items():
        text = content if isinstance(content, str) else json.dumps(content)
        assert (d / name).read_text() == text
    assert store.list_ids() == ["keep-1"]
    assert store.sweep(keep=[]) == ["keep-1"]


def test_sweep_of_a_missing_directory_is_empty(store: SpecStore) -> None:
    store.directory.rmdir()
    assert store.list_ids() == [] and store.sweep(keep=[]) == []


def test_distinct_ids_from_many_threads(store: SpecStore) -> None:
    uids = [f"{i:08x}-0000-4000-8000-000000000000" for i in range(24)]

    def cycle(uid: str) -> None:
        for minor in range(3):
            store.write(uid, claim_spec(uid, minor))
            assert store.read(uid) == Spec.from_json(claim_spec(uid, minor).to_json())
        if uid.startswith("0000000"):
            store.delete(uid)

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(cycle, uids))
    survivors = [u for u in uids if not u.startswith("0000000")]
    assert store.list_ids() == sorted(survivors)
    assert not [n for n in files(store.directory) if n.endswith(".tmp")]


def test_host_paths_are_written_below_the_runtimes_root_and_read_back(scratch: Path) -> None:
    """A runtime that sees the host root at a folder (this machine's containerd reading a simulated node's specs)
    finds every host path of a spec below that folder; reading the spec back gives what the backend wrote."""
    root = "/dev/shm/node"
    store = SpecStore(scratch / "cdi", VENDOR, CLASS, runtime_root=root)
    common = ContainerEdits(device_nodes=(DeviceNode("/dev/nvidiactl"),),
                            mounts=(Mount("/usr/lib/libnvidia-ml.so.1", "/usr/lib/libnvidia-ml.so.1"),),
                            hooks=(Hook("createContainer", "/usr/bin/nvidia-cdi-hook"),), env=("A=/usr",))
    device = ContainerEdits(device_nodes=(DeviceNode("/dev/nvidia0", host_path="/run/nvidia/driver/dev/nvidia0"),))
    spec = Spec(KIND, (Device(f"{UID}-gpu-0", device),), container_edits=common)
    doc = json.loads(store.write(UID, spec).read_text())
    assert doc["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidiactl", "hostPath": f"{root}/dev/nvidiactl"}]
    assert doc["containerEdits"]["mounts"][0]["hostPath"] == f"{root}/usr/lib/libnvidia-ml.so.1"
    assert doc["containerEdits"]["mounts"][0]["containerPath"] == "/usr/lib/libnvidia-ml.so.1"
    assert doc["containerEdits"]["hooks"][0]["path"] == f"{root}/usr/bin/nvidia-cdi-hook"
    assert doc["containerEdits"]["env"] == ["A=/usr"]
    assert doc["devices"][0]["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia0", "hostPath": f"{root}/run/nvidia/driver/dev/nvidia0"}]
    assert read_back(store) == spec
    assert cdi_schema_errors(doc) == []


def test_host_paths_stay_as_written_for_a_runtime_on_the_host(store: SpecStore) -> None:
    spec = claim_spec(UID)
    doc = json.loads(store.write(UID, spec).read_text())
    assert doc["devices"][0]["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia0"}]
    assert read_back(store) == spec


def read_back(store: SpecStore) -> Spec:
    """The spec of UID as read, its version left to be worked out as for a spec to write."""
    spec = store.read(UID)
    assert spec is not None
    return dataclasses.replace(spec, cdi_version=None)
