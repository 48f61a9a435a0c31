"""The agent image's cache for the real node (`cluster.agent_image`): keyed by what goes into the image and nothing
else, found again without a build."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cluster.agent_image import AgentImageError, build_agent_image, cached_agent_image, image_key
from tests.support.repository import ROOT


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A copy of what the image is made from."""
    copy = tmp_path / "repo"
    (copy / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts/build-image.sh", copy / "scripts")
    shutil.copytree(ROOT / "scripts/image", copy / "scripts/image")
    for path in ("pyproject.toml", "README.md", "cdi"):
        (shutil.copytree if (ROOT / path).is_dir() else shutil.copy)(ROOT / path, copy / path)
    (copy / "agent").mkdir()
    (copy / "agent/__init__.py").write_text("")
    (copy / "backends").mkdir()
    return copy


def test_the_key_follows_what_goes_into_the_image(repo: Path) -> None:
    key = image_key(repo)
    assert image_key(repo) == key
    # Not made from: byte-compiled caches, the simulator, tests.
    (repo / "agent/__pycache__").mkdir()
    (repo / "agent/__pycache__/x.pyc").write_bytes(b"\0")
    (repo / "simulator").mkdir()
    (repo / "simulator/node.py").write_text("x = 1\n")
    assert image_key(repo) == key
    # Made from: a product module, the package list, the build script, the project's metadata.
    for changed in ("agent/__init__.py", "scripts/image/packages", "scripts/build-image.sh", "pyproject.toml"):
        before = (repo / changed).read_text()
        (repo / changed).write_text(before + "\n# changed\n")
        assert image_key(repo) != key, changed
        (repo / changed).write_text(before)
    assert image_key(repo) == key
    (repo / "backends/new.py").write_text("")
    assert image_key(repo) != key


def test_a_built_image_is_found_without_building(repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "no-tools"))  # a build would need mmdebstrap and buildah
    assert cached_agent_image(repo) is None
    with pytest.raises(AgentImageError, match="apt-get install mmdebstrap buildah"):
        build_agent_image(repo)
    key = image_key(repo)
    archive = tmp_path / f"cache/dra-agent/agent-image/0.1.0-{key}/dra-agent.tar"
    archive.parent.mkdir(parents=True)
    archive.write_bytes(b"archive")
    found = build_agent_image(repo)
    assert found == cached_agent_image(repo)
    assert found.archive == archive and found.name == f"localhost/dra-agent:0.1.0-{key[:12]}"
