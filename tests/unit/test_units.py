"""sluice.units: durations and sizes as written in sluice.yaml."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.units import format_duration_ms, parse_duration_ms, parse_size_bytes

FAST = settings(max_examples=100, deadline=None, database=None)


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("500ms", 500),
        ("0ms", 0),
        ("2s", 2_000),
        ("1m", 60_000),
        ("1h", 3_600_000),
        ("7d", 7 * 86_400_000),
        ("2w", 2 * 604_800_000),
        ("0.5s", 500),
        ("1.5m", 90_000),
        (" 2 s ", 2_000),
        ("10 ms", 10),
        ("1.001s", 1_001),  # exact decimals: not 1000.9999999999999 as a float product
        ("4.35m", 261_000),
        ("0.001s", 1),
        ("2.5h", 9_000_000),
    ],
)
def test_parse_duration_spellings(text: str, ms: int) -> None:
    assert parse_duration_ms(text) == ms


@pytest.mark.parametrize(("value", "ms"), [(0, 0), (250, 250), (60_000, 60_000), (1500.0, 1500)])
def test_parse_duration_bare_number_is_milliseconds(value: float, ms: int) -> None:
    result = parse_duration_ms(value)
    assert result == ms
    assert isinstance(result, int)


@pytest.mark.parametrize(
    "text",
    ["", "ms", "10", "1 minute", "1M", "1S", "-1s", "1sec", "5mb", "1m2s", "\u0661m", "1_0s"],
)
def test_parse_duration_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError, match=r"expected a duration such as '500ms'"):
        parse_duration_ms(text)


def test_parse_duration_error_names_the_value() -> None:
    with pytest.raises(ValueError, match=r"got '1 minute'"):
        parse_duration_ms("1 minute")


@pytest.mark.parametrize("text", ["1.5ms", "1.0005s", "0.1ms"])
def test_parse_duration_rejects_fractional_milliseconds(text: str) -> None:
    with pytest.raises(ValueError, match=r"is not a whole number of milliseconds"):
        parse_duration_ms(text)


@pytest.mark.parametrize("value", [-1, -0.5, -60_000])
def test_parse_duration_rejects_negative_numbers(value: float) -> None:
    with pytest.raises(ValueError, match=r"must not be negative"):
        parse_duration_ms(value)


@pytest.mark.parametrize("value", [True, False])
def test_parse_duration_rejects_booleans(value: bool) -> None:
    with pytest.raises(ValueError, match=r"expected a duration"):
        parse_duration_ms(value)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("0", 0),
        ("10", 10),
        ("10b", 10),
        ("10B", 10),
        ("500KB", 500_000),
        ("500kb", 500_000),
        ("50MB", 50_000_000),
        ("2GB", 2_000_000_000),
        ("1KiB", 1024),
        ("1kib", 1024),
        ("3MiB", 3 * 1024**2),
        ("1GiB", 1024**3),
        ("1.5KB", 1500),
        (" 4 MB ", 4_000_000),
    ],
)
def test_parse_size_spellings(text: str, size: int) -> None:
    assert parse_size_bytes(text) == size


@pytest.mark.parametrize("value", [0, 1, 4096, 10**12])
def test_parse_size_bare_int_is_bytes(value: int) -> None:
    assert parse_size_bytes(value) == value


@pytest.mark.parametrize("text", ["", "MB", "50 megabytes", "1TB", "-5MB", "5 M", "1s", "KB5"])
def test_parse_size_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError, match=r"expected a size such as '500KB', '50MB' or '1GiB'"):
        parse_size_bytes(text)


def test_parse_size_rejects_negative_and_bool() -> None:
    with pytest.raises(ValueError, match=r"size must not be negative, got -1"):
        parse_size_bytes(-1)
    with pytest.raises(ValueError, match=r"expected a size"):
        parse_size_bytes(True)


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (0, "0ms"),
        (1, "1ms"),
        (999, "999ms"),
        (1000, "1s"),
        (1500, "1500ms"),
        (60_000, "1m"),
        (90_000, "90s"),
        (3_600_000, "1h"),
        (86_400_000, "1d"),
        (7 * 86_400_000, "1w"),
        (8 * 86_400_000, "8d"),
    ],
)
def test_format_duration_shortest_exact(ms: int, text: str) -> None:
    assert format_duration_ms(ms) == text


UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}


@FAST
@given(st.integers(min_value=0, max_value=10**15))
def test_format_then_parse_round_trips(ms: int) -> None:
    text = format_duration_ms(ms)
    assert parse_duration_ms(text) == ms
    unit = text.lstrip("0123456789")
    assert unit in UNIT_MS
    # Shortest: no larger unit spells the same value exactly.
    for other, size in UNIT_MS.items():
        if size > UNIT_MS[unit] and ms >= size:
            assert ms % size != 0, (ms, text, other)


@FAST
@given(
    st.integers(min_value=0, max_value=10**6),
    st.sampled_from(["ms", "s", "m", "h", "d", "w"]),
)
def test_parse_duration_integer_times_unit(n: int, unit: str) -> None:
    assert parse_duration_ms(f"{n}{unit}") == n * UNIT_MS[unit]


def test_a_size_is_exact_and_in_ascii_digits() -> None:
    assert parse_size_bytes("1.001KB") == 1001
    with pytest.raises(ValueError, match="expected a size"):
        parse_size_bytes("\u0661MB")


@pytest.mark.parametrize("text", ["1_796_236_974_671", "+1796236974671", "\u0661\u0662",
                                  " 12", "1e12", "12.0"])  # fmt: skip
def test_an_end_is_an_integer_or_its_ascii_digits(text: str) -> None:
    from sluice.errors import BadQuery
    from sluice.query.params import parse_end

    with pytest.raises(BadQuery, match="epoch milliseconds"):
        parse_end(text, 0)
    assert parse_end("1796236974671", 0) == parse_end(1796236974671, 0) == 1796236974671
