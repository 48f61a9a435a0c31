"""Reading and writing another process's memory with process_vm_readv(2) and process_vm_writev(2): how the NVML
server fills the structs and buffers a calling process passed by pointer, as the real library writes them in that
process. Several spans go in one system call. The caller needs the right to trace the process (root, or Yama
allowing it: the simulated library declares any process may).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["MemoryAccessError", "read_into", "read_string", "write_from"]

_libc = ctypes.CDLL(None, use_errno=True)
_PAGE = os.sysconf("SC_PAGE_SIZE")


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


for _name in ("process_vm_readv", "process_vm_writev"):
    _fn = getattr(_libc, _name)
    _fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                    ctypes.c_ulong]
    _fn.restype = ctypes.c_ssize_t


class MemoryAccessError(OSError):
    """The process's memory could not be read or written there (a bad pointer, or the process is gone)."""


def _transfer(call: str, pid: int, spans: Sequence[tuple[int, int, int]]) -> int:
    """Move bytes between local and remote spans (local address, remote address, length); the bytes moved."""
    if not spans:
        return 0
    local = (_IoVec * len(spans))(*(_IoVec(a, n) for a, _, n in spans))
    remote = (_IoVec * len(spans))(*(_IoVec(r, n) for _, r, n in spans))
    moved: int = getattr(_libc, call)(pid, local, len(spans), remote, len(spans), 0)
    if moved < 0:
        errno = ctypes.get_errno()
        raise MemoryAccessError(errno, f"{call} of process {pid}: {os.strerror(errno)}")
    return moved


def read_into(pid: int, spans: Sequence[tuple[Any, int]]) -> None:
    """Fill each local ctypes object (struct, array, simple value) from `pid`'s memory at the paired address, all or
    nothing."""
    wanted = [(ctypes.addressof(obj), address, ctypes.sizeof(obj)) for obj, address in spans]
    if _transfer("process_vm_readv", pid, wanted) != sum(n for _, _, n in wanted):
        raise MemoryAccessError(14, f"process {pid}: part of its memory could not be read")


def write_from(pid: int, spans: Sequence[tuple[int, int, int]]) -> None:
    """Copy (local address, remote address, length) spans into `pid`'s memory, all or nothing."""
    if _transfer("process_vm_writev", pid, spans) != sum(n for _, _, n in spans):
        raise MemoryAccessError(14, f"process {pid}: part of its memory could not be written")


def read_string(pid: int, address: int, limit: int = 256) -> bytes:
    """The NUL-terminated text at `address` in `pid`'s memory (at most `limit` bytes, read a page at a time so as
    never to read past the page that holds its end); MemoryAccessError when there is none."""
    text = b""
    while len(text) < limit:
        chunk = min(limit - len(text), _PAGE - (address + len(text)) % _PAGE)
        buffer = ctypes.create_string_buffer(chunk)
        read_into(pid, [(buffer, address + len(text))])
        end = buffer.raw.find(b"\0")
        if end >= 0:
            return text + buffer.raw[:end]
        text += buffer.raw
    raise MemoryAccessError(22, f"process {pid}: no terminated text within {limit} bytes at {address:#x}")
