"""The streaming job: source -> per-batch slice fold -> store, with graceful stop and restarts.

`Pipeline.start()` returns once the streaming query runs; batches are processed on Spark's
threads. `Pipeline.run_forever()` blocks until `request_stop()` (SIGINT/SIGTERM in `sluice run`),
restarting a failed query from its checkpoint with exponential backoff.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery

from sluice.clock import SYSTEM_CLOCK, Clock
from sluice.config import Config
from sluice.errors import PipelineError
from sluice.flow.valves import StoreMonitor
from sluice.pipeline.plan import (
    check_expressions,
    explode_updates,
    fold_columns,
    fold_updates,
    metric_specs,
)
from sluice.pipeline.writer import RESULT_DDL, WriterContext, write_partition, writer_token
from sluice.redis.connection import RedisHandle
from sluice.redis.keys import BATCHES_KEY, EPOCH_KEY, STATS_KEY
from sluice.redis.scripts import RECORD_BATCH, script_source
from sluice.source.options import SourceOptions
from sluice.source.reader import FORMAT

log = logging.getLogger(__name__)


def checkpoint_dir(cfg: Config) -> Path:
    return Path(cfg.state_dir) / "checkpoint"


def writer_epoch(ckpt: Path, client: Any) -> int:
    """The epoch of this checkpoint: taken from Redis once, when the checkpoint is new.

    Kept in a file beside Spark's own checkpoint files, so a restart from the same checkpoint
    re-runs its batches with the same writer tokens (and so stays idempotent).
    """
    ckpt.mkdir(parents=True, exist_ok=True)
    path = ckpt / "sluice-epoch"
    if path.exists():
        return int(path.read_text().strip())
    epoch = int(client.incr(EPOCH_KEY))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(epoch))
    tmp.replace(path)
    return epoch


def summarize(
    rows: list[Any], batch_id: int, token: int, started_ms: int, done_ms: int
) -> dict[str, Any]:
    """Fold the writer's per-partition counters into one batch record."""
    rec: dict[str, Any] = {
        "batch": batch_id,
        "token": token,
        "events": 0,
        "dead": 0,
        "applied": 0,
        "duplicates": 0,
        "expired_updates": 0,
        "min_ems": None,
        "max_ems": None,
        "started_ms": started_ms,
        "done_ms": done_ms,
        "write_ms": None,
        "dead_by_reason": {},
    }
    for r in rows:
        if r["kind"] == "stats":
            rec["events"] += r["events"]
            w = r.get("write_ms")
            if w is not None:
                rec["write_ms"] = round(max(w, rec["write_ms"] or 0.0), 1)
            for key, pick in (("min_ems", min), ("max_ems", max)):
                v = r[key]
                if v is not None:
                    rec[key] = v if rec[key] is None else pick(rec[key], v)
            rec["applied"] += r["applied"]
            rec["duplicates"] += r["dups"]
            rec["expired_updates"] += r["expired"]
        elif r["kind"] == "dead":
            rec["dead"] += r["events"]
            rec["events"] += r["events"]
            by = rec["dead_by_reason"]
            by[r["reason"]] = by.get(r["reason"], 0) + r["events"]
    return rec


class Pipeline:
    def __init__(
        self,
        cfg: Config,
        redis: RedisHandle,
        spark: SparkSession,
        clock: Clock = SYSTEM_CLOCK,
        on_batch: Callable[[dict[str, Any]], None] | None = None,
        fault_drop_every: int = 0,
        write_delay_ms: float = 0.0,
    ) -> None:
        self.cfg = cfg
        self.redis = redis
        self.spark = spark
        self.clock = clock
        self.on_batch = on_batch
        self.fault_drop_every = fault_drop_every
        self.write_delay_ms = write_delay_ms
        self.query: StreamingQuery | None = None
        self._stop = threading.Event()
        types = check_expressions(spark, cfg)
        self.specs = tuple(metric_specs(cfg, types))
        self.ckpt = checkpoint_dir(cfg)
        self.epoch = writer_epoch(self.ckpt, redis.client)
        self._record = redis.client.register_script(script_source(RECORD_BATCH))
        self._folds = fold_columns(list(self.specs))
        self.store = StoreMonitor(
            redis.client, cfg.backpressure, tuple(cfg.source.shard_keys()), clock
        )
        self._flow_thread: threading.Thread | None = None
        self._flow_stop = threading.Event()

    def _source(self) -> DataFrame:
        opts = SourceOptions.from_config(self.cfg, self.redis.url)
        events = self.spark.readStream.format(FORMAT).options(**opts.to_spark()).load()
        return explode_updates(events, self.cfg, list(self.specs))

    def process_batch(self, exploded: DataFrame, batch_id: int) -> dict[str, Any]:
        """foreachBatch body: fold and write one micro-batch of exploded updates.

        Safe to re-run with the same batch id (idempotent writes, see pipeline.writer).
        """
        started = self.clock.now_ms()
        token = writer_token(self.epoch, batch_id)
        ctx = WriterContext(
            url=self.redis.url,
            token=token,
            specs=self.specs,
            source_stream=self.cfg.source.stream,
            dead_letter_maxlen=self.cfg.source.dead_letter_maxlen,
            fault_drop_every=self.fault_drop_every,
            write_delay_ms=self.write_delay_ms,
        )
        updates = fold_updates(exploded, self._folds)
        rows = [
            r.asDict()
            for r in updates.mapInArrow(
                functools.partial(write_partition, ctx), RESULT_DDL
            ).collect()
        ]
        rec = summarize(rows, batch_id, token, started, self.clock.now_ms())
        counters: list[Any] = [
            "batches", 1,
            "events_in", rec["events"],
            "events_aggregated", rec["events"] - rec["dead"],
            "dead_letters", rec["dead"],
            "updates_applied", rec["applied"],
            "updates_duplicate", rec["duplicates"],
            "updates_expired", rec["expired_updates"],
        ]  # fmt: skip
        for reason, n in rec["dead_by_reason"].items():
            counters += [f"dead_{reason}", n]
        self._record(keys=[STATS_KEY, BATCHES_KEY], args=[token, orjson.dumps(rec), *counters])
        if rec["events"]:
            log.info(
                "batch %d: %d events, %d dead, %d slice updates in %d ms",
                batch_id, rec["events"], rec["dead"], rec["applied"], rec["done_ms"] - started,
            )  # fmt: skip
        self._observe_store(rec["write_ms"])
        if self.on_batch is not None:
            self.on_batch(rec)
        return rec

    def _observe_store(self, write_ms: float | None) -> None:
        try:
            self.store.observe(write_ms)
        except Exception as e:  # noqa: BLE001 - flow control must never fail a batch
            log.warning("store monitor: %s", e)

    def _flow_loop(self) -> None:
        """Between batches the store is still watched, so quiet periods count (seed 000)."""
        tick_s = self.cfg.backpressure.tick / 1000
        while not self._flow_stop.wait(tick_s):
            last = self.store.last_observed_s
            if last is not None and time.monotonic() - last < tick_s:
                continue
            try:
                self.store.tick()
            except Exception as e:  # noqa: BLE001 - retried next tick
                log.debug("store monitor: %s", e)

    def _on_batch(self, exploded: DataFrame, batch_id: int) -> None:
        self.process_batch(exploded, batch_id)

    def start(self) -> StreamingQuery:
        """Start the streaming query (non-blocking)."""
        trigger_ms = self.cfg.spark.trigger
        self.query = (
            self._source()
            .writeStream.queryName("sluice")
            .foreachBatch(self._on_batch)
            .option("checkpointLocation", str(self.ckpt))
            .trigger(processingTime=f"{trigger_ms} milliseconds")
            .start()
        )
        if self._flow_thread is None or not self._flow_thread.is_alive():
            self._flow_stop.clear()
            self._flow_thread = threading.Thread(
                target=self._flow_loop, name="sluice-store-monitor", daemon=True
            )
            self._flow_thread.start()
        return self.query

    def request_stop(self) -> None:
        self._stop.set()

    def stop(self, grace_s: float = 15.0) -> None:
        """Stop after the batch in flight, waiting at most `grace_s`; the checkpoint makes any
        batch cut short re-run on the next start, so a hard stop loses nothing either."""
        self._stop.set()
        self._flow_stop.set()
        q = self.query
        if q is None:
            return
        deadline = time.monotonic() + grace_s
        while q.isActive and time.monotonic() < deadline:
            if not q.status.get("isTriggerActive", False):
                break
            time.sleep(0.05)
        if q.isActive:
            q.stop()
        self.query = None

    def wait_idle(self, timeout_s: float = 120.0) -> bool:
        """Block until the input backlog is 0 and no batch runs (for tests and benchmarks)."""
        from sluice.pipeline.status import backlog

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            q = self.query
            if q is not None and q.exception() is not None:
                raise PipelineError(f"streaming query failed: {q.exception()}")
            total, _ = backlog(self.redis.client, self.cfg)
            if total == 0 and q is not None and not q.status.get("isTriggerActive", False):
                # A second look: the last batch's commit (and trim) may still be in flight.
                time.sleep(0.2)
                total, _ = backlog(self.redis.client, self.cfg)
                if total == 0:
                    return True
            time.sleep(0.1)
        return False

    def run_forever(self, max_backoff_s: float = 60.0) -> None:
        """Run until request_stop(); restart a failed query with exponential backoff."""
        backoff = 1.0
        while not self._stop.is_set():
            if self.query is None:
                try:
                    self.start()
                except Exception as e:  # noqa: BLE001 - start errors are retried like failures
                    log.error("could not start the streaming query: %s", e)
                    self._sleep(backoff)
                    backoff = min(backoff * 2, max_backoff_s)
                    continue
            q = self.query
            assert q is not None
            if q.awaitTermination(1):
                err = q.exception()
                self.query = None
                if self._stop.is_set():
                    break
                log.error("streaming query stopped: %s; restarting in %.0fs", err, backoff)
                self._sleep(backoff)
                backoff = min(backoff * 2, max_backoff_s)
            else:
                p = q.lastProgress
                if p and p.get("numInputRows", 0) > 0:
                    backoff = 1.0
        self.stop()

    def _sleep(self, seconds: float) -> None:
        self._stop.wait(seconds)
