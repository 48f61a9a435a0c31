"""Tests for agent.kube.quantity: the Kubernetes quantity grammar, our formatting, semantic equality."""

from __future__ import annotations

import re
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.kube.quantity import format_quantity, parse_quantity, same_quantity, served_form

KI = 1024


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", Fraction(0)),
        ("7", Fraction(7)),
        ("+7", Fraction(7)),
        ("-7", Fraction(-7)),
        ("007", Fraction(7)),
        ("1.5", Fraction(3, 2)),
        ("1.", Fraction(1)),
        (".5", Fraction(1, 2)),
        ("1Ki", Fraction(KI)),
        ("1Mi", Fraction(KI**2)),
        ("80Gi", Fraction(80 * KI**3)),
        ("1Ti", Fraction(KI**4)),
        ("1Pi", Fraction(KI**5)),
        ("2Ei", Fraction(2 * KI**6)),
        ("1.5Ki", Fraction(1536)),
        ("-1Ki", Fraction(-KI)),
        ("1n", Fraction(1, 10**9)),
        ("1u", Fraction(1, 10**6)),
        ("250m", Fraction(1, 4)),
        ("1k", Fraction(1000)),
        ("1M", Fraction(10**6)),
        ("1G", Fraction(10**9)),
        ("1T", Fraction(10**12)),
        ("1P", Fraction(10**15)),
        ("1E", Fraction(10**18)),
        ("1e3", Fraction(1000)),
        ("1E3", Fraction(1000)),
        ("1e+3", Fraction(1000)),
        ("12E-2", Fraction(12, 100)),
        ("1.5e1", Fraction(15)),
        ("-0.5e-1", Fraction(-1, 20)),
    ],
)
def test_parse_quantity_accepts_the_grammar(text: str, expected: Fraction) -> None:
    assert parse_quantity(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        " ",
        " 1",
        "1 ",
        "1 Gi",
        "1.2.3",
        "5KB",
        "Gi",
        "Ki",
        "+",
        "-",
        ".",
        "+.",
        "1e",
        "1e+",
        "1e1.5",
        "1ki",
        "1K",
        "1Kib",
        "1gi",
        "1Gi3",
        "e3",
        "1ee3",
        "abc",
        "1\n",
        "\u0661",
        "--1",
        "1_000",
        "0x10",
        "1m3",
        "1Ki+3",
    ],
)
def test_parse_quantity_rejects_everything_else(text: str) -> None:
    with pytest.raises(ValueError, match="invalid quantity"):
        parse_quantity(text)


def test_parse_quantity_bounds_huge_exponents() -> None:
    with pytest.raises(ValueError, match="too large"):
        parse_quantity("1e1000000000")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, "0"),
        (7, "7"),
        (1000, "1000"),
        (1023, "1023"),
        (1024, "1Ki"),
        (1536, "1536"),  # 1.5Ki: not a whole number of Ki
        (2048, "2Ki"),
        (1024 * 1000, "1000Ki"),
        (1536 * 1024, "1536Ki"),
        (85899345920, "80Gi"),
        (KI**6, "1Ei"),
        (KI**7, "1024Ei"),
        (10**9, "1000000000"),
    ],
)
def test_format_quantity(value: int, expected: str) -> None:
    assert format_quantity(value) == expected


def test_format_quantity_rejects_negative_and_non_int() -> None:
    with pytest.raises(ValueError, match="negative"):
        format_quantity(-1)
    with pytest.raises(TypeError):
        format_quantity(True)
    with pytest.raises(TypeError):
        format_quantity(1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("1000", "1k"),
        ("1024", "1Ki"),
        ("1e3", "1k"),
        ("0.1", "100m"),
        ("85899345920", "80Gi"),
        ("1.5Gi", "1536Mi"),
        ("-1k", "-1000"),
        ("0", "0Gi"),
        ("1e-10", "1n"),  # the server rounds sub-nano amounts up to 1n
        ("-1e-10", "-1n"),
        ("16Ei", "9223372036854775807"),  # binary-suffixed values are capped at the int64 maximum
    ],
)
def test_same_quantity_equal(a: str, b: str) -> None:
    assert same_quantity(a, b)
    assert same_quantity(b, a)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("1000", "1Ki"),
        ("1", "2"),
        ("1k", "-1k"),
        ("1n", "2n"),
        ("1.5n", "1n"),
        ("16E", "9223372036854775807"),
    ],
)
def test_same_quantity_different(a: str, b: str) -> None:
    assert not same_quantity(a, b)


def test_same_quantity_rejects_invalid_text() -> None:
    with pytest.raises(ValueError):
        same_quantity("1k", "1 k")


@settings(database=None)
@given(
    st.integers(min_value=0, max_value=2**80)
    | st.integers(min_value=0, max_value=64).map(lambda n: n * KI**3)
)
def test_format_then_parse_round_trips(n: int) -> None:
    text = format_quantity(n)
    assert parse_quantity(text) == n
    if n < 2**63:  # above that the server caps binary-suffixed values, not plain digits
        assert same_quantity(text, str(n))


# --- hostile sizes ------------------------------------------------------------------------------------------------

INTERNALS = re.compile(r"[A-Z]\w*(Error|Exception)\b|Traceback|int_max_str_digits|\[Errno")


def shown(text: str) -> str:
    """A long text as messages quote it: its first 32 characters."""
    return f'"{text[:32]}…"'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1e1001", 'quantity "1e1001" is too large'),
        ("1e" + "9" * 5000, f"quantity {shown('1e' + '9' * 5000)} is too large"),
        ("1e-" + "9" * 5000, f"quantity {shown('1e-' + '9' * 5000)} is too small"),
        ("9" * 5000, f"quantity {shown('9' * 5000)} is too long: more than 4000 digits"),
        ("0." + "0" * 5000 + "1", f"quantity {shown('0.' + '0' * 5000)} is too long: more than 4000 digits"),
        ("1e" + "0" * 5000 + "3", None),  # leading zeros: 1e3
        ("0e99999", None),  # nothing times anything is nothing, as the server computes it
    ],
)
def test_parse_quantity_says_in_words_when_a_quantity_is_too_large_or_too_long(text: str, message: str | None) -> None:
    if message is None:
        assert parse_quantity(text) in (1000, 0)
        return
    with pytest.raises(ValueError) as refused:
        parse_quantity(text)
    assert str(refused.value) == message
    assert not INTERNALS.search(str(refused.value))


# What k8s.io/apimachinery v0.37.2 stores and serves for each text (ParseQuantity, then String), run against it.
APIMACHINERY_SERVES = {
    "0": "0", "1": "1", "-1": "-1", "1m": "1m", "1.5": "1500m", "1500m": "1500m", "1000": "1k", "1k": "1k",
    "1000m": "1", "0.1": "100m", "1e3": "1e3", "1E3": "1E3", "1e+3": "1e+3", "1e0": "1e0", "12E-2": "120e-3",
    "1.5e3": "1500", "1e-10": "1e-9", "1e-7": "100e-9", "1Gi": "1Gi", "1024Mi": "1Gi", "1.5Gi": "1536Mi",
    "0.5Gi": "512Mi", "0.5Ki": "512", "1.0Gi": "1Gi", "+1Gi": "+1Gi", "01Gi": "01Gi", "1.Gi": "1.Gi", "0Gi": "0",
    "-0": "0", "16Gi": "16Gi", "8Ei": "9223372036854775807", "7Ei": "7Ei", "1536": "1536",
    "1073741824": "1073741824", "40G": "40G", "40000M": "40G", "81559Mi": "81559Mi", "-40Gi": "-40Gi",
    "-1099511627776": "-1099511627776", "9223372036854775807": "9223372036854775807", "1.500": "1.500",
    "0001": "0001", "1.5E": "1500P", "0.1Ki": "102400m", ".5": "500m", "1e1000": "10e999",
}  # fmt: skip


@pytest.mark.parametrize(("text", "served"), sorted(APIMACHINERY_SERVES.items()))
def test_served_form_is_what_the_api_server_stores(text: str, served: str) -> None:
    assert served_form(text) == served
    assert served_form(served) == served, "what the server serves, it serves unchanged when read back"


@settings(database=None)
@given(st.integers(min_value=-(2**63) + 1, max_value=2**63 - 1), st.sampled_from(["", "Ki", "Mi", "Gi", "m", "k"]))
def test_served_form_keeps_the_value(n: int, suffix: str) -> None:
    text = f"{n}{suffix}"
    served = served_form(text)
    assert same_quantity(served, text)
    assert served_form(served) == served
