"""`sluice training-set`: point-in-time feature values for a table of labelled rows.

For a spine row at time t and a feature (metric m, window W), the value is what
`GET /v1/metrics/m?key=…&window=W&end=t` answers when the store holds exactly the events with
event time <= t: the window (t − W, t], rounded outward to m's finest slice at its start edge
(covered_start = slice_start(t − W + 1)), merged and finalized as the query server does. No
event after t counts, not even one in t's own slice.

How it is computed, from the archive (`events`), with the live fold's plan (`offline.fold`).
Metrics whose states merge by addition, min or max (`Agg.running`: count, sum, avg, min, max,
first, last) take running totals and range minima or maxima in one pass over events and spine
rows in key and time order (`offline.prefix`), unless as known at. The others:

    events ─▶ explode (the plan) ─▶ per (key, slice) cells, as the fold makes them
    spine  ─▶ key (the plan's key column), t
    full slices    [covered_start, slice(t)):  a window frame over the key's cells ordered by
                   slice index; two frames per window (the number of full slices is q or q + 1,
                   by t's offset in its slice), merged in Spark where the state's merge is a
                   sum (as prefix sums), min or max; else the cells' states are gathered
                   (`Fold.merge`)
    edge           t's own slice, events with ts <= t: folded per spine row from the events
                   (a join on (key, slice)), with the fold's own aggregate expressions
    ─▶ per row and feature: the parts' states merged by `Agg.merge`, answered by
       `Agg.finalize` (the query server's code), derived formulas by `formula.evaluate`

Every window of a metric shares one sort of its cells and spine rows, so a window costs a few
more frame columns, not another pass. Windows need no definition anywhere.

As known at (`arrival`): an event counts only if it had also arrived by t. Cells then hold only
the events that arrived before their slice ended, which every later t has seen; the events that
arrived later are few, and each spine row takes those it had seen by t in a join of their own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple, cast

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from sluice.config import Config, MetricConfig
from sluice.errors import BadQuery
from sluice.offline.answers import AnswerPlan, answer_batches
from sluice.offline.events import TimeBounds, archive_events, read_archive, to_ms
from sluice.offline.features import (
    PART_EDGE,
    PART_FULL,
    PART_LATE,
    ROW,
    SLICE_T,
    SPINE,
    Feature,
    check_spine,
    events_reach,
    feature_types,
    fold_aggs,
    key_value,
    parse_features,
    part_column,
    windows_by_metric,
)
from sluice.offline.fold import offline_config, plan_specs, select_metrics
from sluice.offline.prefix import prefix_part
from sluice.offline.store import UNANSWERED, store_values
from sluice.pipeline.plan import MetricSpec, explode_updates, key_column
from sluice.pipeline.spark import expression_semantics
from sluice.query.engine import integral_value
from sluice.slices.aggs import AGGS, Agg

# Answers up to this size (8 bytes per feature and row id, per spine row) are broadcast back to
# the spine's partitions (`training_set`).
BROADCAST_BYTES = 64 << 20
# A small spine's groups read only the events within their keys' reach (`_reach`) when that is
# likely at most this share of the events in the spine's time bounds (`_reaches_less`).
REACH_SHARE = 0.5


@dataclass(frozen=True)
class _Metric:
    """A base metric the features need: its spec in the offline plan and its windows."""

    cfg: MetricConfig
    spec: MetricSpec
    integral: bool
    windows: tuple[int, ...]  # ms, distinct

    @property
    def agg(self) -> Agg:
        return AGGS[self.cfg.agg]

    @property
    def slice_ms(self) -> int:
        return self.spec.slice_ms


def _group_rows(
    exploded: DataFrame,
    members: list[tuple[int, _Metric]],
    arrival: bool,
    reach: DataFrame | None = None,
) -> DataFrame:
    """The exploded rows of the members' group: key, slice, event time, (arrival,) and each
    member's value `v{mi}` (null where the event does not count for it). With `reach`
    (`_reach`), only the events some spine row of their key can count."""
    group = members[0][1].spec.group
    cols = [F.col("k"), F.col("s"), F.col("t")]
    if arrival:
        cols.append(F.col("ems").alias("a"))
    cols += [F.col(m.spec.column("v")).alias(f"v{mi}") for mi, m in members]
    rows = exploded.where(F.col("g") == F.lit(group)).select(*cols)
    if reach is None:
        return rows
    r = F.broadcast(reach.alias("r"))
    near = (F.xxhash64(F.col("e.k")) == F.col("r.h")) & F.col("e.t").between(
        F.col("r.lo"), F.col("r.hi")
    )
    return rows.alias("e").join(r, near, "left_semi")


def _reach(members: list[tuple[int, _Metric]], spine_g: DataFrame) -> DataFrame:
    """Per key of the spine, the event times any of its rows can count (`_events_needed`, per
    key): from the earliest row's widest window's covered start to the latest row's time. An
    event outside its key's reach changes no answer, so a small spine (a few labelled rows
    per key, or few keys) needs only a small part of the archive shuffled."""
    t = F.col(SLICE_T)
    lo = t - F.lit(max(w for _, m in members for w in m.windows) - 1)
    start = lo - F.pmod(lo, F.lit(members[0][1].slice_ms))
    return (
        spine_g.where(F.col("k").isNotNull() & t.isNotNull())
        .groupBy(F.xxhash64("k").alias("h"))
        .agg(F.min(start).alias("lo"), F.max(t).alias("hi"))
    )


def _cell(mi: int, name: str) -> str:
    return f"c{mi}_{name}"


def _frames(members: list[tuple[int, _Metric]], cells: DataFrame, spine_g: DataFrame) -> DataFrame:
    """Per spine row, each member's and window's full slices [covered_start, slice(t)) merged
    (module docstring): ROW, per member `ok` (the row has a key and a time), and per window
    either one column per state column (merged in Spark) or one list of the cells' states (an
    agg that collects). One sort serves every member and window of the group."""
    s = members[0][1].slice_ms
    names = [_cell(mi, c) for mi, m in members for c in m.agg.columns]
    none = F.lit(None).cast("long")
    cell_cols = [F.col("k"), F.col("s").cast("long").alias("_i"), none.alias(ROW),
                 none.alias(SLICE_T), *[F.col(c) for c in names]]  # fmt: skip
    blank = [F.lit(None).cast(cells.schema[c].dataType).alias(c) for c in names]
    spine_cols = [F.col("k"), F.col("_s").alias("_i"), F.col(ROW), F.col(SLICE_T), *blank]
    both = cells.select(*cell_cols).unionByName(spine_g.select(*spine_cols))
    # Ordered by slice start (ms): a frame of j slices back is a range of j * s.
    order = Window.partitionBy("k").orderBy("_i")

    def frame(fn: Any, c: Column, back: int) -> Column:
        return fn(c).over(order.rangeBetween(-back * s, -s)) if back else F.lit(None)

    def upto(c: Column, back: int) -> Column:
        return F.coalesce(F.sum(c).over(order.rangeBetween(Window.unboundedPreceding, -back * s)),
                          F.lit(0))  # fmt: skip

    ok = F.col("k").isNotNull() & F.col(SLICE_T).isNotNull()
    out: list[Column] = []
    for mi, m in members:
        agg = m.agg
        out.append(ok.alias(part_column(mi, "", "ok")))
        state = F.struct(*[F.col(_cell(mi, c)).alias(c) for c in agg.columns])
        for wi, w_ms in enumerate(m.windows):
            q, r = divmod(w_ms - 1, s)
            more = F.pmod(F.col(SLICE_T), F.lit(s)) < F.lit(r)  # q + 1 full slices, else q
            if agg.collects:
                cells_w = F.when(more, frame(F.collect_list, state, q + 1)).otherwise(
                    F.coalesce(frame(F.collect_list, state, q), F.array())
                )
                out.append(cells_w.alias(part_column(mi, PART_FULL, "cells", wi)))
                continue
            for name, how in [("n", "sum")] + [(f.column, f.merge) for f in agg.folds]:
                c = F.col(_cell(mi, name))
                if how == "sum":
                    # Prefix sums: the slices before t's, less those before the window's first.
                    merged = upto(c, 1) - F.when(more, upto(c, q + 2)).otherwise(upto(c, q + 1))
                else:
                    fn = F.min if how == "min" else F.max
                    merged = F.when(more, frame(fn, c, q + 1)).otherwise(frame(fn, c, q))
                out.append(merged.alias(part_column(mi, PART_FULL, name, wi)))
    return both.select(ROW, *out).where(F.col(ROW).isNotNull())


def _edge(members: list[tuple[int, _Metric]], rows: DataFrame, spine_g: DataFrame,
          arrival: bool, broadcast: bool) -> DataFrame:  # fmt: skip
    """Per spine row, the events of its key in t's own slice with ts <= t (and, as known at,
    arrived by t), folded with the fold's own aggregates. With `broadcast`, the spine's rows
    go to every task of the events, which then are not shuffled: only the pairs are."""
    p, e = spine_g.alias("p"), rows.alias("e")
    if broadcast:
        p = F.broadcast(p)
    cond = (
        (F.col("e.k") == F.col("p.k"))
        & (F.col("e.s") == F.col("p._s"))
        & (F.col("e.t") <= F.col(f"p.{SLICE_T}"))
    )
    if arrival:
        cond = cond & (F.col("e.a") <= F.col(f"p.{SLICE_T}"))
    aggs: list[Column] = []
    for mi, m in members:
        aggs += fold_aggs(m.agg, F.col(f"e.v{mi}"), F.col("e.t"),
                           partial(part_column, mi, PART_EDGE))  # fmt: skip
    return p.join(e, cond).groupBy(F.col(f"p.{ROW}").alias(ROW)).agg(*aggs)


def _late(members: list[tuple[int, _Metric]], rows: DataFrame, spine_g: DataFrame) -> DataFrame:
    """As known at: per spine row and window, the events of its full slices that arrived after
    their slice ended (so the cells left them out) but by t."""
    s = members[0][1].slice_ms
    late = rows.where(F.col("a") >= F.col("s") + F.lit(s)).alias("e")
    p = spine_g.alias("p")
    back = max((w - 1) // s + 1 for _, m in members for w in m.windows) * s
    cond = (
        (F.col("e.k") == F.col("p.k"))
        & (F.col("e.s") < F.col("p._s"))
        & (F.col("e.s") >= F.col("p._s") - F.lit(back))
        & (F.col("e.a") <= F.col(f"p.{SLICE_T}"))
    )
    aggs: list[Column] = []
    t = F.col(f"p.{SLICE_T}")
    for mi, m in members:
        for wi, w_ms in enumerate(m.windows):
            lo = t - F.lit(w_ms - 1)
            v = F.when(F.col("e.s") >= lo - F.pmod(lo, F.lit(s)), F.col(f"e.v{mi}"))
            aggs += fold_aggs(m.agg, v, F.col("e.t"), partial(part_column, mi, PART_LATE, w=wi))
    return p.join(late, cond).groupBy(F.col(f"p.{ROW}").alias(ROW)).agg(*aggs)


class _Spine(NamedTuple):
    """What one small job over the spine tells (`_events_needed`)."""

    needed: TimeBounds  # the event times any row can count
    rows: int
    span_ms: int  # from the earliest row's time to the latest's
    keys: dict[tuple[str, ...], int]  # per key set: its distinct keys (an estimate)


def _events_needed(
    cfg: Config,
    feats: list[Feature],
    spine: DataFrame,
    t: Column,
    metrics: Sequence[_Metric],
    key_cols: Mapping[str, str],
) -> _Spine:
    """The event times a feature of any spine row can count (`t`: a row's time in ms;
    `features.events_reach`). Events outside are never read past the scan (a spine of last
    week on an archive of a year shuffles a week). No bound for a spine with no time at all:
    every feature of it is null. With them, in the same job, the spine's row count and time
    span, and per key set of the metrics an estimate of its distinct keys (for `_reach`;
    `key_cols`: the spine column of each key field)."""  # fmt: skip
    sets = sorted({tuple(m.cfg.key) for m in metrics})
    distinct = [
        F.approx_count_distinct(F.struct(*[F.col(f"`{key_cols.get(f, f)}`") for f in ks]))
        for ks in sets
    ]
    got = spine.select(F.min(t), F.max(t), F.count(F.lit(1)), *distinct).first()
    lo, hi, rows, *counts = got if got is not None else (None, None, 0)
    keys = {ks: int(n or 0) for ks, n in zip(sets, counts, strict=False)}
    if lo is None or hi is None:
        return _Spine(TimeBounds(), int(rows or 0), 0, keys)
    return _Spine(events_reach(cfg, feats, lo, hi), int(rows), int(hi) - int(lo), keys)


def _reaches_less(members: list[tuple[int, _Metric]], spine: _Spine) -> bool:
    """Whether the events within their keys' reach (`_reach`) are likely at most `REACH_SHARE`
    of those in the spine's time bounds, by the spine's rows per key, as if each key's rows
    fell uniformly over its time span: r of them leave, on average, (r − 1)/(r + 1) of the
    span between the first and the last, and the widest window reaches back before the first.
    Rows clustered in time reach less than this says, so it errs toward reading more."""
    keys = spine.keys.get(tuple(members[0][1].cfg.key), 0)
    if not keys or spine.needed.start_ms is None or spine.needed.until_ms is None:
        return False
    per_key = spine.rows / keys
    widest = max(w for _, m in members for w in m.windows)
    reach = spine.span_ms * (per_key - 1) / (per_key + 1) + widest
    return reach <= REACH_SHARE * (spine.needed.until_ms - spine.needed.start_ms)


# -- the job ---------------------------------------------------------------------------------


@expression_semantics
def training_set(
    spark: SparkSession,
    cfg: Config,
    spine: DataFrame,
    features: Mapping[str, Sequence[str]] | Sequence[str],
    ts: str,
    keys: Mapping[str, str] | None = None,
    events: DataFrame | str | Sequence[str] | None = None,
    arrival: str | None = None,
    *,
    url: str | None = None,
) -> DataFrame:
    """`spine` with one column `<metric>_<window>` per feature (module docstring), from the
    archived `events` (as `offline.events.read_archive` reads them) or, without them, from the
    slice store at `url` (default `cfg.redis`; see `offline.store_values`). `events` may also
    be the archive's path or paths, read by `read_archive` (format by suffix). `keys` maps a
    metric's key field to the spine column that holds it where the names differ; `ts` is the
    spine's time column (epoch ms, a timestamp, or ISO 8601 text). `arrival` names the
    archive's arrival-time column: an event then counts only once it had arrived by t.

    Lazy, like any DataFrame, but for one small job over the spine's time column: the archive is
    read only for the event times a row can count (`_events_needed`). Where the features need
    parts joined by row id, the spine is checkpointed locally first (each row's id must stay
    the same in every branch). Raises
    UnknownMetric, BadQuery or ConfigError for features, columns or metrics it cannot answer.
    """
    keys = dict(keys or {})
    if isinstance(events, str | list | tuple):
        events = read_archive(spark, events, None, cfg.source.schema_)
    elif events is not None and not isinstance(events, DataFrame):
        raise TypeError(f"events must be a Spark DataFrame or the archive's path, not"
                        f" {type(events).__name__}")  # fmt: skip
    feats = parse_features(cfg, features)
    windows = windows_by_metric(cfg, feats)
    check_spine(cfg, spine, ts, keys, list(windows), feats)
    chosen = select_metrics(cfg, list(windows))
    spine_in = spine.withColumn(ROW, F.monotonically_increasing_id())
    t = to_ms(F.col(f"`{ts}`"), spine.schema[ts].dataType)
    t_ms = t.alias(SLICE_T)
    types = feature_types(cfg, feats)
    if events is None:
        if UNANSWERED in {c.lower() for c in spine.columns}:
            raise BadQuery(f"the spine has a column {UNANSWERED!r}, which a training set from"
                           " the store adds: rename it", "spine")  # fmt: skip
        spine_in = spine_in.localCheckpoint()
        return store_values(spark, cfg, spine_in, t_ms, keys, feats, types, url or cfg.redis)
    cfg_off = offline_config(cfg, chosen, finest_only=True)
    specs = plan_specs(spark, cfg_off)
    schema = cfg.source.schema_
    whole: list[DataFrame] = []  # parts with a row for every spine row
    parts: list[DataFrame] = []
    plan_metrics = []
    groups: dict[int, list[tuple[int, _Metric]]] = {}
    for mi, m in enumerate(chosen):
        sp = next(x for x in specs if x.name == m.name)
        mm = _Metric(m, sp, integral_value(cfg, m), tuple(windows[m.name]))
        plan_metrics.append((m, mm.integral, mm.windows))
        groups.setdefault(sp.group, []).append((mi, mm))
    known = _events_needed(cfg, feats, spine, t, [m for ms in groups.values() for _, m in ms],
                           keys)  # fmt: skip
    spine_rows = known.rows
    exploded = explode_updates(
        archive_events(events, cfg_off, known.needed, arrival), cfg_off, specs
    )
    # Running states take running totals and range minima or maxima (`offline.prefix`); as
    # known at, or for any other agg, the slice frames, t's own slice and (as known at) the late
    # events.
    prefixed = {mi for ms in groups.values() for mi, m in ms if m.agg.running and not arrival}
    plan = AnswerPlan(
        metrics=tuple(plan_metrics),
        features=tuple((f.column, f.name, f.window_ms) for f in feats),
        derived=tuple((d.name, d.expr) for d in cfg.derived),
        types=types,
        prefix=frozenset(prefixed),
    )
    ddl = ", ".join([f"{ROW} long", *[f"`{f.column}` {types[f.column]}" for f in feats]])
    # One part answers every feature when one key group holds every metric and each one is
    # running. The answers go back to the spine by row id (which must then stay the same in
    # every branch): broadcast to the spine's own partitions, which keeps its order, where they
    # are small (`BROADCAST_BYTES`); else joined and sorted by row id. A large spine answered
    # by one part has its columns ride along through that part instead (`SPINE`): no join.
    single = (
        len(groups) == 1
        and not arrival
        and all(m.agg.running for ms in groups.values() for _, m in ms)
    )
    small = spine_rows * 8 * (len(feats) + 1) <= BROADCAST_BYTES
    carry = single and not small
    if not carry:
        spine_in = spine_in.localCheckpoint()
    for members in groups.values():
        first = members[0][1]
        fields = [
            key_value(F.col(f"`{keys.get(f, f)}`"), schema[f]).alias(f) for f in first.cfg.key
        ]
        s = first.slice_ms
        passed = [F.struct(*[F.col(f"`{c}`") for c in spine.columns]).alias(SPINE)] if carry else []
        whole_key = F.lit(True)
        for f in first.cfg.key:  # a key with a part missing is no key (its features are null)
            whole_key = whole_key & F.col(f"`{f}`").isNotNull()
        spine_g = spine_in.select(ROW, t_ms, *fields, *passed).select(
            ROW, SLICE_T, F.when(whole_key, key_column(first.cfg.key)).alias("k"),
            (F.col(SLICE_T) - F.pmod(F.col(SLICE_T), F.lit(s))).alias("_s"),
            *([F.col(SPINE)] if carry else []),
        )  # fmt: skip
        # Only the events some spine row of their key can count, where that is few of them.
        near = spine_rows * 64 <= BROADCAST_BYTES and _reaches_less(members, known)
        reach = _reach(members, spine_g) if near else None
        running = [(mi, m) for mi, m in members if mi in prefixed]
        framed = [(mi, m) for mi, m in members if mi not in prefixed]
        if running:
            answering = None
            if single:  # its tasks answer the rows too: no second pass to Python and back
                out = cast(StructType, StructType.fromDDL(ddl))
                if carry:
                    out = out.add(SPINE, spine_g.schema[SPINE].dataType)
                answering = (partial(answer_batches, plan), out)
            rows_g = _group_rows(exploded, running, False, reach)
            whole.append(prefix_part(running, rows_g, spine_g, s, answering))
        if not framed:
            continue
        rows = _group_rows(exploded, framed, arrival is not None, reach)
        prompt = rows.where(F.col("a") < F.col("s") + F.lit(s)) if arrival else rows
        cell_aggs = [
            a for mi, m in framed
            for a in fold_aggs(m.agg, F.col(f"v{mi}"), F.col("t"), partial(_cell, mi))
        ]  # fmt: skip
        cells = prompt.groupBy("k", "s").agg(*cell_aggs)
        whole.append(_frames(framed, cells, spine_g))
        # Broadcast where the spine's rows (row id, time, slice, key: about 64 bytes) are small.
        edge_small = spine_rows * 64 <= BROADCAST_BYTES
        parts.append(_edge(framed, rows, spine_g, arrival is not None, edge_small))
        if arrival:
            parts.append(_late(framed, rows, spine_g))
    if carry:  # answered already (`answering`)
        # Computed once: the sort's sampling job would otherwise run the whole job twice.
        return (
            whole[0]
            .localCheckpoint(eager=False)
            .orderBy(ROW)
            .select(f"{SPINE}.*", *[F.col(f"`{f.column}`") for f in feats])
        )  # the spine's order
    if single:
        answers = whole[0]  # answered already (`answering`)
    else:
        # A part in `whole` has a row for every spine row: the first is the base to join onto.
        joined = whole[0] if whole else spine_in.select(ROW)
        for part in [*whole[1:], *parts]:
            joined = joined.join(part, ROW, "left")
        answers = joined.mapInArrow(partial(answer_batches, plan), ddl)
    if small:  # the spine's partitions, in their order
        return spine_in.join(F.broadcast(answers), ROW, "left").drop(ROW)
    return spine_in.join(answers, ROW, "left").orderBy(ROW).drop(ROW)  # the spine's order
