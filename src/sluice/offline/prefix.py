"""Training-set windows by running totals and range minima and maxima, for the aggregations
whose every state column merges by addition, `min` or `max` (`Agg.running`: count, sum, avg,
min, max).

A state column merged by addition over a window is a difference of two running totals. For a
key's events in time order, with each spine row of that key placed after the events of its own
time t:

    window (t − W, t] covered from cs = slice_start(t − W + 1):
    state = total(events before and at t) − total(events before cs)

A column merged by `min` or `max` is the least or greatest of the same run of rows, the events
from cs up to the spine row: a range query, answered for every spine row at once on a segment
tree over the chunk's rows (`_Tree`: levels of pairwise minima, 2n numbers, built once per
chunk and column and asked for every window). A
(time, value) state (`first`, `last`: the least or greatest pair) is ranked in that order
first (`_ranked`), and the range's least or greatest rank names its pair.

so one pass answers every window of every running metric of a key group:

    events ∪ spine rows ─ one shuffle by key ─▶ grouped by a 64-bit hash of the key
      ─▶ per chunk of whole hash runs, in numpy: sorted by (key, time, spine after events)
      ─▶ each event's state as the aggregation record gives it (`Agg.unit_columns`: the
         fold of a cell that holds just that event)
      ─▶ per partition, in numpy: running totals of each summed state column; per spine row
         and window, the first row at or after cs (a binary search); the difference of the
         totals, or the range's least or greatest
      ─▶ the merged state's numbers (`Agg.numbers`, what the store holds), answered later by
         `Agg.finalize` (`offline.answers`), as the query server answers a merged state.

The window cover is the online one (`slices.window.slice_start` at the metric's finest slice),
and nothing after t counts: a spine row's total stops at its own place in the order. Against
the slice frames (`offline.training._frames`) this needs no cell aggregation, no join for t's
own slice and no frame per window: a window costs one binary search per spine row.

Spark groups a partition's rows by the key's hash (`xxhash64`, one long: a radix sort, where a
sort by the key's text and time compares strings and cost Spark most of the job), and the
tasks sort each chunk by key and time: the key's code in the chunk (its dictionary index),
the time and a spine bit packed into one 64-bit number where they fit, one stable sort (the
codes come grouped, so it mostly orders each key's own run). A partition is processed in
chunks that end at a hash boundary (`CHUNK_ROWS` or more rows, never part of a key; keys whose
hashes collide share a run), so memory stays bounded by the chunk and the largest key. Sums of
doubles run in extended precision (`numpy.longdouble`), so the difference of two large totals
keeps the precision of the window's own sum.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from sluice.offline.features import PART_PREFIX, ROW, SLICE_T, SPINE, part_column
from sluice.slices.aggs import AGGS, Agg
from sluice.slices.window import slice_start

CHUNK_ROWS = 1 << 20
_HASH = "_h"  # the key's hash: a partition's rows come grouped by it
_Passed = tuple[pa.ChunkedArray, np.ndarray]  # the spine's columns as they came, the sort
_INT_TYPES = ("bigint", "int", "smallint", "tinyint")


@dataclass(frozen=True)
class PrefixMember:
    """One running metric of the group (`Agg.running`): its index among the job's metrics
    (`mi`), its agg, its windows (ms) and the Spark types of its state columns (`n`, then
    `Agg.folds`)."""

    mi: int
    agg_name: str
    windows: tuple[int, ...]
    state_types: tuple[str, ...]

    @property
    def agg(self) -> Agg:
        return AGGS[self.agg_name]


def _state(mi: int, name: str) -> str:
    return f"_p{mi}_{name}"


def prefix_ddl(members: list[PrefixMember]) -> str:
    """The prefix part's columns: ROW, per member `ok`, and per member and window `has` (any
    event in the window) and the merged state's numbers `x0..`."""
    cols = [f"{ROW} long"]
    for m in members:
        cols.append(f"{part_column(m.mi, '', 'ok')} boolean")
        for wi in range(len(m.windows)):
            cols.append(f"{part_column(m.mi, PART_PREFIX, 'has', wi)} boolean")
            cols += [
                f"{part_column(m.mi, PART_PREFIX, f'x{j}', wi)} double" for j in range(m.agg.width)
            ]
    return ", ".join(cols)


def prefix_part(
    members: list[tuple[int, Any]],
    rows: DataFrame,
    spine_g: DataFrame,
    slice_ms: int,
    then: tuple[Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]], StructType]
    | None = None,
) -> DataFrame:
    """Per spine row of the group, each running member's windows merged (module docstring).
    `members` are (mi, training._Metric); `rows` the group's exploded rows (k, s, t, v{mi});
    `spine_g` the spine's (ROW, SLICE_T, k, _s, and the spine's own columns as `SPINE` when
    they ride along). Every spine row gets a row. `then`: a task body to run on those rows in
    the same tasks (the answers), with the schema of what it yields."""
    none = F.lit(None).cast("long")
    values = [f"v{mi}" for mi, _ in members]
    passed = [SPINE] if SPINE in spine_g.columns else []
    blank = [F.lit(None).cast(spine_g.schema[SPINE].dataType).alias(SPINE)] if passed else []
    events = rows.select("k", "t", none.alias(ROW), *values, *blank)
    spine = spine_g.select(
        "k",
        F.col(SLICE_T).alias("t"),
        ROW,
        *[F.lit(None).cast(rows.schema[v].dataType).alias(v) for v in values],
        *passed,
    )
    # Each event's state (`Agg.unit_columns`: what the fold makes of a cell holding just that
    # event) is a row expression; a spine row's is all zeros.
    states: list[Column] = []
    for mi, m in members:
        states += [
            unit.alias(_state(mi, name))
            for name, unit in m.agg.unit_columns(F.col(f"v{mi}"), F.col("t"))
        ]
    folded = (
        events.unionByName(spine)
        .select("k", "t", ROW, *states, *passed)
        .repartition("k")
        .withColumn(_HASH, F.xxhash64("k"))
        .sortWithinPartitions(_HASH)
    )
    plan = [
        PrefixMember(
            mi,
            m.cfg.agg,
            tuple(m.windows),
            tuple(
                folded.schema[_state(mi, name)].dataType.simpleString() for name in m.agg.columns
            ),
        )
        for mi, m in members
    ]

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        merged = prefix_batches(plan, slice_ms, batches)
        return then[0](merged) if then is not None else merged

    schema = cast(StructType, StructType.fromDDL(prefix_ddl(plan)))
    if passed:
        schema = schema.add(SPINE, spine_g.schema[SPINE].dataType)
    return folded.mapInArrow(run, then[1] if then is not None else schema)


# -- the tasks -------------------------------------------------------------------------------


def prefix_batches(
    members: list[PrefixMember], slice_ms: int, batches: Iterator[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    """mapInArrow body over one partition grouped by the key's hash (`_HASH`): the spine rows'
    merged windows, a chunk of whole hash runs at a time."""
    held: list[pa.RecordBatch] = []
    rows = 0
    for batch in batches:
        held.append(batch)
        rows += batch.num_rows
        if rows < CHUNK_ROWS:
            continue
        table = pa.Table.from_batches(held).combine_chunks()
        h = table.column(_HASH).to_numpy()
        other = np.flatnonzero(h != h[-1])  # rows of other hashes than the last one's
        cut = int(other[-1]) + 1 if len(other) else 0
        if cut == 0:
            continue  # one hash so far: its keys must be whole
        yield from _answer(members, slice_ms, *_in_order(table.slice(0, cut)))
        rest = table.slice(cut)
        held, rows = rest.to_batches(), rest.num_rows
    if held:
        yield from _answer(members, slice_ms, *_in_order(pa.Table.from_batches(held)))


def _in_order(table: pa.Table) -> tuple[pa.Table, np.ndarray, np.ndarray, _Passed | None]:
    """A chunk of whole keys sorted by (key, time, spine rows after events); per sorted row the
    index of its key's run (nulls form one run) and whether it has a key; and the spine's own
    columns (`SPINE`) as they came, with the sort's order, or None: `_answer` takes them for
    spine rows only. The key's text is not carried into the sorted table: its runs are all
    `_answer` needs of it."""
    codes = pc.dictionary_encode(table.column("k")).combine_chunks().indices
    codes = pc.fill_null(codes, -1).to_numpy(zero_copy_only=False)
    t = pc.fill_null(table.column("t"), 0).to_numpy(zero_copy_only=False)
    is_spine = table.column(ROW).is_valid().to_numpy(zero_copy_only=False)
    order = _sort_order(codes, t, is_spine)
    passed = table.column(SPINE) if SPINE in table.column_names else None
    names = [n for n in table.column_names if n not in (_HASH, SPINE, "k")]
    ordered = table.select(names).take(pa.array(order))
    c = codes[order]
    starts = np.empty(len(c), dtype=bool)
    if len(c):
        starts[0] = True
        np.not_equal(c[1:], c[:-1], out=starts[1:])
    return ordered, np.cumsum(starts) - 1, c != -1, (passed, order) if passed is not None else None


def _sort_order(codes: np.ndarray, t: np.ndarray, is_spine: np.ndarray) -> np.ndarray:
    """The stable order by (key code, time, spine rows after events): one sort of a composite
    64-bit number where it fits (a chunk's codes come grouped, so the sort mostly orders each
    key's own run), else a sort on the three columns. Rows equal in all three keep the order
    they came in; spine rows equal in key and time answer alike, whatever their order."""
    if not len(t):
        return np.zeros(0, dtype=np.int64)
    lo = int(t.min())
    span = 2 * (int(t.max()) - lo + 1)  # twice: room for the spine bit
    if (int(codes.max()) + 2) * span < (1 << 63):
        composite = (codes.astype(np.int64) + 1) * span + (t - lo) * 2 + is_spine
        return np.argsort(composite, kind="stable")
    return np.lexsort((is_spine, t, codes))


class _Search:
    """Binary searches over a chunk's rows sorted by (kid, t), built once and asked for every
    window: `first(q_kid, q_t)`, for each query, the first row index with (kid, t) >= it. One
    search over a composite 63-bit key where it fits, else one per key. A query time outside
    the chunk's times is clipped to one step past them, where it finds the same row."""

    def __init__(self, kid: np.ndarray, t: np.ndarray) -> None:
        self.kid, self.t = kid, t
        self.lo = int(t.min()) if len(t) else 0
        self.hi = int(t.max()) + 1 if len(t) else 1  # past every row of a key
        self.span = self.hi - self.lo + 1
        fits = len(t) and (int(kid[-1]) + 1) * self.span < (1 << 62)
        self.comp = kid * self.span + (t - self.lo) if fits else None

    def first(self, q_kid: np.ndarray, q_t: np.ndarray) -> np.ndarray:
        if not len(self.t):
            return np.zeros(len(q_t), dtype=np.int64)
        q = np.clip(q_t, self.lo, self.hi)
        if self.comp is not None:
            return np.searchsorted(self.comp, q_kid * self.span + (q - self.lo), side="left")
        out = np.empty(len(q_t), dtype=np.int64)
        starts = np.searchsorted(self.kid, np.arange(int(self.kid[-1]) + 2), side="left")
        for key in np.unique(q_kid):
            a, b = starts[key], starts[key + 1]
            at = q_kid == key
            out[at] = a + np.searchsorted(self.t[a:b], q[at], side="left")
        return out


def _merges(agg: Agg) -> dict[str, str]:
    """Each state column's merge: `sum`, `min` or `max` (`Fold.merge`)."""
    return {"n": "sum", **{f.column: f.merge for f in agg.folds}}


_UFUNCS = {"min": np.minimum, "max": np.maximum}


def _identity(dtype: np.dtype[Any], merge: str) -> Any:
    """What `min` (`max`) leaves any number as: the type's greatest (least) value."""
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return info.max if merge == "min" else info.min
    return np.inf if merge == "min" else -np.inf


def _values(column: pa.ChunkedArray | pa.Array, type_: str, merge: str) -> np.ndarray:
    """A state column merged by `min` or `max` as numbers, nulls (spine rows, events the metric
    does not count) as the merge's identity."""
    dtype = np.dtype(np.int64) if type_ in _INT_TYPES else np.dtype(np.float64)
    fill = _identity(dtype, merge)
    return pc.fill_null(column, fill).to_numpy(zero_copy_only=False).astype(dtype)


class _Tree:
    """A segment tree over `values` for `min` or `max`: the values, then each level of
    pairwise minima (maxima) of the one below, 2n numbers in all. `query` answers the least
    (greatest) of values[lo[i]:hi[i]] for every i at once (the identity where empty), each
    range taking at most one node at each end per level, as the iterative query does."""

    def __init__(self, values: np.ndarray, merge: str) -> None:
        self.ufunc = _UFUNCS[merge]
        self.empty = _identity(values.dtype, merge)
        self.levels = [values]
        while len(self.levels[-1]) > 1:
            level = self.levels[-1]
            if len(level) & 1:
                level = np.append(level, self.empty)
            self.levels.append(self.ufunc(level[0::2], level[1::2]))

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.levels[0].dtype

    def query(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        ufunc = self.ufunc
        out = np.full(len(lo), self.empty, dtype=self.dtype)
        left, right = lo.astype(np.int64), hi.astype(np.int64)
        for level in self.levels:
            live = left < right
            if not live.any():
                break
            odd = live & (left & 1 == 1)  # a left end on a right child: take it, step right
            out[odd] = ufunc(out[odd], level[left[odd]])
            left = left + odd
            odd = live & (right & 1 == 1)  # an (exclusive) right end after a left child
            right = right - odd
            out[odd] = ufunc(out[odd], level[right[odd]])
            left, right = left >> 1, right >> 1
        return out


class _Ranked(NamedTuple):
    """A (time, value) state column as a tree over its ranks in (time, value) order (nulls: the
    merge's identity), and the times and values by rank."""

    rank: _Tree
    t: np.ndarray
    v: np.ndarray

    def pairs(self, rank: np.ndarray, has: np.ndarray) -> pa.StructArray:
        """The pairs of `rank` (zeros where not `has`), as the fold's struct (t, v)."""
        at = np.where(has, rank, 0)
        t = np.where(has, self.t[at] if len(self.t) else 0, 0).astype(self.t.dtype)
        v = np.where(has, self.v[at] if len(self.v) else 0, 0).astype(self.v.dtype)
        return pa.StructArray.from_arrays([pa.array(t), pa.array(v)], names=["t", "v"])


def _ranked(column: pa.ChunkedArray | pa.Array, merge: str) -> _Ranked:
    """`column`'s (time, value) structs ranked by time, then value: the least (greatest) rank
    of a range is its least (greatest) pair, as Spark orders structs."""
    col = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    valid = col.is_valid().to_numpy(zero_copy_only=False)
    t = pc.fill_null(pc.struct_field(col, "t"), 0).to_numpy(zero_copy_only=False)
    v = pc.fill_null(pc.struct_field(col, "v"), 0).to_numpy(zero_copy_only=False)
    rows = np.flatnonzero(valid)
    order = rows[np.lexsort((v[rows], t[rows]))]
    rank = np.full(len(col), _identity(np.dtype(np.int64), merge), dtype=np.int64)
    rank[order] = np.arange(len(order))
    return _Ranked(_Tree(rank, merge), t[order], v[order])


def _running(column: pa.ChunkedArray | pa.Array, type_: str) -> np.ndarray:
    """0, then the running total of a state column (nulls as 0)."""
    if type_ in _INT_TYPES:
        values = pc.fill_null(column, 0).to_numpy(zero_copy_only=False).astype(np.int64)
    else:
        values = pc.fill_null(column, 0.0).to_numpy(zero_copy_only=False).astype(np.longdouble)
    out = np.zeros(len(values) + 1, dtype=values.dtype)
    np.cumsum(values, out=out[1:])
    return out


def _answer(members: list[PrefixMember], slice_ms: int, table: pa.Table, kid: np.ndarray,
            keyed: np.ndarray, passed: _Passed | None) -> Iterator[pa.RecordBatch]:  # fmt: skip
    """The spine rows' merged windows in a chunk of whole keys sorted by `_in_order`; `kid`:
    its rows' key runs; `keyed`: which rows have a key; `passed`: the spine's columns and the
    sort's order, or None."""
    row_col = table.column(ROW)
    spine = np.flatnonzero(row_col.is_valid().to_numpy(zero_copy_only=False))
    if not len(spine):
        return
    t_col = table.column("t")
    t = pc.fill_null(t_col, 0).to_numpy(zero_copy_only=False).astype(np.int64)
    ok = (t_col.is_valid().to_numpy(zero_copy_only=False) & keyed)[spine]
    t_row, k_row = t[spine], kid[spine]
    cols: list[pa.Array] = [pc.take(row_col, pa.array(spine)).combine_chunks()]
    names = [ROW]
    starts: dict[int, np.ndarray] = {}
    search = _Search(kid, t)
    for m in members:
        cols.append(pa.array(ok))
        names.append(part_column(m.mi, "", "ok"))
        merges = _merges(m.agg)
        columns: dict[str, Any] = {}
        upto: dict[str, np.ndarray] = {}  # a summed column's running total at each spine row
        for name, type_ in zip(m.agg.columns, m.state_types, strict=True):
            column = table.column(_state(m.mi, name))
            if merges[name] == "sum":
                columns[name] = _running(column, type_)
                upto[name] = columns[name][spine + 1]
            elif pa.types.is_struct(column.type):
                columns[name] = _ranked(column, merges[name])
            else:
                columns[name] = _Tree(_values(column, type_, merges[name]), merges[name])
        for wi, w_ms in enumerate(m.windows):
            if w_ms not in starts:
                cs = np.asarray(slice_start(t_row - w_ms + 1, slice_ms))
                starts[w_ms] = search.first(k_row, cs)
            first = starts[w_ms]
            merged = {}
            for name, col in columns.items():
                if merges[name] == "sum":
                    merged[name] = upto[name] - col[first]
                elif isinstance(col, _Ranked):  # (time, value): the range's least/greatest rank
                    merged[name] = col.pairs(col.rank.query(first, spine + 1), merged["n"] > 0)
                else:  # the events from `first` to the spine row (whose state is the identity)
                    least = col.query(first, spine + 1)
                    # `n` (first of the columns) counts the values: none, no number to write
                    merged[name] = np.where(merged["n"] > 0, least, 0).astype(col.dtype)
            n = merged["n"]
            numbers = m.agg.numbers(  # type: ignore[misc]
                pa.array(n.astype(np.int64)),
                *[_arrow(merged[f.column]) for f in m.agg.folds],
            )
            cols.append(pa.array((n > 0) & ok))
            names.append(part_column(m.mi, PART_PREFIX, "has", wi))
            for j, number in enumerate(numbers):
                cols.append(pc.cast(number, pa.float64()))
                names.append(part_column(m.mi, PART_PREFIX, f"x{j}", wi))
    if passed is not None:  # the spine's columns ride along
        column, order = passed
        cols.append(pc.take(column, pa.array(order[spine])).combine_chunks())
        names.append(SPINE)
    yield pa.RecordBatch.from_arrays(cols, names=names)


def _arrow(values: np.ndarray | pa.Array) -> pa.Array:
    if isinstance(values, pa.Array):
        return values
    if values.dtype == np.longdouble:
        return pa.array(values.astype(np.float64))
    return pa.array(values)
