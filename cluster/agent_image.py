"""The agent's own container image for the node, as operators run it: built by `scripts/build-image.sh` (Debian's
packages and the agent's wheels, no registry) and kept as an OCI image archive that the node's containerd imports
with `ctr images import`, as it imports the busybox and pause images (`cluster.images`).

The archive is cached in `~/.cache/dra-agent/agent-image/<version>-<key>/`, the key a hash of everything the
image is made from: the build script, `scripts/image/*`, and the repository paths `scripts/image/sources` lists
(the agent's packages and `pyproject.toml`). A second build with nothing changed finds the archive and takes no
time; a changed source builds a new one. What the key cannot see are the Debian packages and wheels of the day the
image was built: the image holds the newest of each its pins allow then.

`python -m cluster agent-image` (or `python3 -m cluster.agent_image`, which needs nothing but the standard library,
for a machine without the project's venv) builds it or finds it, and prints its name and archive.

The image is named `localhost/dra-agent:<version>-<first 12 digits of the key>`: under `localhost/` a pull
could only ever try 127.0.0.1, and a changed image gets a new name, so a node never runs a stale one by its name.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cluster import HERE

__all__ = ["AgentImage", "AgentImageError", "build_agent_image", "cached_agent_image", "image_key", "main"]

REPO = HERE.parent
_BUILD = REPO / "scripts/build-image.sh"
_IMAGE_SCRIPTS = REPO / "scripts/image"
_ARCHIVE = "dra-agent.tar"


class AgentImageError(Exception):
    """The image could not be built or exported; the message says which step and its output's end."""


@dataclass(frozen=True)
class AgentImage:
    """The agent's image: its name and the OCI image archive that holds it."""

    name: str
    archive: Path


def _cache_root() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "dra-agent" / "agent-image"


def _listed_sources(repo: Path) -> list[str]:
    """The paths of `scripts/image/sources` (comments and blank lines dropped), as build-image.sh reads them."""
    text = (repo / "scripts/image/sources").read_text()
    return [word for line in text.splitlines() for word in line.partition("#")[0].split()]


def _files(repo: Path) -> list[Path]:
    """Every file the image is made from, in a fixed order: byte-compiled caches left out, as the build leaves
    them out."""
    roots = [repo / "scripts/build-image.sh", repo / "scripts/image",
             *(repo / path for path in _listed_sources(repo))]
    found: list[Path] = []
    for root in roots:
        if root.is_dir():
            found += [p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        elif root.exists():
            found.append(root)
    return sorted(set(found))


def image_key(repo: Path = REPO) -> str:
    """A hash of the image's inputs: each file's path in the repository and its content."""
    digest = hashlib.sha256()
    for path in _files(repo):
        digest.update(str(path.relative_to(repo)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def _version(repo: Path) -> str:
    for line in (repo / "pyproject.toml").read_text().splitlines():
        if line.startswith("version = "):
            return line.partition("=")[2].strip().strip('"')
    return "0"


def _image(repo: Path) -> AgentImage:
    version, key = _version(repo), image_key(repo)
    folder = _cache_root() / f"{version}-{key}"
    return AgentImage(f"localhost/dra-agent:{version}-{key[:12]}", folder / _ARCHIVE)


def cached_agent_image(repo: Path = REPO) -> AgentImage | None:
    """The image of the repository as it is now, when its archive was built before; else None."""
    image = _image(repo)
    return image if image.archive.is_file() else None


def _run(step: str, argv: list[str], log: Path) -> None:
    with log.open("a") as out:
        done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-20:])
        raise AgentImageError(f"{step} failed (exit status {done.returncode}); the end of {log}:\n{tail}")


def build_agent_image(repo: Path = REPO) -> AgentImage:
    """The image's archive, from the cache or built now (build-image.sh, then `buildah push` into an OCI
    archive; the image is then removed from buildah's own storage, the archive being all the node needs). The
    build's output goes to `build.log` beside the archive."""
    image = cached_agent_image(repo)
    if image is not None:
        return image
    image = _image(repo)
    missing = [tool for tool in ("mmdebstrap", "buildah") if shutil.which(tool) is None]
    if missing:
        raise AgentImageError(f"building the agent's image needs {' and '.join(missing)}: "
                              f"apt-get install {' '.join(missing)}")
    image.archive.parent.mkdir(parents=True, exist_ok=True)
    log = image.archive.parent / "build.log"
    log.write_text("")
    print(f"building {image.name} (a few minutes); its log: {log}", file=sys.stderr, flush=True)
    _run("scripts/build-image.sh", ["bash", str(_BUILD), "--no-smoke", "--tag", image.name], log)
    # Written beside its final name and renamed: an archive in the cache is always whole.
    with tempfile.TemporaryDirectory(dir=image.archive.parent) as scratch:
        partial = Path(scratch) / _ARCHIVE
        try:
            _run("buildah push", ["buildah", "push", "--quiet", image.name, f"oci-archive:{partial}:{image.name}"],
                 log)
        finally:
            subprocess.run(["buildah", "rmi", image.name], capture_output=True, check=False)
        partial.rename(image.archive)
    return image


def main() -> int:
    """Build the image or find it in the cache; print its name and archive (exit status 1 when the build fails)."""
    try:
        image = build_agent_image()
    except AgentImageError as e:
        print(e, file=sys.stderr)
        return 1
    print(image.name, image.archive)
    return 0


if __name__ == "__main__":
    sys.exit(main())
