"""Kubernetes ``resource.Quantity`` text: parsing, our canonical formatting, comparison, and the form the API
server stores a quantity in (``served_form``), with which amounts read from it are checked (``read_amount``).

Grammar accepted by :func:`parse_quantity`::

    quantity ::= [+-] number [suffix]
    number   ::= digits | digits "." [digits] | "." digits
    suffix   ::= Ki | Mi | Gi | Ti | Pi | Ei          (powers of 1024)
               | n | u | m | k | M | G | T | P | E    (powers of 1000)
               | (e | E) [+-] digits                 (power of ten)

The Go parser is looser than its own grammar (it reads ``Gi``, ``+`` and ``.`` as zero);
those forms are rejected here because no sane publisher emits them. It has no bound on size either (it refuses
only exponents beyond int64, and wraps those beyond int32); this module refuses more than 4000 digits and
exponents beyond ±1000, saying so in words.

The Kubernetes client's ``kubernetes.utils.quantity.parse_quantity`` is not used: it hands the number to
``Decimal``, which also takes ``NaN``, ``Infinity``, ``1_000``, non-ASCII digits and surrounding blanks (so
``1 Gi``), takes ``1K`` and ``1e3k``, and rounds to 28 digits; and the client has no ``same_quantity`` for the
server's rounding (docs/performance.md, "Libraries instead of hand-written code").
"""

from __future__ import annotations

import json
import re
from fractions import Fraction
from typing import NamedTuple

__all__ = ["INT64_MAX", "format_quantity", "parse_quantity", "read_amount", "same_quantity", "served_form"]

_BINARY_SUFFIXES: dict[str, int] = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL_SUFFIXES: dict[str, int] = {
    "n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18,
}  # fmt: skip
_DECIMAL_SUFFIX_OF = {power: suffix for suffix, power in _DECIMAL_SUFFIXES.items()}
_BINARY_SUFFIX_OF = {power: suffix for suffix, power in _BINARY_SUFFIXES.items()} | {0: ""}

# [0-9] rather than \d: Python's \d also matches non-ASCII digits.
_QUANTITY_RE = re.compile(
    r"(?P<sign>[+-]?)(?P<int>[0-9]*)(?:\.(?P<frac>[0-9]*))?"
    r"(?:(?P<bin>[KMGTPE]i)|[eE](?P<exp>[+-]?[0-9]+)|(?P<dec>[numkMGTPE]?))"
)

# Bounds the work done on hostile input; real quantities stay within 10^±30. The API server has no such bound on
# decimal values (it refuses only exponents beyond int64, and caps binary-suffixed values at INT64_MAX).
_MAX_EXPONENT = 1000
_MAX_DIGITS = 4000
_SHOWN = 32  # characters of a long text quoted in a message

INT64_MAX = 2**63 - 1
"""The largest amount Kubernetes computes with: the API server caps binary-suffixed quantities at it, the
scheduler's capacity arithmetic and the policy checks of a ResourceSlice stop there."""

# The API server rounds every value away from zero to whole nano units and caps
# binary-suffixed magnitudes at the int64 maximum (apimachinery ParseQuantity).
_NANO = Fraction(1, 10**9)


class _Parts(NamedTuple):
    """A quantity's text taken apart: sign, digits before and after the point, and the suffix's meaning."""

    negative: bool
    integer: str
    fraction: str
    base: int  # 2 for Ki..Ei, 10 otherwise
    exponent: int  # power of `base`: 10, 20, ... 60 for Ki..Ei
    form: str  # "binary" (Ki..Ei), "decimal" (n..E or none), "exponent" (e<n>)

    @property
    def mantissa(self) -> Fraction:
        digits = self.integer + self.fraction
        return Fraction(int(digits or "0"), 10 ** len(self.fraction))


def _shown(text: str) -> str:
    """`text` quoted for a message, cut short when long."""
    return json.dumps(text) if len(text) <= _SHOWN else f"{json.dumps(text[:_SHOWN])[:-1]}…\""


def _split(text: str) -> _Parts:
    if not isinstance(text, str):
        raise TypeError(f"quantity must be a string, not {type(text).__name__}")
    match = _QUANTITY_RE.fullmatch(text)
    if match is None or not (match["int"] or match["frac"]):
        raise ValueError(
            f"invalid quantity {_shown(text)}: expected an optionally signed decimal number followed by "
            "an optional suffix: Ki, Mi, Gi, Ti, Pi, Ei, n, u, m, k, M, G, T, P, E, or e<integer>"
        )
    integer, fraction = match["int"], match["frac"] or ""
    if len(integer) + len(fraction) > _MAX_DIGITS:
        raise ValueError(f"quantity {_shown(text)} is too long: more than {_MAX_DIGITS} digits")
    negative = match["sign"] == "-"
    if match["bin"] is not None:
        return _Parts(negative, integer, fraction, 2, 10 * _BINARY_SUFFIXES[match["bin"]], "binary")
    if match["exp"] is None:
        return _Parts(negative, integer, fraction, 10, _DECIMAL_SUFFIXES[match["dec"]], "decimal")
    exponent_sign, exponent_digits = match["exp"][:1], match["exp"].lstrip("+-").lstrip("0")
    zero = not (integer + fraction).strip("0")
    # Measured by its digits first: int() of thousands of digits is slow and refused by Python itself.
    if len(exponent_digits) > len(str(_MAX_EXPONENT)) or int(exponent_digits or "0") > _MAX_EXPONENT:
        if not zero:
            small = exponent_sign == "-"
            raise ValueError(f"quantity {_shown(text)} is too {'small' if small else 'large'}")
        exponent_digits = ""  # nothing times anything is nothing, as the API server computes it
    exponent = -int(exponent_digits or "0") if exponent_sign == "-" else int(exponent_digits or "0")
    return _Parts(negative, integer, fraction, 10, exponent, "exponent")


def _value(parts: _Parts) -> Fraction:
    value = parts.mantissa * Fraction(parts.base) ** parts.exponent
    return -value if parts.negative else value


def parse_quantity(text: str) -> Fraction:
    """Return the exact value of a quantity such as ``80Gi``, ``1.5``, ``250m`` or ``12E-2``.

    Raises ``ValueError`` for anything outside the Kubernetes quantity grammar, and for values beyond what this
    module computes with (more than 4000 digits, exponents beyond ±1000), with a message saying so in words.
    """
    return _value(_split(text))


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


def _stored(parts: _Parts) -> Fraction:
    """The value the API server keeps for a quantity: rounded away from zero to whole nano units, and capped at
    INT64_MAX when binary-suffixed."""
    value = _value(parts)
    magnitude = abs(value)
    if magnitude.denominator != 1:
        units = -(-magnitude.numerator * 10**9 // magnitude.denominator)  # ceiling division
        magnitude = units * _NANO
    if parts.form == "binary" and magnitude > INT64_MAX:
        magnitude = Fraction(INT64_MAX)
    return -magnitude if value < 0 else magnitude


def _kept_as_written(parts: _Parts) -> bool:
    """Whether the API server keeps a quantity's text as it was written rather than writing its own.

    apimachinery's ParseQuantity keeps the text when a quick look at its digits takes it for its own form: few
    enough digits for int64, and, with a binary suffix, no fraction and a number not divisible by 8; otherwise a
    power of ten that is a multiple of three, no trailing "000" and no leading zero after the sign. So "+1Gi",
    "01Gi", "1.Gi", "1E3" and "1e+3" are kept, though it would never write them itself.
    """
    number, fraction = parts.integer.lstrip("0") or "0", parts.fraction
    if parts.form == "binary":
        digits_left = 15 - len(number) - parts.exponent * 3 // 10 - 1
        return not fraction and digits_left >= 0 and int(number) & 7 != 0
    shifted, scale = number + fraction, parts.exponent - len(fraction)
    return (len(shifted) <= 18 and scale >= -9 and scale % 3 == 0 and not shifted.endswith("000")
            and not shifted.startswith("0"))


def _canonical(value: Fraction, form: str) -> str:
    """The API server's own text for a value it keeps, in the form its text had (apimachinery's String)."""
    if value == 0:
        return "0"
    if form == "binary" and (abs(value) < 1024 or value.denominator != 1):
        form = "decimal"  # below 1Ki, or not whole: decimal, so nothing is rounded
    if form == "binary":
        amount, power = int(value), 0
        while amount % 1024 == 0:
            amount, power = amount // 1024, power + 1
        return f"{amount}{_BINARY_SUFFIX_OF.get(power, '')}"
    # value = amount * 10**exponent, amount whole; then the exponent made a multiple of three, downwards.
    amount, exponent = value.numerator * 10**9 // value.denominator, -9  # whole nano units: exact, as kept
    while amount % 10 == 0:
        amount, exponent = amount // 10, exponent + 1
    amount, exponent = amount * 10 ** (exponent % 3), exponent - exponent % 3
    if form == "exponent":
        return f"{amount}e{exponent}" if exponent else str(amount)
    # Decimal suffixes end at E (10^18): the server writes a larger value's digits without one, as here.
    return f"{amount}{_DECIMAL_SUFFIX_OF.get(exponent, '')}"


def served_form(text: str) -> str:
    """The text the API server stores and serves for the quantity ``text``: the text itself when it keeps it as
    written, else its own (``1024Mi`` -> ``1Gi``, ``1000`` -> ``1k``, ``1.5`` -> ``1500m``, ``12E-2`` ->
    ``120e-3``, ``8Ei`` -> ``9223372036854775807``).

    A quantity read from the API server is always in its served form; one that is not was never stored by it.
    Raises ``ValueError`` as ``parse_quantity`` does.
    """
    parts = _split(text)
    return text if _kept_as_written(parts) else _canonical(_stored(parts), parts.form)


def same_quantity(a: str, b: str) -> bool:
    """Whether two quantity texts denote the value the API server would store for each.

    Compares by value (``1000`` equals ``1k``), after the server's rounding of
    sub-nano fractions and its int64 cap on binary-suffixed values, so what we
    sent can be matched against what the server returned. Raises ``ValueError``
    if either text is not a quantity.
    """
    return _stored(_split(a)) == _stored(_split(b))


def read_amount(text: str) -> Fraction:
    """The amount of a capacity that ``text``, as read from the API server, denotes.

    Raises ``ValueError``, with a message in words, unless ``text`` is a quantity the API server writes itself
    (``served_form``), neither negative nor larger than ``INT64_MAX``: the server stores any quantity, but
    Kubernetes computes amounts of capacity in int64 and never hands out a negative one.
    """
    amount, served = parse_quantity(text), served_form(text)
    if amount > INT64_MAX:
        raise ValueError(f"quantity {_shown(text)} is too large: an amount of capacity is at most {INT64_MAX}")
    if amount < 0:
        raise ValueError(f"quantity {_shown(text)} is negative")
    if served != text:
        raise ValueError(f"quantity {_shown(text)} is not as the API server writes it ({_shown(served)})")
    return amount
