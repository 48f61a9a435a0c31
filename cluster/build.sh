#!/usr/bin/env bash
# Build the real Kubernetes components pinned in go.mod into a cache folder keyed by what decides their bytes
# (go.mod, go.sum, the Go version and the build recipe below), and print that folder's bin/. A second run with
# nothing changed finds the folder complete and returns at once; a changed pin builds into a new folder, reusing
# the Go build cache for every package that did not change.
#
#   cluster/build.sh            # build if needed, print the bin folder
#   cluster/build.sh --print    # print the bin folder without building; exit 1 if it is not complete
set -euo pipefail
cd "$(dirname "$0")"

# The release the binaries report as their version (kube::version::ldflags in upstream's hack/lib/version.sh).
# The build date is the release's publication time on the module proxy, so two builds give the same bytes.
kube_version="$(awk '$1 == "k8s.io/kubernetes" { print $2 }' go.mod)"
kube_date="2026-10-27T12:01:04Z"
etcd_version="$(awk '$1 == "go.etcd.io/etcd/server/v3" { print $2 }' go.mod)"
major="${kube_version#v}"; major="${major%%.*}"
minor="${kube_version#v*.}"; minor="${minor%%.*}"
ldflags="-s -w"
for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
    ldflags+=" -X '$pkg.gitVersion=$kube_version' -X '$pkg.gitMajor=$major' -X '$pkg.gitMinor=$minor'"
    ldflags+=" -X '$pkg.gitTreeState=clean' -X '$pkg.buildDate=$kube_date'"
done
kube_commands=(kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet)
binaries=(etcd "${kube_commands[@]}")
# All statically linked, in one build so shared packages compile once. Upstream links the kubelet with cgo (it is
# not in KUBE_STATIC_BINARIES of hack/lib/golang.sh); cgo changes the build of every package below it, so that
# would compile the whole tree a second time, and nothing the kubelet does here needs cgo (names resolve through
# /etc/hosts with Go's own resolver).
export CGO_ENABLED=0
recipe="CGO_ENABLED=$CGO_ENABLED -trimpath $ldflags ${binaries[*]}"

key="$( (cat go.mod go.sum; go version; echo "$recipe") | sha256sum | cut -c1-16)"
out="${XDG_CACHE_HOME:-$HOME/.cache}/dra-agent/cluster/${kube_version}-${key}"

complete() {
    [ -f "$out/complete" ] || return 1
    local b
    for b in "${binaries[@]}"; do [ -x "$out/bin/$b" ] || return 1; done
}

if [ "${1:-}" = "--print" ]; then
    complete || exit 1
    echo "$out/bin"
    exit 0
fi
if complete; then
    echo "$out/bin"
    exit 0
fi

rm -rf "$out"
mkdir -p "$out/bin"
started=$SECONDS
echo "building Kubernetes $kube_version and etcd $etcd_version into $out" >&2
go build -trimpath -ldflags "$ldflags" -o "$out/bin/" "${kube_commands[@]/#/k8s.io/kubernetes/cmd/}"
go build -trimpath -ldflags "-s -w" -o "$out/bin/etcd" go.etcd.io/etcd/server/v3
touch "$out/complete"
echo "built in $((SECONDS - started)) s" >&2
echo "$out/bin"
