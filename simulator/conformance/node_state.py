"""The state of a simulated node as a backend can change it: its sysfs and /dev trees (files, links, folders) and
the simulated NVIDIA driver's MIG state, compared before and after a backend's work."""

from __future__ import annotations

import asyncio
import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

from simulator.node.node import SimulatedNode
from simulator.timing import scaled

__all__ = ["NodeState", "settled_state", "take_state"]

_TREES = ("sys", "dev")
# Write-only control files: the simulated tree keeps what was written last, a real one reads nothing back.
_CONTROL_FILES = frozenset({"bind", "unbind", "new_id", "remove_id", "drivers_probe", "rescan", "remove", "reset"})
# What loading a kernel module leaves behind for good (the first vfio-pci bind loads vfio): not the device's state.
_MODULE_STATE = frozenset({"dev/vfio", "dev/vfio/vfio", "sys/devices/virtual", "sys/devices/virtual/vfio"})
_MAX_READ = 4096
_SHOWN = 12


@dataclass(frozen=True)
class NodeState:
    """Every entry of the node's trees (relative path → what it is) and the NVML state, comparable."""

    entries: Mapping[str, str]

    def changes_since(self, before: NodeState) -> list[str]:
        """What differs from `before`, one line per path, the first few only."""
        lines: list[str] = []
        for path in sorted(before.entries.keys() | self.entries.keys()):
            old, new = before.entries.get(path), self.entries.get(path)
            if old == new:
                continue
            if old is None:
                lines.append(f"{path}: appeared ({new})")
            elif new is None:
                lines.append(f"{path}: gone (was {old})")
            else:
                lines.append(f"{path}: {old} -> {new}")
        if len(lines) > _SHOWN:
            lines[_SHOWN:] = [f"... and {len(lines) - _SHOWN} more"]
        return lines


def take_state(node: SimulatedNode) -> NodeState:
    """Read the node now (blocking: call it off the event loop)."""
    entries: dict[str, str] = {}
    root = str(node.root)
    for tree in _TREES:
        for folder, dirs, files in os.walk(f"{root}/{tree}"):
            rel = os.path.relpath(folder, root)
            for name in dirs + files:
                key = f"{rel}/{name}"
                if key in _MODULE_STATE:
                    continue
                entries[key] = "control file" if name in _CONTROL_FILES else _describe(f"{folder}/{name}")
    for index, gpu in enumerate(node.nvml.gpus):
        current, pending = node.nvml.mig_mode(index)
        instances = ", ".join(f"{i.profile}@{i.start}" for i in node.nvml.instances(index)) or "none"
        entries[f"nvml/{gpu.bus_id}"] = f"MIG {'on' if current else 'off'}" + (
            f" (pending {'on' if pending else 'off'})" if pending != current else "") + f", instances: {instances}"
    return NodeState(entries)


def _describe(path: str) -> str:
    if os.path.islink(path):
        return f"link to {os.readlink(path)}"
    if os.path.isdir(path):
        return "folder"
    try:
        with open(path, "rb") as f:
            content = f.read(_MAX_READ)
    except OSError as e:
        return f"unreadable ({e.strerror})"
    text = content.decode("utf-8", "backslashreplace").strip()
    return f"file {text[:60]!r}" if len(text) <= 60 else f"file of {len(content)} bytes (crc {zlib.crc32(content):08x})"


async def settled_state(node: SimulatedNode, timeout: float = scaled(3.0)) -> NodeState:
    """The node once the simulated kernel's asynchronous effects have landed: two reads in a row agree."""
    previous = await asyncio.to_thread(take_state, node)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        await asyncio.sleep(0.02)
        current = await asyncio.to_thread(take_state, node)
        if current == previous or loop.time() > deadline:
            return current
        previous = current
