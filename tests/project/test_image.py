"""The container image's recipes, without building an image: scripts/build-image.sh (from Debian's mirrors, with
mmdebstrap and buildah) and deploy/Dockerfile (for a machine with an image registry) must take the same steps
from the same lists under scripts/image/, and the wheel they install must hold the product alone."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.support.repository import ROOT

DOCKERFILE = ROOT / "deploy" / "Dockerfile"
BUILD = ROOT / "scripts" / "build-image.sh"
IMAGE = ROOT / "scripts" / "image"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _list(name: str) -> list[str]:
    """The words of a list file under scripts/image/, as build-image.sh reads them (comments dropped)."""
    return [word for line in (IMAGE / name).read_text().splitlines() for word in line.split("#")[0].split()]


def _instructions() -> list[tuple[str, str]]:
    """The Dockerfile's instructions (continuation lines joined), as (keyword, arguments)."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0], line.split(None, 1)[1]) for line in lines]


def _stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile's instructions by build stage; the first holds those before the first FROM."""
    stages: list[list[tuple[str, str]]] = [[]]
    for keyword, args in _instructions():
        if keyword == "FROM":
            stages.append([])
        stages[-1].append((keyword, args))
    return stages


def test_both_recipes_build_the_wheel_from_the_listed_sources() -> None:
    sources = _list("sources")
    wheels_stage = _stages()[1]
    copied = [word.removeprefix("./") for keyword, args in wheels_stage if keyword == "COPY"
              for word in args.split()[:-1] if not word.startswith("scripts/")]
    assert sorted(copied) == sorted(sources), "deploy/Dockerfile copies other paths than scripts/image/sources"
    packages = {p.rstrip("*") for p in PROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages - {"simulator"} <= set(sources), "a product package is missing from the image"
    assert "simulator" not in sources, "the image ships the product alone"
    assert {"pyproject.toml", PROJECT["project"]["readme"]} <= set(sources)
    assert any(keyword == "RUN" and "/image/build-wheels.sh /src /wheels" in args for keyword, args in wheels_stage)
    script = BUILD.read_text()
    assert "list sources" in script and "scripts/image/build-wheels.sh" in script


def test_both_recipes_install_the_listed_packages_and_the_wheels_the_same_way() -> None:
    packages = _list("packages")
    # pyudev loads libudev; Debian's python3 runs the agent, its venv module installs it.
    assert {"python3", "python3-venv", "libudev1"} <= set(packages)
    product = _stages()[-1]
    # The registry build's base is Debian 12, as mmdebstrap's; the same in both stages.
    assert ("ARG", "BASE=debian:bookworm-slim") in _stages()[0]
    assert [stage[0] for stage in _stages()[1:]] == [("FROM", "${BASE} AS wheels"), ("FROM", "${BASE}")]
    runs = [args for keyword, args in product if keyword == "RUN"]
    assert any("/image/packages" in run and "apt-get install" in run and "--no-install-recommends" in run
               and "rm -rf /var/lib/apt/lists/*" in run for run in runs)
    assert any(run.startswith("/image/install-agent.sh ") for run in runs)
    script = BUILD.read_text()
    assert "list packages" in script and "--include=" in script
    assert "install-agent.sh /tmp/wheels" in script
    # --dockerfile builds the Dockerfile itself, its base given through the BASE argument.
    assert '--build-arg "BASE=$base" -f "$repo/deploy/Dockerfile"' in script
    assert "APT::Install-Recommends \"false\"" in script


def test_both_recipes_configure_the_image_the_same_way() -> None:
    product = dict(_stages()[-1])
    script = BUILD.read_text()
    env = dict(word.split("=", 1) for word in product["ENV"].split())
    for name, value in env.items():
        assert f"--env {name}={value}" in script, f"build-image.sh sets no {name}={value}"
    (command,) = PROJECT["project"]["scripts"]
    assert product["ENTRYPOINT"] == json.dumps([command])
    assert f"--entrypoint '{product['ENTRYPOINT']}'" in script
    assert f"--cmd {' '.join(json.loads(product['CMD']))}" in script
    assert env["PATH"].startswith("/opt/dra-agent/bin:")
    assert "python3 -m venv /opt/dra-agent" in (IMAGE / "install-agent.sh").read_text()


def test_the_wheel_from_the_listed_sources_holds_the_product_alone(tmp_path: Path) -> None:
    pytest.importorskip("setuptools")
    source = tmp_path / "src"
    source.mkdir()
    for path in _list("sources"):
        copy = shutil.copytree if (ROOT / path).is_dir() else shutil.copy
        copy(ROOT / path, source / path)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path / "wheels"), str(source)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "wheels").glob("dra_agent-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.startswith("dra_agent-")}
    assert tops == {"agent", "backends", "cdi"}
    # Every product module of the checkout is in it, the generated kubelet protocol among them.
    modules = {str(p.relative_to(ROOT)) for top in tops for p in (ROOT / top).rglob("*.py")}
    assert modules <= set(names), sorted(modules - set(names))[:5]
    assert any(name.startswith("agent/kubelet/_proto/") for name in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "dra-agent = agent.commands.cli:main" in text
    for backend in PROJECT["project"]["entry-points"]["dra_agent.backends"].values():
        assert backend in text


def test_build_script_help_and_bad_usage() -> None:
    done = subprocess.run(["bash", str(BUILD), "--help"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    for option in ("--tag", "--dockerfile", "--no-smoke", "--smoke-only", "--keep", "--runtime", "--ulimit",
                   "mmdebstrap", "buildah", "podman"):
        assert option in done.stdout
    bad = subprocess.run(["bash", str(BUILD), "--bogus"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2
    assert "unknown argument: --bogus" in bad.stderr


def test_smoke_script_help() -> None:
    done = subprocess.run([sys.executable, str(IMAGE / "smoke_image.py"), "--help"], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert "SIGTERM" in done.stdout and "ResourceSlices" in done.stdout


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed (.ci/run installs it)")
def test_shell_scripts_are_shellcheck_clean() -> None:
    scripts = [BUILD, *sorted(IMAGE.glob("*.sh"))]
    done = subprocess.run(["shellcheck", *map(str, scripts)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout


STUB = """#!/bin/sh
{ printf '%s' "$(basename "$0")"; for arg in "$@"; do printf '\\t%s' "$arg"; done; printf '\\n'; } >> "$STUB_LOG"
case "$(basename "$0") $1" in
    "buildah from") echo working-container ;;
    "podman image") echo 1024 ;;
esac
"""


def _build_with_stubs(tmp_path: Path, sources: str | None, **env: str) -> tuple[subprocess.CompletedProcess[str],
                                                                                  list[list[str]]]:
    """`build-image.sh --dockerfile --no-smoke` with mmdebstrap, buildah and podman stood in for by stubs that note
    their arguments, on a machine whose apt configuration lists `sources` (a deb822 file) and an apt proxy."""
    stubs, parts = tmp_path / "bin", tmp_path / "sources.list.d"
    stubs.mkdir(parents=True)
    parts.mkdir()
    for tool in ("mmdebstrap", "buildah", "podman"):
        (stubs / tool).write_text(STUB)
        (stubs / tool).chmod(0o755)
    if sources is not None:
        (parts / "site.sources").write_text(sources)
    (tmp_path / "apt.conf").write_text(
        f'Dir::Etc::sourcelist "{tmp_path}/sources.list";\nDir::Etc::sourceparts "{parts}";\n'
        f'Dir::State::lists "{tmp_path}/lists";\nAcquire::http::Proxy "http://proxy.example.net:3142";\n')
    log = tmp_path / "calls"
    done = subprocess.run(["bash", str(BUILD), "--dockerfile", "--no-smoke"], capture_output=True, text=True,
                          check=False, env={**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}",
                                            "APT_CONFIG": str(tmp_path / "apt.conf"), "STUB_LOG": str(log), **env})
    calls = [line.split("\t") for line in log.read_text().splitlines()] if log.exists() else []
    return done, calls


SITE = """Types: deb
URIs: http://mirror.example.net/debian
Suites: bookworm bookworm-updates
Components: main

Types: deb
URIs: http://mirror.example.net/debian-security
Suites: bookworm-security
Components: main
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("apt-get") is None, reason="needs root and apt (Debian)")
def test_the_image_is_built_from_the_machines_apt_sources_or_the_users(tmp_path: Path) -> None:
    done, calls = _build_with_stubs(tmp_path / "machine", SITE)
    assert done.returncode == 0, done.stderr
    (mmdebstrap,) = [call[1:] for call in calls if call[0] == "mmdebstrap"]
    assert mmdebstrap[-3] == "bookworm" and mmdebstrap[-1] == str(tmp_path / "machine/sources.list.d/site.sources")
    assert '--aptopt=Acquire::http::Proxy "http://proxy.example.net:3142"' in mmdebstrap, "the machine's apt proxy"

    own = tmp_path / "own.list"
    own.write_text("deb http://apt.example.org/debian bookworm main\n")
    done, calls = _build_with_stubs(tmp_path / "user", SITE, DEBIAN_SOURCES=str(own))
    assert done.returncode == 0, done.stderr
    assert [call[-1] for call in calls if call[0] == "mmdebstrap"] == [str(own)]

    # A machine whose apt has no Debian 12, or a sources file that lists more than Debian 12: refused, and why.
    done, calls = _build_with_stubs(tmp_path / "other", SITE.replace("bookworm", "trixie"))
    assert done.returncode == 1 and "DEBIAN_SOURCES" in done.stderr and "list no Debian 12" in done.stderr
    mixed = SITE + "\nTypes: deb\nURIs: http://apt.example.com/tools\nSuites: stable\nComponents: main\n"
    done, calls = _build_with_stubs(tmp_path / "mixed", mixed)
    assert done.returncode == 1 and "lists more than Debian 12 (suite stable)" in done.stderr
    assert not [call for call in calls if call[0] == "mmdebstrap"]
    done, _ = _build_with_stubs(tmp_path / "missing", SITE, DEBIAN_SOURCES=str(tmp_path / "nowhere"))
    assert done.returncode == 1 and "is not a readable file" in done.stderr
