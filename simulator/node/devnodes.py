"""The entries of a simulated node's /dev: empty files by default, or real character devices when the node's
profile asks for them (`device_nodes: char`).

The agent only looks the entries up, so files do. A container runtime does more: for every device node a CDI spec
names it stats the host's entry, takes its type and numbers, creates the node in the container and allows it in
the container's device cgroup. So on a node whose containers really start (the real-cluster tier's kubelet and
containerd), each entry is a character device; all carry /dev/null's numbers (1:3), so opening one in a container
is harmless and no simulated entry ever reaches a real device of the machine. Making them needs root (CAP_MKNOD).
"""

from __future__ import annotations

import contextlib
import os
import stat

__all__ = ["NULL_DEVICE", "make_device_node"]

NULL_DEVICE = os.makedev(1, 3)
"""The numbers every character-device entry carries: /dev/null's."""


def make_device_node(path: str, *, char: bool) -> None:
    """Create the /dev entry `path` (its folder exists): an empty file, or with `char` a character device with
    /dev/null's numbers. An entry already there is kept: opening a character device to rewrite it would reach the
    device behind it."""
    if not char:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.close(fd)
        return
    with contextlib.suppress(FileExistsError):
        os.mknod(path, 0o666 | stat.S_IFCHR, NULL_DEVICE)
