"""Slice arithmetic: which slice an event falls in, which slices a window touches.

All times are epoch milliseconds, all intervals half-open [start, end). A query window of length
`window_ms` ending at `end_ms` covers the events with `end_ms - window_ms < ts <= end_ms`, i.e.
the integer interval [end_ms - window_ms + 1, end_ms + 1). Seed 001's coverage policy counts every
slice that interval touches whole; the union of those slices is [covered_start, covered_end).
"""

from __future__ import annotations

from dataclasses import dataclass


def slice_start(ts_ms: int, slice_ms: int) -> int:
    """Start of the slice `ts_ms` falls in. Floors toward -inf, so negative times work too."""
    return ts_ms - (ts_ms % slice_ms)


@dataclass(frozen=True)
class Coverage:
    first_slice: int
    last_slice: int
    slice_ms: int

    @property
    def covered_start(self) -> int:
        return self.first_slice

    @property
    def covered_end(self) -> int:
        return self.last_slice + self.slice_ms

    @property
    def n_slices(self) -> int:
        return (self.last_slice - self.first_slice) // self.slice_ms + 1

    def slice_starts(self) -> range:
        return range(self.first_slice, self.last_slice + 1, self.slice_ms)


def coverage(end_ms: int, window_ms: int, slice_ms: int) -> Coverage:
    """Slices touched by the window (end_ms - window_ms, end_ms]."""
    if window_ms <= 0:
        raise ValueError(f"window must be positive, got {window_ms}ms")
    if slice_ms <= 0:
        raise ValueError(f"slice must be positive, got {slice_ms}ms")
    lo_ts = end_ms - window_ms + 1
    return Coverage(slice_start(lo_ts, slice_ms), slice_start(end_ms, slice_ms), slice_ms)
