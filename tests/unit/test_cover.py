"""Multi-resolution window cover: exact tiling, truthful coverage, bounded slice count."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.slices.window import cover, coverage

FAST = settings(max_examples=300, deadline=None, database=None)
LADDERS = [[1000], [1000, 60_000], [1000, 60_000, 3_600_000], [10_000, 60_000, 600_000]]


@FAST
@given(
    end=st.integers(-(10**12), 10**13),
    window=st.integers(1, 8 * 86_400_000),
    ladder=st.sampled_from(LADDERS),
)
def test_tiles_cover_the_rounded_window_exactly(end: int, window: int, ladder: list[int]) -> None:
    c = cover(end, window, ladder)
    single = coverage(end, window, ladder[0])
    assert (c.covered_start, c.covered_end) == (single.covered_start, single.covered_end)
    at = c.covered_start
    for p in sorted(c.pieces, key=lambda p: p.first):
        assert p.first == at, "tiles are contiguous and do not overlap"
        assert p.first % p.slice_ms == 0 and p.slice_ms in ladder
        assert p.last >= p.first
        at = p.last + p.slice_ms
    assert at == c.covered_end
    assert c.covered_start <= end - window + 1 and c.covered_end >= end + 1


@FAST
@given(
    end=st.integers(0, 10**13),
    window=st.integers(1, 8 * 86_400_000),
    ladder=st.sampled_from(LADDERS),
)
def test_slice_count_is_bounded(end: int, window: int, ladder: list[int]) -> None:
    c = cover(end, window, ladder)
    steps = sum(b // a - 1 for a, b in itertools.pairwise(ladder))
    assert c.n_slices <= -(-window // ladder[-1]) + 2 + 2 * steps


@FAST
@given(
    end_slices=st.integers(1, 10**9),
    window_slices=st.integers(1, 100_000),
    ladder=st.sampled_from(LADDERS),
)
def test_window_aligned_to_the_finest_resolution_is_exact(
    end_slices: int, window_slices: int, ladder: list[int]
) -> None:
    finest = ladder[0]
    end = end_slices * finest - 1  # the window (end - H, end] ends on a slice boundary
    window = window_slices * finest
    c = cover(end, window, ladder)
    assert (c.covered_start, c.covered_end) == (end - window + 1, end + 1)


def test_one_day_at_three_resolutions_reads_few_slices() -> None:
    day = 86_400_000
    c = cover(10 * day + 12_345_678, day, [1000, 60_000, 3_600_000])
    assert c.n_slices < 24 + 2 * (59 + 59) + 2
    assert {p.slice_ms for p in c.pieces} == {1000, 60_000, 3_600_000}
