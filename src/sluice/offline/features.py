"""Training-set features: what a user asks for, the columns it adds, their types, and the
names of the columns that carry each part of a value between the Spark job
(`offline.training`) and the tasks that answer (`offline.answers`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from sluice import formula
from sluice.config import Config, FieldType
from sluice.errors import BadQuery, UnknownMetric
from sluice.offline.events import TimeBounds, not_text
from sluice.query.engine import integral_value
from sluice.query.params import parse_window
from sluice.slices.aggs import AGGS, Agg, N
from sluice.slices.window import slice_start
from sluice.source.values import SPARK_TYPES
from sluice.units import iso_ms

ROW = "_sluice_row"
SLICE_T = "_sluice_t"
SPINE = "_sluice_spine"  # the spine row's own columns, as one struct, where they ride along
PART_FULL, PART_EDGE, PART_LATE, PART_PREFIX = "f", "e", "l", "p"


@dataclass(frozen=True)
class Feature:
    """One output column: metric (or derived metric) `name` over `window_ms`."""

    name: str
    window: str
    window_ms: int
    column: str


def parse_features(
    cfg: Config, features: Mapping[str, Sequence[str]] | Sequence[str]
) -> list[Feature]:
    """`{"txn_count": ["10m", "1h"]}` or `["txn_count:10m,1h", "amount_sum:1d"]` -> Features,
    in order, each column once. Raises UnknownMetric or BadQuery naming the feature."""
    pairs: list[tuple[str, str]] = []
    if isinstance(features, Mapping):
        pairs = [(m, w) for m, ws in features.items() for w in ws]
    else:
        for spec in features:
            name, sep, windows = spec.partition(":")
            if not sep or not windows.strip():
                raise BadQuery(
                    f"`--features` {spec!r} must be METRIC:WINDOW[,WINDOW...],"
                    " e.g. txn_count:10m,1h",
                    "features",
                )
            pairs += [(name.strip(), w.strip()) for w in windows.split(",") if w.strip()]
    if not pairs:
        raise BadQuery("no features asked for, e.g. txn_count:10m,1h", "features")
    known = [m.name for m in cfg.metrics] + [d.name for d in cfg.derived]
    out: dict[str, Feature] = {}
    for name, window in pairs:
        if name not in known:
            raise UnknownMetric(
                f"unknown metric {name!r}; known metrics: {', '.join(known)}", "features"
            )
        window_ms = parse_window(window, f"{name} window")
        column = f"{name}_{re.sub(r'[^0-9A-Za-z]+', '_', window)}"
        out.setdefault(column, Feature(name, window, window_ms, column))
    return list(out.values())


def fold_aggs(agg: Agg, v: Column, t: Column, name: Callable[[str], str]) -> list[Column]:
    """The fold's own aggregates of one metric (its count `n`, then its folds), named by
    `name(column)`: what the live fold computes for a cell."""
    built = [(N.column, N.build(F, v, t)), *agg.fold_columns(v, t)]
    return [c.alias(name(n)) for n, c in built]


def part_column(m: int, part: str, name: str, w: int | None = None) -> str:
    return f"_m{m}{part}{'' if w is None else w}_{name}"


def windows_by_metric(cfg: Config, feats: list[Feature]) -> dict[str, list[int]]:
    """Each base metric the features read, with its windows (a derived feature reads its
    inputs at its own window)."""
    derived = {d.name: formula.parse(d.expr) for d in cfg.derived}
    out: dict[str, list[int]] = {}
    for f in feats:
        for base in formula.names(derived[f.name]) if f.name in derived else [f.name]:
            ws = out.setdefault(base, [])
            if f.window_ms not in ws:
                ws.append(f.window_ms)
    return out


def events_reach(
    cfg: Config, feats: list[Feature], lo_ms: int | None, hi_ms: int | None
) -> TimeBounds:
    """The event times a feature of any row timed `lo_ms` to `hi_ms` can count: from the
    earliest row's widest window's covered start (each metric's at its finest slice, which a
    training set reads) to the latest row's time. Unbounded for rows with no time at all."""
    if lo_ms is None or hi_ms is None:
        return TimeBounds()
    finest = {m.name: m.slice_lengths()[0] for m in cfg.metrics}
    start = min(
        slice_start(lo_ms - w + 1, finest[name])
        for name, ws in windows_by_metric(cfg, feats).items()
        for w in ws
    )
    # A row at the largest long (a "no end" marker) counts every event from `start` on.
    return TimeBounds(int(start), int(hi_ms) + 1 if hi_ms < LONG_MAX else None)


def check_spine(cfg: Config, spine: DataFrame, ts: str, keys: Mapping[str, str],
                   metrics: Sequence[str], feats: list[Feature]) -> None:  # fmt: skip
    """Raises BadQuery for a spine that lacks the time column or a key column, has a column a
    feature or Sluice's row id would overwrite, a key column that is no text for a `string`
    key field (a double's `7.0` would be no key `7`), or `keys` that name no metric's key field;
    TypeError for a spine that is no Spark DataFrame."""
    if not isinstance(spine, DataFrame):
        made = " (spark.createDataFrame(it) makes one of a pandas one)" if hasattr(
            spine, "to_numpy") else ""  # fmt: skip
        raise TypeError(f"the spine must be a Spark DataFrame, not {type(spine).__name__}{made}")
    have = set(spine.columns)
    if ROW in {c.lower() for c in have}:
        raise BadQuery(f"the spine has a column {ROW!r}, a name Sluice uses for its own row ids:"
                       " rename it", "spine")  # fmt: skip
    if ts not in have:
        raise BadQuery(
            f"the spine has no time column {ts!r}; its columns are {', '.join(spine.columns)}", "ts"
        )
    fields = {f for m in cfg.metrics for f in m.key}  # a map kept for every metric is fine
    stray = [f for f in keys if f not in fields]
    if stray:
        raise BadQuery(
            f"keys name {', '.join(map(repr, stray))}, which is no metric's key field"
            f" (key fields: {', '.join(sorted(fields))})", "key",
        )  # fmt: skip
    for name in metrics:
        m = cfg.metric(name)
        assert m is not None
        for field in m.key:
            col = keys.get(field, field)
            text = FieldType.parse(cfg.source.schema_[field]).type == "string"
            if col in have and text and not_text(dtype := spine.schema[col].dataType):
                raise BadQuery(
                    f"the spine's column {col!r} is {dtype.simpleString()}, and key field"
                    f" {field!r} is a string: 7.0 would be the key '7.0', not '7', as the archive"
                    " reads refuse such a column too. Give the keys as text or integers (pandas:"
                    " `.astype('Int64').astype(str)`)", "key",
                )  # fmt: skip
            if col not in have:
                raise BadQuery(
                    f"the spine has no column {col!r} for key field {field!r} of {name!r};"
                    f" name it with --key {field}=COLUMN, or keys={{{field!r}: COLUMN}} in Python"
                    f" (columns: {', '.join(spine.columns)})",
                    "key",
                )
    # Spark's column names are case-insensitive unless a session says otherwise.
    folded = {c.lower(): c for c in have}
    clash = [folded[f.column.lower()] for f in feats if f.column.lower() in folded]
    if clash:
        raise BadQuery(f"the spine already has columns {', '.join(clash)}, which features would"
                       " add (Spark's column names ignore case)", "features")  # fmt: skip


def key_columns(cfg: Config, feats: list[Feature], keys: Mapping[str, str]) -> dict[str, str]:
    """The spine columns that hold the features' key fields (`keys` renames them), each with
    its field's type in `source.schema`."""
    out: dict[str, str] = {}
    for name in windows_by_metric(cfg, feats):
        m = cfg.metric(name)
        assert m is not None
        for f in m.key:
            out.setdefault(keys.get(f, f), cfg.source.schema_[f])
    return out


def key_value(col: Column, spec: str) -> Column:
    """A spine's key column as its field's type (`spec`, from `source.schema`), as the live
    decoder types the field: the key the live writer built from it. A value that does not
    convert is null (that row has no key), and so is a fractional number for an integer
    field: a cast would cut 6.5 to another entity's key 6 (6.0, as pandas writes the integers
    of a column with a gap, is 6)."""
    typ = spark_type(spec)
    if typ not in ("bigint", "int"):
        return col.try_cast(typ)
    number = col.try_cast("double")
    return F.when(number == F.floor(number), col.try_cast(typ))


def key_text(col: Column, spec: str) -> Column:
    """`key_value` as text: the key part the store's hashes are named by."""
    return key_value(col, spec).cast("string")


# A spine time before this many ms since the epoch (1973-03-03) is likely in seconds; one
# after this many (the year 5138), in micro- or nanoseconds.
SECONDS_BELOW = 10**11
FINER_ABOVE = 10**14
LONG_MAX = 2**63 - 1


def spine_problems(spine: DataFrame, t: Column, ts: str, key_cols: Mapping[str, str]) -> list[str]:
    """What makes spine rows' features null without any fault of the events, said in words:
    rows with no time, with a time that is none (`t`: the `ts` column read as ms), with no
    key, with a key that is not of its field's type (`key_cols`: column -> type), and times
    that look like epoch seconds. One small job over the spine."""
    raw = F.col(f"`{ts}`")
    no_key, bad_key = F.lit(False), F.lit(False)
    bad_keys: list[Column] = []
    for c, spec in key_cols.items():
        col = F.col(f"`{c}`")
        no_key = no_key | col.isNull()
        wrong = col.isNotNull() & key_value(col, spec).isNull()
        bad_key = bad_key | wrong
        bad_keys.append(F.when(wrong, F.format_string(f"%s in {c!r} (not a {spec})", col)))
    got = spine.select(
        F.count_if(raw.isNull()).alias("no_time"),
        F.count_if(raw.isNotNull() & t.isNull()).alias("bad_time"),
        F.count_if(no_key).alias("no_key"),
        F.count_if(~no_key & bad_key).alias("bad_key"),
        F.first(F.coalesce(*bad_keys, F.lit(None)), True).alias("bad_key_e"),
        F.count_if((t > 0) & (t < SECONDS_BELOW)).alias("seconds"),
        F.first(F.when((t > 0) & (t < SECONDS_BELOW), t), True).alias("a_second"),
        F.count_if((t > FINER_ABOVE) & (t < LONG_MAX)).alias("finer"),
        F.first(F.when((t > FINER_ABOVE) & (t < LONG_MAX), t), True).alias("a_finer"),
        F.first(F.when(raw.isNotNull() & t.isNull(), raw.cast("string")), True).alias("bad"),
    ).first()
    if got is None:
        return []
    out = []
    if got["no_time"]:
        out.append(
            f"{got['no_time']:,} rows have no time ({ts!r} is null): their features are null"
        )
    if got["bad_time"]:
        out.append(
            f"{got['bad_time']:,} rows have a {ts!r} that is no time (e.g. {got['bad']!r}; epoch"
            " ms, a timestamp or ISO 8601 are read): their features are null"
        )
    if got["seconds"]:
        out.append(
            f"{got['seconds']:,} rows have a {ts!r} that looks like epoch seconds (e.g."
            f" {got['a_second']}): times are read as epoch ms; multiply by 1000"
        )
    if got["finer"]:
        out.append(
            f"{got['finer']:,} rows have a {ts!r} past the year 5000 (e.g. {got['a_finer']}):"
            " times are read as epoch ms; epoch microseconds or nanoseconds must be divided by"
            " 1,000 or 1,000,000"
        )
    if got["no_key"]:
        out.append(f"{got['no_key']:,} rows lack a key ({' or '.join(key_cols)} is null):"
                   " the features of that key are null")  # fmt: skip
    if got["bad_key"]:
        out.append(f"{got['bad_key']:,} rows have a key that is not of its field's type (e.g."
                   f" {got['bad_key_e']}): the features of that key are null")  # fmt: skip
    return out


def bad_rows(events: DataFrame) -> tuple[dict[str, tuple[int, str]], int]:
    """Per reason, how many rows of `events` (`archive_events`) are bad, and one of them: its
    field and its text as read; and how many are good. A training set or a consistency check
    counts no bad row, as the live fold dead-letters it; this says how many there were (one
    pass over the input)."""
    sample = F.concat_ws(": ", F.col("_field"), F.col("_raw"))
    got = (
        events.groupBy(F.coalesce(F.col("_err"), F.lit("")).alias("err"))
        .agg(F.count(F.lit(1)).alias("n"), F.first(sample).alias("e"))
        .collect()
    )
    good = sum(int(r["n"]) for r in got if not r["err"])
    return {r["err"]: (int(r["n"]), r["e"] or "") for r in got if r["err"]}, good


def reach_problems(events: DataFrame, reach: TimeBounds) -> list[str]:
    """Why no good event of `events` (`archive_events`, unbounded) is within `reach`, said in
    words: where the archive's event times are, and whether they look like epoch seconds or
    finer units (times are read as epoch ms). One job over the archive."""
    good = events.where(F.col("_err").isNull())
    got = good.select(F.min("_ts").alias("lo"), F.max("_ts").alias("hi")).first()
    if got is None or got["lo"] is None:
        return []  # no good event at all: the bad rows say why
    lo, hi = int(got["lo"]), int(got["hi"])
    within = ""
    if reach.start_ms is not None:
        until = "" if reach.until_ms is None else f" to {iso_ms(reach.until_ms - 1)}"
        within = f" ({iso_ms(reach.start_ms)}{until})"
    line = (
        f"no archived event is within the spine's reach{within}, so every feature counts"
        f" none: the archive's event times run from {iso_ms(lo)} to {iso_ms(hi)}"
    )
    if 0 < hi < SECONDS_BELOW:
        line += (
            f" ({lo} to {hi}), which looks like epoch seconds: times are read as epoch ms;"
            " multiply by 1000"
        )
    elif lo > FINER_ABOVE:
        line += f" ({lo} to {hi}): epoch micro- or nanoseconds must be divided first"
    return [line]


def spark_type(spec: str) -> str:

    return SPARK_TYPES[FieldType.parse(spec).type]


def feature_types(cfg: Config, feats: list[Feature]) -> dict[str, str]:
    out = {}
    for f in feats:
        m = cfg.metric(f.name)
        if m is None:
            out[f.column] = "double"  # a derived formula
        else:
            single = not isinstance(m.q, list)
            out[f.column] = AGGS[m.agg].answer_type(integral_value(cfg, m), single)
    return out


_ARROW = {"long": pa.int64(), "double": pa.float64()}


def arrow_column(values: list[Any] | pa.Array, spark_type: str) -> pa.Array:
    """Answers (a list, or an Arrow column of numbers) as an Arrow column of their feature's
    Spark type (`feature_types`). A number that is not finite (a sum past the largest double,
    a variance whose moments overflow) is null, as the service answers it."""
    if spark_type in _ARROW:
        kind = _ARROW[spark_type]
        out = values.cast(kind) if isinstance(values, pa.Array) else pa.array(values, kind)
        if pa.types.is_floating(kind):
            out = pc.if_else(pc.is_finite(out), out, pa.scalar(None, kind))
        return out
    return pa.array(  # map<string,double>: the quantiles
        [None if v is None else list(v.items()) for v in values],
        pa.map_(pa.string(), pa.float64()),
    )
