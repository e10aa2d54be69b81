"""The bare engine: the fold's Spark plan (explode, fold) fed from in-memory Arrow with a no-op
write, the ceiling the pipeline is measured against (bench/throughput.py, bench/ingest.py)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from lib.load import HIGHCARD, KeySpace, now_ms, xrange_entries
from lib.stats import batch_rate
from sluice.config import Config
from sluice.pipeline import plan as spark_plan
from sluice.source.decode import Decoder, output_schema, spark_schema_ddl
from sluice.source.options import SourceOptions
from sluice.testing.arrow_source import ARROW_FORMAT

BARE_PARTITIONS, BARE_CHUNKS_PER_PARTITION = 4, 4
STATE_PROVIDERS = {
    "hdfs": "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider",
    "rocksdb": "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
}


def bare_run(
    spark: Any,
    cfg: Config,
    state_dir: Path,
    n_events: int,
    seed: int,
    batches: int,
    timeout_s: float,
    workload: str = "zipf",
    share_columns: bool = True,
    partial: str = "auto",
    space: KeySpace = HIGHCARD,
    state: str | None = None,
) -> tuple[dict[str, Any], list[Any]]:
    """explode_updates + fold_updates + a no-op write over `batches` micro-batches of
    `n_events` events of `workload`, from the Arrow source, back to back (trigger 0, so the
    500 ms trigger does not cap small fast batches); each batch timed. Returns (the rate with
    the events the warm-up batch counted, the batch records). `share_columns=False`: the plan
    without slots (`plan.metric_specs`). `partial`: Spark's partial aggregation as the fold's
    `spark.partial_aggregation` sets it (`auto` from the warm-up batch's rows and cells, as
    the fold from its last batch's), where the revision has that setting. `space`: where
    `highcard` events fall. The rate carries the warm-up batch's exploded rows and the cells
    they folded into (`fold_rows`, `fold_cells`). `state` (a key of STATE_PROVIDERS): the fold
    as a streaming aggregation instead, its cells kept across batches in that state store,
    each batch emitting the cells it changed, whole (output mode `update`); `fold_rows` and
    `fold_cells` are then the warm-up batch's cells."""
    n_rows = write_arrow_batch(cfg, n_events, seed, state_dir / "batch.arrow", workload, space)
    types = spark_plan.check_expressions(spark, cfg)
    specs = spark_plan.metric_specs(cfg, types, share_columns)
    folds = spark_plan.fold_columns(specs, cfg.audit.enabled)  # as the fold builds them
    records: list[dict[str, Any]] = []
    checked: list[int] = []  # the warm-up batch's good events, exploded rows and cells
    mode = getattr(spark_plan, "PartialAggregation", None)  # None: a revision without it
    partial_agg = mode(partial) if mode is not None else None

    def on_batch(exploded: DataFrame, batch_id: int) -> None:
        started = now_ms()
        if partial_agg is not None and state is None:
            partial_agg.apply(exploded.sparkSession)
        # With `state`, the batch holds the cells the stateful fold changed, already folded.
        updates = exploded if state is not None else spark_plan.fold_updates(exploded, folds)
        if not records and not checked:  # warm-up batch: check every row arrived (untimed)
            good = F.sum(F.when(F.col("g") == 0, F.col("cnt")))
            row = updates.agg(good, F.sum("cnt"), F.count(F.lit(1))).collect()[0]
            checked.extend((int(row[0] or 0), int(row[1] or 0), int(row[2])))
            if partial_agg is not None:
                partial_agg.observe(int(row[1] or 0), int(row[2]))
            started = now_ms()
        updates.write.format("noop").mode("overwrite").save()
        records.append({"batch": batch_id, "events": n_rows, "started_ms": started,
                        "done_ms": now_ms()})  # fmt: skip

    options = {"path": str(state_dir / "batch.arrow"), "partitions": str(BARE_PARTITIONS),
               "ddl": spark_schema_ddl(SourceOptions.from_config(cfg, "x")),
               "batches": str(batches)}  # fmt: skip
    events = spark.readStream.format(ARROW_FORMAT).options(**options).load()
    stream = spark_plan.explode_updates(events, cfg, specs)
    if state is not None:  # the provider is fixed when the query's checkpoint is made
        spark.conf.set("spark.sql.streaming.stateStore.providerClass", STATE_PROVIDERS[state])
        stream = spark_plan.fold_updates(stream, folds)
    query = (
        stream.writeStream.foreachBatch(on_batch).outputMode("update" if state else "append")
        .option("checkpointLocation", str(state_dir / "checkpoint"))
        .trigger(processingTime="0 seconds").start()  # back to back: the ceiling
    )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    try:
        while len(records) < batches and time.monotonic() < deadline:
            if query.exception() is not None:
                raise RuntimeError(f"bare engine query failed: {query.exception()}")
            time.sleep(0.2)
    finally:
        query.stop()
    rate = batch_rate(records)
    warm = dict(zip(("checked_events", "fold_rows", "fold_cells"), checked, strict=False))
    return {"checked_events": None, **warm, **(rate or {})}, records


def write_arrow_batch(cfg: Config, n_events: int, seed: int, path: Path, workload: str = "zipf",
                      space: KeySpace = HIGHCARD) -> int:  # fmt: skip
    """Decode `n_events` synthetic entries (or Kafka records) of `workload` (`highcard` over
    `space`) with the real Decoder into an Arrow IPC file of BARE_PARTITIONS x
    BARE_CHUNKS_PER_PARTITION record batches. Returns rows."""
    ref_ms = now_ms()
    opts = SourceOptions.from_config(cfg, url="redis://unused")
    entries = xrange_entries(cfg, n_events, seed, ref_ms, workload, space)
    values, decoder = [e[1][1] for e in entries], Decoder(opts, ref_ms, "events:0")  # value: `d`
    decoded = decoder.decode(entries) if cfg.source.kafka is None else decoder.decode_records(
        values, range(len(values)), [ref_ms] * len(values), "events", 0)  # fmt: skip
    table = pa.Table.from_batches(list(decoded), schema=output_schema(opts))
    chunk = math.ceil(table.num_rows / (BARE_PARTITIONS * BARE_CHUNKS_PER_PARTITION))
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        for b in table.to_batches(max_chunksize=chunk):
            writer.write_batch(b)
    return int(table.num_rows)
