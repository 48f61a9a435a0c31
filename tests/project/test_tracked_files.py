"""The repository's tracked files as a site takes them: no package mirror or image registry of ours in them (a site
builds from its own mirrors and pulls from its own registry), except as links in the documentation; and every
script the documentation tells a user to run is committed runnable."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.support.repository import ROOT

SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()

# Hosts that serve packages or images: Debian's and Ubuntu's archives, the container registries, the language
# package indexes, NVIDIA's package repositories. Written as patterns, so this file does not name them itself.
MIRRORS = [
    r"deb\.debian\.org", r"security\.debian\.org", r"ftp\.debian\.org", r"httpredir\.debian\.org",
    r"ftp\.[a-z]{2}\.debian\.org", r"snapshot\.debian\.org", r"archive\.ubuntu\.com", r"security\.ubuntu\.com",
    r"ports\.ubuntu\.com", r"dl-cdn\.alpinelinux\.org",
    r"registry\.k8s\.io", r"k8s\.gcr\.io", r"gcr\.io", r"[a-z0-9-]+\.pkg\.dev", r"docker\.io", r"ghcr\.io",
    r"quay\.io", r"nvcr\.io", r"public\.ecr\.aws", r"mcr\.microsoft\.com", r"registry\.gitlab\.com",
    r"pypi\.org", r"pypi\.python\.org", r"files\.pythonhosted\.org", r"proxy\.golang\.org",
    r"registry\.npmjs\.org", r"developer\.download\.nvidia\.com",
]
# A host name is whole: not the tail of a longer name, nor followed by more of one.
HOST = re.compile(r"(?<![\w.-])(?:[\w-]+\.)*(?:" + "|".join(MIRRORS) + r")(?![\w-]|\.[a-z])", re.I)
# Documentation may link to a page of such a host: [text](https://host/...).
DOC_LINK = re.compile(r"\]\([^)\s]+\)")


def tracked() -> list[tuple[str, str]]:
    """(mode, path) of every tracked file, as git records them."""
    try:
        listing = subprocess.run(["git", "ls-files", "-s", "-z"], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    entries = []
    for entry in listing.split("\0"):
        if entry:
            info, path = entry.split("\t", 1)
            entries.append((info.split()[0], path))
    return entries


def is_documentation(path: str) -> bool:
    return path.endswith(".md") and (path.startswith("docs/") or Path(path).name == "README.md")


def text_of(path: str) -> str | None:
    data = (ROOT / path).read_bytes()
    return None if b"\0" in data else data.decode(errors="replace")


def mirror_hosts(path: str, text: str) -> list[str]:
    """Where the file names a mirror or registry host ("line: host"), documentation links left out."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        if is_documentation(path):
            line = DOC_LINK.sub("]()", line)
        found += [f"{number}: {m.group(0)}" for m in HOST.finditer(line)]
    return found


def test_no_mirror_or_registry_host_is_named_outside_documentation_links() -> None:
    found = {}
    for _, path in tracked():
        if path == SELF:
            continue  # its examples name such hosts, to show that the scan finds them
        text = text_of(path)
        if text is not None and (hosts := mirror_hosts(path, text)):
            found[path] = hosts
    assert not found, f"name no mirror or registry (a site uses its own; a documentation link is fine): {found}"


@pytest.mark.parametrize(("path", "text", "hosts"), [
    ("scripts/x.sh", "mirror=http://deb.debian.org/debian", ["1: deb.debian.org"]),
    ("deploy/x.yaml", "image: ghcr.io/org/app:1", ["1: ghcr.io"]),
    ("x.py", 'IMAGE = "nvcr.io/nvidia/cuda:12"\nINDEX = "https://pypi.org/simple"', ["1: nvcr.io", "2: pypi.org"]),
    ("x.py", "us-docker.pkg.dev/p/r/i and eu.gcr.io/p/i", ["1: us-docker.pkg.dev", "1: eu.gcr.io"]),
    ("docs/x.md", "see [the index](https://pypi.org/project/x/), then pull docker.io/x", ["1: docker.io"]),
    ("README.md", "[Debian](https://deb.debian.org/)", []),
    ("x.py", "notdocker.io.example and docker.iox and mydeb.debian.org.uk", []),
    ("x.py", "image: dra-agent:0.1.0, registry.example.com/dra-agent", []),
])  # fmt: skip
def test_the_scan_finds_hosts_and_allows_only_documentation_links(path: str, text: str, hosts: list[str]) -> None:
    assert mirror_hosts(path, text) == hosts


def documented_commands() -> set[str]:
    """Tracked files the documentation runs: the first word of a command in a fenced code block (after a `$`
    prompt, `sudo`, `env` and its variables)."""
    paths = {path for _, path in tracked()}
    commands = set()
    for path in paths:
        if not is_documentation(path):
            continue
        blocks = re.findall(r"^```[^\n]*\n(.*?)^```", (ROOT / path).read_text(), re.M | re.S)
        for line in (line for block in blocks for line in block.splitlines()):
            try:
                words = shlex.split(line.removeprefix("$ "), comments=True)
            except ValueError:
                continue
            while words and (words[0] in ("sudo", "env") or re.fullmatch(r"\w+=.*", words[0])):
                words = words[1:]
            if words and words[0].removeprefix("./") in paths:
                commands.add(words[0].removeprefix("./"))
    return commands


def test_every_script_the_documentation_runs_is_committed_runnable() -> None:
    modes = {path: mode for mode, path in tracked()}
    commands = documented_commands()
    assert {"scripts/build-image.sh", "scripts/generate-admission-policy"} <= commands, "the docs' commands are read"
    scripts = {path for path in modes if (ROOT / path).read_bytes()[:2] == b"#!"}
    assert ".ci/run" in scripts
    not_runnable = sorted(path for path in commands | scripts if modes[path] != "100755")
    assert not_runnable == [], "git update-index --chmod=+x them: as the docs run them, they say Permission denied"
    assert commands <= scripts, "a command the docs run names its interpreter on its first line"
