"""A simulated node in use: built from a profile (or reopened) on disk, with its kernel side served for the
duration of a block: the kernel's reactions to sysfs writes, the NVML server every process's NVML library calls,
and the control channel for injected NVML events (see `simulator.kernel.services`), from threads of this process
or from a process of its own (`simulator.kernel.process`). The hardware itself is `simulator.node.hardware`'s."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from simulator.kernel.attach import Attachment, attach, node_lock
from simulator.kernel.process import KernelProcess
from simulator.kernel.services import NodeServices
from simulator.node.hardware import SimulatedNode, mig_minor
from simulator.node.profile import NodeProfile, load_profile

__all__ = ["SimulatedNode", "mig_minor", "simulated_node"]


def _memory_dir() -> str | None:
    """A RAM-backed scratch directory when there is one: like the real sysfs, the simulated one lives in
    memory; on a disk every file creation costs a journal write and building a large node takes seconds."""
    for candidate in (os.environ.get("XDG_RUNTIME_DIR"), "/dev/shm"):
        if candidate and os.path.isdir(candidate) and os.access(candidate, os.W_OK):
            return candidate
    return None  # the system's temporary directory


@contextmanager
def simulated_node(profile: str | NodeProfile, root: Path | None = None,
                   kernel_process: bool = False) -> Iterator[SimulatedNode]:
    """A node from a profile (name, path or object) with its kernel side served (see `simulator.kernel.services`)
    for the duration of the block: from threads of this process, or with `kernel_process` from a process of its
    own (see `simulator.kernel.process`), as for `dra-agent run`. When another process serves the node at `root`
    already, this one attaches to its kernel instead (see `simulator.kernel.attach`), as processes share one
    kernel on a real node.

    Without `root` the node lives in a temporary folder removed afterwards; with `root` it is kept there
    (see `SimulatedNode.open`).
    """
    spec = load_profile(profile) if isinstance(profile, str) else profile
    temporary = root is None
    where = Path(tempfile.mkdtemp(prefix=f"dra-sim-{spec.name}-", dir=_memory_dir())) if root is None else root
    try:
        where.mkdir(parents=True, exist_ok=True)
        with node_lock(where):
            node = SimulatedNode.build(spec, where) if temporary else SimulatedNode.open(spec, where)
            service = _service(node, kernel_process).start()
        try:
            yield node
        finally:
            if isinstance(service, NodeServices):
                with node_lock(where):  # no process attaches to a node stopping
                    service.stop()
            else:
                service.stop()
    finally:
        if temporary:
            shutil.rmtree(where, ignore_errors=True)


def _service(node: SimulatedNode, in_process_of_its_own: bool) -> NodeServices | KernelProcess | Attachment:
    """How this process uses the node's kernel side (call holding the node's lock)."""
    attachment = attach(node.root)
    if attachment is not None:
        node.served_elsewhere = True
        return attachment
    if in_process_of_its_own:
        return KernelProcess(node.root, node.profile)
    return NodeServices(node.root, node.plan, node.nvml)
