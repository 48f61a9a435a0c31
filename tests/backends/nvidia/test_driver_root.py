"""The NVIDIA driver root: glibc's ld.so.cache read as the loader reads it (checked against caches the real
ldconfig makes), libraries found in a driver root with every place tried recorded, links resolved inside it,
and host, container and device paths."""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from backends.nvidia.driver_root import DriverRoot, library_dirs
from backends.nvidia.ldcache import CacheEntry, LdCacheError, abi_flags, lookup, parse_ld_cache

LDCONFIG = shutil.which("ldconfig") or "/sbin/ldconfig"  # glibc's own; /sbin is not on every PATH


def known_abi(machine: str | None = None) -> int:
    """`abi_flags` of a machine the reader knows (this one's without `machine`)."""
    flags = abi_flags(machine)
    assert flags is not None, f"no glibc library flags known for {machine or 'this machine'}"
    return flags


X86 = known_abi("x86_64")


def shared_library(folder: Path, soname: str, version: str) -> Path:
    """A real (tiny) shared library `<soname minus .1>.<version>` with that soname, as ldconfig wants ELF files."""
    source = folder / "lib.c"
    source.write_text("int dra_agent_test_symbol(void) { return 42; }\n")
    path = folder / f"{soname.removesuffix('.1')}.{version}"
    subprocess.run(["cc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(path), str(source)], check=True)
    source.unlink()
    return path


def ldconfig_cache(scratch: Path, *folders: Path) -> Path:
    """A cache made by the real ldconfig (`-C FILE -f CONF DIR…`), for `folders` and the system's trusted ones."""
    conf = scratch / "ld.so.conf"
    conf.write_text("")
    cache = scratch / "ld.so.cache"
    subprocess.run([LDCONFIG, "-C", str(cache), "-f", str(conf), *map(str, folders)], check=True)
    return cache


def ldconfig_listing(cache: Path) -> set[tuple[str, str]]:
    """(name, path) of each entry as `ldconfig -p` prints it: glibc's own reading of the cache."""
    text = subprocess.run([LDCONFIG, "-p", "-C", str(cache)], check=True, capture_output=True, text=True).stdout
    return {(m[1], m[2]) for m in re.finditer(r"^\s+(\S+) \([^)]*\) => (\S+)$", text, re.M)}


def test_the_parser_reads_what_the_real_ldconfig_writes(scratch: Path) -> None:
    libs = scratch / "lib"
    libs.mkdir()
    shared_library(libs, "libnvidia-ml.so.1", "580.95.05")
    shared_library(libs, "libcuda.so.1", "580.95.05")
    cache = ldconfig_cache(scratch, libs)
    entries = parse_ld_cache(cache.read_bytes())
    assert {(e.name, e.path) for e in entries} == ldconfig_listing(cache)
    assert lookup(entries, "libnvidia-ml.so.1", known_abi()) == [f"{libs}/libnvidia-ml.so.1"]
    assert os.readlink(libs / "libnvidia-ml.so.1") == "libnvidia-ml.so.580.95.05"  # ldconfig made the link
    assert lookup(entries, "libnvidia-ml.so.1", known_abi("aarch64")) == [], "another machine's ABI is not taken"


def _new_format(entries: list[tuple[str, str, int, int]], flag_byte: int = 2) -> bytes:
    """A cache in glibc's new format, written here by the layout of dl-cache.h (for cases ldconfig never makes)."""
    header, size = 48, 24
    strings = b""
    rows = b""
    base = header + size * len(entries)
    for name, path, flags, hwcap in entries:
        key = base + len(strings)
        strings += name.encode() + b"\0"
        value = base + len(strings)
        strings += path.encode() + b"\0"
        rows += struct.pack("<iIIIQ", flags, key, value, 0, hwcap)
    top = b"glibc-ld.so.cache1.1" + struct.pack("<IIB3xI12x", len(entries), len(strings), flag_byte, 0)
    return top + rows + strings


def test_old_and_new_formats_together_and_hwcap_variants() -> None:
    new = _new_format([("libnvidia-ml.so.1", "/usr/lib64/glibc-hwcaps/x86-64-v3/libnvidia-ml.so.1", X86, 1 << 62),
                       ("libnvidia-ml.so.1", "/usr/lib64/libnvidia-ml.so.1", X86, 0)])
    # ldconfig's compatible layout: the old header and entries, padding, the new format (whose strings both use).
    old = b"ld.so-1.7.0\0" + struct.pack("<I", 1) + struct.pack("<iII", 3, 0, 18)
    compat = old + b"\0" * (-len(old) % 8) + new
    entries = parse_ld_cache(compat)
    assert [e.path for e in entries] == ["/usr/lib64/glibc-hwcaps/x86-64-v3/libnvidia-ml.so.1",
                                         "/usr/lib64/libnvidia-ml.so.1"]
    assert lookup(entries, "libnvidia-ml.so.1", X86) == ["/usr/lib64/libnvidia-ml.so.1"], "baseline entries only"
    only_old = old + b"libnvidia-ml.so.1\0/old/path\0"  # strings count from the end of the old entries
    assert parse_ld_cache(only_old) == [CacheEntry("libnvidia-ml.so.1", "/old/path", 3)]


@pytest.mark.parametrize(("data", "reason"), [
    (b"", "not an ld.so.cache"),
    (b"\x7fELF\x02\x01\x01" + bytes(100), "not an ld.so.cache"),
    (_new_format([("libnvidia-ml.so.1", "/usr/lib64/x.so", X86, 0)])[:60], "truncated: the header lists 1"),
    (b"glibc-ld.so.cache1.1" + bytes(10), "truncated: 30 bytes"),
    (_new_format([("a", "/b", X86, 0)], flag_byte=3), "big-endian"),
    (_new_format([("a", "/b", X86, 0)], flag_byte=1), "invalid endianness"),
    (_new_format([("a", "/b", X86, 0)])[:-3], "not terminated"),
    (b"glibc-ld.so.cache1.1" + struct.pack("<IIB3xI12x", 1, 0, 2, 0) + struct.pack("<iIIIQ", X86, 9999, 0, 0, 0),
     "outside the file"),
    (b"ld.so-1.7.0\0" + struct.pack("<I", 1000), "old-format header lists 1000"),
])
def test_damaged_caches_are_refused_with_the_reason(data: bytes, reason: str) -> None:
    with pytest.raises(LdCacheError, match=reason):
        parse_ld_cache(data)


def _driver_root(scratch: Path) -> DriverRoot:
    return DriverRoot(scratch, scratch / "run/nvidia/driver", scratch / "dev")


def test_links_resolve_inside_the_driver_root(scratch: Path) -> None:
    root = _driver_root(scratch)
    libs = root.root / "usr/lib/x86_64-linux-gnu"
    libs.mkdir(parents=True)
    (libs / "libnvidia-ml.so.580.95.05").write_bytes(b"\x7fELF")
    (libs / "libnvidia-ml.so.1").symlink_to("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.95.05")  # absolute
    (root.root / "lib").symlink_to("usr/lib")
    (libs / "escape").symlink_to("../../../../../../../../etc/passwd")  # `..` stops at the driver root
    (libs / "loop").symlink_to("loop")
    assert root.resolve("/lib/x86_64-linux-gnu/libnvidia-ml.so.1") == libs / "libnvidia-ml.so.580.95.05"
    assert root.resolve("/usr/lib/x86_64-linux-gnu/escape") is None  # <driver root>/etc/passwd: not there
    assert root.resolve("/usr/lib/x86_64-linux-gnu/loop") is None
    assert root.resolve("/usr/lib/x86_64-linux-gnu/missing.so") is None


def test_library_found_by_the_cache_then_the_folders_with_every_place_tried(scratch: Path) -> None:
    root = _driver_root(scratch)
    (root.root / "etc").mkdir(parents=True)
    cache = root.root / "etc/ld.so.cache"
    listed = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
    cache.write_bytes(_new_format([("libnvidia-ml.so.1", listed, abi_flags() or X86, 0)]))
    search = root.find_library("libnvidia-ml.so.1")
    assert search.candidates == ()
    assert f"{root.root}{listed}: listed in {cache}, but not found" in search.describe()
    assert all(f"{root.root}/{folder}/libnvidia-ml.so.1: not found" in search.describe() for folder in library_dirs())

    libs = root.root / "usr/lib/x86_64-linux-gnu"
    libs.mkdir(parents=True)
    (libs / "libnvidia-ml.so.580.95.05").write_bytes(b"\x7fELF")
    (libs / "libnvidia-ml.so.1").symlink_to("libnvidia-ml.so.580.95.05")
    search = root.find_library("libnvidia-ml.so.1")
    assert search.candidates == (libs / "libnvidia-ml.so.580.95.05",)
    assert f"listed in {cache}: found → {libs / 'libnvidia-ml.so.580.95.05'}" in search.describe()

    cache.write_bytes(b"garbage that is no cache")
    search = root.find_library("libnvidia-ml.so.1")
    assert search.candidates == (libs / "libnvidia-ml.so.580.95.05",), "found in the usual folders instead"
    assert f"{cache}: unreadable (not an ld.so.cache" in search.describe()
    cache.write_bytes(_new_format([("libnvidia-ml.so.1", listed, abi_flags() or X86, 0)])[:70])
    search = root.find_library("libnvidia-ml.so.1")
    assert search.candidates == (libs / "libnvidia-ml.so.580.95.05",)
    assert f"{cache}: unreadable (truncated: the header lists 1 entries" in search.describe()
    cache.unlink()
    assert f"{cache}: No such file or directory" in root.find_library("libnvidia-ml.so.1").describe()


def test_a_directory_does_not_shadow_the_library(scratch: Path) -> None:
    root = _driver_root(scratch)
    (root.root / "usr/lib64/libnvidia-ml.so.1").mkdir(parents=True)
    search = root.find_library("libnvidia-ml.so.1")
    assert search.candidates == ()
    assert f"{root.root}/usr/lib64/libnvidia-ml.so.1: not a regular file" in search.describe()


def test_host_container_and_device_paths(scratch: Path) -> None:
    root = _driver_root(scratch)
    library = root.root / "usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05"
    assert root.host_path(library) == "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05"
    assert root.container_path(library) == "/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05"
    assert root.device_root() == scratch / "dev" and root.device_host_path("nvidia0") is None
    (root.root / "dev").mkdir(parents=True)
    assert root.device_root() == scratch / "dev", "an empty dev/ of the driver root holds no nodes"
    (root.root / "dev/nvidiactl").write_bytes(b"")
    assert root.device_root() == root.root / "dev"
    assert root.device_host_path("nvidia-caps/nvidia-cap3") == "/run/nvidia/driver/dev/nvidia-caps/nvidia-cap3"
    on_host = DriverRoot(scratch, scratch, scratch / "dev")
    assert on_host.host_path(scratch / "usr/bin/nvidia-smi") == on_host.container_path(scratch / "usr/bin/nvidia-smi")
