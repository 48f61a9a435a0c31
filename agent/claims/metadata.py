"""Device metadata for containers (KEP-5304): what the file of one claim request holds, where it lives on the host
and in the container, and the CDI spec that mounts it there.

Pure. One file per request (a subrequest `req/sub` counts as its base request `req`), a JSON stream of one
`metadata.resource.k8s.io/v1alpha1` `DeviceMetadata` object: the claim's name, namespace and UID, the pod's name
for a claim made from a template, and the request's devices with their attributes (the backends' `facts`, in the
ResourceSlice form) and network data. The file goes to
`<plugins_dir>/<driver>/dra-device-metadata/<namespace>_<claim>/<request>/metadata.json`; a CDI spec
`<driver>_metadata_<claim UID>_<request>.json` of kind `<driver>/metadata` mounts it read-only at
`/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim>/<request>/<driver>-metadata.json`, or
`.../resourceclaimtemplates/<pod claim name>/<request>/...` for a claim made from a template, where a workload (a
KubeVirt launcher) looks for it. The CDI ID `<driver>/metadata=<claim UID>_<request>` goes with the first device
of the request in the kubelet's answer.

Every name a claim puts into these paths is checked before anything is written (`check_names`): the annotation and
the request names are DNS labels, and `<namespace>_<claim>` (up to 63 + 1 + 253 bytes, over the 255 bytes a file name
may have) must fit the file system.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import PurePath
from typing import Any

from agent.claims.records import DeviceRecord
from agent.kube.names import is_dns_label
from backends.attributes import attribute_json
from cdi.names import MAX_SPEC_FILE_NAME, CdiNameError, qualified_name
from cdi.spec import ContainerEdits, Device, Mount, Spec

__all__ = [
    "API_VERSION",
    "CDI_CLASS",
    "CDI_VERSION",
    "CONTAINER_ROOT",
    "DIRECTORY",
    "FILE",
    "KIND",
    "NAME_MAX",
    "PATH_MAX",
    "ClaimIdentity",
    "MetadataError",
    "RequestFile",
    "Result",
    "base_request",
    "cdi_id",
    "check_names",
    "claim_directory",
    "container_path",
    "decode_stream",
    "host_file",
    "is_metadata_id",
    "request_files",
    "spec_file_prefix",
    "spec_for",
    "transient_id",
    "with_metadata_ids",
]

API_VERSION = "metadata.resource.k8s.io/v1alpha1"
KIND = "DeviceMetadata"
CDI_CLASS = "metadata"
CDI_VERSION = "0.5.0"
CONTAINER_ROOT = "/var/run/kubernetes.io/dra-device-attributes"
"""Where a container finds the files (k8s.io/dynamic-resource-allocation api/metadata)."""
DIRECTORY = "dra-device-metadata"
"""The host folder of the files, in the driver's plugin data folder."""
FILE = "metadata.json"
MOUNT_OPTIONS = ("ro", "bind")
NAME_MAX = 255
"""Bytes a file name may have (Linux's usual file systems), when the file system does not say."""
PATH_MAX = 4096
"""Bytes a path may have, with its terminating zero (Linux), when the file system does not say."""
_TEMP_ROOM = len(".metadata.json.12345678.tmp") - len(FILE)
"""What the temporary file of an atomic write adds to a file's name (agent/claims/metadata_files.py)."""


class MetadataError(ValueError):
    """The claim's metadata cannot be made; the message says why."""


@dataclass(frozen=True)
class ClaimIdentity:
    """The claim a file is about; `pod_claim_name` only for a claim made from a template."""

    uid: str
    namespace: str
    name: str
    pod_claim_name: str | None = None


@dataclass(frozen=True)
class RequestFile:
    """The metadata of one request: the file's content, where it lives on the host (relative to the driver's plugin
    data folder), and the CDI spec that mounts it."""

    request: str  # the base request
    relative_path: PurePath
    content: bytes
    spec: Spec
    cdi_id: str


def base_request(request: str) -> str:
    """`req` of `req/sub`: the request a subrequest belongs to (what the kubelet and the pod know)."""
    return request.split("/", 1)[0]


def transient_id(claim_uid: str, request: str) -> str:
    """`<claim UID>_<base request>`: the CDI device name and the variable part of the spec file name."""
    return f"{claim_uid}_{base_request(request)}"


def cdi_id(driver: str, claim_uid: str, request: str) -> str:
    """`<driver>/metadata=<claim UID>_<base request>`, as the kubelet hands it to the runtime."""
    return qualified_name(f"{driver}/{CDI_CLASS}", transient_id(claim_uid, request))


def is_metadata_id(driver: str, cdi_device_id: str) -> bool:
    return cdi_device_id.startswith(f"{driver}/{CDI_CLASS}=")


def spec_file_prefix(driver: str) -> str:
    """`<driver>_metadata_`: the spec files are `<prefix><claim UID>_<base request>.json`."""
    return f"{driver}_{CDI_CLASS}_"


def claim_directory(namespace: str, name: str) -> PurePath:
    """The claim's folder, relative to the driver's plugin data folder: `dra-device-metadata/<namespace>_<name>`."""
    return PurePath(DIRECTORY, f"{namespace}_{name}")


def host_file(namespace: str, name: str, request: str) -> PurePath:
    """The request's file, relative to the driver's plugin data folder."""
    return claim_directory(namespace, name) / base_request(request) / FILE


def container_path(driver: str, claim: ClaimIdentity, request: str) -> str:
    """Where the container finds the request's file."""
    if claim.pod_claim_name is not None:
        where = f"resourceclaimtemplates/{claim.pod_claim_name}"
    else:
        where = f"resourceclaims/{claim.name}"
    return f"{CONTAINER_ROOT}/{where}/{base_request(request)}/{driver}-metadata.json"


def spec_for(driver: str, claim: ClaimIdentity, request: str, host_path: str) -> Spec:
    """The CDI spec mounting the request's file (at `host_path` on the host) into the container."""
    mount = Mount(host_path=host_path, container_path=container_path(driver, claim, request), options=MOUNT_OPTIONS)
    device = Device(name=transient_id(claim.uid, request), container_edits=ContainerEdits(mounts=(mount,)))
    return Spec(kind=f"{driver}/{CDI_CLASS}", cdi_version=CDI_VERSION, devices=(device,))


def document(driver: str, pool: str, claim: ClaimIdentity, request: str,
             devices: Sequence[DeviceRecord]) -> dict[str, Any]:
    """The `DeviceMetadata` object of one request (`request` as allocated: `req` or `req/sub`)."""
    body: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": claim.name, "namespace": claim.namespace, "uid": claim.uid, "generation": 1},
    }
    if claim.pod_claim_name is not None:
        body["podClaimName"] = claim.pod_claim_name
    entries = []
    for d in devices:
        entry: dict[str, Any] = {"driver": driver, "pool": pool, "name": d.device}
        if d.facts:
            entry["attributes"] = {key: attribute_json(value) for key, value in sorted(d.facts.items())}
        if d.network is not None:
            network: dict[str, Any] = {}
            if d.network.interface_name:
                network["interfaceName"] = d.network.interface_name
            if d.network.ips:
                network["ips"] = list(d.network.ips)
            if d.network.hardware_address:
                network["hardwareAddress"] = d.network.hardware_address
            entry["networkData"] = network
        entries.append(entry)
    body["requests"] = [{"name": request, "devices": entries}]
    return body


Result = tuple[str, str] | tuple[str, str, str | None]
"""One allocation result of the driver: (request as allocated, device), with the share ID for a share of a device."""


def _parts(result: Result) -> tuple[str, tuple[str, str | None]]:
    """(request, (device, share ID)): a share of a device is a device of its own in a claim."""
    return result[0], (result[1], result[2] if len(result) == 3 else None)


def request_files(driver: str, pool: str, claim: ClaimIdentity, allocated: Sequence[Result],
                  records: Sequence[DeviceRecord], plugin_dir: str) -> list[RequestFile]:
    """The file and spec of each request of a prepared claim. `allocated`: the allocation results of this driver, in
    the claim's order; `records`: the prepared devices; `plugin_dir`: the driver's plugin data folder as an absolute
    path."""
    check_names(driver, claim, [result[0] for result in allocated], plugin_dir)
    by_device = {(r.device, r.share_id): r for r in records}
    requests: dict[str, tuple[str, list[DeviceRecord]]] = {}
    for result in allocated:
        request, key = _parts(result)
        record = by_device.get(key)
        if record is None:
            raise MetadataError(f"device {key[0]} of request {request} was not prepared")
        _, devices = requests.setdefault(base_request(request), (request, []))
        if record not in devices:
            devices.append(record)
    files = []
    for base, (request, devices) in requests.items():
        relative = host_file(claim.namespace, claim.name, base)
        content = encode_stream([document(driver, pool, claim, request, devices)])
        try:
            spec = spec_for(driver, claim, base, f"{plugin_dir.rstrip('/')}/{relative}")
            identifier = cdi_id(driver, claim.uid, base)
        except CdiNameError as e:
            raise MetadataError(f"driver name {driver} cannot name a CDI kind: {e}") from None
        files.append(RequestFile(base, relative, content, spec, identifier))
    return files


def check_names(driver: str, claim: ClaimIdentity, requests: Sequence[str], plugin_dir: str, *,
                name_max: int = NAME_MAX, path_max: int = PATH_MAX) -> None:
    """MetadataError, saying which name and why, unless every file and folder of the claim's metadata can be made:
    the pod claim name and the request names are DNS labels (they are path parts), each file or folder name has at
    most `name_max` bytes, each path fewer than `path_max`, and each CDI spec file name fits the spec store. Pure;
    `requests` as allocated (`req` or `req/sub`), `plugin_dir` as in `request_files`."""
    where = f"claim {claim.namespace}/{claim.name}"
    if claim.pod_claim_name is not None and not is_dns_label(claim.pod_claim_name):
        raise MetadataError(f"{where}: annotation resource.kubernetes.io/pod-claim-name "
                            f"{claim.pod_claim_name[:80]!r} is not a pod claim name (a DNS label)")
    for request in requests:
        if not all(is_dns_label(part) for part in request.split("/", 1)):
            raise MetadataError(f"{where}: request name {request[:80]!r} is not a DNS label (or two, for a "
                                "subrequest): it cannot name a metadata file")
    folder = claim_directory(claim.namespace, claim.name).name
    if len(folder.encode()) > name_max:
        raise MetadataError(
            f"{where} cannot get device metadata (setting device_metadata): the name of its folder, "
            f"<namespace>_<claim name>, would have {len(folder.encode())} bytes, more than the {name_max} a file name "
            f"may have on this node; namespace and claim name together may have at most {name_max - 1} characters")
    for base in dict.fromkeys(base_request(r) for r in requests):
        if len(base.encode()) > name_max:  # a DNS label has at most 63; a file system may allow fewer
            raise MetadataError(f"{where}: request name {base} has more than the {name_max} bytes a file name may "
                                "have on this node: it cannot name a metadata folder")
        path = f"{plugin_dir.rstrip('/')}/{host_file(claim.namespace, claim.name, base)}"
        if len(path.encode()) + _TEMP_ROOM >= path_max:
            raise MetadataError(f"{where}: the path of its device metadata file for request {base} would have "
                                f"{len(path.encode())} bytes, too long for a path on this node (at most "
                                f"{path_max - 1 - _TEMP_ROOM} here)")
        spec_file = f"{spec_file_prefix(driver)}{transient_id(claim.uid, base)}.json"
        if len(spec_file.encode()) > MAX_SPEC_FILE_NAME:
            raise MetadataError(f"{where}: the CDI spec file of its device metadata for request {base} would have a "
                                f"name of {len(spec_file.encode())} bytes, more than the {MAX_SPEC_FILE_NAME} a spec "
                                "file name may have")


def with_metadata_ids(records: Sequence[DeviceRecord], allocated: Sequence[Result],
                      files: Sequence[RequestFile]) -> tuple[DeviceRecord, ...]:
    """The records with each request's metadata CDI ID added to the first device allocated for it."""
    first: dict[str, tuple[str, str | None]] = {}
    for result in allocated:
        request, key = _parts(result)
        first.setdefault(base_request(request), key)
    extra: dict[tuple[str, str | None], list[str]] = {}
    for f in files:
        extra.setdefault(first[f.request], []).append(f.cdi_id)
    return tuple(replace(r, cdi_ids=(*r.cdi_ids, *(i for i in extra.get((r.device, r.share_id), ())
                                                   if i not in r.cdi_ids)))
                 for r in records)


def encode_stream(objects: Sequence[Mapping[str, Any]]) -> bytes:
    """A JSON stream: each object (newest API version first) on a line of its own."""
    return b"".join(json.dumps(o, separators=(",", ":")).encode() + b"\n" for o in objects)


def decode_stream(data: bytes) -> dict[str, Any]:
    """The first object of a metadata file whose apiVersion this agent reads; MetadataError when there is none."""
    decoder = json.JSONDecoder()
    text, at = data.decode(), 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            raise MetadataError(f"no {API_VERSION} {KIND} object in the metadata file")
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError as e:
            raise MetadataError(f"metadata file is not a JSON stream: {e}") from None
        if isinstance(value, dict) and value.get("apiVersion") == API_VERSION and value.get("kind") == KIND:
            return value
