"""The Spark plan that folds one micro-batch of events into slice updates.

    events ─▶ reason (bad / expired / future) ─▶ one row per (event, metric group it touches)
                                               + one row per dead-lettered event
           ─▶ GROUP BY (g, k, s) ─▶ per-metric aggregates, as columns

A *metric group* is the set of metrics that share key fields and slice length: they fold into
the same (key, slice) cells, so one exploded row carries all of them, each metric's value being
null where its filter does not match. The number of rows entering the aggregation is then the
number of groups an event touches, not the number of metrics. Group 0's row is emitted for every
good event, so the sum of its `cnt` is the number of good events in the batch.

Metrics of different groups that fold alike (the same value type and aggregates) share their
columns, a *slot*: the fold groups by g first, so a cell only ever holds one group's values, and
each aggregate runs once per slot rather than once per metric. Six metrics in six groups fold
with three value columns instead of six (`MetricSpec.slot`).

All of it is Spark expressions: no Python UDF touches an event, and the input is read and
decoded once per batch however many metrics there are.

Spark folds in two steps around the shuffle: each task first folds its own rows (partial
aggregation), then the cells are folded again after the shuffle. The first step pays when cells
repeat within a task; when most rows are a cell of their own (many keys, or times spread over
many slices) it is a hash table built for nothing. `PartialAggregation` turns it off for the
next batch when the last one's rows folded into at least 0.3 cells per row
(`spark.partial_aggregation`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pyspark.errors import AnalysisException, ParseException
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import DataType, IntegralType, NumericType

from sluice.config import Config, MetricConfig
from sluice.config.runtime import BYPASS_PARTIAL_AGGREGATION
from sluice.errors import ConfigError
from sluice.files import read_text, replace_text
from sluice.redis.keys import ESCAPES, KEY_SEP
from sluice.slices.aggs import AGGS
from sluice.source.options import SourceOptions
from sluice.source.values import SPARK_TYPES

DEAD_G = -1
# `auto` folds without the partial step after a batch with at least this many cells per row:
# measured on the bare engine (docs/benchmarks.md, `bench/ingest.py --partial-sweep`), the step
# cost as much as it saved at 0.24 and more from 0.32 on, in both formats.
PARTIAL_OFF_CELLS_PER_ROW = 0.3
# Each batch's choice, under the checkpoint, for a batch that runs again; the newest kept.
PARTIAL_DIR, PARTIAL_KEEP = "sluice-partial", 100


@dataclass(frozen=True)
class MetricSpec:
    """What the executor-side writer needs to know about a metric: plain, picklable values."""

    index: int  # this (metric, resolution)'s own per-event value column, `_v{index}`
    name: str
    agg: str
    slice_ms: int
    retention_ms: int
    integral: bool  # the value is an integer type: sums stay exact integers
    group: int = 0
    metric: int = 0  # index in cfg.metrics
    resolution_ms: int | None = None  # None: the metric's own (finest) slice
    slot: int | None = None  # its columns in the exploded and folded rows; None: `index`

    def column(self, prefix: str) -> str:
        """The name of this metric's `prefix` column in the exploded or folded rows: its value
        `v`, its count `n`, or a fold's column (`Fold.column`), in its slot."""
        return f"{prefix}{self.index if self.slot is None else self.slot}"


def slot_signature(spec: MetricSpec) -> tuple[str, tuple[str, ...]]:
    """What metrics must have in common to share a slot: the value's type and the folds."""
    return value_type(spec), tuple(f.column for f in AGGS[spec.agg].folds)


def assign_slots(specs: list[MetricSpec]) -> list[MetricSpec]:
    """`specs` with their slots: each takes the first slot of its signature that no metric of
    its own group holds yet, or a new one (module docstring)."""
    holders: list[tuple[tuple[str, tuple[str, ...]], set[int]]] = []  # per slot
    out = []
    for sp in specs:
        sig = slot_signature(sp)
        slot = next(
            (i for i, (s, groups) in enumerate(holders) if s == sig and sp.group not in groups),
            len(holders),
        )
        if slot == len(holders):
            holders.append((sig, set()))
        holders[slot][1].add(sp.group)
        out.append(dataclasses.replace(sp, slot=slot))
    return out


def _escaped(col: Column) -> Column:
    out = col.cast("string")
    for raw, esc in ESCAPES:
        out = F.replace(out, F.lit(raw), F.lit(esc))
    return out


def key_column(fields: list[str]) -> Column:
    parts = [_escaped(F.col(f"`{f}`")) for f in fields]
    return parts[0] if len(parts) == 1 else F.concat_ws(KEY_SEP, *parts)


def check_expressions(spark: SparkSession, cfg: Config) -> dict[str, DataType | None]:
    """Analyse every `filter` and `value` against the schema. Returns each metric's value type.

    Raises ConfigError naming the field path, e.g. `metrics[2].filter`, with Spark's reason.
    """
    # The schema's fields only: the source's own columns (`_ts`, `_e`, …) are not for metrics
    # to name, nor for Spark to suggest when a name is mistyped.
    opts = SourceOptions.from_config(cfg, url="redis://unused")
    fields = ", ".join(f"`{n}` {SPARK_TYPES[t]}" for n, t, _ in opts.fields)
    empty = spark.createDataFrame([], fields)
    types: dict[str, DataType | None] = {}
    for i, m in enumerate(cfg.metrics):
        for attr in ("filter", "value"):
            text = getattr(m, attr)
            if text is None:
                continue
            try:
                field = empty.select(F.expr(text).alias("x")).schema["x"]
            except (AnalysisException, ParseException) as e:
                reason = str(e).strip().splitlines()[0]
                raise ConfigError(
                    f"invalid Spark SQL {attr} {text!r}: {reason}", f"metrics[{i}].{attr}"
                ) from None
            if attr == "filter" and field.dataType.typeName() != "boolean":
                raise ConfigError(
                    f"filter {text!r} is of type {field.dataType.simpleString()}, not boolean",
                    f"metrics[{i}].filter",
                )
            if attr == "value":
                if not AGGS[m.agg].any_type and not isinstance(field.dataType, NumericType):
                    raise ConfigError(
                        f"value {text!r} is of type {field.dataType.simpleString()};"
                        f" agg {m.agg!r} needs a number",
                        f"metrics[{i}].value",
                    )
                types[m.name] = field.dataType
        types.setdefault(m.name, None)
    return types


def metric_specs(
    cfg: Config, value_types: dict[str, DataType | None], share_columns: bool = True
) -> list[MetricSpec]:
    """One spec per (metric, slice length): a metric with `resolutions` is folded at each.
    `share_columns=False` gives each metric columns of its own instead of slots (module
    docstring), as plans were before slots; benchmarks compare the two."""
    groups: dict[tuple[tuple[str, ...], int], int] = {}
    out: list[MetricSpec] = []
    for i, m in enumerate(cfg.metrics):
        for r, slice_ms in enumerate(m.slice_lengths()):
            out.append(
                MetricSpec(
                    index=len(out),
                    name=m.name,
                    agg=m.agg,
                    slice_ms=slice_ms,
                    retention_ms=m.retention,
                    integral=isinstance(value_types.get(m.name), IntegralType),
                    group=groups.setdefault((tuple(m.key), slice_ms), len(groups)),
                    metric=i,
                    resolution_ms=None if r == 0 else slice_ms,
                )
            )
    return assign_slots(out) if share_columns else out


def value_type(spec: MetricSpec) -> str:
    """The Spark type of a metric's value column in the exploded rows."""
    return AGGS[spec.agg].value_type(spec.integral)


def _value_column(cfg: Config, spec: MetricSpec, good: Column) -> Column:
    """Metric `spec`'s value for this event, or null when the event does not count for it."""
    m = cfg.metrics[spec.metric]
    cond = good & _kept(spec.slice_ms, m.retention) & _counted(m)
    if not m.value:
        return F.when(cond, F.lit(1).cast(value_type(spec)))
    value = F.expr(m.value)
    if spec.agg == "count":  # the events whose value is not null, whatever its type
        return F.when(cond & value.isNotNull(), F.lit(1).cast(value_type(spec)))
    value = value.cast(value_type(spec))
    if value_type(spec) == "double" and m.value not in cfg.source.schema_:
        # A computed NaN or ±infinity (`sqrt(-1)`, `amount * 1e307`) counts as null, as an
        # arithmetic error does: a sum, an average or a maximum holding it would answer NaN
        # for good. (A field's own NaN is a `non_finite` dead letter when it is decoded.)
        cond = cond & ~F.isnan(value) & (F.abs(value) != F.lit(float("inf")))
    return F.when(cond, value)


def _kept(slice_ms: int, retention_ms: int) -> Column:
    """Whether an event's slice of `slice_ms` ends within `retention_ms` of the batch's time: the
    slice store keeps such a slice (a key's newest slice and the retention before it)."""
    ts = F.col("_ts")
    return ts - F.pmod(ts, F.lit(slice_ms)) + F.lit(slice_ms) > F.col("_ref") - F.lit(retention_ms)


def _counted(m: MetricConfig) -> Column:
    """Whether an event counts for metric `m` by its key fields and its filter."""
    cond = F.lit(True)
    for k in m.key:
        cond = cond & F.col(f"`{k}`").isNotNull()
    if m.filter:
        cond = cond & F.coalesce(F.expr(m.filter), F.lit(False))
    return cond


def dead_letter_json(reason: Column, fields: Iterable[str]) -> Column:
    """A bad event's dead-letter record as JSON (see `lua/dead_letters.lua` for its fields);
    `raw` is the offending input, or the decoded event when the decoder kept none."""
    return F.to_json(
        F.struct(
            F.coalesce(F.col("_eid"), F.lit("")).alias("id"),
            F.col("_idx").alias("idx"),
            reason.alias("reason"),
            F.col("_field").alias("field"),
            F.coalesce(
                F.col("_raw"), F.to_json(F.struct(*[F.col(f"`{n}`") for n in fields]))
            ).alias("raw"),
            F.col("_ts").alias("ts"),
        )
    )


SINGLE_TASK_ROWS = 32_000  # `spark.single_task_events: auto`, in exploded rows


def single_task_events(setting: int | str, specs: list[MetricSpec]) -> int:
    """`spark.single_task_events` in events. `auto` is SINGLE_TASK_ROWS exploded rows: one task
    folds a batch on one core, and a batch's fold grows with the groups each event touches, so
    a plan with more groups keeps fewer events in one task (16,000 for two groups)."""
    if setting != "auto":
        return int(setting)
    groups = max((sp.group for sp in specs), default=0) + 1
    return SINGLE_TASK_ROWS // groups


def explode_updates(events: DataFrame, cfg: Config, specs: list[MetricSpec]) -> DataFrame:
    """Decoded events -> one row per (event, metric group it touches) + one per bad event.

    Stateless, so it is applied once to the streaming DataFrame; the per-batch work is then only
    `fold_updates`, and no expression tree is rebuilt (over py4j) for every micro-batch.
    Output columns: g, k, s, ems, t, (with the audit) u, fx, and a value column `v{slot}` per
    slot (`MetricSpec.column("v")`), which in group g's rows holds its metric of that slot.

    What a row needs more than once (each metric's value, whether an event touches a group, the
    audit's ids) is computed once per event in a projection of its own (`_per_event`) before the
    explode: written inline, each was evaluated again in every row and in `fx`, which with six
    groups cost the bare engine a third of its speed (docs/audit.md).
    """
    ts = F.col("_ts")
    pre, n_groups = _per_event(events, cfg, specs)
    good, audit = F.col("_reason").isNull(), cfg.audit.enabled
    zero = F.lit(0).cast("bigint")
    slots = {name: value_type(sp) for name, sp in _slot_heads(specs).items()}
    rows: list[Column] = []
    for g in range(n_groups):
        members = [sp for sp in specs if sp.group == g]
        first = cfg.metrics[members[0].metric]
        ts_s = ts - F.pmod(ts, F.lit(members[0].slice_ms))
        cols = [
            F.lit(g).alias("g"),
            key_column(first.key).alias("k"),
            ts_s.alias("s"),
            F.col("_ems").alias("ems"),
            ts.alias("t"),
        ]
        if audit:
            cols += [F.col(f"_u{g}").alias("u"), (F.col("_fx") if g == 0 else zero).alias("fx")]
        held = {sp.column("v"): sp for sp in specs if sp.group == g}
        for name, type_ in slots.items():
            sp_g = held.get(name)
            v = F.col(f"_v{sp_g.index}") if sp_g is not None else F.lit(None)
            cols.append(v.cast(type_).alias(name))
        rows.append(F.when(F.col(f"_t{g}"), F.struct(*cols)))
    dead = dead_letter_json(F.col("_reason"), cfg.source.schema_)
    dead_cols = [
        F.lit(DEAD_G).alias("g"),
        dead.alias("k"),
        F.col("_ems").alias("s"),
        F.col("_ems").alias("ems"),
        F.col("_ts").alias("t"),
    ]
    if audit:
        dead_cols += [F.col("_ud").alias("u"), F.col("_fx").alias("fx")]
    dead_cols += [F.lit(None).cast(type_).alias(name) for name, type_ in slots.items()]
    rows.append(F.when(~good, F.struct(*dead_cols)))
    exploded = pre.select(F.explode(F.array(*rows)).alias("u")).where(F.col("u").isNotNull())
    return exploded.select("u.*")


def _slot_heads(specs: list[MetricSpec]) -> dict[str, MetricSpec]:
    """Each slot's value column name and the first metric that holds it: the metrics of a slot
    share its value type and folds (`slot_signature`), so any one of them stands for all."""
    heads: dict[str, MetricSpec] = {}
    for sp in specs:
        heads.setdefault(sp.column("v"), sp)
    return heads


def _per_event(events: DataFrame, cfg: Config, specs: list[MetricSpec]) -> tuple[DataFrame, int]:
    """`events` with, per event: `_reason` (why it is dead-lettered, or null), `_v{i}` (metric
    i's value, null where the event does not count for it), `_t{g}` (whether it touches group
    g) and, with the audit, `_u{g}`, `_ud` and `_fx` (`_audit_columns`). Returns it and the
    number of groups. Each step is a projection of its own, so that Spark computes a column once
    and the next one reads it (names starting with `_` are reserved: no event field has one)."""
    ts, ref = F.col("_ts"), F.col("_ref")
    # Expired: no metric keeps the event's slice (of its finest length).
    finest = {(sp.slice_ms, sp.retention_ms) for sp in specs if sp.resolution_ms is None}
    kept = functools.reduce(Column.__or__, [_kept(*sr) for sr in sorted(finest)])
    reason = F.coalesce(
        F.col("_err"),
        F.when(ts > ref + F.lit(cfg.source.max_future), F.lit("future")),
        F.when(~kept, F.lit("expired")),
    )
    good = F.col("_reason").isNull()
    out = events.withColumn("_reason", reason)
    out = out.select("*", *[_value_column(cfg, sp, good).alias(f"_v{sp.index}") for sp in specs])
    n_groups = max(sp.group for sp in specs) + 1
    touched: list[Column] = []
    for g in range(n_groups):
        members = [F.col(f"_v{sp.index}").isNotNull() for sp in specs if sp.group == g]
        t = good if g == 0 else functools.reduce(Column.__or__, members)
        touched.append(t.alias(f"_t{g}"))
    out = out.select("*", *touched)
    if cfg.audit.enabled:
        out = _audit_columns(out, n_groups)
    return out, n_groups


def _audit_columns(events: DataFrame, n_groups: int) -> DataFrame:
    """The completeness audit's ids (see pipeline.audit), as columns of `events`.

    `_u{g}`: the id of the update event `_e` fans out into for group g: xxhash64(_e, g); `_ud`,
    that of its dead-letter record (group DEAD_G) for a bad event, 0 for a good one (hashed only
    for the few bad events).
    `_fx`: `_e` XOR the ids of every update it fans out into (every touched group, or the
    dead-letter row). It rides on one row per event (group 0 for a good event, which always
    touches it; the dead-letter row for a bad one), so the XOR of `fx` over a batch is the XOR of
    the events and all their updates, computed before any update is written.
    """
    e, zero = F.col("_e"), F.lit(0).cast("bigint")
    ids = [F.xxhash64(e, F.lit(g)).alias(f"_u{g}") for g in range(n_groups)]
    dead = F.when(F.col("_reason").isNotNull(), F.xxhash64(e, F.lit(DEAD_G))).otherwise(zero)
    out = events.select("*", *ids, dead.alias("_ud"))
    fx = F.col("_ud")
    for g in range(n_groups):
        fx = fx.bitwiseXOR(F.when(F.col(f"_t{g}"), F.col(f"_u{g}")).otherwise(zero))
    return out.withColumn("_fx", e.bitwiseXOR(fx))


def fold_columns(specs: list[MetricSpec], audit: bool = True) -> list[Column]:
    """The aggregate columns of `fold_updates`; build once and reuse for every batch."""
    aggs = [
        F.count(F.lit(1)).alias("cnt"),
        F.min("ems").alias("min_ems"),
        F.max("ems").alias("max_ems"),
    ]
    if audit:
        # Per folded row: the XOR of the update ids it carries (what the store must apply), and
        # of the events' fan-out ids (what the plan produced).
        aggs += [F.bit_xor("u").alias("ux"), F.bit_xor("fx").alias("fx")]
    for sp in _slot_heads(specs).values():  # one set of aggregates per slot (module docstring)
        v = F.col(sp.column("v"))
        aggs.append(F.count(v).alias(sp.column("n")))
        for column, folded in AGGS[sp.agg].fold_columns(v, F.col("t")):
            aggs.append(folded.alias(sp.column(column)))
    return aggs


def fold_updates(exploded: DataFrame, aggs: list[Column]) -> DataFrame:
    """One micro-batch of exploded updates -> one row per (g, k, s) with every metric's state.

    Output columns: g, k, s, cnt, min_ems, max_ems, and per slot (`MetricSpec.column`): `n`
    (values folded) and a column per fold of its agg (`sluice.slices.aggs`); in group g's rows,
    a slot's columns hold its metric of group g. For DEAD_G rows, k is the dead-letter record as
    JSON, one row per bad event.
    """
    return exploded.groupBy("g", "k", "s").agg(*aggs)


class PartialAggregation:
    """`spark.partial_aggregation` for one fold: whether Spark folds each task's rows before the
    shuffle (module docstring). `on` and `off` are fixed; `auto` starts on and, after each
    batch (`observe`: its exploded rows and the cells they folded into), is off for the next
    batches while cells per row are at least PARTIAL_OFF_CELLS_PER_ROW.

    The answers are the same either way, but a float sum adds in another order and a sketch
    takes its values in another order, so a batch that runs again (after a crash, or a write
    that did not balance) folds as its first attempt did: `apply` records each batch's choice
    under the checkpoint (PARTIAL_DIR) and reads it back for a batch that has one."""

    def __init__(self, setting: str) -> None:
        self.setting = setting
        self.on = setting != "off"

    def observe(self, rows: int, cells: int) -> None:
        if self.setting == "auto" and rows > 0:
            self.on = cells < PARTIAL_OFF_CELLS_PER_ROW * rows

    def apply(self, session: SparkSession, ckpt: Path | None = None, batch_id: int = 0) -> bool:
        """Set it in `session` (a batch's) before its fold is planned: as recorded for
        `batch_id` under `ckpt`, else as it stands now (then recorded). Returns it."""
        on = self.on if ckpt is None else self._recorded(ckpt / PARTIAL_DIR, batch_id)
        session.conf.set(BYPASS_PARTIAL_AGGREGATION, "false" if on else "true")
        return on

    def _recorded(self, where: Path, batch_id: int) -> bool:
        recorded = read_text(where / str(batch_id))
        if recorded is not None:
            return recorded == "on"
        replace_text(where / str(batch_id), "on" if self.on else "off")
        (where / str(batch_id - PARTIAL_KEEP)).unlink(missing_ok=True)
        return self.on
