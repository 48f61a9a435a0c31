"""The NVIDIA driver's root: where its user-space files are as the agent sees them, and as the host sees them.

The driver is either installed on the host (driver root = the host root) or lives in the GPU operator's driver
container, whose root the host sees at /run/nvidia/driver (driver root = `<host root>/run/nvidia/driver`). Inside
the driver root, paths are the driver's own (`/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05`); its symbolic
links are resolved inside it, as a process with that root would resolve them. A file's path on the host, which
CDI specs name, is its path below the host root; its path in a container is its path below the driver root.

Libraries are found as the dynamic loader would find them in the driver root: its `etc/ld.so.cache` first, then
the usual library folders. Every place looked at is recorded with what was found there, so that a driver that
cannot be found is reported with the paths tried.
"""

from __future__ import annotations

import os
import platform
import stat
from dataclasses import dataclass
from pathlib import Path

from backends.nvidia.ldcache import CacheEntry, LdCacheError, abi_flags, lookup, parse_ld_cache

__all__ = ["Attempt", "DriverRoot", "LibrarySearch", "library_dirs"]

_LINK_HOPS = 40  # as the kernel's limit on symbolic links followed in one lookup (ELOOP)
_DIRS = {
    "x86_64": ("usr/lib64", "usr/lib/x86_64-linux-gnu", "lib64", "lib/x86_64-linux-gnu", "usr/lib", "lib"),
    "aarch64": ("usr/lib64", "usr/lib/aarch64-linux-gnu", "lib64", "lib/aarch64-linux-gnu", "usr/lib", "lib"),
}
_CONTROL_NODE = "nvidiactl"
_PROGRAM_DIRS = ("usr/bin", "bin", "usr/local/bin", "usr/sbin", "sbin")


def _below(path: Path, root: Path) -> str:
    relative = os.path.relpath(path, root)
    return "/" if relative == "." else "/" + relative


def library_dirs(machine: str | None = None) -> tuple[str, ...]:
    """The usual folders of this machine's 64-bit libraries, relative to a root, in the order they are searched."""
    return _DIRS.get(machine or platform.machine(), ("usr/lib64", "lib64", "usr/lib", "lib"))


@dataclass(frozen=True)
class Attempt:
    """One place looked at for a file, and what was there."""

    path: str
    outcome: str

    def __str__(self) -> str:
        return f"{self.path}: {self.outcome}"


@dataclass(frozen=True)
class LibrarySearch:
    """The files found for a library name, best first (each resolved inside the driver root), and every place
    looked at."""

    name: str
    candidates: tuple[Path, ...]
    tried: tuple[Attempt, ...]

    def describe(self) -> str:
        return "; ".join(str(a) for a in self.tried) or "nowhere to look"


class DriverRoot:
    """The NVIDIA driver's files under `driver_root`, which lies at or below `host_root` (both as the agent sees
    them); its device nodes are under `dev_root` unless the driver root has its own (see `device_root`)."""

    def __init__(self, host_root: Path, driver_root: Path, dev_root: Path) -> None:
        self.host_root = host_root
        self.root = driver_root
        self.dev_root = dev_root
        # The parsed ld.so.cache, by the file's identity: searches repeat (driver reloads, retries), it rarely changes.
        self._cache: tuple[tuple[int, int, int], list[CacheEntry] | LdCacheError] | None = None

    def __repr__(self) -> str:
        return f"DriverRoot({str(self.root)!r})"

    # -- paths -----------------------------------------------------------------------------------------

    def host_path(self, path: Path) -> str:
        """Where the host sees a file the agent sees at `path` (below the host root)."""
        return _below(path, self.host_root)

    def container_path(self, path: Path) -> str:
        """Where a container gets a file of the driver the agent sees at `path`: its path in the driver root."""
        return _below(path, self.root)

    def device_root(self) -> Path:
        """Where the driver's device nodes are, as the agent sees them: the driver root's own dev/ when it holds
        the driver's control node (a driver container that made its nodes there), else the node's /dev."""
        own = self.root / "dev"
        return own if (own / _CONTROL_NODE).exists() else self.dev_root

    def device_host_path(self, name: str) -> str | None:
        """Where the host sees device node `name` (e.g. nvidia0, nvidia-caps/nvidia-cap12), when it is not the
        host's /dev/<name> (the node's /dev is the host's); a container always gets it at /dev/<name>."""
        root = self.device_root()
        return None if root == self.dev_root else self.host_path(root / name)

    def resolve(self, inner: str) -> Path | None:
        """The file the driver root's path `inner` (e.g. /usr/lib/libx.so.1) names, with every symbolic link
        followed inside the driver root (an absolute link target starts from the driver root, `..` stops at
        it); None when a part is missing or the links loop."""
        parts = [p for p in inner.split("/") if p and p != "."]
        resolved: list[str] = []
        hops = 0
        while parts:
            part = parts.pop(0)
            if part == "..":
                if resolved:
                    resolved.pop()
                continue
            here = self.root.joinpath(*resolved, part)
            try:
                mode = os.lstat(here).st_mode
            except OSError:
                return None
            if not stat.S_ISLNK(mode):
                resolved.append(part)
                continue
            hops += 1
            if hops > _LINK_HOPS:
                return None
            target = os.readlink(here)
            if target.startswith("/"):
                resolved = []
            parts = [p for p in target.split("/") if p and p != "."] + parts
        return self.root.joinpath(*resolved)

    def find_program(self, name: str) -> Path | None:
        """The executable file the driver root's `name` (e.g. nvidia-cuda-mps-control) is, as the agent sees it:
        the first found in the driver's usual program folders, links resolved inside the driver root."""
        for folder in _PROGRAM_DIRS:
            target = self.resolve(f"/{folder}/{name}")
            if target is not None and target.is_file() and os.access(target, os.X_OK):
                return target
        return None

    # -- libraries -------------------------------------------------------------------------------------

    def find_library(self, name: str) -> LibrarySearch:
        """The regular files that library `name` (a soname such as libnvidia-ml.so.1) stands for in the driver
        root: what its ld.so.cache lists for this machine's ABI, then the same name in the usual folders."""
        tried: list[Attempt] = []
        found: dict[Path, None] = {}
        for inner in self._cached(name, tried):
            self._consider(inner, f"listed in {self.root / 'etc/ld.so.cache'}", tried, found)
        for folder in library_dirs():
            self._consider(f"/{folder}/{name}", "", tried, found)
        return LibrarySearch(name, tuple(found), tuple(tried))

    def _consider(self, inner: str, why: str, tried: list[Attempt], found: dict[Path, None]) -> None:
        path = self.root / inner.lstrip("/")
        target = self.resolve(inner)
        if target is None:
            tried.append(Attempt(str(path), f"{why + ', but ' if why else ''}not found"))
            return
        shown = "" if target == path else f" → {target}"
        if not target.is_file():
            tried.append(Attempt(str(path), f"{why + ', but ' if why else ''}not a regular file{shown}"))
            return
        tried.append(Attempt(str(path), f"{why + ': ' if why else ''}found{shown}"))
        found.setdefault(target)

    def _cached(self, name: str, tried: list[Attempt]) -> list[str]:
        """What the driver root's ld.so.cache lists for `name`; its absence or damage goes into `tried`."""
        path = self.root / "etc/ld.so.cache"
        flags = abi_flags()
        if flags is None:
            tried.append(Attempt(str(path), f"not read: no known library ABI for machine {platform.machine()}"))
            return []
        try:
            info = os.stat(path)
        except OSError as e:
            tried.append(Attempt(str(path), e.strerror or str(e)))
            return []
        key = (info.st_ino, info.st_size, info.st_mtime_ns)
        if self._cache is None or self._cache[0] != key:
            try:
                parsed: list[CacheEntry] | LdCacheError = parse_ld_cache(path.read_bytes())
            except LdCacheError as e:
                parsed = e
            except OSError as e:
                tried.append(Attempt(str(path), e.strerror or str(e)))
                return []
            self._cache = (key, parsed)
        entries = self._cache[1]
        if isinstance(entries, LdCacheError):
            tried.append(Attempt(str(path), f"unreadable ({entries}); searching the library folders"))
            return []
        listed = lookup(entries, name, flags)
        if not listed:
            tried.append(Attempt(str(path), f"no entry for {name} ({platform.machine()})"))
        return listed

