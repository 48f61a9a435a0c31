"""A simulated node's sysfs and /dev trees as tests compare them before and after a change, and what a backend
discovers there."""

from __future__ import annotations

import os
from pathlib import Path

import structlog

from backends.contract import Backend, BackendContext
from backends.topology import TopologyReader
from simulator.node.node import SimulatedNode

Tree = dict[str, tuple[str, str | bytes]]


def tree(root: Path) -> Tree:
    """Every file (with its content), link (with its target) and folder of the node's sysfs and /dev."""
    found: Tree = {}
    for top in ("sys", "dev"):
        for folder, subdirs, files in os.walk(root / top):
            for name in subdirs + files:
                path = os.path.join(folder, name)
                key = os.path.relpath(path, root)
                if os.path.islink(path):
                    found[key] = ("link", os.readlink(path))
                elif os.path.isdir(path):
                    found[key] = ("dir", "")
                else:
                    found[key] = ("file", Path(path).read_bytes())
    return found


def dangling_links(root: Path) -> list[str]:
    """The links of the node's trees whose target is gone."""
    return [k for k, (kind, target) in tree(root).items()
            if kind == "link" and not (root / k).parent.joinpath(str(target)).exists()]


async def inventory(node: SimulatedNode, backend: Backend) -> set[str]:
    """The names of the devices `backend` discovers on the node, started and stopped for it; a warning fails."""
    ctx = BackendContext(node.sysfs, node.dev, node.root, TopologyReader(node.sysfs), {}, structlog.get_logger(),
                         driver_root=node.driver_root)
    await backend.start(ctx)
    try:
        found = await backend.discover()
        assert not found.warnings, found.warnings
        return {d.name for d in found.devices}
    finally:
        await backend.stop()
