"""Slice states merged in the query server, from the raw values HMGET returns.

A lookup over a bounded number of slices reads them with HMGET and merges them here: Redis then
only looks fields up (about 0.04 µs each) instead of running a script that parses and merges
every slice (about 0.7 µs each), so the single-threaded store stops being what limits the
lookup rate, and the merging is spread over the server's worker processes. Long ranges are
still merged in Redis by `read_slices.lua`, which can scan a sparse hash instead of asking for
every slice (see `QueryEngine`).

The states are the writer's text, `token:v1:...` (see `write_slices.lua`). The merge works on
whole columns with C-level iteration (join, split, map, reduce), never a Python loop per
slice, and gives exactly what `read_slices.lua` gives: the same doubles added in the same
order, the same minimum, maximum and last value. Only `var` is merged differently: the
two-pass combination of (count, mean, M2) over all slices at once, which may differ from the
script's pairwise updates in the last bits.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import reduce
from operator import add

import numpy as np

# Numbers in a state after its token, per agg (see write_slices.lua).
WIDTH = {"count": 1, "sum": 1, "min": 1, "max": 1, "avg": 2, "var": 3, "last": 2}


def merge_states(agg: str, replies: Iterable[bytes | None]) -> list[float]:
    """[slices with data, merged state...] of the packed states in `replies` (None = no slice),
    in the shape `read_slices.lua` returns: just [0] when no slice holds data. Raises
    ValueError on a state that does not have the agg's width."""
    states = list(filter(None, replies))
    if not states:
        return [0]
    stride = WIDTH[agg] + 1
    parts = b":".join(states).split(b":")
    if len(parts) != stride * len(states):
        raise ValueError(f"a slice state is not `token` and {stride - 1} numbers for {agg!r}")
    cols = [parts[j::stride] for j in range(1, stride)]
    n = float(len(states))
    if agg in ("count", "sum"):
        return [n, reduce(add, map(float, cols[0]))]
    if agg == "min":
        return [n, min(map(float, cols[0]))]
    if agg == "max":
        return [n, max(map(float, cols[0]))]
    if agg == "avg":
        return [n, reduce(add, map(float, cols[0])), reduce(add, map(float, cols[1]))]
    if agg == "last":  # the greater event time wins; a tie goes to the greater value
        ts, value = max(zip(map(float, cols[0]), map(float, cols[1]), strict=True))
        return [n, ts, value]
    if agg == "var":
        counts, means, m2s = (np.fromiter(map(float, c), np.float64, len(c)) for c in cols)
        total = counts.sum()
        mean = float((counts * means).sum() / total)
        m2 = float(m2s.sum() + (counts * (means - mean) ** 2).sum())
        return [n, float(total), mean, m2]
    raise ValueError(f"no merge for agg {agg!r}")
