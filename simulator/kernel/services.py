"""The simulated node's kernel side while the node is in use: what a real node's kernel and driver do beside the
agent. The kernel's reactions to sysfs writes (`sysfs_writes`), the NVML server that every process's NVML
library calls (`simulator.nvml.server`) and the control channel for injected NVML events
(`simulator.nvml.control`), all on one NVML state; and the socket other processes attach to instead of serving
the node again (`attach`).

Run from threads of the process that opened the node (tests), or in a process of its own (`process`, as
`dra-agent run` uses it); the same code either way. Start it holding the node's lock (`attach.node_lock`).
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType

from simulator.kernel.attach import AttachListener
from simulator.kernel.sysfs_writes import SimulatedKernel
from simulator.node.driver_install import nvml_server_socket
from simulator.node.layout import NodePlan
from simulator.nvml.api import SimulatedNvml
from simulator.nvml.control import ControlServer, control_socket
from simulator.nvml.server import NvmlServer

__all__ = ["NodeServices", "served_nvml"]

_here: dict[Path, NodeServices] = {}  # the nodes this process serves, by root


class NodeServices:
    """Serves the node at `root` laid out by `plan`, with NVML state `nvml`, between `start()` and `stop()`."""

    def __init__(self, root: Path, plan: NodePlan, nvml: SimulatedNvml) -> None:
        self.root = root
        self.kernel = SimulatedKernel(root, plan)
        self.nvml_server = NvmlServer(nvml, nvml_server_socket(root))
        self.control = ControlServer(nvml, control_socket(root), self.kernel.driver_changes)
        self.attachments = AttachListener(root)

    def start(self) -> NodeServices:
        self.kernel.start()
        try:
            self.nvml_server.start()
            self.control.start()
            self.attachments.start()
        except BaseException:
            self.stop()
            raise
        _here[self.root] = self
        return self

    def stop(self) -> None:
        if _here.get(self.root) is self:
            del _here[self.root]
        self.attachments.stop()
        self.control.stop()
        self.nvml_server.stop()
        self.kernel.stop()

    def __enter__(self) -> NodeServices:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()


def served_nvml(root: Path) -> SimulatedNvml:
    """The NVML state of the node at `root`, which this process serves (test-facing: a test looks at or changes
    the GPUs of the node its in-process agent runs on); LookupError when another process serves it."""
    services = _here.get(root)
    if services is None:
        raise LookupError(f"this process does not serve the simulated node at {root}")
    return services.nvml_server.nvml
