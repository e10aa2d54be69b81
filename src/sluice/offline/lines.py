"""A JSON-lines archive read as its lines and decoded by the live pipeline's own decoder.

Spark's JSON reader would give every value as text (or fail a whole line on one bad value), so
an archive line would be judged otherwise than the same line read from the log: `"12.5"` in a
double field or `123` in a string field would count offline and be dead-lettered online. Here
each non-blank line is one record of the `json` format, decoded by `source.decode.Decoder` on
the executors, so a line counts offline exactly when it counts online, with the same
dead-letter reason (`bad_json`, `not_object`, `bad_type`, `out_of_range`, ...). The time field
is required offline, where there is no log time to fall back on: a line without one is
`missing_field`. Blank lines are no records. A bad line's `_eid` is `<file>:<block>@<line>`:
the byte where the task's part of the file starts (0 for a file read whole, as Spark reads any
file under `spark.sql.files.maxPartitionBytes` or compressed) and the line's number among the
lines that begin in that part, from 1, blank lines counted: for a file read whole, its line
number in the file.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from functools import partial

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from sluice.config import Config, FieldType
from sluice.source.decode import Decoder, spark_schema_ddl
from sluice.source.options import SourceOptions

LINE = "_sluice_line"
FILE = "_sluice_file"
BLOCK = "_sluice_block"  # the byte where the task's part of the file starts
KNOWN = "_sluice_known"  # the arrival column's text, carried past the decoder
WHEN = "_sluice_when"  # the time key's text as ms, carried past it: a bad line's time
SAMPLE_LINES = 64


def read_lines(spark: SparkSession, paths: list[str]) -> DataFrame:
    """The archive's lines, blank ones too (they keep the line numbers right), with the file
    each comes from and where its task's part of that file starts."""
    return spark.read.text(paths).select(
        F.col("value").alias(LINE),
        F.input_file_name().alias(FILE),
        F.col("_metadata.file_block_start").alias(BLOCK),
    )


def json_value(name: str) -> Column:
    """A line's value of key `name` as text (a number's digits, a string's contents)."""
    return F.get_json_object(F.col(LINE), "$['" + name.replace("'", "\\'") + "']")


def sample_keys(lines: DataFrame) -> set[str] | None:
    """The keys of the first lines that are JSON objects (None: none of them is; none at all
    where there is no line but blank ones), to tell a schema mismatch before any work."""
    keys: set[str] = set()
    rows = lines.where(F.trim(F.col(LINE)) != F.lit("")).select(LINE).limit(SAMPLE_LINES)
    got = rows.collect()
    if not got:
        return keys
    seen = False
    for row in got:
        try:
            obj = json.loads(row[0])
        except ValueError:
            continue
        if isinstance(obj, dict):
            seen = True
            keys.update(obj)
    return keys if seen else None


def decoded(
    lines: DataFrame,
    cfg: Config,
    schema: dict[str, str],
    arrival: str | None,
    when: Column,
    ref_ms: int | None = None,
) -> DataFrame:
    """The lines as events: the schema's fields typed, `_err`, `_field`, `_raw`, `_eid`, with
    `arrival`, that key's text as `KNOWN`, and `when` (a line's time key read as ms, null where
    it is none) as `WHEN`, which bounds a line the decoder refused as the input's other rows
    are bounded. With `ref_ms` (the plan's reference time), the lines the plan will find out of
    time are named too, as the live decoder names them."""
    opts = dataclasses.replace(
        SourceOptions.from_config(cfg, url="redis://unused"),
        format="json",
        fields=tuple(
            (n, FieldType.parse(s).type, FieldType.parse(s).nullable) for n, s in schema.items()
        ),
    )
    if ref_ms is None:
        opts = dataclasses.replace(opts, named_ahead_ms=None, named_behind_ms=None)
    arrives = (json_value(arrival) if arrival else F.lit(None)).alias(KNOWN)
    src = lines.select(LINE, FILE, BLOCK, arrives, when.cast("bigint").alias(WHEN))
    ddl = f"{spark_schema_ddl(opts)}, {KNOWN} string, {WHEN} bigint"
    out = src.mapInArrow(partial(_decode, opts, ref_ms or 0), ddl)
    time_field = cfg.source.time_field
    no_time = F.col("_err").isNull() & F.col(f"`{time_field}`").isNull()
    return out.select(
        *[F.col(f"`{n}`") for n in schema],
        F.when(no_time, F.lit("missing_field")).otherwise(F.col("_err")).alias("_err"),
        F.when(no_time, F.lit(time_field)).otherwise(F.col("_field")).alias("_field"),
        "_raw",
        "_eid",
        KNOWN,
        WHEN,
    )


def _decode(
    opts: SourceOptions, ref_ms: int, batches: Iterator[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: each run of one file part's lines decoded as records of the `json`
    format (one event per non-blank line, in order), named by their line numbers, the carried
    columns (the arrival text, the time) passed along."""
    decoder = Decoder(opts, ref_ms=ref_ms, stream="archive")
    part: tuple[str, int] | None = None  # the (file, block) whose lines are being read
    read = 0  # its lines read so far
    for batch in batches:
        n = batch.num_rows
        if not n:
            continue
        text, files, blocks = (batch.column(j) for j in range(3))
        carried = [
            (batch.schema.field(j).name, batch.column(j)) for j in range(3, batch.num_columns)
        ]
        values = text.cast(pa.binary()).to_pylist()
        # Blank as the live decoder has it (`bytes.strip`): bytes, so that a line cut inside a
        # UTF-8 character (a file truncated mid-write) is a bad row, not a failed task.
        blank = np.fromiter((not v.strip() for v in values), dtype=bool, count=n)
        moved = pc.or_(pc.not_equal(files[1:], files[:-1]), pc.not_equal(blocks[1:], blocks[:-1]))
        starts = [0, *(np.flatnonzero(moved.to_numpy(zero_copy_only=False)) + 1).tolist()]
        for a, b in zip(starts, [*starts[1:], n], strict=True):
            here = (str(files[a]), int(blocks[a].as_py()))
            if here != part:
                part, read = here, 0
            rows = a + np.flatnonzero(~blank[a:b])
            numbers = (read + 1 - a + rows).tolist()  # each row's line number in its part
            read += b - a
            if not len(rows):
                continue
            kept = [(name, column.take(pa.array(rows))) for name, column in carried]
            at = 0  # one row per record, in order
            for rb in decoder.decode_records([values[i] for i in rows], numbers,
                                             [0] * len(rows), *here):  # fmt: skip
                for name, column in kept:
                    rb = rb.append_column(name, column.slice(at, len(rb)))
                yield rb
                at += len(rb)
            assert at == len(rows), f"the decoder gave {at} rows for {len(rows)} json records"
