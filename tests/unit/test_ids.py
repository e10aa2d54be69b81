"""sluice.source.ids: stream entry ids as offsets, splitting (start, end] into ranges, and the
64-bit event ids of the completeness audit."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.source.ids import (
    MAX_SEQ,
    ZERO_ID,
    event_ids,
    format_id,
    id_ms,
    parse_id,
    split_range,
    stream_salt,
    xor_all,
)

FAST = settings(max_examples=120, deadline=None, database=None)


@pytest.mark.parametrize(
    ("entry_id", "parsed"),
    [
        ("1700000000000-0", (1_700_000_000_000, 0)),
        (b"1700000000000-5", (1_700_000_000_000, 5)),
        ("0-0", (0, 0)),
        ("42", (42, 0)),
        (f"7-{MAX_SEQ}", (7, MAX_SEQ)),
    ],
)
def test_parse_id(entry_id: str | bytes, parsed: tuple[int, int]) -> None:
    assert parse_id(entry_id) == parsed
    assert id_ms(entry_id) == parsed[0]


def test_parse_id_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="invalid literal"):
        parse_id("abc-1")


def test_zero_id_and_format() -> None:
    assert parse_id(ZERO_ID) == (0, 0)
    assert format_id(12, 3) == "12-3"


@FAST
@given(st.integers(0, 2**48), st.integers(0, MAX_SEQ))
def test_format_parse_round_trip(ms: int, seq: int) -> None:
    assert parse_id(format_id(ms, seq)) == (ms, seq)


def test_small_range_is_not_split() -> None:
    assert split_range("100-0", "103-0", 8) == [("100-0", "103-0")]
    assert split_range("100-0", "200-0", 1) == [("100-0", "200-0")]
    assert split_range("100-0", "200-0", 0) == [("100-0", "200-0")]


def test_split_range_example() -> None:
    parts = split_range("0-0", "100-7", 4)
    assert parts == [
        ("0-0", f"25-{MAX_SEQ}"),
        (f"25-{MAX_SEQ}", f"50-{MAX_SEQ}"),
        (f"50-{MAX_SEQ}", f"75-{MAX_SEQ}"),
        (f"75-{MAX_SEQ}", "100-7"),
    ]


ids = st.tuples(
    st.integers(0, 2_000_000_000_000),
    st.integers(0, 50),
)


@FAST
@given(ids, st.integers(0, 10**6), st.integers(0, 50), st.integers(1, 64), st.data())
def test_split_range_partitions_the_interval(
    start: tuple[int, int], span: int, end_seq: int, parts: int, data: st.DataObject
) -> None:
    s_ms, s_seq = start
    start_id = format_id(s_ms, s_seq)
    end_id = format_id(s_ms + span, end_seq if span else max(end_seq, s_seq))
    ranges = split_range(start_id, end_id, parts)

    assert 1 <= len(ranges) <= max(parts, 1)
    # Chained: first lo is start, last hi is end, each hi is the next lo (no gap, no overlap).
    assert ranges[0][0] == start_id
    assert ranges[-1][1] == end_id
    for (_, hi), (lo, _) in itertools.pairwise(ranges):
        assert hi == lo
    # Ordered, and every range is non-empty when the whole interval is.
    bounds = [parse_id(ranges[0][0])] + [parse_id(hi) for _, hi in ranges]
    assert bounds == sorted(bounds)
    if parse_id(start_id) < parse_id(end_id):
        assert all(parse_id(lo) < parse_id(hi) for lo, hi in ranges)

    # Every id in (start, end] falls in exactly one (lo, hi]; nothing outside falls in any.
    lo_t, hi_t = parse_id(start_id), parse_id(end_id)
    probes = [lo_t, hi_t, (lo_t[0], lo_t[1] + 1), (hi_t[0] + 1, 0), (max(lo_t[0] - 1, 0), 0)]
    for _, hi in ranges:
        h = parse_id(hi)
        probes += [h, (h[0] + 1, 0), (h[0], 0)]
    probes += data.draw(
        st.lists(
            st.tuples(st.integers(s_ms, s_ms + span + 1), st.integers(0, MAX_SEQ)), max_size=20
        )
    )
    parsed = [(parse_id(lo), parse_id(hi)) for lo, hi in ranges]
    for p in probes:
        owners = [r for r in parsed if r[0] < p <= r[1]]
        inside = lo_t < p <= hi_t
        assert len(owners) == (1 if inside else 0), (p, ranges)


@FAST
@given(st.integers(0, 10**13), st.integers(0, 10**7), st.integers(2, 64))
def test_split_range_spreads_by_time(s_ms: int, span: int, parts: int) -> None:
    ranges = split_range(f"{s_ms}-0", f"{s_ms + span}-0", parts)
    if span >= parts:
        assert len(ranges) == parts
        widths = [id_ms(hi) - id_ms(lo) for lo, hi in ranges]
        # Roughly even cuts: no range is more than one step (+1 ms rounding) wider than another.
        assert max(widths) - min(widths) <= 1
    else:
        assert ranges == [(f"{s_ms}-0", f"{s_ms + span}-0")]


def test_event_ids_differ_between_shards_that_share_an_entry_id() -> None:
    """Two shards written in the same millisecond both hold `<ms>-0`. Their events must not share
    ids: the audit XORs ids, and equal ids would cancel in pairs and hide lost updates."""
    ms, seq, idx = [1_795_335_220_118] * 40, [0] * 40, list(range(40))
    a = event_ids(ms, seq, idx, "events:0")
    b = event_ids(ms, seq, idx, "events:1")
    assert not set(a.tolist()) & set(b.tolist())
    assert xor_all(np.concatenate([a, b])) != 0
    assert stream_salt("events:0") != stream_salt("events:1")


@FAST
@given(
    st.lists(
        st.tuples(st.integers(0, 2**48), st.integers(0, 3), st.integers(0, 500),
                  st.sampled_from(["events:0", "events:1", "orders:0"])),
        min_size=2, max_size=200, unique=True,
    )
)  # fmt: skip
def test_event_ids_are_distinct_and_deterministic(
    events: list[tuple[int, int, int, str]],
) -> None:
    ids = []
    for ms, seq, idx, stream in events:
        (one,) = event_ids([ms], [seq], [idx], stream).tolist()
        ids.append(one)
        assert event_ids([ms], [seq], [idx], stream).tolist() == [one]
    assert len(set(ids)) == len(ids)
