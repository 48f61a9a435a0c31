"""Removing a claim's device metadata: what is not there counts as removed (a file or folder gone already, one whose
name the file system could never hold), so unprepare and the roll-back of a prepare cut short always complete and
free the device; a real failure to remove is still told, in words."""

from __future__ import annotations

import errno
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from unittest import mock

import pytest

from agent.claims.metadata import MetadataError
from agent.claims.metadata_files import MetadataFiles
from agent.claims.records import ClaimRecord, DeviceRecord
from agent.claims.recovery import recover
from simulator.node.node import SimulatedNode
from tests.support.prepare_env import PrepareEnv, prepare_env

GPU = "gpu.nvidia.com"
UID = "0b6f4f4e-2c1a-4d8e-9a51-3f0c5d7e8a90"
LONG = "c" * 248 + ".x"  # a claim name of 250 characters: `default_<name>` would be 258 bytes


def started(name: str) -> ClaimRecord:
    return ClaimRecord(UID, "default", name, "started", "boot", (DeviceRecord("gpu-0", "nvidia-gpu"),))


@pytest.mark.parametrize("root_exists", [True, False])
def test_removing_files_no_name_could_have_counts_as_removed(tmp_path: Path, root_exists: bool) -> None:
    files = MetadataFiles("d.example.com", "node-a", tmp_path / "plugin", tmp_path / "cdi", enabled=True)
    if root_exists:
        files.root.mkdir(parents=True)
    files.release(started(LONG))
    files.remove(UID, "default", LONG, ["gpu"])


def test_a_folder_gone_while_removing_counts_as_removed_and_a_real_failure_is_told(tmp_path: Path) -> None:
    files = MetadataFiles("d.example.com", "node-a", tmp_path / "plugin", tmp_path / "cdi", enabled=True)
    folder = files.root / "default_vm" / "gpu"
    folder.mkdir(parents=True)
    with mock.patch("shutil.rmtree", side_effect=FileNotFoundError(errno.ENOENT, "No such file or directory")):
        files.release(started("vm"))
    denied = PermissionError(errno.EACCES, "Permission denied", str(folder))
    with mock.patch("shutil.rmtree", side_effect=denied), pytest.raises(MetadataError) as failed:
        files.release(started("vm"))
    assert str(failed.value) == f"{folder}: Permission denied"


@pytest.fixture
async def env(sim_node: Callable[[str], SimulatedNode], scratch: Path) -> AsyncIterator[PrepareEnv]:
    environment = await prepare_env(sim_node("dgx-h100"), scratch, ("nvidia-gpu",), backend_state=True)
    yield environment
    await environment.close()


@pytest.mark.parametrize("gone", ["metadata file", "request folder", "claim folder", "metadata root", "spec"])
async def test_unprepare_completes_when_its_metadata_is_gone_already(env: PrepareEnv, gone: str) -> None:
    preparer = env.preparer(GPU, device_metadata=True)
    device = env.devices(GPU)[0]
    ref = env.claims.add("vm", [("dev", GPU, device)])
    assert (await preparer.prepare([ref]))[ref.uid].error == ""
    root = env.plugin_dir(GPU) / "dra-device-metadata"
    path = {"metadata file": root / "default_vm/dev/metadata.json", "request folder": root / "default_vm/dev",
            "claim folder": root / "default_vm", "metadata root": root,
            "spec": env.cdi_dir / f"{GPU}_metadata_{ref.uid}_dev.json"}[gone]
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    assert await preparer.unprepare([ref]) == {ref.uid: ""}
    assert env.kept_of(preparer, ref) == []
    other = env.claims.add("other", [("gpu", GPU, device)])
    assert (await preparer.prepare([other]))[other.uid].error == ""


@pytest.mark.parametrize("long_name", [False, True])
@pytest.mark.parametrize("root_exists", [True, False])
@pytest.mark.parametrize("undo", ["unprepare", "prepare", "restart"])
async def test_a_started_record_whose_files_never_existed_is_undone(
        env: PrepareEnv, long_name: bool, root_exists: bool, undo: str) -> None:
    """What a prepare cut short before any file was written leaves (or one of a name no file can have, left by an
    agent that did not check names), with the setting off since: the kubelet's unprepare, its next prepare of the
    claim, and a restart each undo it and free the device."""
    device = env.devices(GPU)[0]
    if root_exists:
        (env.plugin_dir(GPU) / "dra-device-metadata").mkdir(parents=True)
    preparer = env.preparer(GPU, device_metadata=False)
    ref = env.claims.add(LONG if long_name else "vm", [("gpu", GPU, device)])
    preparer.checkpoint.start(ref.uid, ref.namespace, ref.name, [(device, "nvidia-gpu")])
    if undo == "unprepare":
        assert await preparer.unprepare([ref]) == {ref.uid: ""}
    elif undo == "prepare":
        assert (await preparer.prepare([ref]))[ref.uid].error == ""
        assert await preparer.unprepare([ref]) == {ref.uid: ""}
    else:
        preparer.checkpoint.close()
        preparer = env.preparer(GPU, device_metadata=False)
        await recover(preparer)
    assert env.kept_of(preparer, ref) == []
    other = env.claims.add("other", [("gpu", GPU, device)])
    assert (await preparer.prepare([other]))[other.uid].error == ""
    assert await preparer.unprepare([other]) == {other.uid: ""}
