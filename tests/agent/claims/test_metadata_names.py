"""Device metadata and the file system's limits: the longest names the API server allows fit the metadata paths
except `<namespace>_<claim>`, which can exceed a file name's 255 bytes and is then refused before anything is
written, in words; the file system's own limits count."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest

from agent.claims.metadata import ClaimIdentity, MetadataError, check_names, request_files
from agent.claims.metadata_files import MetadataFiles
from agent.claims.read import ClaimAllocation, DeviceAllocation
from agent.claims.records import DeviceRecord
from agent.kube.names import is_dns_label, is_dns_subdomain, is_driver_name
from backends.contract import ClaimRef

UID = "0b6f4f4e-2c1a-4d8e-9a51-3f0c5d7e8a90"
LONGEST_DRIVER = "d" * 59 + ".com"  # 63 characters, the most a driver name may have
LONGEST_LABEL = "r" * 63
PLUGIN_DIR = f"/var/lib/kubelet/plugins/{LONGEST_DRIVER}"


def subdomain(size: int) -> str:
    """An object name of `size` characters (the labels of an object name have no length limit of their own)."""
    return "n" * (size - 2) + ".x" if size > 2 else "n" * size


def test_the_longest_names_fit_when_namespace_and_claim_name_together_fit() -> None:
    name = subdomain(253)
    assert is_dns_subdomain(name) and len(name) == 253 and is_driver_name(LONGEST_DRIVER)
    assert is_dns_label(LONGEST_LABEL)
    claim = ClaimIdentity(UID, "a", name, pod_claim_name=LONGEST_LABEL)  # a_<253> is 255 bytes
    check_names(LONGEST_DRIVER, claim, [f"{LONGEST_LABEL}/{LONGEST_LABEL}"], PLUGIN_DIR)
    (f,) = request_files(LONGEST_DRIVER, "node-a", claim, [(f"{LONGEST_LABEL}/{LONGEST_LABEL}", "gpu-0")],
                         [DeviceRecord("gpu-0", "nvidia-gpu")], PLUGIN_DIR)
    assert len(f.relative_path.parts[1]) == 255
    # The CDI spec file: driver (63) + "_metadata_" + UID (36) + "_" + request (63) + ".json" = 178 bytes.
    assert len(f"{LONGEST_DRIVER}_metadata_{UID}_{LONGEST_LABEL}.json") == 178


@pytest.mark.parametrize(("namespace", "size"), [("ab", 253), ("default", 250), ("n" * 63, 253)])
def test_a_namespace_and_claim_name_too_long_for_a_file_name_are_refused_in_words(namespace: str, size: int) -> None:
    name = subdomain(size)
    folder = len(namespace) + 1 + size
    with pytest.raises(MetadataError) as refused:
        check_names(LONGEST_DRIVER, ClaimIdentity(UID, namespace, name), ["gpu"], PLUGIN_DIR)
    assert str(refused.value) == (
        f"claim {namespace}/{name} cannot get device metadata (setting device_metadata): the name of its folder, "
        f"<namespace>_<claim name>, would have {folder} bytes, more than the 255 a file name may have on this node; "
        "namespace and claim name together may have at most 254 characters")


def test_the_file_systems_own_limits_count() -> None:
    claim = ClaimIdentity(UID, "ns", subdomain(140))  # ns_<140>: 143 bytes, what eCryptfs allows
    check_names(LONGEST_DRIVER, claim, ["gpu"], PLUGIN_DIR, name_max=143)
    with pytest.raises(MetadataError, match="would have 144 bytes, more than the 143"):
        check_names(LONGEST_DRIVER, ClaimIdentity(UID, "ns", subdomain(141)), ["gpu"], PLUGIN_DIR, name_max=143)
    with pytest.raises(MetadataError, match="request name gpu-request has more than the 10 bytes"):
        check_names(LONGEST_DRIVER, ClaimIdentity(UID, "n", "c"), ["gpu-request"], PLUGIN_DIR, name_max=10)
    deep = "/" + "/".join(["p" * 200] * 19)  # a plugin folder of 3,819 bytes
    with pytest.raises(MetadataError, match="too long for a path on this node"):
        check_names(LONGEST_DRIVER, ClaimIdentity(UID, "ns", subdomain(252)), ["gpu"], deep)


def test_the_files_ask_their_file_system(tmp_path: Path) -> None:
    def allocation(name: str) -> ClaimAllocation:
        return ClaimAllocation(ClaimRef(UID, "default", name), (DeviceAllocation("gpu", "d.example.com", "n", "g"),),
                               ())

    files = MetadataFiles("d.example.com", "node-a", tmp_path / "plugin", tmp_path / "cdi", enabled=True)
    files.check(allocation(subdomain(247)))  # default_<247>: 255 bytes
    with pytest.raises(MetadataError, match="would have 258 bytes, more than the 255"):
        files.check(allocation(subdomain(250)))
    assert not (tmp_path / "plugin").exists(), "checked before anything is written"
    real = os.pathconf
    with mock.patch("os.pathconf", lambda path, name: 143 if name == "PC_NAME_MAX" else real(path, name)):
        small = MetadataFiles("d.example.com", "node-a", tmp_path / "plugin", tmp_path / "cdi", enabled=True)
    with pytest.raises(MetadataError, match="would have 144 bytes, more than the 143"):
        small.check(allocation(subdomain(136)))
