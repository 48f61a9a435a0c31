"""Host paths in a spec as the container runtime sees them, when it sees the host's root somewhere else than at /.

A backend names host paths as the host sees them (/dev/nvidia0, /usr/lib/x86_64-linux-gnu/libcuda.so.1): the
part below the host root the agent reads. A runtime whose view of that root is a folder (a simulated node's root,
read by the machine's own containerd) finds the same files below that folder. `rooted` writes every host path of a
spec below the runtime's root (device nodes' host paths, mounts' sources, hooks' programs); `unrooted` takes a
spec read back to the backends' form. Container paths, environment and network devices are not host paths.
"""

from __future__ import annotations

import dataclasses
import posixpath

from cdi.spec import ContainerEdits, DeviceNode, Hook, Mount, Spec

__all__ = ["rooted", "unrooted"]


def _below(root: str, path: str) -> str:
    return posixpath.join(root, path.lstrip("/"))


def _above(root: str, path: str) -> str:
    relative = posixpath.relpath(path, root)
    if relative == ".." or relative.startswith("../"):
        return path  # not below the root: written by someone else, left as it is
    return "/" if relative == "." else "/" + relative


def _edits(edits: ContainerEdits, move: str, root: str) -> ContainerEdits:
    def node(n: DeviceNode) -> DeviceNode:
        if move == "in":
            return dataclasses.replace(n, host_path=_below(root, n.host_path or n.path))
        host = _above(root, n.host_path) if n.host_path else None
        return dataclasses.replace(n, host_path=None if host == n.path else host)

    def mount(m: Mount) -> Mount:
        return dataclasses.replace(m, host_path=(_below if move == "in" else _above)(root, m.host_path))

    def hook(h: Hook) -> Hook:
        return dataclasses.replace(h, path=(_below if move == "in" else _above)(root, h.path))

    return dataclasses.replace(edits, device_nodes=tuple(map(node, edits.device_nodes)),
                               mounts=tuple(map(mount, edits.mounts)), hooks=tuple(map(hook, edits.hooks)))


def _move(spec: Spec, move: str, root: str) -> Spec:
    if root in ("", "/"):
        return spec
    return dataclasses.replace(
        spec, container_edits=_edits(spec.container_edits, move, root),
        devices=tuple(dataclasses.replace(d, container_edits=_edits(d.container_edits, move, root))
                      for d in spec.devices))


def rooted(spec: Spec, runtime_root: str) -> Spec:
    """`spec` with its host paths below `runtime_root` (unchanged for /)."""
    return _move(spec, "in", runtime_root)


def unrooted(spec: Spec, runtime_root: str) -> Spec:
    """`spec` read back: host paths below `runtime_root` as the host sees them (unchanged for /); a device node
    whose host path is then its container path has none, as the backends wrote it."""
    return _move(spec, "out", runtime_root)
