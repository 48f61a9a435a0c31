"""Where this node's hardware is seen: the real host, or a simulated node built from a profile."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from agent.kube.names import is_node_name
from agent.logs import get_logger
from agent.node import simulated
from agent.settings import Settings, lies_under

__all__ = ["Host", "HostError", "NodeNameError", "open_host", "resolve_node_name"]


class HostError(Exception):
    """The node cannot be opened as configured; the message says why."""


class NodeNameError(HostError):
    """No usable node name could be determined."""


@dataclass(frozen=True)
class Host:
    """The sysfs, /dev, host and driver roots backends read, and the simulated profile's name when simulated."""

    sysfs_root: Path
    dev_root: Path
    host_root: Path = Path("/")
    profile: str | None = None
    driver_root: Path = field(kw_only=True)
    """Where the GPU driver's user-space files are seen; `host_root` or below it."""


@contextmanager
def open_host(settings: Settings) -> Iterator[Host]:
    """The real host, or (with `simulate`) a simulated node that exists for the duration of the block.

    A simulated node brings its NVIDIA driver's files, its NVML library among them, so backends run their real
    code paths (NVML is loaded from the driver root as on a real node). `dra-agent run`
    on a kept node (`--sim-root`) re-executes itself under umockdev's preload library first, so that its udev
    monitor sees the node and receives the uevents injected into it. The simulator is reached through
    `agent.node.simulated` only. Raises HostError for an unknown or invalid profile, a missing simulator, or a
    driver root outside the simulated node.
    """
    if settings.simulate is None:
        yield Host(settings.sysfs_root, settings.dev_root, settings.host_root,
                   driver_root=settings.effective_driver_root)
        return
    agent_run = _is_agent_run()
    if settings.sim_root is not None and agent_run:
        # Returns only when this process already runs under the preload, or cannot.
        reason = simulated.reexec_under_preload(settings.sim_root)
        if reason:
            get_logger("host").warning("simulated node without udev events", reason=reason)

    with ExitStack() as stack:
        # The agent's simulated kernel runs beside it, as a real kernel does, not in a thread taking turns with it.
        try:
            node = stack.enter_context(simulated.open_node(settings.simulate, settings.sim_root, agent_run))
        except simulated.SimulatorError as e:
            raise HostError(str(e)) from e
        driver_root = settings.driver_root if settings.driver_root is not None else node.root
        if not lies_under(driver_root, node.root):
            raise HostError(f"driver_root {driver_root} must lie under the simulated node's root {node.root}, which "
                            "is its host root (e.g. --driver-root <sim root>/run/nvidia/driver for a driver "
                            "container's files)")
        yield Host(node.sysfs, node.dev, node.root, node.profile, driver_root=driver_root)


def _is_agent_run() -> bool:
    """Whether this process is `dra-agent run` (or `python -m agent run`) itself: the only process open_host may
    re-execute. Tests and other programs that open a simulated host in their own process are left alone."""
    program = Path(sys.argv[0])
    return (program.name == "dra-agent" or program.parts[-2:] == ("agent", "__main__.py")) and sys.argv[1:2] == ["run"]


def resolve_node_name(settings: Settings, host: Host) -> str:
    """The configured node name, else a simulated node's profile name, else this machine's host name."""
    if settings.node_name:
        return settings.node_name
    if host.profile:
        return host.profile
    name = socket.gethostname().lower()
    if not is_node_name(name):
        raise NodeNameError(f"host name {name!r} is not a valid node name; set --node-name or NODE_NAME")
    return name
