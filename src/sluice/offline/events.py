"""Archived events -> the rows the fold's plan takes, with bad rows flagged, never dropped.

The live source decodes log entries into the schema's fields and the meta columns of
`sluice.source.decode` (`_ts`, `_ems`, `_ref`, `_err`, `_field`, `_eid`, `_idx`, `_raw`, `_e`).
An archive is read by Spark instead (Parquet, JSON lines or CSV: a file, a directory, a glob,
any URL Spark reads), and `archive_events` gives it the same columns, so that
`plan.explode_updates` and `plan.fold_updates` fold it exactly as they fold a micro-batch.

JSON lines are decoded by the live decoder itself (`offline.lines`): a line counts offline
exactly when it would count read from the log, with the same dead-letter reason. Parquet and
CSV columns are cast to each schema field's type (`try_cast`: a value that does not convert is
null; a `string` field takes a text, binary, integer or boolean column, and refuses a
floating-point, time or nested one at start), and a row is bad, with the decoder's reasons
(its id: `row_name`), when:

    missing_field   a non-nullable field is null or absent (the time field always is non-null)
    bad_type        a value that is there but does not convert to the field's type
    non_finite      NaN or ±infinity in a double or float field
    too_long        a string over `source.max_string_bytes` (in UTF-8 bytes)

A bad row is folded into the plan's dead-letter rows (group DEAD_G, with its reason), which the
offline jobs count and report; it never stops them.

Time. `_ts` is the time field (epoch ms, or a Spark timestamp column, taken to ms). `_ems`, the
event's *arrival* time, is a named column where the archive keeps one (`arrival`: epoch ms, a
timestamp, ISO 8601 text or a Redis Stream entry id), else the event time. With `arrival`, a row
whose arrival time is absent (`missing_field`) or does not convert (`bad_type`) is bad too: when
it became known is what as-known-at values depend on. `_ref`, the time the plan measures
retention and `max_future` from, is `ref_ms` (a backfill: the store's clock now), or each
event's own time (training sets: nothing expires, nothing is in the future).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from py4j.protocol import Py4JJavaError
from pyspark.errors import AnalysisException, IllegalArgumentException
from pyspark.errors.exceptions.captured import CapturedException
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from sluice.config import Config, FieldType
from sluice.errors import ConfigError, SluiceError
from sluice.offline.lines import (
    KNOWN,
    LINE,
    WHEN,
    decoded,
    json_value,
    read_lines,
    sample_keys,
)
from sluice.pipeline.schemas import CSV_OPTIONS
from sluice.source.options import named_bounds
from sluice.source.values import SPARK_TYPES

FORMATS = ("parquet", "jsonl", "csv")
_COMPRESSED = ("gz", "bz2", "xz", "zst", "lz4", "snappy", "deflate")
_SUFFIXES = {".parquet": "parquet", ".json": "jsonl", ".jsonl": "jsonl", ".ndjson": "jsonl",
             ".csv": "csv"}  # fmt: skip


class ArchiveError(SluiceError):
    """An archive that cannot be read as events: a bad path, a format, a schema mismatch."""


@dataclass(frozen=True)
class TimeBounds:
    """Event time bounds, epoch ms: start <= ts < until (None: unbounded)."""

    start_ms: int | None = None
    until_ms: int | None = None

    def __post_init__(self) -> None:
        if (
            self.start_ms is not None
            and self.until_ms is not None
            and self.start_ms >= self.until_ms
        ):
            raise ArchiveError(
                f"`--start` ({self.start_ms}) must be before `--until` ({self.until_ms})"
            )

    def condition(self, ts: Column) -> Column:
        cond = F.lit(True)
        if self.start_ms is not None:
            cond = cond & (ts >= F.lit(self.start_ms))
        if self.until_ms is not None:
            cond = cond & (ts < F.lit(self.until_ms))
        return cond


def guess_format(path: str) -> str:
    """The format named by a path's suffix, a compression suffix aside (`events.jsonl.gz`); for
    a local directory, the one its files' suffixes name when they all name one; else Parquet."""
    local = path.removeprefix("file://")
    if "://" not in local and os.path.isdir(local):
        with os.scandir(local) as entries:
            kinds = {_named_format(e.name) for e in entries
                     if e.is_file() and not e.name.startswith(("_", "."))}  # fmt: skip
        named = {k for k in kinds if k is not None}
        if len(named) > 1:
            raise ArchiveError(f"directory {path!r} holds files of more than one format"
                               f" ({', '.join(sorted(named))}): Spark reads a directory in one;"
                               " give each format a directory of its own")  # fmt: skip
        if len(kinds) == 1:
            return kinds.pop() or "parquet"
    return _named_format(path) or "parquet"


def _named_format(path: str) -> str | None:
    name = path.rstrip("/*").lower()
    stem, dot, last = name.rpartition(".")
    if dot and last in _COMPRESSED:
        name = stem
    return next((fmt for suffix, fmt in _SUFFIXES.items() if name.endswith(suffix)), None)


def read_archive(
    spark: SparkSession,
    path: str | Sequence[str],
    fmt: str | None,
    schema: dict[str, str],
) -> DataFrame:
    """The archive as Spark reads it, before any cast: JSON lines as their lines (decoded by
    the live decoder in `archive_events`, `offline.lines`), CSV with a header and every value
    as text, Parquet as it is typed. Directories partitioned Hive-style (`card=0042/`) give
    their partition values as text, as written: Spark's type inference would read `0042`,
    `042` and `42` as one integer key. Raises ArchiveError for a path that does not exist, a
    format Sluice does not read, or inputs that name one file twice (it would count twice)."""
    paths = list(dict.fromkeys([path] if isinstance(path, str) else path))
    if fmt is None and len({guess_format(p) for p in paths}) > 1:
        raise ArchiveError(
            f"inputs of more than one format ({', '.join(paths)}): run one backfill per"
            " format, each with its own inputs (--format reads every input in one format)"
        )
    fmt = fmt or guess_format(paths[0])
    if fmt not in FORMATS:
        raise ArchiveError(f"unknown input format {fmt!r}; expected one of {', '.join(FORMATS)}")
    try:
        with _partition_values_as_text(spark):
            if len(paths) > 1:
                _no_overlap(spark, paths)
            if fmt == "parquet":
                return spark.read.parquet(*paths)
            if fmt == "csv":
                return spark.read.options(**CSV_OPTIONS, inferSchema="false").csv(paths)
            return read_lines(spark, paths)
    except (AnalysisException, IllegalArgumentException, Py4JJavaError) as e:
        raise ArchiveError(f"cannot read {fmt} input {', '.join(paths)}: {_why(e)}") from None


PARTITION_INFERENCE = "spark.sql.sources.partitionColumnTypeInference.enabled"


@contextlib.contextmanager
def _partition_values_as_text(spark: SparkSession) -> Iterator[None]:
    """Partition columns typed as text while the reads are planned (a read keeps the schema
    it was planned with), and the caller's setting back after."""
    before = spark.conf.get(PARTITION_INFERENCE, None)
    spark.conf.set(PARTITION_INFERENCE, "false")
    try:
        yield
    finally:
        if before is None:
            spark.conf.unset(PARTITION_INFERENCE)
        else:
            spark.conf.set(PARTITION_INFERENCE, before)


def _no_overlap(spark: SparkSession, paths: list[str]) -> None:
    """Raises ArchiveError when two inputs take in one file (a glob and one of its files, a
    directory and a file under it): Spark would read it once for each."""
    owner: dict[str, str] = {}
    for p in paths:
        for file in spark.read.format("text").load(p).inputFiles():
            if file in owner:
                raise ArchiveError(
                    f"inputs {owner[file]!r} and {p!r} both take in {file}: its events would"
                    " count twice; give each file once"
                )
            owner[file] = p


def _why(e: Exception) -> str:
    """A failed read's reason in one line: a URL scheme with no Hadoop filesystem on Spark's
    classpath (`s3a://` without hadoop-aws, say) says what to add, not a Java trace."""
    text = str(e)
    missing = re.search(r"Class (\S*FileSystem\S*) not found", text)
    scheme = re.search(r'No FileSystem for scheme "?([\w+.-]+)', text)
    if missing or scheme:
        what = (
            f"its filesystem, {missing.group(1)}, is not on Spark's classpath"
            if missing
            else f"Spark has no filesystem for {scheme.group(1)}://"  # type: ignore[union-attr]
        )
        return (
            f"{what}; add its connector's jars with `spark.conf` in sluice.yaml (`spark.jars` or"
            " `spark.jars.packages`, hadoop-aws for s3a://; docs/offline.md)"
        )
    if "TIMESTAMP(NANOS" in text:
        return (
            "a timestamp column in nanoseconds, which Spark does not read: write it in ms or µs"
            ' (pandas: `to_parquet(..., coerce_timestamps="ms", allow_truncated_timestamps=True)`)'
            " or as epoch ms"
        )
    if "UNABLE_TO_INFER_SCHEMA" in text:
        return "no data found in it (an empty directory, or files of another format: --format)"
    for line in text.splitlines():
        line = line.strip().removeprefix(": ")
        if line and not line.startswith(("An error occurred while calling", "at ", "JVM ")):
            for wrapper in ("java.lang.RuntimeException: ", "java.io.IOException: "):
                line = line.removeprefix(wrapper)
            return line
    return type(e).__name__


def event_time(raw: DataFrame, cfg: Config) -> Column | None:
    """A row of `raw` (`read_archive`)'s event time in epoch ms, null where it is none; None
    when the input has no time column at all."""
    time_field = cfg.source.time_field
    have = {f.name: f.dataType for f in raw.schema.fields}
    if time_field is None:
        return None
    if LINE in have:  # JSON lines: the time key's text
        return to_ms(json_value(time_field), T.StringType())
    if time_field in have:
        return to_ms(F.col(f"`{time_field}`"), have[time_field])
    return None


def outside(raw: DataFrame, cfg: Config, bounds: TimeBounds) -> tuple[int, int]:
    """How many rows of `raw` (`read_archive`) have an event time before `bounds` and how many
    at or after it: rows that are not read past the scan, counted so that none goes unsaid.
    One job over the time column alone."""
    ts = event_time(raw, cfg)
    if ts is None or (bounds.start_ms is None and bounds.until_ms is None):
        return 0, 0
    before = F.count_if(ts < F.lit(bounds.start_ms)) if bounds.start_ms is not None else F.lit(0)
    after = F.count_if(ts >= F.lit(bounds.until_ms)) if bounds.until_ms is not None else F.lit(0)
    got = raw.select(before.alias("b"), after.alias("a")).first()
    return (0, 0) if got is None else (int(got["b"]), int(got["a"]))


@contextlib.contextmanager
def read_failures(then: str = "") -> Iterator[None]:
    """A Spark job over the archive that fails on one of its files (not Parquet, truncated,
    unreadable) raises ArchiveError naming the file and why, not the job's Java trace, and
    `then` (what to do next). Any other failure passes unchanged."""
    try:
        yield
    except (Py4JJavaError, CapturedException) as e:
        text = str(e)
        file = re.search(r"FAILED_READ_FILE\S*\s+Encountered error while reading file (\S+?)\.?\s",
                         text)  # fmt: skip
        if file is None:
            raise
        cause = re.search(r"Caused by: (?:\S+Exception: )?(.+)", text)
        why = cause.group(1).strip() if cause else "Spark could not read it"
        if "is not a Parquet file" in why:
            why += " (if the input is JSON lines or CSV, say so with --format)"
        raise ArchiveError(f"cannot read {file.group(1)}: {why}{then}") from None


def to_ms(col: Column, dtype: T.DataType) -> Column:
    """A time column as epoch ms: a timestamp or date as such, anything else cast to long."""
    if isinstance(dtype, T.TimestampType | T.TimestampNTZType):
        return F.unix_millis(col.cast("timestamp"))
    if isinstance(dtype, T.DateType):
        return F.unix_millis(col.cast("timestamp"))
    if isinstance(dtype, T.StringType):  # CSV, JSON: epoch ms as text, or an ISO 8601 time
        return F.coalesce(col.try_cast("bigint"), F.unix_millis(col.try_cast("timestamp")))
    return col.try_cast("bigint")


def arrival_ms(col: Column, dtype: T.DataType) -> Column:
    """An arrival-time column as epoch ms: what `to_ms` reads, and a Redis Stream entry id as
    text (`<ms>-<seq>`: the time its entry was added)."""
    if isinstance(dtype, T.StringType):
        entry_id = F.regexp_extract(col, r"^\s*([0-9]{1,19})-[0-9]{1,20}\s*$", 1)
        return F.coalesce(to_ms(col, dtype), F.nullif(entry_id, F.lit("")).try_cast("bigint"))
    return to_ms(col, dtype)


def _checked(name: str, ftype: FieldType, src: Column, dtype: T.DataType, time: bool,
             max_string_bytes: int) -> tuple[Column, Column]:  # fmt: skip
    """(the field's value, or null; its dead-letter reason, or null)."""
    value = to_ms(src, dtype) if time else src.try_cast(SPARK_TYPES[ftype.type])
    reasons = []
    if not ftype.nullable or time:
        reasons.append(F.when(src.isNull(), F.lit("missing_field")))
    reasons.append(F.when(src.isNotNull() & value.isNull(), F.lit("bad_type")))
    integral = time or ftype.type in ("long", "int")
    if integral and isinstance(dtype, T.FloatType | T.DoubleType | T.DecimalType):
        # a cast would drop the fraction: 1.5 is no long, as the live decoder says too
        reasons.append(F.when(src != F.floor(src), F.lit("bad_type")))
    if ftype.type != "boolean" and isinstance(dtype, T.BooleanType):
        # true is no number and no text, online either (a null is only missing)
        reasons.append(F.when(src.isNotNull(), F.lit("bad_type")))
    if ftype.type in ("double", "float"):
        reasons.append(F.when(F.isnan(value) | (F.abs(value) == F.lit(float("inf"))),
                              F.lit("non_finite")))  # fmt: skip
    if ftype.type == "string":
        reasons.append(F.when(F.octet_length(value) > F.lit(max_string_bytes), F.lit("too_long")))
    return value, F.coalesce(*reasons)


def not_text(dtype: T.DataType) -> bool:
    """A column a `string` field cannot take as text: its values have no one spelling (a
    double's, a time's) or are not scalars. Text, bytes (Parquet strings of writers that do
    not mark them UTF-8) and integers convert; a boolean is a `bad_type` row, as online."""
    if isinstance(dtype, T.DecimalType):
        return dtype.scale > 0
    return isinstance(dtype, T.FloatType | T.DoubleType | T.DateType | T.TimestampType
                      | T.TimestampNTZType | T.ArrayType | T.MapType | T.StructType)  # fmt: skip


def _shown(keys: list[str], most: int = 20) -> str:
    """Column names for an error message, printable and short: a file read in another format
    than its own (Parquet as CSV) has its bytes for a header."""
    text = ", ".join(repr(k)[1:-1][:40] for k in keys[:most])
    more = f", and {len(keys) - most} more" if len(keys) > most else ""
    odd = any(not k.isprintable() for k in keys)
    return text + more + (" (not text: is the input in the format given?)" if odd else "")


def archive_events(
    raw: DataFrame,
    cfg: Config,
    bounds: TimeBounds = TimeBounds(),
    arrival: str | None = None,
    ref_ms: int | None = None,
    schema: dict[str, str] | None = None,
) -> DataFrame:
    """`raw` (from `read_archive`) as the plan's input rows (module docstring), bounded by event
    time. Bad rows are kept, flagged; a bad row whose time is known is bounded like a good one.

    Raises ArchiveError when a non-nullable field, the time field or `arrival` is not a column
    of the input: a schema mismatch fails before any work, naming the field and what is there.
    """
    schema = schema or cfg.source.schema_
    time_field = cfg.source.time_field
    if time_field is None:
        raise ConfigError("offline input needs `source.time_field`: events carry their time",
                          "source.time_field")  # fmt: skip
    lines = LINE in raw.columns
    have = {f.name: f.dataType for f in raw.schema.fields}
    sampled = sample_keys(raw) if lines else None
    keys = (sorted(sampled) if sampled is not None else None) if lines else list(have)
    what = "its first lines have the keys" if lines else "its columns are"
    if keys == []:  # an empty file, a JSON-lines one of blank lines, a CSV one with no header
        raise ArchiveError("input has no columns: it is empty (or only blank lines), or"
                           " a CSV file without its header line (which names them)")  # fmt: skip
    for name, spec in schema.items():
        required = not FieldType.parse(spec).nullable or name == time_field
        if keys is not None and name not in keys and required:
            raise ArchiveError(
                f"input has no column {name!r} (source.schema: {name}: {spec}); {what}"
                f" {_shown(keys)}"
            )
    if arrival is not None and keys is not None and arrival not in keys:
        raise ArchiveError(
            f"`--as-known-at` column {arrival!r} is not in the input ({what} {', '.join(keys)})"
        )
    for name, spec in schema.items():
        if FieldType.parse(spec).type == "string" and not_text(have.get(name, T.NullType())):
            raise ArchiveError(
                f"input column {name!r} is {have[name].simpleString()} and source.schema says"
                f" {name}: {spec}: a string field reads a text, binary or integer column, whose"
                " values have one spelling as text (a double's would be Spark's, `1.0`, not the"
                " text events of the live source carry); write the column as text"
            )
    if lines:
        when = event_time(raw, cfg)  # the time key's text as `outside` reads it
        out = decoded(raw, cfg, schema, arrival, F.lit(None) if when is None else when, ref_ms)
        as_text: tuple[Column, T.DataType] | None = (F.col(KNOWN), T.StringType())
        return _bounded(out, cfg, bounds, as_text if arrival else None, arrival, ref_ms, schema)
    values: list[Column] = []
    reasons: list[Column] = []
    fields: list[Column] = []
    named = F.lit(False)  # rows the plan will find out of time, named as bad ones are
    for name, spec in schema.items():
        ftype = FieldType.parse(spec)
        if name in have:
            src, dtype = F.col(f"`{name}`"), have[name]
        else:
            src, dtype = F.lit(None), T.NullType()
        value, reason = _checked(name, ftype, src, dtype, name == time_field,
                                 cfg.source.max_string_bytes)  # fmt: skip
        if name == time_field and ref_ms is not None:
            named = out_of_time(value, cfg, ref_ms)
        values.append(value.cast(SPARK_TYPES[ftype.type]).alias(name))
        reasons.append(reason)
        fields.append(F.when(reason.isNotNull(), F.lit(name)))
    raw_text = F.to_json(F.struct(*[F.col(f"`{n}`") for n in have]))
    err = F.coalesce(*reasons)
    out = raw.select(
        *values,
        err.alias("_err"),
        F.coalesce(*fields).alias("_field"),
        F.when(err.isNotNull(), F.substring(raw_text, 1, 1024)).alias("_raw"),
        F.when(err.isNotNull() | named, row_name(raw)).alias("_eid"),
        *([F.col(f"`{arrival}`").alias(KNOWN)] if arrival is not None else []),
    )
    known = (F.col(KNOWN), have[arrival]) if arrival is not None else None
    return _bounded(out, cfg, bounds, known, arrival, ref_ms, schema)


def out_of_time(ts: Column, cfg: Config, ref_ms: int) -> Column:
    """Whether an event at `ts` (ms) is one the plan will dead-letter as `future`, or may as
    `expired`, at `ref_ms`: what the live decoder names too (`SourceOptions.named_ahead_ms`)."""
    ahead, behind = named_bounds(cfg)
    cond = ts > F.lit(ref_ms + ahead)
    if behind is not None:
        cond = cond | (ts < F.lit(ref_ms - behind))
    return F.coalesce(cond, F.lit(False))


def row_name(raw: DataFrame) -> Column:
    """Where a row of `raw` is: its file and, for Parquet, `#<index>`, the row's place in the
    file from 0 (pandas' `iloc`, pyarrow's `take`). Spark keeps no row number for CSV."""
    try:
        known = raw.select("_metadata").schema[0].dataType
    except AnalysisException:  # not a file source
        return F.input_file_name()
    if not isinstance(known, T.StructType) or "row_index" not in known.fieldNames():
        return F.input_file_name()
    return F.concat(F.input_file_name(), F.lit("#"), F.col("_metadata.row_index").cast("string"))


def _bounded(out: DataFrame, cfg: Config, bounds: TimeBounds,
             known: tuple[Column, T.DataType] | None, arrival: str | None, ref_ms: int | None,
             schema: dict[str, str]) -> DataFrame:  # fmt: skip
    """The events (the schema's fields, `_err`, `_field`, `_raw`, `_eid` and, as known at, the
    arrival column as `KNOWN`) within `bounds`, with the plan's meta columns. As known at, a row
    whose arrival is absent or no time is bad."""
    time_field = cfg.source.time_field
    ems = None
    if known is not None:  # as known at: an event whose arrival is not known counts nowhere
        src, dtype = known
        ems = arrival_ms(src, dtype)
        reason = F.when(src.isNull(), F.lit("missing_field")).when(ems.isNull(), F.lit("bad_type"))
        err = F.coalesce(F.col("_err"), reason)
        out = out.select(
            *[F.col(f"`{n}`") for n in schema],
            err.alias("_err"),
            F.when(F.col("_err").isNull() & reason.isNotNull(), F.lit(arrival))
            .otherwise(F.col("_field"))
            .alias("_field"),
            F.when(err.isNotNull(), F.coalesce(F.col("_raw"), src.cast("string"), F.lit(""))).alias(
                "_raw"
            ),
            "_eid",
            ems.alias("_arrival"),
        )
    ts = F.col(f"`{time_field}`").cast("bigint")
    # A bad row's time is the event time when it converted (of a JSON line the decoder refused,
    # its time key read as `outside` reads it); else it is bounded by nothing.
    out = out.withColumn("_ts", F.coalesce(ts, F.col(WHEN)) if WHEN in out.columns else ts)
    out = out.where(F.col("_ts").isNull() | bounds.condition(F.col("_ts")))
    ems_col = F.col("_arrival") if ems is not None else F.col("_ts")
    ref = F.lit(ref_ms).cast("bigint") if ref_ms is not None else F.col("_ts")
    return out.select(
        *[F.col(f"`{n}`") for n in schema],
        F.coalesce(F.col("_ts"), F.lit(0)).cast("bigint").alias("_ts"),
        F.coalesce(ems_col, F.col("_ts"), F.lit(0)).cast("bigint").alias("_ems"),
        F.coalesce(ref, F.lit(0)).cast("bigint").alias("_ref"),
        "_err",
        "_field",
        "_eid",
        F.lit(0).alias("_idx"),
        "_raw",
        F.lit(0).cast("bigint").alias("_e"),
    )
