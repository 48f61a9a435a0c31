"""glibc's ld.so.cache, read as the dynamic loader reads it: which file a library name such as
`libnvidia-ml.so.1` stands for on a root file system, for this machine's ABI.

The format (glibc sysdeps/generic/dl-cache.h, written by ldconfig): since glibc 2.32 only the "new" format,
`glibc-ld.so.cache1.1`: a 48-byte header (magic, version, entry count, string table size, an endianness flag
byte, extension offset) followed by 24-byte entries (flags, name offset, path offset, an unused OS version,
hwcap) and the strings. Older ldconfig wrote the "old" format `ld.so-1.7.0` (12-byte entries) first, with the
new one after it, 8-byte aligned; a file of only the old format is read too. String offsets count from the
start of the new header (old format: from the end of the old entries).

An entry's flags hold the file type (`0x03`: ELF for glibc) and the architecture (`0x0300` x86-64 and so on); an
entry with a non-zero hwcap is a variant for CPUs with extra features (glibc-hwcaps subfolders), which the loader
picks only on such CPUs: the search here takes the baseline entries only.
"""

from __future__ import annotations

import platform
import struct
from dataclasses import dataclass

__all__ = ["CacheEntry", "LdCacheError", "abi_flags", "lookup", "parse_ld_cache"]

_OLD_MAGIC = b"ld.so-1.7.0"
_NEW_MAGIC = b"glibc-ld.so.cache1.1"
_NEW_HEADER = struct.Struct("<20sIIB3xI12x")  # magic+version, nlibs, len_strings, flags, extension offset
_NEW_ENTRY = struct.Struct("<iIIIQ")  # flags, key, value, osversion (unused), hwcap
_OLD_HEADER = struct.Struct("<12sI")  # magic (11 bytes and its NUL), nlibs
_OLD_ENTRY = struct.Struct("<iII")  # flags, key, value

_ELF_LIBC6 = 0x0003
_TYPE_MASK, _ARCH_MASK = 0x00FF, 0xFF00
# The architecture byte ldconfig writes for 64-bit libraries of each machine (dl-cache.h FLAG_*_LIB64 and kin).
_ARCH_FLAGS = {"x86_64": 0x0300, "aarch64": 0x0A00, "ppc64le": 0x0500, "s390x": 0x0400, "riscv64": 0x1000}
_ENDIAN_LITTLE, _ENDIAN_BIG, _ENDIAN_MASK = 2, 3, 3


class LdCacheError(ValueError):
    """The bytes are not an ld.so.cache this reader understands; the message says what is wrong."""


@dataclass(frozen=True)
class CacheEntry:
    """One library of the cache: its name (`libnvidia-ml.so.1`), the path the loader opens for it, the flags
    (file type and architecture) and the hwcap word."""

    name: str
    path: str
    flags: int
    hwcap: int = 0


def abi_flags(machine: str | None = None) -> int | None:
    """The flags of this machine's (or `machine`'s, as `platform.machine()` names it) 64-bit glibc libraries;
    None for a machine this reader does not know."""
    arch = _ARCH_FLAGS.get(machine or platform.machine())
    return None if arch is None else arch | _ELF_LIBC6


def _string(data: bytes, base: int, offset: int, what: str) -> str:
    start = base + offset
    end = data.find(b"\0", start)
    if start >= len(data) or end < 0:
        raise LdCacheError(f"{what} at offset {offset} lies outside the file ({len(data)} bytes) or is not "
                           "terminated")
    try:
        return data[start:end].decode()
    except UnicodeDecodeError:
        raise LdCacheError(f"{what} at offset {offset} is not UTF-8 text") from None


def _parse_new(data: bytes, base: int) -> list[CacheEntry]:
    if len(data) - base < _NEW_HEADER.size:
        raise LdCacheError(f"truncated: {len(data) - base} bytes where the {_NEW_HEADER.size}-byte header goes")
    _magic, count, _strings, flags, _extensions = _NEW_HEADER.unpack_from(data, base)
    if flags & _ENDIAN_MASK == _ENDIAN_BIG:
        raise LdCacheError("written for a big-endian machine")
    if flags & _ENDIAN_MASK not in (0, _ENDIAN_LITTLE):
        raise LdCacheError(f"invalid endianness flag {flags & _ENDIAN_MASK}")
    table = base + _NEW_HEADER.size
    if table + count * _NEW_ENTRY.size > len(data):
        raise LdCacheError(f"truncated: the header lists {count} entries, which need "
                           f"{table + count * _NEW_ENTRY.size} bytes; the file has {len(data)}")
    entries = []
    for i in range(count):
        entry_flags, key, value, _os, hwcap = _NEW_ENTRY.unpack_from(data, table + i * _NEW_ENTRY.size)
        entries.append(CacheEntry(_string(data, base, key, f"entry {i}'s name"),
                                  _string(data, base, value, f"entry {i}'s path"), entry_flags, hwcap))
    return entries


def _parse_old(data: bytes, count: int) -> list[CacheEntry]:
    strings = _OLD_HEADER.size + count * _OLD_ENTRY.size
    entries = []
    for i in range(count):
        entry_flags, key, value = _OLD_ENTRY.unpack_from(data, _OLD_HEADER.size + i * _OLD_ENTRY.size)
        entries.append(CacheEntry(_string(data, strings, key, f"entry {i}'s name"),
                                  _string(data, strings, value, f"entry {i}'s path"), entry_flags))
    return entries


def parse_ld_cache(data: bytes) -> list[CacheEntry]:
    """Every entry of an ld.so.cache file's contents, in file order; LdCacheError for anything else."""
    if data.startswith(_NEW_MAGIC):
        return _parse_new(data, 0)
    if not data.startswith(_OLD_MAGIC):
        raise LdCacheError(f"not an ld.so.cache: it starts with {data[:20]!r}")
    if len(data) < _OLD_HEADER.size:
        raise LdCacheError(f"truncated: {len(data)} bytes")
    _magic, count = _OLD_HEADER.unpack_from(data)
    end = _OLD_HEADER.size + count * _OLD_ENTRY.size
    if end > len(data):
        raise LdCacheError(f"truncated: the old-format header lists {count} entries, which need {end} bytes; the "
                           f"file has {len(data)}")
    new = end + (-end % 8)  # the new format follows, aligned as its 8-byte fields need
    if data[new:new + len(_NEW_MAGIC)] == _NEW_MAGIC:
        return _parse_new(data, new)
    return _parse_old(data, count)


def lookup(entries: list[CacheEntry], name: str, flags: int) -> list[str]:
    """The paths the cache gives for library `name` built for the ABI `flags` (see `abi_flags`), baseline
    (hwcap 0) entries only, in cache order, without repeats."""
    found: dict[str, None] = {}
    for entry in entries:
        if (entry.name == name and entry.hwcap == 0 and entry.flags & _TYPE_MASK == flags & _TYPE_MASK
                and entry.flags & _ARCH_MASK == flags & _ARCH_MASK):
            found.setdefault(entry.path)
    return list(found)
