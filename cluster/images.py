"""The node's container images, made here: no registry is reachable, so the node's containerd gets them as OCI
image archives imported with `ctr images import`.

Two images, each one uncompressed layer:

- the pause image, the sandbox every pod's containers join: upstream's `pause` program, compiled by
  `cluster/build.sh` from the Kubernetes release's own `build/pause/linux/pause.c`, as upstream's image has it
  (`/pause`, run as 65535);
- the test image: Debian's static busybox with a link per applet under `/bin`, so pods can run `sh -c`.

Both are named under `localhost/`: were a pod ever to ask for a pull, containerd would try 127.0.0.1 and nothing
else. Pods use `imagePullPolicy: Never`.

An archive is an OCI image layout (`oci-layout`, `index.json`, `blobs/sha256/...`) in a tar, the form
`ctr images export` writes: the index names the image by `io.containerd.image.name` and its tag by
`org.opencontainers.image.ref.name`. Every tar is written with fixed owners and times, so the same inputs make the
same digests.
"""

from __future__ import annotations

import hashlib
import io
import json
import platform
import subprocess
import tarfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BUSYBOX", "Image", "busybox_image", "pause_image", "write_archive"]

BUSYBOX = Path("/bin/busybox")
"""Debian's busybox-static."""

_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}
_LAYER = "application/vnd.oci.image.layer.v1.tar"
_CONFIG = "application/vnd.oci.image.config.v1+json"
_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_INDEX = "application/vnd.oci.image.index.v1+json"


@dataclass(frozen=True)
class Image:
    """An image to build: its full name, its files (path in the image → content and mode), symbolic links (path
    → target), folders beyond the files' own (path → mode), and its configuration (entrypoint, user...)."""

    name: str
    files: Mapping[str, tuple[bytes, int]]
    config: Mapping[str, Any]
    links: Mapping[str, str] = field(default_factory=dict)
    folders: Mapping[str, int] = field(default_factory=dict)


def pause_image(pause: Path, version: str) -> Image:
    """Upstream's pause image (build/pause/Dockerfile): `/pause` as entrypoint, run as 65535:65535."""
    return Image(f"localhost/dra-agent/pause:{version}", {"pause": (pause.read_bytes(), 0o755)},
                 {"Entrypoint": ["/pause"], "User": "65535:65535"})


def busybox_image(busybox: Path = BUSYBOX) -> Image:
    """Debian's static busybox at /bin/busybox with every applet it lists linked to it, `sh` as the command."""
    applets = subprocess.run([str(busybox), "--list"], capture_output=True, text=True, check=True).stdout.split()
    version = _busybox_version(busybox)
    return Image(f"localhost/dra-agent/busybox:{version}", {"bin/busybox": (busybox.read_bytes(), 0o755)},
                 {"Cmd": ["sh"], "Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]},
                 links={f"bin/{applet}": "busybox" for applet in applets if applet != "busybox"},
                 folders={"tmp": 0o1777})


def _busybox_version(busybox: Path) -> str:
    """The version busybox prints first ("BusyBox v1.35.0 (Debian 1:1.35.0-4+b3) multi-call binary.")."""
    banner = subprocess.run([str(busybox)], capture_output=True, text=True, check=False).stdout.split()
    return banner[1].lstrip("v") if len(banner) > 1 and banner[0] == "BusyBox" else "unknown"


def _layer(image: Image) -> bytes:
    """The image's one layer: its folders, files and links; owners root, times zero."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        parents = {str(Path(p).parent): 0o755 for p in (*image.files, *image.links) if str(Path(p).parent) != "."}
        for folder, mode in sorted({**parents, **image.folders}.items()):
            tar.addfile(_info(folder, tarfile.DIRTYPE, mode))
        for path, (data, mode) in sorted(image.files.items()):
            info = _info(path, tarfile.REGTYPE, mode)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for path, target in sorted(image.links.items()):
            info = _info(path, tarfile.SYMTYPE, 0o777)
            info.linkname = target
            tar.addfile(info)
    return out.getvalue()


def _info(path: str, kind: bytes, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(path)
    info.type, info.mode, info.mtime, info.uid, info.gid = kind, mode, 0, 0, 0
    return info


def _blob(data: bytes, media_type: str) -> tuple[dict[str, Any], bytes]:
    return {"mediaType": media_type, "digest": "sha256:" + hashlib.sha256(data).hexdigest(), "size": len(data)}, data


def _json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def write_archive(image: Image, path: Path) -> Path:
    """Write `image` as an OCI image layout tar at `path`; returns `path`."""
    layer, layer_bytes = _blob(_layer(image), _LAYER)
    arch = _ARCH.get(platform.machine(), platform.machine())
    config, config_bytes = _blob(_json({
        "architecture": arch, "os": "linux", "config": dict(image.config),
        "rootfs": {"type": "layers", "diff_ids": [layer["digest"]]},  # uncompressed: the diff id is the digest
    }), _CONFIG)
    manifest, manifest_bytes = _blob(_json({
        "schemaVersion": 2, "mediaType": _MANIFEST, "config": config, "layers": [layer]}), _MANIFEST)
    tag = image.name.rpartition(":")[2]
    manifest["annotations"] = {"io.containerd.image.name": image.name, "org.opencontainers.image.ref.name": tag}
    manifest["platform"] = {"architecture": arch, "os": "linux"}
    index = _json({"schemaVersion": 2, "mediaType": _INDEX, "manifests": [manifest]})
    entries: Iterable[tuple[str, bytes]] = [
        ("oci-layout", _json({"imageLayoutVersion": "1.0.0"})),
        ("index.json", index),
        *((f"blobs/sha256/{d['digest'].removeprefix('sha256:')}", b)
          for d, b in ((layer, layer_bytes), (config, config_bytes), (manifest, manifest_bytes))),
    ]
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for folder in ("blobs", "blobs/sha256"):
            tar.addfile(_info(folder, tarfile.DIRTYPE, 0o755))
        for name, data in entries:
            info = _info(name, tarfile.REGTYPE, 0o644)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path
