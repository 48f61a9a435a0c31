"""CDI container edits: what a container gets for one device (device nodes, mounts, environment, hooks)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceNode:
    """A device node made available in the container; `host_path` defaults to `path`."""

    path: str
    host_path: str | None = None
    permissions: str | None = None


@dataclass(frozen=True)
class Mount:
    """A bind mount from the host into the container."""

    host_path: str
    container_path: str
    options: tuple[str, ...] = ("ro", "nosuid", "nodev", "bind")


@dataclass(frozen=True)
class Hook:
    """An OCI hook run by the container runtime."""

    hook_name: str
    path: str
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class ContainerEdits:
    """Edits applied to a container that uses a device."""

    env: tuple[str, ...] = ()
    device_nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[Mount, ...] = ()
    hooks: tuple[Hook, ...] = ()
