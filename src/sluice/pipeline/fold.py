"""A fold: the streaming query that folds one stream's events into slices in the store.

Per micro-batch: the exploded updates (`pipeline.plan`) are folded by (group, key, slice),
written by the executors (`pipeline.writer`, idempotent per writer token), and audited
(`pipeline.audit`): the events the batch admitted, read again from the log itself, against the
updates the plan fanned out and those the store acknowledged. The audit's source side runs in a
thread beside the Spark job (it needs only the batch's logged offsets), so the batch waits for
it only when it is the slower of the two; the batch still commits only once it balanced. A
batch that does not balance is written again in place; after `audit.retries` replays it raises
AuditError, so Spark neither commits nor releases it and replays it after the restart.

A small batch (at most `spark.single_task_events` events admitted, as its offsets say; `auto`
scales it by the metric groups, `plan.single_task_events`) is coalesced to one partition first:
Spark then folds and writes it in the task that reads it, with no shuffle and no second stage,
which is most of a small batch's fixed cost. The fold is the same; only where it runs changes.

Write-behind (`spark.write_behind`, `pipeline.behind`): a larger batch's folded updates are
collected to the driver and written there by a writer thread while Spark commits the batch and
folds the next one; the fold then releases the batch's input itself, once it is written.

The store's write time feeds its monitor (the `store` flow stage), after every batch and, from
a thread, between batches, so quiet periods count (seed 000).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession

from sluice import collector
from sluice.clock import SYSTEM_CLOCK, Clock
from sluice.config import Config
from sluice.errors import AuditError, PipelineError
from sluice.flow.valves import StoreMonitor
from sluice.pipeline.audit import SourceSide, batch_offsets, source_side, writer_xors
from sluice.pipeline.behind import (
    WriteBehind,
    describe,
    read_mark,
    replay_unwritten,
    write_behind,
    write_mark,
)
from sluice.pipeline.plan import (
    PartialAggregation,
    check_expressions,
    explode_updates,
    fold_columns,
    fold_updates,
    single_task_events,
)
from sluice.pipeline.plan import metric_specs as make_specs
from sluice.pipeline.query import Role, StreamQuery, query_name, record_folding
from sluice.pipeline.writer import RESULT_DDL, WriterContext, summarize, write_partition
from sluice.redis import marks
from sluice.redis.cluster import is_cluster_url
from sluice.redis.connection import RedisHandle
from sluice.source.log import Log
from sluice.source.logs import open_log
from sluice.source.options import SourceOptions
from sluice.source.warm import ROWS_OPTION, WARM_FORMAT
from sluice.status.ledger import AuditResult, Ledger

log = logging.getLogger(__name__)

Writer = Callable[[WriterContext, Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]
Offsets = tuple[dict[str, Any], dict[str, Any]]
WARM_UP_EVENTS = 64
WARM_UP_TIMEOUT_S = 120


def _sample(kind: str, i: int, now_ms: int) -> Any:
    """A warm-up value of type `kind` (a long is `now_ms`: a time field must be in retention)."""
    samples = {"long": now_ms, "int": i, "double": 1.0 + i, "float": 1.0 + i, "boolean": True}
    return samples.get(kind, f"warm-up-{i % 8}")


def warm_partition(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """mapInArrow body of the warm-up batch (`FoldQuery.warm_up`): takes its input as a write
    would, in a Python worker that has imported what a write imports, and writes nothing.
    The worker settles its objects here (`collector.settle`), before the first real batch."""
    collector.settle()
    for _ in batches:
        pass
    yield from ()


class FoldQuery(StreamQuery):
    """The fold of one stream (the source's, named `spark`, or a stage output's `fold:<s>`).

    `writer` is the executor-side partition writer; tests and benchmarks install a wrapper of
    `write_partition` to inject store faults (see `sluice.testing.faults`).
    """

    def __init__(
        self,
        cfg: Config,
        redis: RedisHandle,
        spark: SparkSession,
        clock: Clock = SYSTEM_CLOCK,
        on_batch: Callable[[dict[str, Any]], None] | None = None,
        role: Role | None = None,
    ) -> None:
        super().__init__(cfg, redis, spark, role or Role.single(cfg), clock)
        self.on_batch = on_batch
        self.writer: Writer = write_partition
        self.specs: tuple[Any, ...] = ()
        self.ledger = Ledger(redis.client, cfg.source.stream, cfg.audit.ledger_shards)
        self.log: Log = open_log(self.base_options(), redis.client)
        assert self.role.store is not None, "a fold feeds a store"
        self.store = StoreMonitor(redis.client, cfg.backpressure, self.role.store, clock)
        self._folds: list[Any] = []
        self._single_task = 0  # spark.single_task_events in events, once the plan is known
        self.partial = PartialAggregation(cfg.spark.partial_aggregation)
        # The audit's source side reads the log again while Spark folds and writes the batch.
        self._auditor = ThreadPoolExecutor(1, thread_name_prefix="sluice-audit")
        self._flow_thread: threading.Thread | None = None
        self._flow_stop = threading.Event()
        # Write-behind (`pipeline.behind`): the fold, not the source, then releases the input.
        self.behind = WriteBehind(self.name) if write_behind(cfg, spark) else None
        self._releaser: Log | None = None
        self._written: int | None = None  # write-behind: the newest batch written at start

    def base_options(self) -> SourceOptions:
        return SourceOptions.from_config(self.cfg, self.redis.url)

    def source_options(self) -> SourceOptions:
        opts = super().source_options()
        return dataclasses.replace(opts, release=False) if self.behind is not None else opts

    def prepare(self) -> None:
        if not self.specs:
            types = check_expressions(self.spark, self.cfg)
            self.specs = tuple(make_specs(self.cfg, types))
            self._folds = fold_columns(list(self.specs), self.cfg.audit.enabled)
            self._single_task = single_task_events(
                self.cfg.spark.single_task_events, list(self.specs)
            )
        super().prepare()

    def frame(self) -> DataFrame:
        return explode_updates(self.read_stream(), self.cfg, list(self.specs))

    def warm_up(self) -> None:
        """Run the batch plan (explode, fold, a Python writer stage that writes nothing) as a
        streaming query over one batch of made-up events (`source.warm`), to a throwaway
        checkpoint: Spark loads its streaming classes, starts and fills its Python workers and
        daemons, and generates the plan's code before a real batch needs them."""
        super().warm_up()
        opts = self.base_options()
        now = self.clock.now_ms()
        meta = {"_ts": now, "_ems": now, "_ref": now, "_idx": 0}
        rows = []
        for i in range(WARM_UP_EVENTS):
            values = {n: _sample(t, i, now) for n, t, _ in opts.fields}
            err = "bad_type" if i == 0 else None  # one dead letter: its branch runs too
            rows.append({**values, **meta, "_e": i, "_err": err})
        options = opts.to_spark() | {ROWS_OPTION: orjson.dumps(rows).decode()}
        stream = self.spark.readStream.format(WARM_FORMAT).options(**options).load()
        folds = self._folds

        def body(df: DataFrame, batch_id: int) -> None:
            for frame in (df, df.coalesce(1)):  # a large batch's plan and a small one's
                fold_updates(frame, folds).mapInArrow(warm_partition, RESULT_DDL).collect()

        ckpt = Path(self.cfg.state_dir) / "warm-up" / self.ckpt.name
        shutil.rmtree(ckpt, ignore_errors=True)
        query = (
            explode_updates(stream, self.cfg, list(self.specs))
            .writeStream.queryName(f"{query_name(self.name)}-warm-up")
            .foreachBatch(body)
            .option("checkpointLocation", str(ckpt))
            .trigger(availableNow=True)
            .start()
        )
        try:
            if not query.awaitTermination(WARM_UP_TIMEOUT_S):
                raise PipelineError(f"the warm-up batch took over {WARM_UP_TIMEOUT_S} s")
            if query.exception() is not None:
                raise PipelineError(f"the warm-up batch failed: {query.exception()}")
        finally:
            query.stop()
            shutil.rmtree(ckpt, ignore_errors=True)

    def process_batch(self, exploded: DataFrame, batch_id: int) -> dict[str, Any]:
        """Fold and write one micro-batch of exploded updates, then audit it (see the module
        docstring). Safe to re-run with the same batch id. Under write-behind, a large batch
        returns once its folded updates are on the driver and its write has begun; the record
        it returns then says only `behind` (the batch record comes when the write is done)."""
        self.prepare()
        started = self.clock.now_ms()
        token = self.token(batch_id)
        offsets = self._offsets(batch_id)
        if offsets is not None and self._written is not None and batch_id <= self._written:
            log.info("batch written, its commit lost: skipped", extra={"batch": batch_id})
            return {"batch": batch_id, "token": token, "written": True}
        audit_source = self._auditor.submit(self._audit_source, batch_id, offsets)
        ctx = WriterContext(
            url=self.redis.url,
            token=token,
            specs=self.specs,
            source_stream=self.cfg.source.stream,
            dead_letter_maxlen=self.cfg.source.dead_letter_maxlen,
            recorded_shards=self.role.recorded_shards,
            cluster=is_cluster_url(self.redis.url),
            ref_ms=(offsets[1].get("ref") or started) if offsets is not None else started,
        )
        events = offsets[1].get("events") if offsets is not None else None
        small = events is not None and events <= self._single_task
        if small:
            exploded = exploded.coalesce(1)  # one task, no shuffle (module docstring)
        self.partial.apply(exploded.sparkSession, self.ckpt, batch_id)  # plan.PartialAggregation
        done = functools.partial(self._finish, batch_id, token, started, offsets, audit_source)
        if self.behind is not None and offsets is not None and not small:
            t0 = time.perf_counter()
            table = fold_updates(exploded, self._folds).toArrow()
            t1 = time.perf_counter()
            self.behind.wait()  # the previous batch: written, audited, recorded (or raises)
            wait_ms = (time.perf_counter() - t1) * 1000
            self.timings.add(batch_id, job=(t1 - t0) * 1000, wait=wait_ms)

            def on_driver() -> list[dict[str, Any]]:
                out = self.writer(ctx, iter(table.to_batches()))
                return [r for b in out for r in b.to_pylist()]

            self.timings.hold(batch_id)
            self.behind.submit(lambda: done(on_driver, wait_ms))
            return {"batch": batch_id, "token": token, "behind": True}
        if self.behind is not None:
            self.behind.wait()  # batches reach the store in order

        def in_spark() -> list[dict[str, Any]]:
            t0 = time.perf_counter()
            updates = fold_updates(exploded, self._folds)
            written = updates.mapInArrow(functools.partial(self.writer, ctx), RESULT_DDL)
            t_job = time.perf_counter()
            rows = [r.asDict() for r in written.collect()]
            self.timings.add(batch_id, analyze=(t_job - t0) * 1000,
                             job=(time.perf_counter() - t_job) * 1000)  # fmt: skip
            return rows

        return done(in_spark, None)

    def _finish(
        self,
        batch_id: int,
        token: int,
        started: int,
        offsets: Offsets | None,
        audit_source: Future[SourceSide | None],
        write: Callable[[], list[dict[str, Any]]],
        wait_ms: float | None,
    ) -> dict[str, Any]:
        """Write the batch (`write` returns the writer's rows), audit it, writing it again in
        place while it does not balance, and record it; then mark it written and, when the fold
        releases its own input (write-behind), release it. `wait_ms`: for a batch written
        behind, how long it waited for the previous batch's write; None for one its job wrote."""
        attempts = 1 + self.cfg.audit.retries
        audit: AuditResult | None = None
        for attempt in range(1, attempts + 1):
            rows = write()
            t1 = time.perf_counter()
            audit = self._audit(batch_id, attempt, audit_source, rows)
            self.timings.add(batch_id, audit=(time.perf_counter() - t1) * 1000)
            if audit is None or audit.ok:
                break
            read = sum(r["events"] for r in rows if r["kind"] == "stats")  # a short read?
            log.warning(
                "audit did not balance; writing the batch again",
                extra={"batch": batch_id, "attempt": attempt, "attempts": attempts,
                       "events_read": read, **audit.sides()},
            )  # fmt: skip
            if attempt < attempts:  # and the source side read from the log again
                audit_source = self._auditor.submit(self._audit_source, batch_id, offsets, True)
        else:
            assert audit is not None
            raise AuditError(batch_id, audit.residual, attempts)
        marks.clear(self.redis.client, token)  # what failed attempts' tasks left (redis.marks)
        t_done = time.perf_counter()
        rec = summarize(rows, batch_id, token, started, self.clock.now_ms())
        self.partial.observe(rec["fold_rows"], rec["fold_cells"])
        if wait_ms is not None:  # written behind
            rec |= {"behind": True, "wait_ms": round(wait_ms, 1)}
        counters: list[Any] = [
            "batches", 1,
            "events_in", rec["events"],
            "events_aggregated", rec["events"] - rec["dead"],
            "dead_letters", rec["dead"],
            "updates_applied", rec["updates_applied"],
            "updates_duplicate", rec["updates_duplicate"],
            "updates_expired", rec["updates_expired"],
            "updates_before_seam", rec["updates_before_seam"],
        ]  # fmt: skip
        if audit is not None:
            rec["audit"] = {
                "ok": True,
                "attempts": attempt,
                "events_admitted": audit.events,
                "audit_ms": round(audit.audit_ms, 1),
            }
            counters += ["events_admitted", audit.events, "audit_replays", attempt - 1,
                         "audit_ok", 1]  # fmt: skip
            if audit.removed:
                rec["audit"]["events_removed"] = audit.removed
                counters += ["events_removed", audit.removed]
                log.warning("events left the log after the batch was planned, before it read"
                            " them (an XDEL, or a Redis failover that lost acknowledged writes)",
                            extra={"batch": batch_id, "events_removed": audit.removed,
                                   "events_admitted": audit.events})  # fmt: skip
        if self.lease is not None and offsets is not None:  # a deposed leader records, marks
            self.lease.check(self.name)  # (the shared checkpoint's) and trims nothing
        self.record(rec, counters)
        if offsets is not None:
            write_mark(self.ckpt, batch_id)
            if self.behind is not None:
                self._release(offsets[1])
        if rec["events"]:
            log.debug("batch written", extra={
                "batch": batch_id, "events": rec["events"], "dead": rec["dead"],
                "updates": rec["updates_applied"], "duration_ms": rec["done_ms"] - started,
                "attempts": attempt})  # fmt: skip
        self._observe_store(rec["write_ms"], rec["write_updates"])
        in_job = wait_ms is None
        self._time_batch(batch_id, offsets, rec, (time.perf_counter() - t_done) * 1000, in_job)
        if not in_job:
            self.timings.done(batch_id)
        if self.on_batch is not None:
            self.on_batch(rec)
        return rec

    def _time_batch(
        self,
        batch_id: int,
        offsets: Offsets | None,
        rec: dict[str, Any],
        record_ms: float,
        in_job: bool,
    ) -> None:
        """Split the batch's Spark job into decode, write (when the job wrote) and the rest
        (`pipeline.timing`)."""
        ref = offsets[1].get("ref") if offsets is not None else None
        decode = self.timings.decode_ms(None if ref is None else int(ref))
        write = rec["write_ms"]
        job = self.timings.take(batch_id, "job")
        written = (write or 0.0) if in_job else 0.0
        fold = None if job is None else max(0.0, job - (decode or 0.0) - written)
        self.timings.add(batch_id, decode=decode, write=write, fold=fold, record=record_ms)

    # -- the audit ----------------------------------------------------------------------------

    def _offsets(self, batch_id: int) -> Offsets | None:
        """The batch's (start, end) offsets from Spark's offset log; None for a batch handed in
        directly (not by the streaming query), which has no entry there."""
        try:
            return batch_offsets(self.ckpt, batch_id)
        except FileNotFoundError:
            return None

    def _audit_source(
        self, batch_id: int, offsets: Offsets | None, reread: bool = False
    ) -> SourceSide | None:
        """The audit's source side (`audit.source_side`), or None when it is off. Runs in the
        audit thread, beside the batch's Spark job."""
        if not self.cfg.audit.enabled:
            return None
        if offsets is None:
            log.warning("batch not audited: no offset log entry", extra={"batch": batch_id})
            return None
        return source_side(self.log, offsets, reread)

    def _audit(self, batch_id: int, attempt: int, pending: Future[SourceSide | None],
               rows: list[dict[str, Any]]) -> AuditResult | None:  # fmt: skip
        source = pending.result()
        if source is None:
            return None
        fan, applied = writer_xors(rows)
        a, ms, removed = source
        result = AuditResult(batch_id, attempt, a.xor, fan, applied, a.events, a.entries, ms,
                             removed)  # fmt: skip
        if not result.ok and self.lease is not None:  # a deposed leader whose input the new
            self.lease.check(self.name)  # one trimmed: its failure is no one's (LeaseLost)
        self.ledger.record(result)
        return result

    # -- the store's flow stage ---------------------------------------------------------------

    def _observe_store(self, write_ms: float | None, updates: int) -> None:
        """The slowest partition's write time, and per slice update it wrote (`flow.levels`)."""
        per_update = 1000 * write_ms / updates if write_ms is not None and updates else None
        try:
            self.store.observe(write_ms, per_update, updates)
        except Exception as e:  # noqa: BLE001 - flow control must never fail a batch
            log.warning("store monitor failed", extra={"error": str(e)})

    def _check_behind(self) -> None:
        """A write-behind failure with no batch after it to raise it: stop the query, so that
        the supervisor restarts it and the batch is replayed (`pipeline.behind`)."""
        err = self.behind.failed() if self.behind is not None else None
        q = self.query
        if err is None or q is None or not q.isActive:
            return
        log.error("a batch's write failed behind the query; stopping it to replay the batch",
                  extra={"error": describe(err)})  # fmt: skip
        with contextlib.suppress(Exception):
            q.stop()

    def _flow_loop(self) -> None:
        """Between batches the store is still watched, so quiet periods count (seed 000)."""
        tick_s = self.cfg.backpressure.tick / 1000
        while not self._flow_stop.wait(tick_s):
            self._check_behind()
            last = self.store.last_observed_s
            if last is not None and time.monotonic() - last < tick_s:
                continue
            try:
                self.store.tick()
            except Exception as e:  # noqa: BLE001 - retried next tick
                log.debug("store monitor failed", extra={"error": str(e)})

    def _release(self, end: dict[str, Any]) -> None:
        """Release a written batch's input (write-behind: the source does not)."""
        if self._releaser is None:
            self._releaser = open_log(self.source_options(), self.redis.client)
        self._releaser.release(end.get(self._releaser.OFFSETS_FIELD) or {}, [*end.get("from", {})])

    def _settle(self) -> None:
        """Finish the write in flight; a failure is logged (the restart replays the batch)."""
        if self.behind is None:
            return
        err = self.behind.settle()
        if err is not None:
            log.error("the last batch's write failed; it runs again on the next start",
                      extra={"error": describe(err)})  # fmt: skip

    def start(self) -> Any:
        self._settle()
        replay_unwritten(self.ckpt)  # before the lease's `begin` reads the offset log
        mark = read_mark(self.ckpt)
        # Written and released (write-behind): skipped if Spark lost its commit and reruns it.
        self._written = mark if self.behind is not None else None
        if self.behind is not None and mark is not None and mark >= 0:
            with contextlib.suppress(FileNotFoundError):  # a crash between mark and release
                self._release(batch_offsets(self.ckpt, mark)[1])
        query = super().start()
        record_folding(self.redis.client, [sp.name for sp in self.specs], self.clock.now_ms())
        if self._flow_thread is None or not self._flow_thread.is_alive():
            self._flow_stop.clear()
            self._flow_thread = threading.Thread(
                target=self._flow_loop, name="sluice-store-monitor", daemon=True
            )
            self._flow_thread.start()
        return query

    def stop(self, grace_s: float = 15.0) -> None:
        self._flow_stop.set()
        super().stop(grace_s)
        self._settle()
        if self._releaser is not None:  # after the last release: its commit thread and clients
            self._releaser.close()

    # -- for tests and benchmarks -------------------------------------------------------------

    def wait_idle(self, timeout_s: float = 120.0) -> bool:
        """Block until the input backlog is 0 and no batch runs."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            q = self.query
            if q is not None and q.exception() is not None:
                raise PipelineError(f"streaming query failed: {q.exception()}")
            if (
                self.log.level().entries == 0
                and q is not None
                and not q.status.get("isTriggerActive", False)
                and (self.behind is None or self.behind.idle)
            ):
                # A second look: the last batch's commit (and release) may still be in flight.
                time.sleep(0.2)
                if self.log.level().entries == 0:
                    return True
            time.sleep(0.1)
        return False

    def run_forever(self, max_backoff_s: float = 15.0) -> None:
        """Run until request_stop(), restarting a failed query (see `pipeline.supervisor`)."""
        from sluice.pipeline.supervisor import Supervisor

        Supervisor([self], self.redis.client, self.clock, self._stop).run_forever(max_backoff_s)
