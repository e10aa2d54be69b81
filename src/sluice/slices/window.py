"""Slice arithmetic: which slice an event falls in, which slices a window touches.

All times are epoch milliseconds, all intervals half-open [start, end). A query window of length
`window_ms` ending at `end_ms` covers the events with `end_ms - window_ms < ts <= end_ms`, i.e.
the integer interval [end_ms - window_ms + 1, end_ms + 1). Seed 001's coverage policy counts every
slice that interval touches whole; the union of those slices is [covered_start, covered_end).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field


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


@dataclass(frozen=True)
class Piece:
    """Consecutive slices [first, last] (slice starts, inclusive) of one resolution."""

    slice_ms: int
    first: int
    last: int

    @property
    def n_slices(self) -> int:
        return (self.last - self.first) // self.slice_ms + 1


@dataclass(frozen=True)
class Cover:
    pieces: tuple[Piece, ...]
    covered_start: int
    covered_end: int
    n_slices: int = field(init=False)  # of every piece (counted once: covers are shared)

    def __post_init__(self) -> None:
        object.__setattr__(self, "n_slices", sum(p.n_slices for p in self.pieces))


def cover(end_ms: int, window_ms: int, slice_lengths: Sequence[int]) -> Cover:
    """Cover the window (end_ms - window_ms, end_ms] with slices of several resolutions.

    `slice_lengths` is finest first, each a multiple of the one before. The window is first
    rounded outward to the finest resolution (seed 001's policy, at the finest grain), giving
    [covered_start, covered_end). That interval is then tiled exactly: the coarsest slices that
    fit inside it, and finer ones toward the edges, recursively. The tiles never overlap.

    Slices read, at most: ceil(window / r_n) + 2 + 2 * sum(r_(i+1) / r_i - 1) over consecutive
    resolutions. For [1s, 1m, 1h] that is window/1h + 238, whatever the window's length.
    """
    finest = slice_lengths[0]
    if window_ms <= 0 or finest <= 0:
        coverage(end_ms, window_ms, finest)  # raises the error that says which
    # `coverage`'s edges, without the object: a lookup's dearest step after the merge.
    lo, hi = slice_start(end_ms - window_ms + 1, finest), slice_start(end_ms, finest) + finest
    lengths = slice_lengths if isinstance(slice_lengths, tuple) else tuple(slice_lengths)
    return _tiled(lo, hi, lengths)


@functools.lru_cache(maxsize=4096)
def _tiled(lo: int, hi: int, slice_lengths: tuple[int, ...]) -> Cover:
    """The cover of [lo, hi) (see `cover`). Lookups in the same finest slice with the same
    window share it, so it is made once (a Cover is immutable)."""
    finest = slice_lengths[0]
    pieces: list[Piece] = []

    def tile(a: int, b: int, level: int) -> None:
        """Cover [a, b) exactly; a and b are multiples of slice_lengths[0]."""
        if a >= b:
            return
        if level == 0:
            pieces.append(Piece(finest, a, b - finest))
            return
        r = slice_lengths[level]
        inner_a = -(-a // r) * r
        inner_b = b // r * r
        if inner_a < inner_b:
            tile(a, inner_a, level - 1)
            pieces.append(Piece(r, inner_a, inner_b - r))
            tile(inner_b, b, level - 1)
        else:
            tile(a, b, level - 1)

    tile(lo, hi, len(slice_lengths) - 1)
    return Cover(tuple(pieces), lo, hi)
