"""A JSON-lines archive read as its lines and decoded by the live pipeline's own decoder.

Spark's JSON reader would give every value as text (or fail a whole line on one bad value), so
an archive line would be judged otherwise than the same line read from the log: `"12.5"` in a
double field or `123` in a string field would count offline and be dead-lettered online. Here
each non-blank line is one record of the `json` format, decoded by `source.decode.Decoder` on
the executors, so a line counts offline exactly when it counts online, with the same
dead-letter reason (`bad_json`, `not_object`, `bad_type`, `out_of_range`, ...). The time field
is required offline, where there is no log time to fall back on: a line without one is
`missing_field`. A bad line's `_eid` is `<file>:<task>@<line in the task>`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from functools import partial

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark import TaskContext
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from sluice.config import Config, FieldType
from sluice.source.decode import Decoder, spark_schema_ddl
from sluice.source.options import SourceOptions

LINE = "_sluice_line"
FILE = "_sluice_file"
KNOWN = "_sluice_known"  # the arrival column's text, carried past the decoder
SAMPLE_LINES = 64


def read_lines(spark: SparkSession, paths: list[str]) -> DataFrame:
    """The archive's non-blank lines and the file each comes from."""
    lines = spark.read.text(paths).select(
        F.col("value").alias(LINE), F.input_file_name().alias(FILE)
    )
    return lines.where(F.trim(F.col(LINE)) != F.lit(""))


def json_value(name: str) -> Column:
    """A line's value of key `name` as text (a number's digits, a string's contents)."""
    return F.get_json_object(F.col(LINE), "$['" + name.replace("'", "\\'") + "']")


def sample_keys(lines: DataFrame) -> set[str] | None:
    """The keys of the first lines that are JSON objects (None: none of them is), to tell a
    schema mismatch before any work."""
    keys: set[str] = set()
    seen = False
    for row in lines.select(LINE).limit(SAMPLE_LINES).collect():
        try:
            obj = json.loads(row[0])
        except ValueError:
            continue
        if isinstance(obj, dict):
            seen = True
            keys.update(obj)
    return keys if seen else None


def decoded(
    lines: DataFrame, cfg: Config, schema: dict[str, str], arrival: str | None
) -> DataFrame:
    """The lines as events: the schema's fields typed, `_err`, `_field`, `_raw`, `_eid`, and
    with `arrival`, that key's text as `KNOWN`."""
    opts = dataclasses.replace(
        SourceOptions.from_config(cfg, url="redis://unused"),
        format="json",
        fields=tuple(
            (n, FieldType.parse(s).type, FieldType.parse(s).nullable) for n, s in schema.items()
        ),
    )
    src = lines.select(LINE, FILE, (json_value(arrival) if arrival else F.lit(None)).alias(KNOWN))
    ddl = f"{spark_schema_ddl(opts)}, {KNOWN} string"
    out = src.mapInArrow(partial(_decode, opts), ddl)
    time_field = cfg.source.time_field
    no_time = F.col("_err").isNull() & F.col(f"`{time_field}`").isNull()
    return out.select(
        *[F.col(f"`{n}`") for n in schema],
        F.when(no_time, F.lit("missing_field")).otherwise(F.col("_err")).alias("_err"),
        F.when(no_time, F.lit(time_field)).otherwise(F.col("_field")).alias("_field"),
        "_raw",
        "_eid",
        KNOWN,
    )


def _decode(opts: SourceOptions, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: each run of one file's lines decoded as records of the `json` format
    (one event per line, in order), the arrival text passed along."""
    ctx = TaskContext.get()
    part = ctx.partitionId() if ctx is not None else 0
    decoder = Decoder(opts, ref_ms=0, stream="archive")
    row = 0
    for batch in batches:
        values = batch.column(0).cast(pa.binary()).to_pylist()
        files = batch.column(1)
        n = len(values)
        if not n:
            continue
        edges = np.flatnonzero(pc.not_equal(files[1:], files[:-1]).to_numpy(zero_copy_only=False))
        starts = [0, *(edges + 1).tolist()]
        known = batch.column(2)
        for a, b in zip(starts, [*starts[1:], n], strict=True):
            offsets = range(row + a, row + b)
            at = a  # one row per record, in order: each chunk's rows follow the last one's
            for rb in decoder.decode_records(values[a:b], offsets, [0] * (b - a), str(files[a]),
                                             part):  # fmt: skip
                yield rb.append_column(KNOWN, known.slice(at, len(rb)))
                at += len(rb)
            assert at == b, f"the decoder gave {at - a} rows for {b - a} json records"
        row += n
