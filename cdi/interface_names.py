"""The kernel's rule for the name of a network interface, said in words: what `dev_valid_name` (net/core/dev.c)
refuses when an interface is created, renamed or moved into another network namespace under a new name.

Pure. The kernel reads a name as bytes: 1 to IFNAMSIZ - 1 = 15 of them, not `.` or `..`, no `/` or `:`, and no
byte its own isspace() calls whitespace (include/linux/ctype.h, the table in lib/ctype.c): tab, line feed,
vertical tab, form feed, carriage return, space, and 0xa0. In UTF-8 that refuses every character one of whose bytes
is 0xa0 (`à` is c3 a0, `†` e2 80 a0) and takes characters Unicode calls spaces whose bytes are none of these (EM
SPACE, U+2003, is e2 80 83). A NUL ends the name for the kernel: a name with one would not be the name asked for.
"""

from __future__ import annotations

__all__ = ["IFNAMSIZ", "KERNEL_WHITESPACE", "kernel_name_problem"]

IFNAMSIZ = 16
"""The kernel's buffer for an interface name, its terminating NUL included: names have at most 15 bytes."""

KERNEL_WHITESPACE = frozenset(b"\t\n\x0b\x0c\r \xa0")
"""The bytes the kernel's isspace() is true for."""

_NEVER = (
    (ord("/"), "'/' (the kernel makes a folder of each interface under its name, /sys/class/net/<name>)"),
    (ord(":"), "':' (older tools read `eth0:1` as an alias of eth0)"),
    (0, "NUL (the kernel would end the name there)"),
)


def _bytes_of(char: str) -> str:
    raw = char.encode()
    return f"byte 0x{raw.hex()}" if len(raw) == 1 else f"bytes {raw.hex(' ')}"


def kernel_name_problem(name: str) -> str | None:
    """Why the kernel would refuse `name` for a network interface, or None."""
    try:
        raw = name.encode()
    except UnicodeEncodeError:
        return f"an interface name is text in UTF-8, and {name!r} is not text (it holds a lone UTF-16 surrogate)"
    if not raw:
        return "an interface name cannot be empty"
    if len(raw) >= IFNAMSIZ:
        return f"an interface name has at most {IFNAMSIZ - 1} bytes in UTF-8, {name!r} has {len(raw)}"
    if name in (".", ".."):
        return (f"{name!r} is not an interface name: '.' and '..' stand for folders (the kernel makes a folder of "
                "each interface under its name)")
    for byte, what in _NEVER:
        if byte in raw:
            return f"an interface name cannot contain {what}"
    spaces = [c for c in dict.fromkeys(name) if KERNEL_WHITESPACE.intersection(c.encode())]
    if spaces:
        shown = ", ".join(f"{c!r} ({_bytes_of(c)})" for c in spaces)
        return ("an interface name cannot contain whitespace as the kernel reads it, byte by byte (bytes 0x09 to "
                f"0x0d, 0x20 and 0xa0): {name!r} has {shown}")
    return None
