"""sluice.slices.window: slice alignment and the slices a query window touches."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from sluice.slices.window import Coverage, coverage, slice_start

FAST = settings(max_examples=120, deadline=None, database=None)
ENUMERATE_LIMIT = 2_000  # enumerate every ts / slice below this size, sample above
BRUTE_FORCE_SLICES = 64  # `containing` scans every included slice when there are this few

ends = st.one_of(
    st.integers(min_value=-(10**6), max_value=10**6),
    st.integers(min_value=1_600_000_000_000, max_value=1_800_000_000_000),
    st.integers(min_value=-(2**62), max_value=2**62),
)
windows = st.one_of(
    st.integers(min_value=1, max_value=5_000),
    st.integers(min_value=1, max_value=10**12),
)
slices = st.one_of(
    st.integers(min_value=1, max_value=100),
    st.integers(min_value=1, max_value=10**9),
    st.sampled_from([1_000, 60_000, 3_600_000, 86_400_000]),
)


def containing(cov: Coverage, ts: int) -> list[int]:
    """Included slice starts whose [start, start + slice) holds ts (enumerates small ranges)."""
    starts = cov.slice_starts()
    if len(starts) <= BRUTE_FORCE_SLICES:
        candidates = list(starts)
    else:
        # Only slices starting within one slice length of ts can hold it.
        base = ts - (ts % cov.slice_ms)
        candidates = [s for s in (base - cov.slice_ms, base, base + cov.slice_ms) if s in starts]
    return [s for s in candidates if s <= ts < s + cov.slice_ms]


def samples(lo: int, hi: int, data: st.DataObject, slice_ms: int) -> list[int]:
    """Integer timestamps in [lo, hi): all of them when few, else edges plus random draws."""
    if hi - lo <= ENUMERATE_LIMIT:
        return list(range(lo, hi))
    picks = {lo, lo + 1, hi - 2, hi - 1}
    # Both sides of a few slice boundaries inside the range.
    first_boundary = lo - (lo % slice_ms) + slice_ms
    for k in range(3):
        b = first_boundary + k * slice_ms
        if lo < b < hi:
            picks.update({b - 1, b})
    picks.update(data.draw(st.lists(st.integers(lo, hi - 1), min_size=20, max_size=20)))
    return sorted(picks)


@pytest.mark.parametrize(
    ("ts", "size", "start"),
    [
        (0, 60_000, 0),
        (59_999, 60_000, 0),
        (60_000, 60_000, 60_000),
        (1_700_000_012_345, 60_000, 1_699_999_980_000),
        (-1, 60_000, -60_000),
        (-60_000, 60_000, -60_000),
        (-60_001, 60_000, -120_000),
        (7, 1, 7),
    ],
)
def test_slice_start_examples(ts: int, size: int, start: int) -> None:
    assert slice_start(ts, size) == start


@FAST
@given(st.integers(min_value=-(2**62), max_value=2**62), slices)
def test_slice_start_floors(ts: int, size: int) -> None:
    s = slice_start(ts, size)
    assert s % size == 0
    assert s <= ts < s + size


def test_coverage_example_one_minute_slices() -> None:
    # Window (12:00:30, 12:15:30] in minutes since the epoch: slices 12:00 .. 12:15 inclusive.
    end = 15 * 60_000 + 30_000
    cov = coverage(end, 15 * 60_000, 60_000)
    assert cov.first_slice == 0
    assert cov.last_slice == 15 * 60_000
    assert cov.n_slices == 16
    assert (cov.covered_start, cov.covered_end) == (0, 16 * 60_000)
    assert list(cov.slice_starts()) == [i * 60_000 for i in range(16)]


def test_coverage_aligned_window_is_exact() -> None:
    cov = coverage(3_600_000 - 1, 3_600_000, 60_000)
    assert (cov.covered_start, cov.covered_end, cov.n_slices) == (0, 3_600_000, 60)


@pytest.mark.parametrize(("window", "size"), [(0, 1000), (-5, 1000)])
def test_coverage_rejects_non_positive_window(window: int, size: int) -> None:
    with pytest.raises(ValueError, match=rf"window must be positive, got {window}ms"):
        coverage(1_000_000, window, size)


@pytest.mark.parametrize("size", [0, -1000])
def test_coverage_rejects_non_positive_slice(size: int) -> None:
    with pytest.raises(ValueError, match=rf"slice must be positive, got {size}ms"):
        coverage(1_000_000, 60_000, size)


@FAST
@given(ends, windows, slices, st.data())
def test_every_window_ts_is_in_exactly_one_included_slice(
    end: int, window: int, size: int, data: st.DataObject
) -> None:
    """(a) every integer ts in (end - window, end] is covered, by exactly one slice."""
    cov = coverage(end, window, size)
    for ts in samples(end - window + 1, end + 1, data, size):
        assert containing(cov, ts) == [slice_start(ts, size)], ts
        assert cov.covered_start <= ts < cov.covered_end


@FAST
@given(ends, windows, slices)
def test_every_included_slice_intersects_the_window(end: int, window: int, size: int) -> None:
    """(b) no slice is included that the window does not touch."""
    cov = coverage(end, window, size)
    lo, hi = end - window + 1, end + 1  # the window as the integer interval [lo, hi)
    starts = cov.slice_starts()
    checked = list(starts) if len(starts) <= ENUMERATE_LIMIT else [starts[0], starts[-1]]
    for s in checked:
        assert s < hi
        assert s + size > lo
    # Tightness: one more slice on either side would not touch the window.
    assert cov.covered_start <= lo < cov.covered_start + size
    assert cov.covered_end - size <= end < cov.covered_end


@FAST
@given(ends, windows, slices)
def test_slices_are_contiguous_and_aligned(end: int, window: int, size: int) -> None:
    """(c) aligned, contiguous, and n_slices agrees with slice_starts()."""
    cov = coverage(end, window, size)
    starts = cov.slice_starts()
    assert cov.slice_ms == size
    assert starts.step == size
    assert starts[0] == cov.first_slice == cov.covered_start
    assert starts[-1] == cov.last_slice == cov.covered_end - size
    assert cov.first_slice % size == 0
    assert cov.last_slice % size == 0
    assert cov.n_slices == len(starts) >= 1
    assert cov.covered_end - cov.covered_start == cov.n_slices * size
    # At most one partial slice at each end beyond the window itself.
    assert cov.n_slices <= window // size + 2
    if len(starts) <= ENUMERATE_LIMIT:
        listed = list(starts)
        assert all(b - a == size for a, b in itertools.pairwise(listed))
        assert all(s % size == 0 for s in listed)


@FAST
@given(ends, windows, slices, st.data())
def test_covered_interval_is_exactly_the_union_of_slices(
    end: int, window: int, size: int, data: st.DataObject
) -> None:
    """(d) ts in [covered_start, covered_end) -> one slice; ts outside -> none."""
    cov = coverage(end, window, size)
    for ts in samples(cov.covered_start, cov.covered_end, data, size):
        assert len(containing(cov, ts)) == 1, ts
    outside = [cov.covered_start - 1, cov.covered_start - size, cov.covered_end]
    outside += [cov.covered_end + size - 1, cov.covered_start - 10 * size, cov.covered_end + 10**9]
    outside += data.draw(
        st.lists(
            st.one_of(
                st.integers(max_value=cov.covered_start - 1),
                st.integers(min_value=cov.covered_end),
            ),
            max_size=10,
        )
    )
    for ts in outside:
        assert containing(cov, ts) == [], ts


@FAST
@given(
    st.integers(min_value=-(10**9), max_value=10**9),
    st.integers(min_value=1, max_value=10**4),
    slices,
)
def test_aligned_window_is_covered_exactly(k: int, n: int, size: int) -> None:
    """(e) when end + 1 and end - window + 1 are slice boundaries, covered == the window."""
    end = k * size - 1
    window = n * size
    assert (end + 1) % size == 0 and (end - window + 1) % size == 0
    cov = coverage(end, window, size)
    assert cov.covered_start == end - window + 1
    assert cov.covered_end == end + 1
    assert cov.n_slices == n


@FAST
@given(ends, windows, slices)
def test_unaligned_window_covers_strictly_more(end: int, window: int, size: int) -> None:
    """The converse of (e): if either edge is off a boundary, coverage is strictly larger."""
    assume((end + 1) % size != 0 or (end - window + 1) % size != 0)
    cov = coverage(end, window, size)
    assert cov.covered_end - cov.covered_start > window
