#!/usr/bin/env bash
# Build the real components the cluster tier runs, each part from the Go module that pins it, into a cache folder
# per part keyed by what decides its bytes (the module's go.mod and go.sum, the Go version and the build recipe
# below), and print each part's bin/ folder, one line each. A second run with nothing changed finds the folders
# complete and returns at once; a changed pin builds into a new folder, reusing the Go build cache for every
# package that did not change.
#
# The parts:
#   kubernetes  go.mod: kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kubelet, etcd
#   node        node-runtime/go.mod: containerd, containerd-shim-runc-v2, ctr, runc, crictl (containerd's
#               dependency versions clash with Kubernetes' staging pins, so the node's runtime is a module of
#               its own; a changed runtime pin never relinks Kubernetes); and pause, the sandbox's program,
#               compiled from the pinned Kubernetes release's build/pause/linux/pause.c as upstream's image has it
#
#   cluster/build.sh [PART...]            # build if needed (default: every part), print the bin folders
#   cluster/build.sh --print [PART...]    # print the bin folders without building; exit 1 if one is not complete
set -euo pipefail
cd "$(dirname "$0")"

cache="${XDG_CACHE_HOME:-$HOME/.cache}/dra-agent/cluster"
version_of() { awk -v m="$1" '$1 == m { print $2 }' "$2"; }

# The parts' recipes: each sets name, binaries, the cache folder `out`, and a `build_part` that fills $out/bin.

kubernetes() {
    # The release the binaries report as their version (kube::version::ldflags in upstream's hack/lib/version.sh).
    # The build date is the release's publication time on the module proxy, so two builds give the same bytes.
    kube_version="$(version_of k8s.io/kubernetes go.mod)"
    local kube_date="2026-10-27T12:01:04Z" major minor pkg
    major="${kube_version#v}"; major="${major%%.*}"
    minor="${kube_version#v*.}"; minor="${minor%%.*}"
    kube_ldflags="-s -w"
    for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
        kube_ldflags+=" -X '$pkg.gitVersion=$kube_version' -X '$pkg.gitMajor=$major' -X '$pkg.gitMinor=$minor'"
        kube_ldflags+=" -X '$pkg.gitTreeState=clean' -X '$pkg.buildDate=$kube_date'"
    done
    kube_commands=(kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet)
    binaries=(etcd "${kube_commands[@]}")
    # All statically linked, in one build so shared packages compile once. Upstream links the kubelet with cgo (it
    # is not in KUBE_STATIC_BINARIES of hack/lib/golang.sh); cgo changes the build of every package below it, so
    # that would compile the whole tree a second time, and nothing the kubelet does here needs cgo (names resolve
    # through /etc/hosts with Go's own resolver).
    local recipe="CGO_ENABLED=0 -trimpath $kube_ldflags ${binaries[*]}"
    local key
    key="$( (cat go.mod go.sum; go version; echo "$recipe") | sha256sum | cut -c1-16)"
    out="$cache/${kube_version}-${key}"
    describe="Kubernetes $kube_version and etcd $(version_of go.etcd.io/etcd/server/v3 go.mod)"
}

build_kubernetes() {
    CGO_ENABLED=0 go build -trimpath -ldflags "$kube_ldflags" -o "$out/bin/" \
        "${kube_commands[@]/#/k8s.io/kubernetes/cmd/}"
    CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$out/bin/etcd" go.etcd.io/etcd/server/v3
}

node() {
    local mod=node-runtime/go.mod
    containerd_version="$(version_of github.com/containerd/containerd/v2 $mod)"
    runc_version="$(version_of github.com/opencontainers/runc $mod)"
    crictl_version="$(version_of sigs.k8s.io/cri-tools $mod)"
    binaries=(containerd containerd-shim-runc-v2 ctr runc crictl pause)
    # Upstream's Makefiles: containerd's (version ldflags, urfave_cli_no_docs; the shim also no_grpc, and always
    # without cgo; without cgo containerd leaves out btrfs, which needs its C headers), runc's (cgo for its C
    # nsenter; seccomp through Debian's libseccomp; not libpathrs, a Rust library Debian does not ship, so runc
    # takes its built-in Go path resolution) and cri-tools' (the version without its "v").
    local c=github.com/containerd/containerd/v2
    containerd_ldflags="-s -w -X $c/version.Version=$containerd_version -X $c/version.Package=$c"
    crictl_ldflags="-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=${crictl_version#v}"
    local recipe="containerd: CGO_ENABLED=0 urfave_cli_no_docs $containerd_ldflags; shim: no_grpc;"
    recipe+=" crictl: CGO_ENABLED=0 $crictl_ldflags; runc: CGO_ENABLED=1 seccomp urfave_cli_no_docs -s -w;"
    kube_version="$(version_of k8s.io/kubernetes go.mod)"
    recipe+=" pause: k8s.io/kubernetes@$kube_version cc $pause_cflags"
    local key
    # runc links Debian's libseccomp with the C compiler: their versions decide its bytes too.
    key="$( (cat node-runtime/go.mod node-runtime/go.sum; go version; echo "$recipe"; cc --version | head -1
             pkg-config --modversion libseccomp 2>/dev/null || true) | sha256sum | cut -c1-16)"
    out="$cache/node-${containerd_version}-${key}"
    describe="containerd $containerd_version, runc $runc_version, crictl $crictl_version and pause"
}

# Upstream's build/pause/Makefile compiles it so (its VERSION also names the git revision, which a module lacks).
pause_cflags="-Os -Wall -Werror -static"

build_node() {
    local c=github.com/containerd/containerd/v2
    if ! command -v pkg-config >/dev/null || ! pkg-config --exists libseccomp; then
        echo "runc needs libseccomp's headers and pkg-config (Debian: libseccomp-dev pkg-config)" >&2
        return 1
    fi
    cd node-runtime
    CGO_ENABLED=0 go build -trimpath -tags urfave_cli_no_docs -ldflags "$containerd_ldflags" -o "$out/bin/" \
        "$c/cmd/containerd" "$c/cmd/ctr"
    CGO_ENABLED=0 go build -trimpath -tags "urfave_cli_no_docs no_grpc" -ldflags "$containerd_ldflags" \
        -o "$out/bin/containerd-shim-runc-v2" "$c/cmd/containerd-shim-runc-v2"
    CGO_ENABLED=0 go build -trimpath -ldflags "$crictl_ldflags" -o "$out/bin/crictl" sigs.k8s.io/cri-tools/cmd/crictl
    CGO_ENABLED=1 go build -trimpath -tags "seccomp urfave_cli_no_docs" -ldflags "-s -w" -o "$out/bin/runc" \
        github.com/opencontainers/runc
    cd ..
    local kube tag
    kube="$(go mod download -json "k8s.io/kubernetes@$kube_version" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')"
    tag="$(awk '$1 == "TAG" { print $3 }' "$kube/build/pause/Makefile")"
    # shellcheck disable=SC2086  # the flags are words
    cc $pause_cflags -DVERSION="v$tag" -o "$out/bin/pause" "$kube/build/pause/linux/pause.c"
}

complete() {
    [ -f "$out/complete" ] || return 1
    local b
    for b in "${binaries[@]}"; do [ -x "$out/bin/$b" ] || return 1; done
}

print_only=false
if [ "${1:-}" = "--print" ]; then print_only=true; shift; fi
parts=("$@")
((${#parts[@]})) || parts=(kubernetes node)
for part in "${parts[@]}"; do
    case "$part" in
        kubernetes|node) ;;
        *) echo "unknown part '$part': kubernetes or node" >&2; exit 2 ;;
    esac
done

for part in "${parts[@]}"; do
    "$part"
    if complete; then
        echo "$out/bin"
        continue
    fi
    $print_only && exit 1
    rm -rf "$out"
    mkdir -p "$out/bin"
    started=$SECONDS
    echo "building $describe into $out" >&2
    "build_$part"
    touch "$out/complete"
    echo "built in $((SECONDS - started)) s" >&2
    echo "$out/bin"
done
