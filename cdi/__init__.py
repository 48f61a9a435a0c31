"""Container Device Interface: the spec model the agent writes for container runtimes."""

from cdi.spec import ContainerEdits, DeviceNode, Hook, Mount

__all__ = ["ContainerEdits", "DeviceNode", "Hook", "Mount"]
