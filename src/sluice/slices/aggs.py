"""Aggregations: one record per `agg`, the only place an aggregation is defined.

Every step of a metric's life asks its `Agg`:

    fold (Spark, per batch) ─▶ encode (writer, on columns) ─▶ merge into the stored slice
    (write_slices.lua)
    query: merge the window's slices (read_slices.lua, or `Agg.merge` here) ─▶ finalize

The stored state is one of three kinds, named by `Agg.state`:
- a Lua-merged state: `width` numbers, merged by `merge_state` in `redis/lua/_merge.lua` under
  the same name, and in Python by `merge_columns` (`slices/state.py`);
- `blob`: an opaque value (a sketch) the writer merges itself with `union`, under the writer
  token; the script only replaces it;
- `hll`: a Redis HyperLogLog per slice, merged by PFADD and PFCOUNT, never parsed.

Adding an aggregation: a record in AGGS; a merge in `_merge.lua` if its state is a new one; its
row in docs/metrics.md; tests (`tests/integration/test_merge.py` holds the Python merge of every
state to the Lua one). Outside this module, only the config's `q` (quantile's parameter)
names an agg.

Importing this module imports neither pyspark, numpy nor datasketches: the config takes its agg
names from here, and the query server must not start a JVM.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from sluice.slices.state import (
    Columns,
    merge_add,
    merge_add_states,
    merge_avg,
    merge_first,
    merge_last,
    merge_max,
    merge_min,
    merge_var,
    number_text,
    state_columns,
)

if TYPE_CHECKING:
    from pyspark.sql import Column

    from sluice.config import MetricConfig

BLOB = "blob"
HLL = "hll"
# (merged state, metric, integral value) -> the answer; see `Agg`.
Finalize = Callable[[Any, "MetricConfig", bool], Any]
# (has data, the merged numbers, integral) on numpy columns -> (answers, valid or None for all)
FinalizeColumns = Callable[[Any, Sequence[Any], bool], tuple[Any, Any]]
RUNNING_MERGES = ("sum", "min", "max")  # `Fold.merge`s a running pass takes (`Agg.running`)
MergeColumns = Callable[[Columns], list[float]]
MergeStates = Callable[[Iterable[bytes | None]], list[float]]


class Fold(NamedTuple):
    """One aggregate column a metric needs besides its count `n`; the plan names both after the
    metric's slot (`MetricSpec.column`), and the writer hands the folded columns to
    `Agg.encode` in `folds` order.

    `merge` says how an offline job merges this column over many folded cells in Spark
    (`sluice.offline.training`): `sum`, `min` or `max` where that is the state's own merge
    (`_merge.lua`), else `collect`: the cells' states are gathered and merged by `Agg.merge`,
    as the query server merges them."""

    column: str
    build: Callable[[Any, Column, Column], Column]  # (pyspark.sql.functions, value, event time)
    merge: str = "collect"
    # For a column merged by `sum`, `min` or `max`: its state for one event (the fold of a cell
    # that holds just that event), as a row expression; a window's state is then the sum (the
    # least, the greatest) of its events' units (`sluice.offline.prefix`).
    # tests/integration/test_training_set.py checks both agree.
    unit: Callable[[Any, Column, Column], Column] | None = None


@dataclass(frozen=True)
class Agg:
    """How one `agg` folds, is stored, merges and answers.

    `finalize(merged, metric, integral)` turns the merged state into the answer: `merged` is
    what `merge` returns, or what read_slices.lua returns (the same numbers, as text), or
    PFCOUNT's reply for `hll`; `integral` says the value is an integer field, so sums, minima
    and the like are answered as ints.
    """

    name: str
    state: str  # a `_merge.lua` state name, BLOB or HLL
    finalize: Finalize
    folds: tuple[Fold, ...] = ()
    width: int = 1  # numbers in a stored state after its token
    # A state's numbers, on Arrow columns: (n, *folded columns in `folds` order) -> the `width`
    # columns stored after the token, in order (`encode` writes them as text).
    numbers: Callable[..., list[Any]] | None = None
    merge_columns: MergeColumns | None = None  # Lua-merged states
    # `merge` itself on HMGET's replies, where that is quicker (count, sum).
    merge_states: MergeStates | None = None
    union: Callable[[Sequence[bytes]], bytes | None] | None = None  # BLOB: serialized union
    # BLOB, at query time: what `merge` gives `finalize` instead of the union (a sketch whose
    # merge takes random choices would answer the same window differently from call to call).
    gather: Callable[[Sequence[bytes]], Any] | None = None
    # The value column's Spark type: long, double, string, or `number` (long for an integral
    # value, else double).
    value_kind: str = "double"
    any_type: bool = False  # `value` may be of any type: counted or compared as text
    needs_value: bool = True
    # The answer's Spark type: long, double, `number` (long for an integral value, else
    # double) or `quantiles` (double for one `q`, else a map from q to double).
    answer_kind: str = "double"
    # `finalize` on columns, for many merged states at once (training sets): numpy arrays of
    # whether any slice had data and of each merged number. Every `running` agg has one;
    # tests/unit/test_aggs.py holds it to `finalize` on every state.
    finalize_columns: FinalizeColumns | None = None

    def encode(self, n: Any, *folded: Any) -> list[Any]:
        """The Lua args of folded rows: `numbers` as exact text (`slices.state.number_text`)."""
        return [number_text(c) for c in self.numbers(n, *folded)]  # type: ignore[misc]

    @property
    def lua(self) -> bool:
        """The state is numbers merged by the slice scripts (not a blob, not a HyperLogLog)."""
        return self.state not in (BLOB, HLL)

    def value_type(self, integral: bool) -> str:
        """The Spark type of a metric's value column in the exploded rows."""
        if self.value_kind == "number":
            return "long" if integral else "double"
        return self.value_kind

    def answer_type(self, integral: bool, single_q: bool = True) -> str:
        """The Spark type of this agg's answers (training sets' feature columns)."""
        if self.answer_kind == "number":
            return "long" if integral else "double"
        if self.answer_kind == "quantiles":
            return "double" if single_q else "map<string,double>"
        return self.answer_kind

    @property
    def collects(self) -> bool:
        """Offline merges gather this agg's cell states (`Fold.merge`) rather than merging
        each column in Spark."""
        return any(f.merge == "collect" for f in self.folds)

    @property
    def running(self) -> bool:
        """Every state column, the count `n` included, merges by `sum`, `min` or `max` and has a
        per-event state (`Fold.unit`): a window's state is running totals and range minima or
        maxima over its events (`sluice.offline.prefix`)."""
        folds = (N, *self.folds)
        return self.lua and all(f.merge in RUNNING_MERGES and f.unit is not None for f in folds)

    @property
    def columns(self) -> list[str]:
        """The state's columns as folded: the count `n`, then each fold's."""
        return [N.column, *[f.column for f in self.folds]]

    def unit_columns(self, value: Column, time: Column) -> list[tuple[str, Column]]:
        """(column name, one event's state) for the count `n` and each fold of a `running` agg:
        row expressions whose sums (least, greatest: `Fold.merge`) are what `fold_columns` (and
        `n`) fold."""
        from pyspark.sql import functions as F

        units = [(f.column, f.unit) for f in (N, *self.folds)]
        missing = [name for name, unit in units if unit is None]
        if not self.running or missing:
            raise ValueError(f"agg {self.name!r} has no per-event state for {missing}")
        return [(name, unit(F, value, time)) for name, unit in units if unit is not None]

    def fold_columns(self, value: Column, time: Column) -> list[tuple[str, Column]]:
        """(column name prefix, Spark aggregate) for each fold, over `value` and event `time`."""
        from pyspark.sql import functions as F

        return [(f.column, f.build(F, value, time)) for f in self.folds]

    def merge(self, replies: Iterable[bytes | None]) -> Any:
        """Merge the stored states HMGET returned (None = no slice): a Lua-merged state to what
        read_slices.lua returns, [slices with data, merged numbers...] or [0] with no data; a
        blob to its union, or None. Raises ValueError on a state without the agg's width."""
        if self.merge_states is not None:
            try:
                return self.merge_states(replies)
            except ValueError as e:
                raise ValueError(f"{e} for {self.name!r}") from None
        states = list(filter(None, replies))
        if self.gather is not None:
            return self.gather([s.partition(b":")[2] for s in states])
        if self.union is not None:
            return self.union([s.partition(b":")[2] for s in states])
        if self.merge_columns is None:
            raise ValueError(f"agg {self.name!r} is merged in Redis only")
        if not states:
            return [0]
        try:
            cols = state_columns(states, self.width)
        except ValueError as e:
            raise ValueError(f"{e} for {self.name!r}") from None
        return [float(len(states)), *self.merge_columns(cols)]


# -- folds (Spark aggregate expressions; `F` is pyspark.sql.functions) ------------------------


def _timed(F: Any, v: Column, t: Column) -> Column:
    """(event time, value) of an event with a value; null otherwise, which min and max skip."""
    return F.when(v.isNotNull(), F.struct(t.alias("t"), v.alias("v")))


# Every metric's count of the events it folded, the first number of each state.
N = Fold("n", lambda F, v, t: F.count(v), "sum", lambda F, v, t: v.isNotNull().cast("long"))
SUM = Fold("sum", lambda F, v, t: F.sum(v), "sum", lambda F, v, t: v)
MIN = Fold("min", lambda F, v, t: F.min(v), "min", lambda F, v, t: v)
MAX = Fold("max", lambda F, v, t: F.max(v), "max", lambda F, v, t: v)
MEAN = Fold("avg", lambda F, v, t: F.avg(v))
# The sum of squared deviations from the mean, merged with Chan's formula.
M2 = Fold("m2", lambda F, v, t: F.var_pop(v) * F.count(v))
# Struct order is (time, value): the greatest time, a tie to the greater value; min the reverse.
LAST = Fold("last", lambda F, v, t: F.max(_timed(F, v, t)), "max", _timed)
FIRST = Fold("first", lambda F, v, t: F.min(_timed(F, v, t)), "min", _timed)
SET = Fold("set", lambda F, v, t: F.collect_set(v))
KLL = Fold("kll", lambda F, v, t: F.kll_sketch_agg_double(v))


# -- a state's numbers: folded columns -> the numbers stored after its token --------------------


def _numbers_timed(n: Any, timed: Any) -> list[Any]:
    import pyarrow.compute as pc

    return [pc.struct_field(timed, "t"), pc.struct_field(timed, "v")]


# -- finalizers: merged state -> answer ----------------------------------------------------------


def _numbers(merged: Sequence[Any]) -> list[float]:
    """The merged numbers of a Lua-merged state, from either merge; [] when no slice had data."""
    return [float(v) for v in merged[1:]] if int(merged[0]) else []


def _as_value(x: float, integral: bool) -> float | int:
    return int(x) if integral else x


def _finalize_count(merged: Any, m: MetricConfig, integral: bool) -> int:
    vals = _numbers(merged)
    return int(vals[0]) if vals else 0


def _finalize_sum(merged: Any, m: MetricConfig, integral: bool) -> float | int:
    vals = _numbers(merged)
    return _as_value(vals[0], integral) if vals else 0


def _finalize_value(merged: Any, m: MetricConfig, integral: bool) -> float | int | None:
    """min, max: the value, null with no data."""
    vals = _numbers(merged)
    return _as_value(vals[0], integral) if vals else None


def _finalize_avg(merged: Any, m: MetricConfig, integral: bool) -> float | None:
    vals = _numbers(merged)
    return vals[1] / vals[0] if vals and vals[0] else None


def _columns_count(has: Any, numbers: Sequence[Any], integral: bool) -> tuple[Any, Any]:
    import numpy as np

    return np.where(has, numbers[0], 0).astype(np.int64), None


def _columns_number(at: int, nullable: bool = True) -> FinalizeColumns:
    """sum (the number at 0; 0 with no data), min, max (at 0), first, last (at 1, after the
    time): null with no data."""

    def columns(has: Any, numbers: Sequence[Any], integral: bool) -> tuple[Any, Any]:
        import numpy as np

        values = np.where(has, numbers[at], 0.0)
        return (values.astype(np.int64) if integral else values), has if nullable else None

    return columns


def _columns_avg(has: Any, numbers: Sequence[Any], integral: bool) -> tuple[Any, Any]:
    import numpy as np

    n, total = numbers
    valid = has & (n != 0)
    return np.divide(total, n, out=np.zeros(len(n)), where=valid), valid


def _sample_variance(merged: Any) -> float | None:
    """M2 / (n - 1), as Spark's `variance`; null below two values. Moments past the largest
    double are not finite (NaN or infinity, answered as null), never clamped to 0."""
    vals = _numbers(merged)
    if not vals or vals[0] < 2:
        return None
    variance = vals[2] / (vals[0] - 1)
    return variance if math.isnan(variance) else max(0.0, variance)


def _finalize_variance(merged: Any, m: MetricConfig, integral: bool) -> float | None:
    return _sample_variance(merged)


def _finalize_stddev(merged: Any, m: MetricConfig, integral: bool) -> float | None:
    variance = _sample_variance(merged)
    return None if variance is None else math.sqrt(variance)


def _finalize_timed(merged: Any, m: MetricConfig, integral: bool) -> float | int | None:
    """last, first: the value of the (time, value) state, null with no data."""
    vals = _numbers(merged)
    return _as_value(vals[1], integral) if vals else None


def _finalize_distinct(merged: Any, m: MetricConfig, integral: bool) -> int:
    return int(merged)


# -- quantile: KLL sketches in Spark's binary format, read by the `datasketches` package --------


def _kll_union(blobs: Sequence[bytes]) -> bytes | None:
    """The union of serialized KLL sketches, serialized (merged in order); None for none."""
    from datasketches import kll_doubles_sketch

    merged = None
    for blob in blobs:
        sketch = kll_doubles_sketch.deserialize(bytes(blob))
        if merged is None:
            merged = sketch
        else:
            merged.merge(sketch)
    return None if merged is None else bytes(merged.serialize())


def _kll_sample(blobs: Sequence[bytes]) -> tuple[Any, Any] | None:
    """The items the KLL sketches keep, with their weights, as one sample: (items sorted,
    cumulative weights), or None for no sketch. Merging sketches would compact them again with
    random choices, so the same slices could answer differently from one query to the next;
    the sample of the sketches' own items is the same every time, for any merge order, and no
    less accurate than a merged sketch. For a single sketch its quantiles are the sketch's own
    (`get_quantile`, exclusive ranks)."""
    if not blobs:
        return None
    import numpy as np
    from datasketches import kll_doubles_sketch

    pairs = [pair for blob in blobs for pair in kll_doubles_sketch.deserialize(bytes(blob))]
    if not pairs:
        return None
    items = np.fromiter((p[0] for p in pairs), np.float64, len(pairs))
    weights = np.fromiter((p[1] for p in pairs), np.float64, len(pairs))
    order = np.lexsort((weights, items))
    return items[order], np.cumsum(weights[order])


def _finalize_quantiles(merged: tuple[Any, Any] | None, m: MetricConfig, integral: bool) -> Any:
    """One value for a single `q`, else {q: value}; null values with no data. A quantile is
    the first item whose cumulative weight exceeds q times the total (the sketch's exclusive
    rank rule)."""
    qs = m.quantiles()
    values: list[float | None] = [None] * len(qs)
    if merged is not None:
        import numpy as np

        items, cum = merged
        at = np.minimum(
            np.searchsorted(cum, np.asarray(qs) * cum[-1], side="right"), len(items) - 1
        )
        values = [float(items[i]) for i in at]
    if isinstance(m.q, int | float):
        return values[0]
    return {str(q): v for q, v in zip(qs, values, strict=True)}


# -- the aggregations ------------------------------------------------------------------------------


def _one_number(name: str, fold: Fold, merge: MergeColumns, finalize: Finalize,
                columns: FinalizeColumns | None = None,
                merge_states: MergeStates | None = None) -> Agg:  # fmt: skip
    """sum, min, max: one number per slice, of the value's own type; the state is named as the
    agg."""
    return Agg(
        name,
        state=name,
        finalize=finalize,
        finalize_columns=columns,
        folds=(fold,),
        numbers=lambda n, x: [x],
        merge_columns=merge,
        merge_states=merge_states,
        value_kind="number",
        answer_kind="number",
    )


def _timed_value(name: str, fold: Fold, merge: MergeColumns) -> Agg:
    """first, last: (event time, value) per slice, answered with the value."""
    return Agg(
        name,
        state=name,
        finalize=_finalize_timed,
        finalize_columns=_columns_number(1),
        folds=(fold,),
        width=2,
        numbers=_numbers_timed,
        merge_columns=merge,
        value_kind="number",
        answer_kind="number",
    )


def _moments(name: str, finalize: Finalize) -> Agg:
    """variance, stddev: (count, mean, M2) per slice, the state `var`."""
    return Agg(
        name,
        state="var",
        finalize=finalize,
        folds=(MEAN, M2),
        width=3,
        numbers=lambda n, mean, m2: [n, mean, m2],
        merge_columns=merge_var,
    )


AGGS: dict[str, Agg] = {
    a.name: a
    for a in (
        Agg(
            "count",
            state="count",
            finalize=_finalize_count,
            finalize_columns=_columns_count,
            numbers=lambda n: [n],
            merge_columns=merge_add,
            merge_states=merge_add_states,
            value_kind="long",
            any_type=True,
            needs_value=False,
            answer_kind="long",
        ),
        _one_number(
            "sum", SUM, merge_add, _finalize_sum, _columns_number(0, False), merge_add_states
        ),
        _one_number("min", MIN, merge_min, _finalize_value, _columns_number(0)),
        _one_number("max", MAX, merge_max, _finalize_value, _columns_number(0)),
        Agg(
            "avg",
            state="avg",
            finalize=_finalize_avg,
            finalize_columns=_columns_avg,
            folds=(SUM,),
            width=2,
            numbers=lambda n, total: [n, total],
            merge_columns=merge_avg,
        ),
        Agg(
            "distinct",
            state=HLL,
            finalize=_finalize_distinct,
            folds=(SET,),
            width=0,
            value_kind="string",
            any_type=True,
            answer_kind="long",
        ),
        Agg(
            "quantile",
            state=BLOB,
            finalize=_finalize_quantiles,
            folds=(KLL,),
            union=_kll_union,
            gather=_kll_sample,
            answer_kind="quantiles",
        ),
        _timed_value("last", LAST, merge_last),
        _moments("stddev", _finalize_stddev),
        _moments("variance", _finalize_variance),
        _timed_value("first", FIRST, merge_first),
    )
}
AGG_NAMES = tuple(AGGS)
