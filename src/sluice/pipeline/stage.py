"""A stream-to-stream stage: read streams, apply Spark SQL to each micro-batch, write a stream.

Per micro-batch:
1. bad input events (the decoder's `_err`) go to the dead-letter stream of the stage's first
   input, with their reason, as in the fold;
2. the good ones are the view `input` (the time field filled with the entry's time where it was
   missing), beside the stage's static `tables`; the stage's `sql` runs over them;
3. the result, cast to the output schema, is written as `jsonl` entries of up to
   `to.entry_events` events, spread over the output shards.

Exactly once. Spark re-runs a batch after a crash with the same batch id and offsets, so the
same input and (the SQL being deterministic) the same output rows. The rows are hash-partitioned
by their JSON text and sorted within each partition, so each partition holds the same rows in
the same order on every attempt. They go out in chunks, each by one script call that first sets
a marker for (writer token, partition, chunk) and only then appends, atomically
(`lua/emit.lua`): a chunk an earlier attempt wrote is skipped whole, any other written once.
Every batch records how many events came in, went to dead letters, and went out.

The batch session Spark hands to `foreachBatch` is a clone per streaming query, so each stage's
`input` view is its own, and the tables registered in its session at start are visible in it.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from sluice import collector
from sluice.clock import SYSTEM_CLOCK, Clock
from sluice.config import Config, FieldType, StageConfig
from sluice.graph import Graph, StreamsSpec
from sluice.pipeline.plan import dead_letter_json
from sluice.pipeline.query import Role, StreamQuery
from sluice.pipeline.schemas import load_tables
from sluice.pipeline.writer import WriterContext, write_dead_letters
from sluice.redis.connection import RedisHandle, client_for
from sluice.redis.keys import shard_side_key
from sluice.redis.scripts import EMIT, evalsha_on, execute_loading
from sluice.source.options import SourceOptions
from sluice.source.reader import LogDataSource
from sluice.source.values import SPARK_TYPES

log = logging.getLogger(__name__)

PARTITIONS_PER_SHARD = 2  # output partitions per output shard (fixed: a re-run must match)
ENTRY_BYTES = 1_000_000  # an entry is cut before it grows past this
CALL_ENTRIES = 32  # entries per script call (one marker each)
MARKER_TTL_S = 7 * 86400
EMIT_DDL = "events long, entries long, replayed long, write_ms double"
DEAD_DDL = "reason string, events long"


@dataclass(frozen=True)
class EmitContext:
    url: str
    token: int
    shards: tuple[str, ...]
    entry_events: int


def emit_partition(ctx: EmitContext, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: append this partition's JSON lines to its shard, chunk by chunk, each
    chunk at most once per writer token. Yields one row of counters."""
    collector.settle()
    task = TaskContext.get()
    part = task.partitionId() if task is not None else 0
    shard = ctx.shards[part % len(ctx.shards)]
    lines: list[str] = []
    for b in batches:
        lines.extend(b.column("d").to_pylist())
    entries = list(_entries(lines, ctx.entry_events))
    t0 = time.perf_counter()
    added = replayed = 0
    if entries:
        client = client_for(ctx.url, timeout_s=60, connect_timeout_s=10)
        try:

            def run() -> list[Any]:
                pipe = client.pipeline(transaction=False)
                for i in range(0, len(entries), CALL_ENTRIES):
                    marker = shard_side_key("emit", shard, ctx.token, part, i // CALL_ENTRIES)
                    chunk = entries[i : i + CALL_ENTRIES]
                    evalsha_on(pipe, EMIT, [marker, shard], [MARKER_TTL_S, *chunk])
                return list(pipe.execute())

            for n in execute_loading(client, run, (EMIT,)):
                if int(n) < 0:
                    replayed += 1
                else:
                    added += int(n)
        finally:
            client.close()
    row = {
        "events": len(lines),
        "entries": added,
        "replayed": replayed,
        "write_ms": (time.perf_counter() - t0) * 1000,
    }
    yield pa.RecordBatch.from_pylist([row], schema=pa.schema(_arrow_fields(EMIT_DDL)))


def _entries(lines: list[str], per_entry: int) -> Iterator[str]:
    """Join lines into entries of at most `per_entry` lines and about ENTRY_BYTES bytes."""
    cur: list[str] = []
    size = 0
    for line in lines:
        if cur and (len(cur) >= per_entry or size + len(line) > ENTRY_BYTES):
            yield "\n".join(cur)
            cur, size = [], 0
        cur.append(line)
        size += len(line) + 1
    if cur:
        yield "\n".join(cur)


def by_reason(rows: list[Any]) -> dict[str, int]:
    """Events per dead-letter reason, summed over the partitions' rows (each has its own)."""
    out: dict[str, int] = {}
    for r in rows:
        out[r["reason"]] = out.get(r["reason"], 0) + int(r["events"])
    return out


def dead_partition(
    ctx: WriterContext, batches: Iterator[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: write this partition's dead letters (once per token and content)."""
    collector.settle()
    dead: list[str] = []
    for b in batches:
        dead.extend(b.column("k").to_pylist())
    reasons: dict[str, int] = {}
    if dead:
        client = client_for(ctx.url, timeout_s=60, connect_timeout_s=10)
        try:
            reasons = write_dead_letters(client, ctx, dead)
        finally:
            client.close()
    rows = [{"reason": r, "events": n} for r, n in reasons.items()]
    yield pa.RecordBatch.from_pylist(rows, schema=pa.schema(_arrow_fields(DEAD_DDL)))


def _arrow_fields(ddl: str) -> list[tuple[str, pa.DataType]]:
    kinds = {"string": pa.string(), "long": pa.int64(), "double": pa.float64()}
    return [(n, kinds[t]) for n, t in (c.strip().split() for c in ddl.split(","))]


class StageQuery(StreamQuery):
    """One `stages:` entry, run as its own streaming query in its own Spark session (its temp
    views, `input` and its tables, are its own)."""

    def __init__(
        self,
        cfg: Config,
        graph: Graph,
        stage: StageConfig,
        role: Role,
        redis: RedisHandle,
        spark: SparkSession,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__(cfg, redis, spark, role, clock)
        self.graph = graph
        self.stage = stage
        self.inputs = [graph.streams[s] for s in stage.from_]
        self.output = graph.streams[stage.to.stream]
        assert self.output.schema is not None, "resolve_schemas first"
        self.session: SparkSession | None = None

    def prepare(self) -> None:
        if self.session is None:
            self.session = self.spark.newSession()
            self.session.dataSource.register(LogDataSource)
            load_tables(self.session, self.stage, f"stages.{self.stage.name}.tables")
        super().prepare()

    def base_options(self) -> SourceOptions:
        first = self.inputs[0]
        fields = tuple(
            (n, t.type, t.nullable or n == first.time_field)
            for n, t in ((n, FieldType.parse(s)) for n, s in (first.schema or {}).items())
        )
        log = first.log
        if len(self.inputs) > 1:  # streams of one shape, read as one log (config checks it)
            log = StreamsSpec(tuple(k for s in self.inputs for k in s.shards))
        return SourceOptions(
            url=self.redis.url,
            log=log,
            format=first.format,
            fields=fields,
            time_field=first.time_field,
            max_events_per_batch=self.cfg.source.max_events_per_batch,
            max_string_bytes=self.cfg.source.max_string_bytes,
            max_entry_bytes=self.cfg.source.max_entry_bytes,
        )

    def source_options(self) -> SourceOptions:
        # The stage's watermarks are those of the stream it reads.
        cfg = self.cfg.model_copy(update={"backpressure": self.inputs[0].backpressure})
        return self.role.source_options(self.base_options(), cfg, self.ckpt)

    def frame(self) -> DataFrame:
        return self.read_stream(self.session)

    def process_batch(self, events: DataFrame, batch_id: int) -> dict[str, Any]:
        self.prepare()
        started = self.clock.now_ms()
        token = self.token(batch_id)
        first = self.inputs[0]
        events = events.persist()
        try:
            bad = F.col("_err").isNotNull()
            seen = events.agg(
                F.count(F.lit(1)).alias("n"),
                F.sum(F.when(bad, 1).otherwise(0)).alias("bad"),
                F.min("_ems").alias("min_ems"),
                F.max("_ems").alias("max_ems"),
            ).collect()[0]
            dead_rows: list[Any] = []
            if seen["bad"]:
                ctx = WriterContext(
                    url=self.redis.url,
                    token=token,
                    specs=(),
                    source_stream=first.name,
                    dead_letter_maxlen=self.cfg.source.dead_letter_maxlen,
                    recorded_shards=self.role.recorded_shards,
                )
                records = events.where(bad).select(
                    dead_letter_json(F.col("_err"), list(first.schema or {})).alias("k")
                )
                dead_rows = records.mapInArrow(
                    functools.partial(dead_partition, ctx), DEAD_DDL
                ).collect()
            emitted = self._emit(events.where(~bad), token)
        finally:
            events.unpersist()
        rec = {
            "batch": batch_id,
            "token": token,
            "events": int(seen["n"]),
            "dead": int(seen["bad"] or 0),
            "out": sum(int(r["events"]) for r in emitted),
            "entries": sum(int(r["entries"]) for r in emitted),
            "replayed_chunks": sum(int(r["replayed"]) for r in emitted),
            "min_ems": seen["min_ems"],
            "max_ems": seen["max_ems"],
            "write_ms": max((round(float(r["write_ms"]), 1) for r in emitted), default=None),
            "started_ms": started,
            "done_ms": self.clock.now_ms(),
            "dead_by_reason": by_reason(dead_rows),
        }
        self.record(
            rec,
            [
                "batches", 1,
                "events_in", rec["events"],
                "dead_letters", rec["dead"],
                "events_out", rec["out"],
                "entries_out", rec["entries"],
            ],
        )  # fmt: skip
        return rec

    def _emit(self, good: DataFrame, token: int) -> list[Any]:
        """Run the stage's SQL over the good events and append the result to the output."""
        first = self.inputs[0]
        cols = []
        for name in first.schema or {}:
            c = F.col("_ts") if name == first.time_field else F.col(f"`{name}`")
            cols.append(c.alias(name))
        session = good.sparkSession
        good.select(*cols).createOrReplaceTempView("input")
        result = session.sql(self.stage.sql)
        schema = self.output.schema or {}
        typed = [
            F.col(f"`{n}`").cast(SPARK_TYPES[FieldType.parse(t).type]).alias(n)
            for n, t in schema.items()
        ]
        lines = result.select(F.to_json(F.struct(*typed)).alias("d"))
        k = PARTITIONS_PER_SHARD * len(self.output.shards)
        ctx = EmitContext(self.redis.url, token, self.output.shards, self.stage.to.entry_events)
        ordered = lines.repartition(k, "d").sortWithinPartitions("d")
        return ordered.mapInArrow(functools.partial(emit_partition, ctx), EMIT_DDL).collect()
