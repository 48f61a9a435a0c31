"""Reading sysfs attribute files and links, with errors that name the file."""

from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = ["SysfsError", "list_dir", "list_pci_devices", "read_attr", "read_hex", "read_int", "read_link_name"]

# A missing file or a path through a missing directory just means "not there"; anything else is a fault.
_ABSENT = (errno.ENOENT, errno.ENOTDIR, errno.ENODEV)


class SysfsError(Exception):
    """A sysfs file exists but cannot be read or does not hold what it should."""


def read_attr(path: str | Path) -> str | None:
    """The stripped text of a sysfs attribute, or None when it does not exist."""
    # os.open/os.read rather than open(): sysfs files are tiny and a node may have thousands of them.
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            data = os.read(fd, 4096)
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno in _ABSENT:
            return None
        raise SysfsError(f"cannot read {path}: {e.strerror or e}") from e
    return data.decode("ascii", errors="replace").strip()


def read_int(path: str | Path) -> int | None:
    """A decimal integer attribute (e.g. numa_node, sriov_numvfs), or None when absent."""
    text = read_attr(path)
    if text is None:
        return None
    try:
        return int(text, 10)
    except ValueError:
        raise SysfsError(f"{path} holds {text!r}, expected a decimal integer") from None


def read_hex(path: str | Path) -> int | None:
    """A hexadecimal attribute such as vendor ('0x10de') or class ('0x030200'), or None when absent."""
    text = read_attr(path)
    if text is None:
        return None
    try:
        return int(text, 16)
    except ValueError:
        raise SysfsError(f"{path} holds {text!r}, expected a hexadecimal number") from None


def read_link_name(path: str | Path) -> str | None:
    """The last component of a symlink's target (a driver or IOMMU group link), or None when absent."""
    try:
        return os.path.basename(os.readlink(path))
    except OSError as e:
        if e.errno in (*_ABSENT, errno.EINVAL):
            return None
        raise SysfsError(f"cannot read link {path}: {e.strerror or e}") from e


def list_pci_devices(sysfs_root: Path) -> list[str]:
    """Bus ids of every PCI function under `bus/pci/devices`, sorted; empty when there is no PCI bus."""
    try:
        return sorted(os.listdir(sysfs_root / "bus" / "pci" / "devices"))
    except FileNotFoundError:
        return []
    except OSError as e:
        raise SysfsError(f"cannot list {sysfs_root / 'bus/pci/devices'}: {e.strerror or e}") from e


def list_dir(path: str | Path) -> list[str]:
    """Sorted entries of a sysfs directory, or an empty list when it does not exist."""
    try:
        return sorted(os.listdir(path))
    except OSError as e:
        if e.errno in _ABSENT:
            return []
        raise SysfsError(f"cannot list {path}: {e.strerror or e}") from e
