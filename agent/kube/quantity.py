"""Kubernetes ``resource.Quantity`` text: parsing, our canonical formatting, and comparison.

Grammar accepted by :func:`parse_quantity`::

    quantity ::= [+-] number [suffix]
    number   ::= digits | digits "." [digits] | "." digits
    suffix   ::= Ki | Mi | Gi | Ti | Pi | Ei          (powers of 1024)
               | n | u | m | k | M | G | T | P | E    (powers of 1000)
               | (e | E) [+-] digits                 (power of ten)

The Go parser is looser than its own grammar (it reads ``Gi``, ``+`` and ``.`` as zero);
those forms are rejected here because no sane publisher emits them.

The Kubernetes client's ``kubernetes.utils.quantity.parse_quantity`` is not used: it hands the number to
``Decimal``, which also takes ``NaN``, ``Infinity``, ``1_000``, non-ASCII digits and surrounding blanks (so
``1 Gi``), takes ``1K`` and ``1e3k``, and rounds to 28 digits; and the client has no ``same_quantity`` for the
server's rounding (docs/performance.md, "Libraries instead of hand-written code").
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["format_quantity", "parse_quantity", "same_quantity"]

_BINARY_SUFFIXES: dict[str, int] = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL_SUFFIXES: dict[str, int] = {
    "n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18,
}  # fmt: skip

# [0-9] rather than \d: Python's \d also matches non-ASCII digits.
_QUANTITY_RE = re.compile(
    r"(?P<sign>[+-]?)(?P<int>[0-9]*)(?:\.(?P<frac>[0-9]*))?"
    r"(?:(?P<bin>[KMGTPE]i)|[eE](?P<exp>[+-]?[0-9]+)|(?P<dec>[numkMGTPE]?))"
)

# Bounds the work done on hostile input; real quantities stay within 10^±30.
_MAX_EXPONENT = 1000
_MAX_DIGITS = 4000

# The API server rounds every value away from zero to whole nano units and caps
# binary-suffixed magnitudes at the int64 maximum (apimachinery ParseQuantity).
_NANO = Fraction(1, 10**9)
_INT64_MAX = 2**63 - 1


def _parse(text: str) -> tuple[Fraction, bool]:
    """Return the exact value of ``text`` and whether it used a binary suffix."""
    if not isinstance(text, str):
        raise TypeError(f"quantity must be a string, not {type(text).__name__}")
    match = _QUANTITY_RE.fullmatch(text)
    if match is None or not (match["int"] or match["frac"]):
        raise ValueError(
            f"invalid quantity {text!r}: expected an optionally signed decimal number followed by "
            "an optional suffix: Ki, Mi, Gi, Ti, Pi, Ei, n, u, m, k, M, G, T, P, E, or e<integer>"
        )
    integer, fraction = match["int"], match["frac"] or ""
    if len(integer) + len(fraction) > _MAX_DIGITS:
        raise ValueError(f"invalid quantity {text[:32]!r}...: more than {_MAX_DIGITS} digits")
    value = Fraction(int(integer or "0") * 10 ** len(fraction) + int(fraction or "0"), 10 ** len(fraction))
    binary = match["bin"] is not None
    if binary:
        value *= 1024 ** _BINARY_SUFFIXES[match["bin"]]
    else:
        exponent = int(match["exp"]) if match["exp"] is not None else _DECIMAL_SUFFIXES[match["dec"]]
        if abs(exponent) > _MAX_EXPONENT:
            raise ValueError(f"invalid quantity {text!r}: exponent must be within ±{_MAX_EXPONENT}")
        value *= Fraction(10) ** exponent
    return (-value if match["sign"] == "-" else value), binary


def parse_quantity(text: str) -> Fraction:
    """Return the exact value of a quantity such as ``80Gi``, ``1.5``, ``250m`` or ``12E-2``.

    Raises ``ValueError`` for anything outside the Kubernetes quantity grammar.
    """
    return _parse(text)[0]


def format_quantity(value: int) -> str:
    """Return the text we publish for a non-negative integer amount.

    Exact multiples of 1024 use the largest binary suffix that divides them
    (``85899345920`` -> ``80Gi``); everything else is plain digits (``1536``, ``1000``).
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"quantity value must be an int, not {type(value).__name__}")
    if value < 0:
        raise ValueError(f"quantity value must not be negative, got {value}")
    if value == 0 or value % 1024:
        return str(value)
    for suffix, power in sorted(_BINARY_SUFFIXES.items(), key=lambda item: -item[1]):
        if value % 1024**power == 0:
            return f"{value // 1024**power}{suffix}"
    raise AssertionError("unreachable: 1024 divides value")  # pragma: no cover


def _as_stored(value: Fraction, binary: bool) -> Fraction:
    magnitude = abs(value)
    if magnitude.denominator != 1:
        units = -(-magnitude.numerator * 10**9 // magnitude.denominator)  # ceiling division
        magnitude = units * _NANO
    if binary and magnitude > _INT64_MAX:
        magnitude = Fraction(_INT64_MAX)
    return -magnitude if value < 0 else magnitude


def same_quantity(a: str, b: str) -> bool:
    """Whether two quantity texts denote the value the API server would store for each.

    Compares by value (``1000`` equals ``1k``), after the server's rounding of
    sub-nano fractions and its int64 cap on binary-suffixed values, so what we
    sent can be matched against what the server returned. Raises ``ValueError``
    if either text is not a quantity.
    """
    return _as_stored(*_parse(a)) == _as_stored(*_parse(b))
