"""Writing glibc's ld.so.cache, as ldconfig writes it, for a simulated driver root: the new format
(`glibc-ld.so.cache1.1`, little-endian, no extensions), entries in ldconfig's order (descending by glibc's
name comparison, which compares runs of digits as numbers), so that the loader's binary search would work on it
too. The agent reads it with `backends.nvidia.ldcache`; `ldconfig -p -C FILE` lists it as glibc reads it.
"""

from __future__ import annotations

import functools
import os
import struct
from collections.abc import Sequence
from pathlib import Path

__all__ = ["library_order", "write_ld_cache"]

_HEADER = struct.Struct("<20sIIB3xI12x")
_ENTRY = struct.Struct("<iIIIQ")
_LITTLE_ENDIAN = 2


def _compare(a: str, b: str) -> int:
    """glibc's _dl_cache_libcmp: character by character, runs of digits by their value, digits after letters."""
    i = j = 0
    while i < len(a):
        if a[i].isdigit():
            if j >= len(b) or not b[j].isdigit():
                return 1
            start_i, start_j = i, j
            while i < len(a) and a[i].isdigit():
                i += 1
            while j < len(b) and b[j].isdigit():
                j += 1
            if int(a[start_i:i]) != int(b[start_j:j]):
                return int(a[start_i:i]) - int(b[start_j:j])
        elif j < len(b) and b[j].isdigit():
            return -1
        elif j >= len(b) or a[i] != b[j]:
            return ord(a[i]) - (ord(b[j]) if j < len(b) else 0)
        else:
            i, j = i + 1, j + 1
    return -(ord(b[j]) if j < len(b) else 0)


def library_order(names: Sequence[str]) -> list[str]:
    """`names` in the order ldconfig writes them."""
    def descending(x: str, y: str) -> int:
        return _compare(y, x)

    return sorted(names, key=functools.cmp_to_key(descending))


def write_ld_cache(path: Path, entries: Sequence[tuple[str, str]], flags: int) -> None:
    """Write a cache of (library name, path) entries, all of ABI `flags` (see backends.nvidia.ldcache.abi_flags),
    atomically."""
    by_name = dict(entries)
    ordered = library_order(list(by_name))
    base = _HEADER.size + _ENTRY.size * len(ordered)
    strings = bytearray()
    rows = bytearray()
    for name in ordered:
        key = base + len(strings)
        strings += name.encode() + b"\0"
        value = base + len(strings)
        strings += by_name[name].encode() + b"\0"
        rows += _ENTRY.pack(flags, key, value, 0, 0)
    header = _HEADER.pack(b"glibc-ld.so.cache1.1", len(ordered), len(strings), _LITTLE_ENDIAN, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_bytes(header + rows + strings)
    os.replace(temp, path)
