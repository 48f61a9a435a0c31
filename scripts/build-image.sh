#!/usr/bin/env bash
# Builds the dra-agent container image from Debian's packages alone (no image registry), then smoke-tests it.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: scripts/build-image.sh [--tag NAME] [--dockerfile] [--no-smoke | --smoke-only] [--keep DIR]
                              [--runtime NAME] [--ulimit SPEC]... [-h | --help]

Builds the dra-agent container image without an image registry, the same steps as deploy/Dockerfile:

  1. the agent's wheel, from the paths in scripts/image/sources only (no simulator), and its dependencies'
     wheels from the package index pip is configured with (scripts/image/build-wheels.sh);
  2. a Debian 12 (bookworm) root file system with mmdebstrap: the essential set and the packages in
     scripts/image/packages, no recommends, no apt lists, no documentation. Its packages come from where this
     machine's apt takes Debian 12 from (scripts/image/debian-sources.sh), and through its apt proxy if any;
  3. the agent installed into it from the wheels (scripts/image/install-agent.sh, in a chroot);
  4. an image of it, committed with buildah (entry point dra-agent).

Then, unless --no-smoke, runs the image with podman (scripts/image/smoke_image.py): --version, discover, and a
short run against a test API server, on a simulated node laid out on this machine and mounted as the DaemonSet
mounts the host; the run must publish its ResourceSlices and stop cleanly on SIGTERM.

Needs root, and the Debian packages mmdebstrap and buildah (apt-get install mmdebstrap buildah), podman for the
smoke test, python3-venv, and a checkout whose .venv has the simulator extra for the smoke test (pip install -e
'.[test]').

Environment:
  DEBIAN_SOURCES  a sources file (sources.list lines or deb822 stanzas) of Debian 12 to build from instead of
                  this machine's apt sources

Options:
  --tag NAME     the image's name (default: localhost/dra-agent:<version in pyproject.toml>)
  --dockerfile   build deploy/Dockerfile with buildah instead, on a stand-in for its base debian:bookworm-slim
                 made here by mmdebstrap --variant=minbase (no registry needed), and smoke-test that image
  --no-smoke     build only
  --smoke-only   smoke-test an image built before, without building
  --keep DIR     keep the wheels and the root file system's tarball in DIR
  --runtime NAME the OCI runtime of podman and buildah (e.g. runc where crun refuses the host's cgroups)
  --ulimit SPEC  a --ulimit of the containers run (repeatable; where podman may not raise the limits)
  -h, --help     this text
EOF
}

repo=$(cd "$(dirname "$0")/.." && pwd)
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$repo/pyproject.toml")
tag="localhost/dra-agent:$version"
build=1
smoke=1
keep=""
dockerfile=0
container_options=()
while (($#)); do
    case "$1" in
        --tag) tag=${2:?--tag needs a name}; shift ;;
        --no-smoke) smoke=0 ;;
        --smoke-only) build=0 ;;
        --keep) keep=${2:?--keep needs a folder}; shift ;;
        --dockerfile) dockerfile=1 ;;
        --runtime) container_options+=(--runtime "${2:?--runtime needs a name}"); shift ;;
        --ulimit) container_options+=(--ulimit "${2:?--ulimit needs a limit}"); shift ;;
        -h | --help) usage; exit 0 ;;
        *) echo "build-image.sh: unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

# podman only runs the smoke test; building needs the other two.
tools=(mmdebstrap buildah)
((smoke)) && tools+=(podman)
missing=()
for tool in "${tools[@]}"; do
    command -v "$tool" >/dev/null || missing+=("$tool")
done
if ((${#missing[@]})); then
    echo "build-image.sh: missing ${missing[*]}: apt-get install ${missing[*]}" >&2
    exit 1
fi
if ((EUID != 0)); then
    echo "build-image.sh: run as root (mmdebstrap's root mode, rootful podman)" >&2
    exit 1
fi

# The non-comment words of a list file under scripts/image/.
list() {
    sed -e 's/#.*//' "$repo/scripts/image/$1" | tr -s '[:blank:]' '\n' | sed -e '/^$/d'
}

# Sets `apt_sources`, where Debian 12's packages come from (this machine's apt sources for it, or DEBIAN_SOURCES: see
# the helper), and `proxies`, mmdebstrap's options for this machine's apt proxy if it has one (mmdebstrap's apt
# reads a configuration of its own, not the machine's).
debian_sources() {
    mapfile -t apt_sources < <("$repo/scripts/image/debian-sources.sh")
    ((${#apt_sources[@]})) || exit 1
    proxies=()
    local scheme proxy
    for scheme in http https; do
        proxy=""
        eval "$(apt-config shell proxy "Acquire::$scheme::Proxy")"
        if [[ -n $proxy ]]; then
            proxies+=(--aptopt="Acquire::$scheme::Proxy \"$proxy\"")
        fi
    done
}
# No recommends, no documentation: as Debian's slim images.
slim=(
    --aptopt='APT::Install-Recommends "false"'
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*'
    --dpkgopt='path-exclude=/usr/share/info/*' --dpkgopt='path-exclude=/usr/share/locale/*'
)

# Echoes a command, then runs it: the output reads as a transcript (docs/deploy.md quotes one).
say() {
    printf '$'
    printf ' %q' "$@"
    echo
    "$@"
}

build_image() {
    local work
    work=$(mktemp -d /var/tmp/dra-agent-image.XXXXXX)
    # shellcheck disable=SC2064 # expanded now, on purpose: $work is local
    trap "rm -rf '$work'" EXIT

    echo "== wheels: the agent's (from $(list sources | paste -sd ' ')) and its dependencies'"
    mkdir "$work/src"
    mapfile -t sources < <(list sources)
    tar -C "$repo" --exclude=__pycache__ -cf - "${sources[@]}" | tar -C "$work/src" -xf -
    python3 -m venv "$work/venv"
    say env PYTHON="$work/venv/bin/python" "$repo/scripts/image/build-wheels.sh" "$work/src" "$work/wheels"
    ls "$work/wheels"
    if python3 -m zipfile -l "$work/wheels"/dra_agent-*.whl | grep -q '^simulator/'; then
        echo "build-image.sh: the agent's wheel holds the simulator package" >&2
        exit 1
    fi

    debian_sources
    echo "== root file system: Debian 12 from ${apt_sources[*]}"
    local packages
    packages=$(list packages | paste -sd ,)
    # The hooks' "$1" is the root file system's path, which mmdebstrap passes them.
    # shellcheck disable=SC2016
    # The merged-usr hook lays out /usr's links itself: the default for bookworm installs the usrmerge package,
    # which pulls in perl (50 MB).
    say mmdebstrap --mode=root --variant=essential --include="$packages" \
        --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr "${slim[@]}" "${proxies[@]}" \
        --customize-hook="copy-in $work/wheels $repo/scripts/image/install-agent.sh /tmp" \
        --customize-hook='chroot "$1" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin sh /tmp/install-agent.sh /tmp/wheels' \
        --customize-hook='rm -rf "$1"/tmp/wheels "$1"/tmp/install-agent.sh' \
        bookworm "$work/rootfs.tar" "${apt_sources[@]}"

    echo "== image: $tag"
    local container
    container=$(buildah from scratch)
    say buildah add --quiet "$container" "$work/rootfs.tar" /
    # The same configuration as deploy/Dockerfile's ENV, WORKDIR, ENTRYPOINT and CMD.
    say buildah config \
        --env PATH=/opt/dra-agent/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --env PYTHONDONTWRITEBYTECODE=1 --env PYTHONUNBUFFERED=1 \
        --workingdir / --entrypoint '["dra-agent"]' --cmd --help \
        --label org.opencontainers.image.title=dra-agent --label "org.opencontainers.image.version=$version" \
        "$container"
    say buildah commit --quiet --rm "$container" "$tag"
    if [[ -n $keep ]]; then
        mkdir -p "$keep"
        cp -r "$work/wheels" "$work/rootfs.tar" "$keep/"
    fi
    echo "root file system tarball: $(du -h "$work/rootfs.tar" | cut -f1)"
}

# deploy/Dockerfile built with buildah, its base debian:bookworm-slim stood in for by Debian's minbase (what the
# slim image is made of) from the same sources, passed as the BASE build argument.
build_dockerfile() {
    local work base=localhost/dra-agent-base:bookworm
    work=$(mktemp -d /var/tmp/dra-agent-image.XXXXXX)
    # shellcheck disable=SC2064 # expanded now, on purpose: $work is local
    trap "rm -rf '$work'" EXIT
    debian_sources
    echo "== base: Debian 12 minbase from ${apt_sources[*]}, standing in for debian:bookworm-slim"
    say mmdebstrap --mode=root --variant=minbase --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr "${slim[@]}" \
        "${proxies[@]}" bookworm "$work/base.tar" "${apt_sources[@]}"
    local container
    container=$(buildah from scratch)
    buildah add --quiet "$container" "$work/base.tar" /
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd bash "$container"
    buildah commit --quiet --rm "$container" "$base" >/dev/null
    # Where the machine's pip trusts another certificate authority (PIP_CERT: a proxy that intercepts TLS), the
    # build's ca-certificates takes it in as a local one, for the wheels stage's pip. Mounted, not copied: no
    # layer keeps it (the image keeps the empty folder it was mounted on).
    local trust=()
    if [[ -n ${PIP_CERT:-} ]]; then
        mkdir "$work/trust"
        cp "$PIP_CERT" "$work/trust/build-host.crt"
        trust=(--volume "$work/trust:/usr/local/share/ca-certificates:ro")
    fi
    echo "== image: $tag, from deploy/Dockerfile"
    say buildah build --quiet --pull=never --network=host --layers=false "${container_options[@]}" "${trust[@]}" \
        --build-arg "BASE=$base" -f "$repo/deploy/Dockerfile" -t "$tag" "$repo"
}

if ((build && dockerfile)); then
    build_dockerfile
elif ((build)); then
    build_image
fi
echo "image $tag: $(buildah images --noheading --format '{{.Size}}' "$tag")"

if ((smoke)); then
    python=$repo/.venv/bin/python
    [[ -x $python ]] || python=python3
    echo "== smoke test"
    "$python" "$repo/scripts/image/smoke_image.py" "${container_options[@]}" "$tag"
fi
