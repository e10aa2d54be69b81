"""The Spark streaming source over a log (`spark.readStream.format("sluice")`).

One reader class serves both logs (Redis Streams and Kafka, see `source.log`). A batch's offsets
are the log's end positions (see `source.log` for the JSON); Spark logs them before it runs the
batch, so a re-run after a crash reads exactly the same entries: entries are released (a Redis
stream trimmed, a Kafka group's offsets committed) only after the batch is committed; with
`SourceOptions.release` off, not by the source at all (a fold that writes behind releases a
batch once its write is done, `pipeline.behind`).

Admission control: `latestOffset(start, limit)` honours `ReadMaxRows(n)` with n counted in
*events* (a `jsonl` entry holds many), capped by the stage's controller (`Admission`).

A log that cannot be read (Kafka unreachable, its topic gone, a Redis loading its dataset) plans
no new data and is shown as waiting (`source.waiting`), with a backoff between plans (50 ms
doubling up to `WAIT_S`); the query keeps running and picks up when the log is back. Reads on
the executors wait likewise (`Log.read`'s `on_wait`).

Each read reports how long it spent reading and decoding (`note_read_ms`): the batch's longest
partition, kept per batch for its time breakdown (`pipeline.timing`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows

from sluice import collector
from sluice.clock import SYSTEM_CLOCK
from sluice.files import read_text, replace_text
from sluice.logs import setup_worker_logging
from sluice.redis.connection import client_for
from sluice.redis.keys import decode_times_key
from sluice.source.admission import Admission
from sluice.source.arm import wait_for_go
from sluice.source.decode import spark_schema_ddl
from sluice.source.log import LogUnavailable, Span
from sluice.source.logs import open_log
from sluice.source.options import SourceOptions
from sluice.source.waiting import LogState

FORMAT = "sluice"
START_FILE = "sluice-start-positions.json"
WAIT_S = 1.0  # how long a fresh query waits between tries for its log's start positions
FIRST_BACKOFF_S = 0.05  # the first pause after a plan that could not read the log (doubling)
JSONL_PART_ENTRIES = 500  # a jsonl entry carries many events: fewer entries per partition
READ_TIMES_TTL_S = 3600  # read times a driver never collected (it crashed) go with the key
log = logging.getLogger(__name__)
_note_clients: dict[str, Any] = {}  # per Python worker: one client per URL


def note_read_ms(url: str, stage: str, ref_ms: int, ms: float) -> None:
    """Record that a partition of the batch planned at `ref_ms` spent `ms` reading and
    decoding; the batch keeps its longest (a sorted set scored by time, `ZADD GT`). Executor
    side; never raises: a measurement only."""
    try:
        client = _note_clients.get(url)
        if client is None:
            client = _note_clients[url] = client_for(url, timeout_s=5, connect_timeout_s=5)
        key = decode_times_key(stage)
        pipe = client.pipeline(transaction=False)
        pipe.zadd(key, {str(ref_ms): round(ms, 1)}, gt=True)
        pipe.expire(key, READ_TIMES_TTL_S)
        pipe.execute()
    except Exception as e:  # noqa: BLE001 - a measurement only
        log.debug("read time not noted", extra={"error": str(e)})


class ShardRange(InputPartition):
    """The entries of a span of one shard. Plain values only: it is pickled to the executors."""

    def __init__(self, shard: str, lo: Any, hi: Any, ref_ms: int) -> None:
        super().__init__((shard, lo, hi, ref_ms))
        self.shard = shard
        self.lo = lo
        self.hi = hi
        self.ref_ms = ref_ms


class LogStreamReader(DataSourceStreamReader):
    def __init__(self, opts: SourceOptions) -> None:
        setup_worker_logging()  # built in the query's planner, a process Spark starts
        self.opts = opts
        self.log = open_log(opts)
        self.field = self.log.OFFSETS_FIELD
        self.admission = Admission(opts, self.log) if opts.flow is not None else None
        stage = opts.flow.stage if opts.flow is not None else "spark"
        self.state = LogState(opts.url, stage)
        self._released: dict[str, Any] | None = None
        self._backoff_s = FIRST_BACKOFF_S  # between plans while the log cannot be read
        self._lease_client: Any = None

    # -- driver side ------------------------------------------------------------------------

    def initialOffset(self) -> dict[str, Any]:
        return {self.field: self._start_positions(), "ref": 0}

    def _start_positions(self) -> dict[str, Any]:
        """Where a fresh checkpoint begins. Spark asks again when the first batch is re-run
        after a crash, and a Kafka topic's start moves, so the first answer is kept beside
        the checkpoint. Waits (shown as waiting) while the log cannot be read."""
        path = Path(self.opts.checkpoint) / START_FILE if self.opts.checkpoint else None
        kept = None if path is None else read_text(path)
        if kept is not None:
            positions: dict[str, Any] = json.loads(kept)
            return positions
        while True:
            try:
                positions = self.log.start_positions()
                break
            except LogUnavailable as e:
                self.state.waiting(e.reason, str(e))
                time.sleep(WAIT_S)
        self.state.ok()
        if path is not None:
            replace_text(path, json.dumps(positions))
        return positions

    def getDefaultReadLimit(self) -> ReadLimit:
        # Spark asks once, while it builds the query's plan and before it reads the checkpoint:
        # where an armed query waits for its takeover (`source.arm`).
        if self.opts.armed is not None:
            wait_for_go(self.opts.url, self.opts.armed)
            self.opts = dataclasses.replace(self.opts, armed=None)
        n = self.opts.max_events_per_batch
        return ReadAllAvailable() if n is None else ReadMaxRows(n)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        # Spark asks for the next batch only after the batch ending at `start` is in its commit
        # log (a batch re-run after a crash is re-planned from the offset log, not from here), so
        # everything up to `start` is done: release it, even when no new data arrives to trigger
        # `commit()`.
        if not self._leading():
            return start
        self._release(start)
        budget = getattr(limit, "max_rows", None) if isinstance(limit, ReadMaxRows) else None
        cap = self.admission.budget() if self.admission is not None else None
        if cap is not None:
            budget = cap if budget is None else min(int(budget), cap)
        held = start.get(self.field) or {}
        try:
            plan = self.log.plan(held, budget, SYSTEM_CLOCK.now_ms())
        except LogUnavailable as e:
            self.state.waiting(e.reason, str(e))
            if self.admission is not None:
                self.admission.admitted(0, False)
            # Spark asks again at once (its polling delay is 10 ms): back off, up to WAIT_S.
            time.sleep(self._backoff_s)
            self._backoff_s = min(WAIT_S, self._backoff_s * 2)
            return start
        self._backoff_s = FIRST_BACKOFF_S
        self.state.ok()
        if self.admission is not None:
            self.admission.admitted(plan.events, plan.more)
        if plan.end == held:
            return start
        out: dict[str, Any] = {self.field: plan.end, "ref": plan.ref_ms}
        if budget is not None:
            out["events"] = plan.events  # counted only under a budget (picks the batch's plan)
        if plan.entries is not None:
            out["entries"] = plan.entries  # sizes the partitions of this batch
        if plan.first:
            out["from"] = plan.first
        if plan.admitted:
            out["admitted"] = plan.admitted  # the audit's source side (Log.planned_source)
        return out

    def _leading(self) -> bool:
        """False while another process holds this query's lease (see SourceOptions.lease);
        True when there is no lease, or Redis cannot tell (the batch's own lease check, before
        its commit, still decides)."""
        if self.opts.lease is None:
            return True
        key, owner = self.opts.lease
        try:
            if self._lease_client is None:
                self._lease_client = client_for(self.opts.url, timeout_s=5, connect_timeout_s=5)
            holder = self._lease_client.hget(key, "owner")
        except Exception as e:  # noqa: BLE001 - cannot tell: the commit check decides
            log.debug("lease not read", extra={"error": str(e)})
            return True
        return holder is None or holder.decode() == owner

    def reportLatestOffset(self) -> dict[str, Any] | None:
        return None

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        parts: list[InputPartition] = []
        ref = int(end.get("ref", 0))
        per_part = JSONL_PART_ENTRIES if self.opts.format == "jsonl" else self.opts.partition_events
        for span in self.log.spans(start, end):
            n = (end.get("entries") or {}).get(span.shard)
            if n is None:
                n = self.log.count_entries(span)
            k = min(self.opts.max_partitions_per_shard, max(1, math.ceil(n / per_part)))
            parts.extend(ShardRange(s.shard, s.lo, s.hi, ref) for s in self.log.split(span, n, k))
        return parts

    def commit(self, end: dict[str, Any]) -> None:
        """Spark finished every batch up to `end`: the input before it may go."""
        self._release(end)

    def _release(self, end: dict[str, Any]) -> None:
        if end == self._released or not self.opts.release:
            return
        try:
            self.log.release(end.get(self.field) or {}, list(end.get("from") or {}))
        except LogUnavailable as e:
            self.state.waiting(e.reason, str(e))
            return
        self._released = end

    def stop(self) -> None:
        self.log.close()

    # -- executor side ----------------------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        collector.settle()
        shard, lo, hi, ref_ms = partition.value
        batches = iter(self.log.read(Span(shard, lo, hi), ref_ms, self.state.waiting))
        spent = 0.0  # in the log's reads and the decoder, not in Spark taking the batches
        while True:
            t0 = time.perf_counter()
            batch = next(batches, None)
            spent += time.perf_counter() - t0
            if batch is None:
                break
            yield batch
        if ref_ms:
            stage = self.opts.flow.stage if self.opts.flow is not None else "spark"
            note_read_ms(self.opts.url, stage, ref_ms, spent * 1000)


class LogDataSource(DataSource):
    """`spark.readStream.format("sluice").options(**SourceOptions(...).to_spark())`."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        return spark_schema_ddl(SourceOptions.from_spark(self.options))

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        return LogStreamReader(SourceOptions.from_spark(self.options))
