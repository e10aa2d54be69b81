"""The streaming job: source -> per-batch slice fold -> store, with graceful stop and restarts.

`Pipeline.start()` returns once the streaming query runs; batches are processed on Spark's
threads. `Pipeline.run_forever()` blocks until `request_stop()` (SIGINT/SIGTERM in `sluice run`),
restarting a failed query from its checkpoint with exponential backoff.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery

from sluice.clock import SYSTEM_CLOCK, Clock
from sluice.config import Config
from sluice.errors import AuditError, PipelineError
from sluice.flow.stages import SPARK, STORE, Stage, topology
from sluice.flow.valves import StoreMonitor
from sluice.pipeline import freshness
from sluice.pipeline.audit import AuditResult, Ledger, batch_offsets, source_xor, writer_xors
from sluice.pipeline.plan import (
    check_expressions,
    explode_updates,
    fold_columns,
    fold_updates,
    metric_specs,
)
from sluice.pipeline.writer import RESULT_DDL, WriterContext, write_partition, writer_token
from sluice.redis.cluster import is_cluster_url
from sluice.redis.connection import RedisHandle
from sluice.redis.keys import EPOCH_KEY, StatsKeys, stats_keys
from sluice.redis.scripts import RECORD_BATCH, script_source
from sluice.source.options import SourceOptions
from sluice.source.reader import FORMAT

log = logging.getLogger(__name__)


def checkpoint_dir(cfg: Config, stage: str = SPARK) -> Path:
    """The source's fold keeps the checkpoint of a pipeline without stages; every other stage
    has its own under `checkpoints/` (`fold:x` as `fold-x`: Hadoop paths refuse a colon)."""
    if stage == SPARK:
        return Path(cfg.state_dir) / "checkpoint"
    return Path(cfg.state_dir) / "checkpoints" / stage.replace(":", "-")


@dataclass(frozen=True)
class Role:
    """Where one streaming query sits in the graph: its flow stage (name, the stages it
    signals, its input shards), its reader name and the readers of each input shard, and the
    stage of the store it feeds (None for a stream-to-stream stage)."""

    stage: Stage
    reader: str = ""
    readers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    store: Stage | None = None

    @classmethod
    def single(cls, cfg: Config) -> Role:
        """A pipeline without stages: the source's one reader, folding into the store."""
        stages = topology(tuple(cfg.source.shard_keys()))
        return cls(stages[SPARK], store=stages[STORE])

    @property
    def stats(self) -> StatsKeys:
        return stats_keys(self.stage.name)

    def source_options(self, cfg: Config, base: SourceOptions) -> SourceOptions:
        """`base` with this role's reader and flow valve."""
        flow = {
            "backpressure": cfg.backpressure.model_dump(mode="json"),
            "trigger_ms": cfg.spark.trigger,
            "stage": [self.stage.name, list(self.stage.upstreams)],
            # A stream read by others too: its own backlog, not the stream's whole length.
            "reader": self.reader if any(len(r) > 1 for r in self.readers.values()) else None,
        }
        return dataclasses.replace(
            base, reader=self.reader, readers=self.readers, flow=json.dumps(flow)
        )


def query_name(stage: str) -> str:
    return "sluice" if stage == SPARK else f"sluice-{stage.replace(':', '-')}"


def stop_query(q: StreamingQuery | None, grace_s: float) -> None:
    """Stop `q` after the batch in flight, waiting at most `grace_s`; the checkpoint makes any
    batch cut short re-run on the next start, so a hard stop loses nothing either."""
    if q is None:
        return
    deadline = time.monotonic() + grace_s
    while q.isActive and time.monotonic() < deadline:
        if not q.status.get("isTriggerActive", False):
            break
        time.sleep(0.05)
    if q.isActive:
        q.stop()


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
        fault_lose_one: bool = False,
        role: Role | None = None,
    ) -> None:
        self.cfg = cfg
        self.redis = redis
        self.spark = spark
        self.clock = clock
        self.on_batch = on_batch
        self.fault_drop_every = fault_drop_every
        self.write_delay_ms = write_delay_ms
        self.fault_lose_one = fault_lose_one
        self.role = role or Role.single(cfg)
        self.name = self.role.stage.name
        self.query: StreamingQuery | None = None
        self._stop = threading.Event()
        types = check_expressions(spark, cfg)
        self.specs = tuple(metric_specs(cfg, types))
        self.ckpt = checkpoint_dir(cfg, self.name)
        self.epoch = writer_epoch(self.ckpt, redis.client)
        self._record = redis.client.register_script(script_source(RECORD_BATCH))
        self._folds = fold_columns(list(self.specs), cfg.audit.enabled)
        self.ledger = Ledger(redis.client, cfg.source.stream, cfg.audit.ledger_shards)
        self.store = StoreMonitor(
            redis.client, cfg.backpressure, tuple(cfg.source.shard_keys()), clock, self.role.store
        )
        self._flow_thread: threading.Thread | None = None
        self._flow_stop = threading.Event()

    def _source(self) -> DataFrame:
        base = SourceOptions.from_config(self.cfg, self.redis.url)
        opts = self.role.source_options(self.cfg, base)
        events = self.spark.readStream.format(FORMAT).options(**opts.to_spark()).load()
        return explode_updates(events, self.cfg, list(self.specs))

    def process_batch(self, exploded: DataFrame, batch_id: int) -> dict[str, Any]:
        """foreachBatch body: fold and write one micro-batch of exploded updates, then audit it.

        Safe to re-run with the same batch id (idempotent writes, see pipeline.writer). A batch
        that fails the audit is written again in place; after `audit.retries` replays it raises
        AuditError, so Spark neither commits nor trims it and replays it after the restart.
        """
        started = self.clock.now_ms()
        token = writer_token(self.epoch, batch_id)
        ctx = WriterContext(
            url=self.redis.url,
            token=token,
            specs=self.specs,
            source_stream=self.cfg.source.stream,
            dead_letter_maxlen=self.cfg.source.dead_letter_maxlen,
            cluster=is_cluster_url(self.redis.url),
            fault_drop_every=self.fault_drop_every,
            write_delay_ms=self.write_delay_ms,
        )
        source = self._audit_source(batch_id)
        attempts = 1 + self.cfg.audit.retries
        for attempt in range(1, attempts + 1):
            run_ctx = self._fault_context(ctx)
            updates = fold_updates(exploded, self._folds)
            rows = [
                r.asDict()
                for r in updates.mapInArrow(
                    functools.partial(write_partition, run_ctx), RESULT_DDL
                ).collect()
            ]
            if run_ctx.fault_lose_one and self.redis.client.exists(run_ctx.fault_lose_one):
                self.fault_lose_one = False  # done: one update was lost, once
            audit = self._audit(batch_id, attempt, source, rows)
            if audit is None or audit.ok:
                break
            log.warning(
                "audit did not balance; writing the batch again",
                extra={"batch": batch_id, "residual": f"{audit.residual:#018x}",
                       "attempt": attempt, "attempts": attempts},
            )  # fmt: skip
        else:
            assert audit is not None
            raise AuditError(batch_id, audit.residual, attempts)
        rec = summarize(rows, batch_id, token, started, self.clock.now_ms())
        if audit is not None:
            rec["audit"] = {
                "ok": True,
                "attempts": attempt,
                "events_admitted": audit.events,
                "audit_ms": round(audit.audit_ms, 1),
            }
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
        if audit is not None:
            counters += ["events_admitted", audit.events, "audit_replays", attempt - 1,
                         "audit_ok", 1]  # fmt: skip
        wait_ms = freshness.observation(rec)
        if wait_ms is not None:
            counters += ["|", *freshness.increments(wait_ms)]
        self._record(keys=list(self.role.stats), args=[token, orjson.dumps(rec), *counters])
        if rec["events"]:
            log.debug(
                "batch written",
                extra={
                    "batch": batch_id, "events": rec["events"], "dead": rec["dead"],
                    "updates": rec["applied"], "duration_ms": rec["done_ms"] - started,
                    "attempts": attempt,
                },
            )  # fmt: skip
        self._observe_store(rec["write_ms"])
        if self.on_batch is not None:
            self.on_batch(rec)
        return rec

    def _fault_context(self, ctx: WriterContext) -> WriterContext:
        """The test hook `fault_lose_one`: the next attempt loses one slice update."""
        if not self.fault_lose_one:
            return ctx
        import dataclasses
        import uuid

        return dataclasses.replace(ctx, fault_lose_one=f"sluice:fault:{{{uuid.uuid4().hex}}}")

    def _audit_source(self, batch_id: int) -> tuple[int, int, int, float] | None:
        """The source side of the audit: (xor, events, entries, ms), or None when it is off."""
        if not self.cfg.audit.enabled:
            return None
        t0 = time.perf_counter()
        try:
            start, end = batch_offsets(self.ckpt, batch_id)
        except FileNotFoundError:
            # Only a batch handed in directly (not by the streaming query) has no offset log.
            log.warning("batch not audited: no offset log entry", extra={"batch": batch_id})
            return None
        x, events, entries = source_xor(
            self.redis.client, start, end, self.cfg.source.format,
            self.cfg.source.max_entry_bytes,
        )  # fmt: skip
        return x, events, entries, (time.perf_counter() - t0) * 1000

    def _audit(
        self,
        batch_id: int,
        attempt: int,
        source: tuple[int, int, int, float] | None,
        rows: list[dict[str, Any]],
    ) -> AuditResult | None:
        if source is None:
            return None
        fan, applied = writer_xors(rows)
        x, events, entries, ms = source
        result = AuditResult(batch_id, attempt, x, fan, applied, events, entries, ms)
        self.ledger.record(result)
        return result

    def _observe_store(self, write_ms: float | None) -> None:
        try:
            self.store.observe(write_ms)
        except Exception as e:  # noqa: BLE001 - flow control must never fail a batch
            log.warning("store monitor failed", extra={"error": str(e)})

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
                log.debug("store monitor failed", extra={"error": str(e)})

    def _on_batch(self, exploded: DataFrame, batch_id: int) -> None:
        self.process_batch(exploded, batch_id)

    def start(self) -> StreamingQuery:
        """Start the streaming query (non-blocking)."""
        trigger_ms = self.cfg.spark.trigger
        self.query = (
            self._source()
            .writeStream.queryName(query_name(self.name))
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
        stop_query(self.query, grace_s)
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

    def run_forever(self, max_backoff_s: float = 15.0) -> None:
        """Run until request_stop(), restarting a failed query (see `pipeline.supervisor`)."""
        from sluice.pipeline.supervisor import Supervisor

        Supervisor([self], self.redis.client, self.clock, self._stop).run_forever(max_backoff_s)
