"""The running tasks of training sets (`offline.prefix`) against a brute-force sum, minimum,
maximum, first and last over the same rows (ties at one time included): every window, keys cut
across batches and chunks, nulls, both searches, and the segment tree's range queries on their
own."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from sluice.offline import prefix
from sluice.offline.features import PART_PREFIX, ROW, part_column
from sluice.offline.prefix import PrefixMember, prefix_batches
from sluice.slices.window import slice_start

SLICE = 10_000
WINDOWS = (1, 9_999, 10_000, 25_000, 3_600_000)
MEMBERS = [
    PrefixMember(0, "count", WINDOWS, ("bigint",)),
    PrefixMember(1, "sum", WINDOWS, ("bigint", "double")),
    PrefixMember(2, "max", WINDOWS, ("bigint", "double")),
    PrefixMember(3, "min", WINDOWS, ("bigint", "bigint")),
    PrefixMember(4, "last", WINDOWS, ("bigint", "struct<t:bigint,v:double>")),
    PrefixMember(5, "first", WINDOWS, ("bigint", "struct<t:bigint,v:bigint>")),
]
TIMED = pa.struct([("t", pa.int64()), ("v", pa.float64())])
TIMED_LONG = pa.struct([("t", pa.int64()), ("v", pa.int64())])


def partition(seed: int, keys: int = 30, events: int = 3_000, spine: int = 400) -> pa.Table:
    """Rows as the Spark side hands them over: grouped by a hash of the key (`_h`), in no order
    within a hash, each event's state (`_p{mi}_{column}`), spine rows with null states and their
    ROW. The hash here has 7 values, so that keys collide and share runs."""
    rng = np.random.default_rng(seed)
    ek = rng.integers(0, keys, events)
    et = rng.integers(0, 2 * 3_600_000, events) // 1000 * 1000  # ties at one time
    amount = np.round(rng.lognormal(2, 1, events), 2)
    counted = rng.random(events) < 0.8  # the metric's filter: some events do not count for it
    sk = rng.integers(0, keys + 2, spine)  # two keys with no events
    st = np.where(rng.random(spine) < 0.3, et[rng.integers(0, events, spine)],
                  rng.integers(0, 2 * 3_600_000, spine))  # fmt: skip
    qty = rng.integers(-(2**40), 2**40, events)  # a long value: min over longs
    small = rng.integers(0, 3, events)  # few values: ties at one time are common
    rows: list[tuple[Any, ...]] = [
        (f"k{k:03d}", int(t), None, 1, int(c), float(a) if c else None, int(c),
         float(-a) if c else None, int(c), int(q) if c else None,
         int(c), {"t": int(t), "v": float(x)} if c else None,
         int(c), {"t": int(t), "v": int(x)} if c else None)
        for k, t, a, c, q, x in zip(ek, et, amount, counted, qty, small, strict=True)
    ]  # fmt: skip
    blank = (0, 0, None, 0, None, 0, None, 0, None, 0, None)
    rows += [(f"k{k:03d}", int(t), i, *blank) for i, (k, t) in enumerate(zip(sk, st, strict=True))]
    rows += [(None, 5, len(sk), *blank), ("k001", None, len(sk) + 1, *blank)]
    order = rng.permutation(len(rows))
    rows = [(zlib.crc32((rows[i][0] or "").encode()) % 7, *rows[i]) for i in order]
    rows.sort(key=lambda r: r[0])  # stable: shuffled within a hash
    h, k, t, row, n0, n1, s1, n2, x2, n3, x3, n4, x4, n5, x5 = zip(*rows, strict=True)
    return pa.table({
        "_h": pa.array(h, pa.int64()), "k": pa.array(k, pa.string()), "t": pa.array(t, pa.int64()),
        ROW: pa.array(row, pa.int64()), "_p0_n": pa.array(n0, pa.int64()),
        "_p1_n": pa.array(n1, pa.int64()), "_p1_sum": pa.array(s1, pa.float64()),
        "_p2_n": pa.array(n2, pa.int64()), "_p2_max": pa.array(x2, pa.float64()),
        "_p3_n": pa.array(n3, pa.int64()), "_p3_min": pa.array(x3, pa.int64()),
        "_p4_n": pa.array(n4, pa.int64()), "_p4_last": pa.array(x4, TIMED),
        "_p5_n": pa.array(n5, pa.int64()), "_p5_first": pa.array(x5, TIMED_LONG),
    })  # fmt: skip


def brute(table: pa.Table) -> dict[int, dict[str, object]]:
    d = table.to_pylist()
    out: dict[int, dict[str, object]] = {}
    for r in d:
        if r[ROW] is None:
            continue
        got: dict[str, object] = {}
        for wi, w in enumerate(WINDOWS):
            if r["k"] is None or r["t"] is None:
                for name in ("count", "sum", "max", "min", "last", "first"):
                    got[f"{name}{wi}"] = None
                continue
            lo = slice_start(r["t"] - w + 1, SLICE)
            inside = [
                e for e in d if e[ROW] is None and e["k"] == r["k"] and lo <= e["t"] <= r["t"]
            ]
            got[f"count{wi}"] = sum(e["_p0_n"] for e in inside)
            n = sum(e["_p1_n"] for e in inside)
            got[f"sum{wi}"] = sum(e["_p1_sum"] or 0.0 for e in inside) if n else None
            highs = [e["_p2_max"] for e in inside if e["_p2_max"] is not None]
            got[f"max{wi}"] = max(highs) if highs else None
            lows = [e["_p3_min"] for e in inside if e["_p3_min"] is not None]
            got[f"min{wi}"] = float(min(lows)) if lows else None
            # last: the greatest (time, value), a tie to the greater value; first the least
            lasts = [(e["_p4_last"]["t"], e["_p4_last"]["v"]) for e in inside if e["_p4_last"]]
            got[f"last{wi}"] = max(lasts)[1] if lasts else None
            firsts = [(e["_p5_first"]["t"], e["_p5_first"]["v"]) for e in inside if e["_p5_first"]]
            got[f"first{wi}"] = float(min(firsts)[1]) if firsts else None
        out[r[ROW]] = got
    return out


def answers(table: pa.Table, batch_rows: int) -> dict[int, dict[str, object]]:
    out: dict[int, dict[str, object]] = {}
    for b in prefix_batches(MEMBERS, SLICE, iter(table.to_batches(max_chunksize=batch_rows))):
        cols = b.to_pydict()
        for i, row in enumerate(cols[ROW]):
            assert row not in out  # every spine row once
            got: dict[str, object] = {}
            for wi in range(len(WINDOWS)):
                ok = cols[part_column(0, "", "ok")][i]
                has0 = cols[part_column(0, PART_PREFIX, "has", wi)][i]
                count = cols[part_column(0, PART_PREFIX, "x0", wi)][i]
                got[f"count{wi}"] = (int(count) if has0 else 0) if ok else None
                has1 = cols[part_column(1, PART_PREFIX, "has", wi)][i]
                total = cols[part_column(1, PART_PREFIX, "x0", wi)][i]
                got[f"sum{wi}"] = total if has1 else None
                for mi, name, x in ((2, "max", 0), (3, "min", 0), (4, "last", 1), (5, "first", 1)):
                    has = cols[part_column(mi, PART_PREFIX, "has", wi)][i]
                    value = cols[part_column(mi, PART_PREFIX, f"x{x}", wi)][i]
                    got[f"{name}{wi}"] = value if has else None
            out[row] = got
    return out


def same(got: dict[int, dict[str, object]], want: dict[int, dict[str, object]]) -> None:
    assert got.keys() == want.keys()
    for row, values in want.items():
        for name, w in values.items():
            g = got[row][name]
            if isinstance(w, float):
                assert g == pytest.approx(w, rel=1e-12), (row, name)
            else:
                assert g == w, (row, name, got[row], values)


@pytest.mark.parametrize("batch_rows", [10_000, 97])
def test_every_window_matches_a_brute_force_sum(batch_rows: int) -> None:
    table = partition(1)
    same(answers(table, batch_rows), brute(table))


def test_chunks_end_at_hash_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small chunks: every chunk but the last holds whole hash runs, and answers do not change."""
    table = partition(2)
    monkeypatch.setattr(prefix, "CHUNK_ROWS", 150)
    same(answers(table, 61), brute(table))


def test_the_search_per_key_agrees_with_the_composite_one() -> None:
    """Queries before, inside and after each key's times; the composite search, and the search
    per key that a span too wide for one number takes, both give the brute force's rows."""
    rng = np.random.default_rng(5)
    kid = np.sort(rng.integers(0, 50, 2_000))
    t = np.concatenate([np.sort(rng.integers(0, 10**6, int((kid == k).sum()))) for k in range(50)])
    q_kid, q_t = rng.integers(0, 50, 500), rng.integers(-10, 10**6 + 10, 500)
    q_kid, q_t = np.append(q_kid, [49, 0, 0]), np.append(q_t, [1 << 61, -(1 << 61), 1 << 61])
    fast = prefix._Search(kid, t)
    assert fast.comp is not None
    wide_t = t.copy()
    wide_t[-1] = 1 << 61  # the last key's last row, far in the future: no composite fits
    wide = prefix._Search(kid, wide_t)
    assert wide.comp is None
    for search, times in ((fast, t), (wide, wide_t)):
        got = search.first(q_kid, q_t)
        for i in range(len(q_t)):
            want = next(
                (j for j in range(len(t)) if (kid[j], times[j]) >= (q_kid[i], q_t[i])), len(t)
            )
            assert got[i] == want, (i, q_kid[i], q_t[i])


def test_the_composite_sort_agrees_with_the_sort_on_three_columns() -> None:
    """Codes from -1 (no key), times with ties, spine rows among them: the one-number sort and
    the three-column one give the same order, and a time span too wide for one number takes
    the three-column sort."""
    rng = np.random.default_rng(9)
    codes = rng.integers(-1, 40, 5_000)
    t = rng.integers(-5_000, 5_000, 5_000) // 100 * 100
    spine = rng.random(5_000) < 0.2
    want = np.lexsort((spine, t, codes))
    assert (prefix._sort_order(codes, t, spine) == want).all()
    t_wide = t.copy()
    t_wide[0], t_wide[1] = -(1 << 60), 1 << 60
    assert (prefix._sort_order(codes, t_wide, spine) == np.lexsort((spine, t_wide, codes))).all()
    assert len(prefix._sort_order(codes[:0], t[:0], spine[:0])) == 0


@pytest.mark.parametrize("merge", ["min", "max"])
@pytest.mark.parametrize("n", [1, 2, 7, 64, 1001])
def test_range_queries_match_a_brute_force(merge: str, n: int) -> None:
    rng = np.random.default_rng(n)
    for dtype in (np.float64, np.int64):
        values = rng.integers(-1000, 1000, n).astype(dtype)
        lo = rng.integers(0, n + 1, 300)
        hi = np.minimum(n, lo + rng.integers(0, n + 1, 300))
        lo[:3], hi[:3] = [0, n, 0], [n, n, 0]  # all of it, and two empty ranges
        got = prefix._Tree(values, merge).query(lo, hi)
        empty = prefix._identity(values.dtype, merge)
        pick = min if merge == "min" else max
        want = [pick(values[a:b].tolist()) if a < b else empty for a, b in zip(lo, hi, strict=True)]
        assert got.tolist() == want and got.dtype == values.dtype
