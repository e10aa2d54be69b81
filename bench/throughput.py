"""Sluice throughput and freshness benchmark, for both source formats (`jsonl`, `fields`).

    .venv/bin/python bench/throughput.py            # full run, about 15 minutes
    .venv/bin/python bench/throughput.py --quick    # smoke run, about 2 minutes

Per format, with 3 metrics (txn_count, amount_sum, card_max), 2 shards, 10 s slices, 1 h
retention, the default Spark settings (local[2], 500 ms trigger), embedded Redis in a fresh
temporary state_dir per run:

1. drain: pre-fill N events, start the pipeline, wait until idle; events/s from the batch
   records, warm-up batch excluded.
2. sustained: produce at a fixed rate beside the running pipeline; a step is bounded when the
   backlog does not trend up (see `_util.judge_backlog`). Rates are a ladder around the drain rate.
3. freshness: at about half the sustained rate, probe events (card `probe-<i>`) every 100 ms; a
   poller queries `txn_count` until each probe counts 1. Latency = visible - sent.
4. bare engine: the same Spark plan (explode_updates + fold_updates, no-op write) fed from an
   in-memory Arrow streaming source instead of Redis, at the same batch size.

Results go to the `## Throughput and freshness (bench/throughput.py)` section of
docs/benchmarks.md, a plot to docs/throughput.png, a summary to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import math
import os
import shlex
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

from _util import (
    BatchRate,
    Deadline,
    LoadPool,
    PacedProducer,
    StepVerdict,
    batch_rate,
    bench_config,
    build_pool,
    judge_step,
    log,
    machine_note,
    percentile,
    prefill,
    probe_fields,
    replace_section,
    xrange_entries,
)
from sluice.config import Config
from sluice.pipeline.job import Pipeline
from sluice.pipeline.plan import (
    check_expressions,
    explode_updates,
    fold_columns,
    fold_updates,
    metric_specs,
)
from sluice.pipeline.spark import build_spark
from sluice.pipeline.status import backlog, recent_batches
from sluice.query.engine import QueryEngine
from sluice.redis.connection import RedisHandle, client_for, open_redis
from sluice.redis.keys import STATS_KEY
from sluice.source.decode import Decoder, output_schema, spark_schema_ddl
from sluice.source.options import SourceOptions

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## Throughput and freshness (bench/throughput.py)"
ARROW_FORMAT = "sluice-bench-arrow"
BARE_PARTITIONS = 4
BARE_CHUNKS_PER_PARTITION = 4
SAMPLE_EVERY_S = 0.5
MAX_LAG_S = 15.0  # a step whose final backlog exceeds this much input is not bounded
ABORT_LAG_S = 25.0  # ... and one whose backlog passes this is cut short
PROBE_EVERY_S = 0.1
POLL_EVERY_S = 0.025
PROBE_WINDOW = "5m"
BATCH_HISTORY = 600  # the store keeps this many batch records


# -- plan -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FormatPlan:
    fmt: str
    batch_events: int  # source.max_events_per_batch
    drain_events: int  # events pre-filled for the drain run
    pool_events: int  # distinct pre-generated events, cycled


@dataclass(frozen=True)
class Plan:
    quick: bool
    formats: tuple[FormatPlan, ...]
    step_s: float  # one sustained-rate step
    max_steps: int
    freshness_s: float
    bare_batches: int
    drain_timeout_s: float
    bare_reserve_s: float  # time kept back for the bare-engine run
    budget_s: float
    seed: int


QUICK_SIZES = {
    "jsonl": FormatPlan("jsonl", batch_events=100_000, drain_events=400_000, pool_events=100_000),
    "fields": FormatPlan("fields", batch_events=20_000, drain_events=80_000, pool_events=40_000),
}
FULL_SIZES = {
    "jsonl": FormatPlan(
        "jsonl", batch_events=1_000_000, drain_events=3_000_000, pool_events=200_000
    ),
    "fields": FormatPlan(
        "fields", batch_events=200_000, drain_events=1_000_000, pool_events=100_000
    ),
}


def make_plan(quick: bool, formats: Sequence[str], budget_s: float | None, seed: int) -> Plan:
    """Sizes and durations: quick is a ~2 minute smoke run, full fits in about 15 minutes."""
    sizes = QUICK_SIZES if quick else FULL_SIZES
    return Plan(
        quick=quick,
        formats=tuple(sizes[f] for f in formats),
        step_s=10.0 if quick else 30.0,
        max_steps=2 if quick else 4,
        freshness_s=8.0 if quick else 30.0,
        bare_batches=5 if quick else 6,
        drain_timeout_s=120.0 if quick else 300.0,
        bare_reserve_s=25.0 if quick else 60.0,
        budget_s=budget_s or (240.0 if quick else 900.0),
        seed=seed,
    )


# -- results --------------------------------------------------------------------------------------


@dataclass
class DrainResult:
    prefilled_events: int
    shard_share: tuple[float, ...]  # fraction of the events on each shard
    prefill_s: float
    idle: bool
    events_in: int
    dead_letters: int
    records: list[dict[str, Any]]
    rate: BatchRate | None


@dataclass
class StepResult:
    target_per_s: float
    achieved_per_s: float
    processed_per_s: float
    verdict: StepVerdict
    t_start_s: float  # relative to the phase start
    t_end_s: float
    drained: bool
    drain_s: float


@dataclass
class FreshnessResult:
    target_per_s: float
    achieved_per_s: float
    sent: int
    latencies_ms: list[float]
    wrong_counts: dict[str, Any]
    t_start_s: float
    t_end_s: float


@dataclass
class SustainedResult:
    steps: list[StepResult] = field(default_factory=list)
    samples: list[tuple[float, int]] = field(default_factory=list)  # (t_s, backlog events)
    records: list[dict[str, Any]] = field(default_factory=list)
    t0_ms: int = 0
    freshness: FreshnessResult | None = None

    def best(self) -> StepResult | None:
        ok = [s for s in self.steps if s.verdict.bounded]
        return max(ok, key=lambda s: s.achieved_per_s) if ok else None


@dataclass
class BareResult:
    batch_events: int
    records: list[dict[str, Any]]
    rate: BatchRate | None
    checked_events: int | None  # good events counted by the plan in the warm-up batch


@dataclass
class FormatResult:
    plan: FormatPlan
    drain: DrainResult | None = None
    sustained: SustainedResult | None = None
    bare: BareResult | None = None


# -- shared plumbing ------------------------------------------------------------------------------


class Workspace:
    """Fresh temporary state dirs under one root, removed by `cleanup()` unless kept."""

    def __init__(self, keep: bool) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="sluice-bench-"))
        self.keep = keep
        self._n = 0

    def state_dir(self, label: str) -> Path:
        self._n += 1
        path = self.root / f"{self._n:02d}-{label}"
        path.mkdir()
        return path

    def cleanup(self) -> None:
        if self.keep:
            log(f"state kept under {self.root}")
        else:
            shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def pipeline_run(spark: SparkSession, cfg: Config) -> Iterator[tuple[Pipeline, RedisHandle]]:
    """An embedded Redis under cfg.state_dir and a (not yet started) Pipeline; both stopped on
    exit, also on errors."""
    handle = open_redis(None, cfg.state_dir)
    pipeline: Pipeline | None = None
    try:
        pipeline = Pipeline(cfg, handle, spark)
        yield pipeline, handle
    finally:
        if pipeline is not None:
            pipeline.stop()
        handle.close()


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def stat_counter(client: Any, name: str) -> int:
    raw = client.hget(STATS_KEY, name)
    return int(raw) if raw is not None else 0


def backlog_events(client: Any, cfg: Config, pool: LoadPool) -> int:
    """The backlog in events: entries not yet committed x the pool's events per entry."""
    entries, _ = backlog(client, cfg)
    return round(entries * pool.events_per_entry())


def wait_idle_logged(
    pipeline: Pipeline, client: Any, cfg: Config, timeout_s: float, what: str
) -> bool:
    """`Pipeline.wait_idle` in 5 s slices with a progress line each; False on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pipeline.wait_idle(timeout_s=min(5.0, max(0.1, deadline - time.monotonic()))):
            return True
        entries, _ = backlog(client, cfg)
        log(f"{what}: {stat_counter(client, 'events_in'):,} events in, {entries:,} entries left")
    return False


# -- 1. drain, 2. sustained, 3. freshness: one pipeline per format ------------------------------


def measure_pipeline(
    spark: SparkSession, plan: Plan, fp: FormatPlan, ws: Workspace, deadline: Deadline
) -> tuple[DrainResult, SustainedResult | None]:
    """Drain, then (on the same, now idle pipeline) the rate ladder and freshness."""
    cfg = bench_config(fp.fmt, ws.state_dir(f"{fp.fmt}-pipeline"), fp.batch_events)
    with pipeline_run(spark, cfg) as (pipeline, handle):
        drain = run_drain(pipeline, handle, cfg, plan, fp)
        if drain.rate is None or not drain.idle:
            log(f"{fp.fmt}: no drain rate, skipping the sustained and freshness runs")
            return drain, None
        sustained = run_sustained(pipeline, handle, cfg, plan, fp, drain.rate.wall_per_s, deadline)
    return drain, sustained


def run_drain(
    pipeline: Pipeline, handle: RedisHandle, cfg: Config, plan: Plan, fp: FormatPlan
) -> DrainResult:
    """Pre-fill `fp.drain_events`, then start the pipeline and wait until it is idle."""
    pool = build_pool(cfg, fp.pool_events, plan.seed, now_ms())
    t0 = time.monotonic()
    sent = prefill(handle.url, pool, fp.drain_events)
    prefill_s = time.monotonic() - t0
    log(f"{fp.fmt} drain: pre-filled {sent:,} events in {prefill_s:.1f} s; starting pipeline")
    pipeline.start()
    idle = wait_idle_logged(pipeline, handle.client, cfg, plan.drain_timeout_s, f"{fp.fmt} drain")
    records = recent_batches(handle.client, BATCH_HISTORY)
    result = DrainResult(
        prefilled_events=sent,
        shard_share=tuple(n / pool.total_events for n in pool.shard_events),
        prefill_s=prefill_s,
        idle=idle,
        events_in=stat_counter(handle.client, "events_in"),
        dead_letters=stat_counter(handle.client, "dead_letters"),
        records=records,
        rate=batch_rate(records),
    )
    r = result.rate
    log(
        f"{fp.fmt} drain: {len(records)} batches, "
        + (f"{r.wall_per_s:,.0f} events/s (warm-up excluded)" if r else "too few batches")
    )
    return result


class ProbePoller(threading.Thread):
    """Polls `txn_count` for every pending probe card until it counts >= 1.

    `add(card, sent_ms)` registers a probe; `latencies_ms` gets visible - sent for each probe
    seen (visible = when the poll reply arrived, so at most POLL_EVERY_S late); `wrong` maps a
    card to its count when that count was not exactly 1.
    """

    def __init__(self, cfg: Config, url: str) -> None:
        super().__init__(name="bench-probe-poller", daemon=True)
        self.engine = QueryEngine(cfg, client_for(url))
        self.pending: dict[str, int] = {}
        self.latencies_ms: list[float] = []
        self.wrong: dict[str, Any] = {}
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._stop_evt = threading.Event()

    def add(self, card: str, sent_ms: int) -> None:
        with self._lock:
            self.pending[card] = sent_ms

    def n_pending(self) -> int:
        with self._lock:
            return len(self.pending)

    def stop(self) -> None:
        self._stop_evt.set()

    def run(self) -> None:
        try:
            while not self._stop_evt.wait(POLL_EVERY_S):
                self._poll()
        except Exception as e:  # noqa: BLE001 - handed to the caller, which raises it
            self.error = e

    def _poll(self) -> None:
        with self._lock:
            cards = list(self.pending)[:1000]
        if not cards:
            return
        answers = self.engine.run(
            [self.engine.lookup("txn_count", [c], PROBE_WINDOW) for c in cards]
        )
        seen_ms = now_ms()
        with self._lock:
            for card, ans in zip(cards, answers, strict=True):
                if ans["value"] >= 1:
                    self.latencies_ms.append(seen_ms - self.pending.pop(card))
                    if ans["value"] != 1:
                        self.wrong[card] = ans["value"]


def sample_until_idle(
    pipeline: Pipeline,
    handle: RedisHandle,
    cfg: Config,
    pool: LoadPool,
    sustained: SustainedResult,
    timeout_s: float,
) -> bool:
    """Wait until the pipeline is idle (False after `timeout_s`), sampling the backlog."""
    deadline = time.monotonic() + timeout_s
    next_log = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if pipeline.wait_idle(timeout_s=SAMPLE_EVERY_S):
            return True
        b = backlog_events(handle.client, cfg, pool)
        sustained.samples.append(((now_ms() - sustained.t0_ms) / 1000, b))
        if time.monotonic() >= next_log:
            log(f"draining after the step: {b:,} events left")
            next_log += 5.0
    return False


def run_step(
    pipeline: Pipeline,
    handle: RedisHandle,
    cfg: Config,
    plan: Plan,
    pool: LoadPool,
    rate_per_s: float,
    sustained: SustainedResult,
) -> StepResult:
    """Produce at `rate_per_s` for `plan.step_s` beside the running pipeline, sampling the
    backlog; then let the pipeline drain and judge the step (`_util.judge_step`). The step is
    cut short if the backlog passes ABORT_LAG_S of input."""
    t0_ms = sustained.t0_ms
    events_before = stat_counter(handle.client, "events_in")
    producer = PacedProducer(handle.url, pool, rate_per_s, plan.step_s)
    start_ms = now_ms()
    producer.start()
    samples: list[tuple[float, int]] = []
    aborted = False
    while producer.is_alive():
        producer.join(SAMPLE_EVERY_S)
        b = backlog_events(handle.client, cfg, pool)
        samples.append(((now_ms() - t0_ms) / 1000, b))
        if b > ABORT_LAG_S * rate_per_s and not aborted:
            aborted = True
            producer.stop()
    if producer.error is not None:
        raise RuntimeError(f"the load producer failed: {producer.error}")
    end_ms = now_ms()
    processed_per_s = (stat_counter(handle.client, "events_in") - events_before) / max(
        producer.elapsed_s, 1e-9
    )
    achieved = producer.achieved_per_s()
    sustained.samples += samples
    t = time.monotonic()
    drain_timeout_s = min(120.0, 20.0 + samples[-1][1] / max(processed_per_s, 1.0) * 2)
    drained = sample_until_idle(pipeline, handle, cfg, pool, sustained, drain_timeout_s)
    # Batches admitted in the last two thirds of the step (all done now that it drained).
    judged_from_ms = start_ms + (end_ms - start_ms) / 3
    batch_events = [
        r["events"]
        for r in recent_batches(handle.client, BATCH_HISTORY)
        if judged_from_ms <= r["started_ms"] <= end_ms
    ]
    verdict = judge_step(samples, achieved, MAX_LAG_S, batch_events, fp_cap(cfg))
    if aborted:
        verdict = StepVerdict(False, f"cut short: backlog over {ABORT_LAG_S:.0f} s of input")
    return StepResult(
        target_per_s=rate_per_s,
        achieved_per_s=achieved,
        processed_per_s=processed_per_s,
        verdict=verdict,
        t_start_s=(start_ms - t0_ms) / 1000,
        t_end_s=(end_ms - t0_ms) / 1000,
        drained=drained,
        drain_s=time.monotonic() - t,
    )


def fp_cap(cfg: Config) -> int:
    """The admission cap per batch, in events."""
    cap = cfg.source.max_events_per_batch
    if cap is None:
        raise ValueError("the benchmark needs source.max_events_per_batch")
    return cap


def next_factor(factor: float, steps: Sequence[StepResult]) -> float | None:
    """The ladder (factors of the drain rate, starting at 0.9): 1.25 x higher after a bounded
    step, 0.7 x lower after an unbounded one, until both outcomes were seen (None: stop)."""
    both = any(s.verdict.bounded for s in steps) and any(not s.verdict.bounded for s in steps)
    if both:
        return None
    return factor * 1.25 if steps[-1].verdict.bounded else factor * 0.7


def run_sustained(
    pipeline: Pipeline,
    handle: RedisHandle,
    cfg: Config,
    plan: Plan,
    fp: FormatPlan,
    drain_per_s: float,
    deadline: Deadline,
) -> SustainedResult:
    """The rate ladder, then freshness at about half the best bounded rate (half the lowest rate
    tried if none was bounded). The pipeline must be running and idle."""
    result = SustainedResult(t0_ms=now_ms())
    factor = 0.9
    reserve_s = plan.step_s + plan.freshness_s + plan.bare_reserve_s
    for i in range(plan.max_steps):
        if deadline.left_s() < reserve_s:
            log(f"{fp.fmt} sustained: time budget reached, skipping further steps")
            break
        rate = factor * drain_per_s
        pool = build_pool(cfg, fp.pool_events, plan.seed + 10 + i, now_ms())
        log(f"{fp.fmt} sustained: step {i + 1}, {rate:,.0f} events/s for {plan.step_s:.0f} s")
        step = run_step(pipeline, handle, cfg, plan, pool, rate, result)
        result.steps.append(step)
        log(
            f"{fp.fmt} sustained: produced {step.achieved_per_s:,.0f}/s, processed"
            f" {step.processed_per_s:,.0f}/s during the step, bounded={step.verdict.bounded}"
            f" ({step.verdict.reason})"
        )
        if not step.drained:
            log(f"{fp.fmt} sustained: backlog did not drain; stopping the ladder")
            break
        nxt = next_factor(factor, result.steps)
        if nxt is None:
            break
        factor = nxt
    if result.steps and all(s.drained for s in result.steps):
        best = result.best()
        base = best.achieved_per_s if best else min(s.achieved_per_s for s in result.steps)
        result.freshness = measure_freshness(handle, cfg, plan, fp, base / 2, result)
    result.records = recent_batches(handle.client, BATCH_HISTORY)
    return result


def measure_freshness(
    handle: RedisHandle,
    cfg: Config,
    plan: Plan,
    fp: FormatPlan,
    rate_per_s: float,
    sustained: SustainedResult,
) -> FreshnessResult:
    """Load at `rate_per_s`, a probe every PROBE_EVERY_S, poll until every probe is visible."""
    pool = build_pool(cfg, fp.pool_events, plan.seed + 99, now_ms())
    t_start = (now_ms() - sustained.t0_ms) / 1000
    log(f"{fp.fmt} freshness: load {rate_per_s:,.0f} events/s, probes for {plan.freshness_s} s")
    producer = PacedProducer(handle.url, pool, rate_per_s, plan.freshness_s + 3.0)
    poller = ProbePoller(cfg, handle.url)
    sender = client_for(handle.url)
    producer.start()
    time.sleep(2.0)  # let the load reach its pace first
    poller.start()
    sent = 0
    try:
        n_probes = int(plan.freshness_s / PROBE_EVERY_S)
        t0 = time.monotonic()
        for i in range(n_probes):
            card = f"probe-{i}"
            sent_ms = now_ms()
            shard, fields = probe_fields(cfg, card, sent_ms)
            poller.add(card, sent_ms)
            sender.xadd(shard, fields)
            sent += 1
            sustained.samples.append(
                ((now_ms() - sustained.t0_ms) / 1000, backlog_events(handle.client, cfg, pool))
            )
            time.sleep(max(0.0, t0 + (i + 1) * PROBE_EVERY_S - time.monotonic()))
        producer.join(10.0)
        wait_until = time.monotonic() + 30.0
        while poller.n_pending() and time.monotonic() < wait_until and poller.is_alive():
            time.sleep(0.1)
    finally:
        producer.stop()
        poller.stop()
        poller.join(5.0)
        sender.close()
    if poller.error is not None:
        raise RuntimeError(f"the probe poller failed: {poller.error}")
    if producer.error is not None:
        raise RuntimeError(f"the load producer failed: {producer.error}")
    res = FreshnessResult(
        target_per_s=rate_per_s,
        achieved_per_s=producer.achieved_per_s(),
        sent=sent,
        latencies_ms=sorted(poller.latencies_ms),
        wrong_counts=dict(poller.wrong),
        t_start_s=t_start,
        t_end_s=(now_ms() - sustained.t0_ms) / 1000,
    )
    log(
        f"{fp.fmt} freshness: {len(res.latencies_ms)}/{sent} probes seen, p50"
        f" {_ms(percentile(res.latencies_ms, 0.5))}, p99 {_ms(percentile(res.latencies_ms, 0.99))}"
    )
    return res


# -- 4. bare engine -------------------------------------------------------------------------------
# The source below is pickled by value (this file runs as __main__) into Spark's Python workers,
# so it may use only sluice, pyarrow and the standard library, nothing from _util.


class ArrowFileSource(DataSource):
    """`spark.readStream.format("sluice-bench-arrow")`: every micro-batch re-reads one
    pre-built Arrow IPC file (memory-mapped), split into `partitions` partitions.

    Options: path, ddl (the schema), batches (micro-batches in all), partitions.
    """

    @classmethod
    def name(cls) -> str:
        return ARROW_FORMAT

    def schema(self) -> str:
        return str(self.options["ddl"])

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        return ArrowFileReader(
            str(self.options["path"]), int(self.options["batches"]), int(self.options["partitions"])
        )


class ArrowFileReader(DataSourceStreamReader):
    def __init__(self, path: str, total_batches: int, n_partitions: int) -> None:
        self.path = path
        self.total_batches = total_batches
        self.n_partitions = n_partitions

    def initialOffset(self) -> dict[str, Any]:
        return {"batch": 0}

    def latestOffset(self, start: dict[str, Any], limit: Any) -> dict[str, Any]:
        return {"batch": min(int(start["batch"]) + 1, self.total_batches)}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        n = int(end["batch"]) - int(start["batch"])
        return [
            InputPartition((self.path, j, self.n_partitions))
            for _ in range(n)
            for j in range(self.n_partitions)
        ]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        import pyarrow.ipc as ipc

        path, j, n_parts = partition.value
        with pa.memory_map(path) as src:
            reader = ipc.open_file(src)
            for i in range(j, reader.num_record_batches, n_parts):
                yield reader.get_batch(i)


def write_arrow_batch(cfg: Config, n_events: int, seed: int, path: Path) -> int:
    """Decode `n_events` synthetic entries with the real Decoder and store them as an Arrow IPC
    file in BARE_PARTITIONS x BARE_CHUNKS_PER_PARTITION record batches. Returns rows."""
    ref_ms = now_ms()
    opts = SourceOptions.from_config(cfg, url="redis://unused")
    entries = xrange_entries(cfg, n_events, seed, ref_ms)
    batches = list(Decoder(opts, ref_ms, "events:0").decode(entries))
    table = pa.Table.from_batches(batches, schema=output_schema(opts))
    if table.schema != output_schema(opts):
        raise RuntimeError("decoded batches do not have the source's output schema")
    chunk = math.ceil(table.num_rows / (BARE_PARTITIONS * BARE_CHUNKS_PER_PARTITION))
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        for b in table.to_batches(max_chunksize=chunk):
            writer.write_batch(b)
    return table.num_rows


def measure_bare(spark: SparkSession, plan: Plan, fp: FormatPlan, ws: Workspace) -> BareResult:
    """Run explode_updates + fold_updates + a no-op write over `plan.bare_batches` micro-batches
    of `fp.batch_events` events each, from the Arrow source, back to back (trigger 0, so the
    500 ms trigger does not cap small fast batches); time each batch."""
    state_dir = ws.state_dir(f"{fp.fmt}-bare")
    cfg = bench_config(fp.fmt, state_dir, fp.batch_events)
    path = state_dir / "batch.arrow"
    rows = write_arrow_batch(cfg, fp.batch_events, plan.seed + 7, path)
    specs = metric_specs(cfg, check_expressions(spark, cfg))
    folds = fold_columns(specs)
    records: list[dict[str, Any]] = []
    checked: list[int] = []

    def on_batch(exploded: DataFrame, batch_id: int) -> None:
        started = now_ms()
        updates = fold_updates(exploded, folds)
        if not records and not checked:  # warm-up batch: check every row arrived (untimed)
            row = updates.where("g = 0").agg({"cnt": "sum"}).collect()[0]
            checked.append(int(row[0] or 0))
            started = now_ms()
        updates.write.format("noop").mode("overwrite").save()
        records.append(
            {"batch": batch_id, "events": rows, "started_ms": started, "done_ms": now_ms()}
        )

    options = {"path": str(path), "ddl": spark_schema_ddl(SourceOptions.from_config(cfg, "x")),
               "batches": str(plan.bare_batches), "partitions": str(BARE_PARTITIONS)}  # fmt: skip
    events = spark.readStream.format(ARROW_FORMAT).options(**options).load()
    query = (
        explode_updates(events, cfg, specs)
        .writeStream.queryName(f"bench-bare-{fp.fmt}")
        .foreachBatch(on_batch)
        .option("checkpointLocation", str(state_dir / "checkpoint"))
        .trigger(processingTime="0 seconds")  # back to back: the ceiling, not the trigger
        .start()
    )
    deadline = time.monotonic() + plan.drain_timeout_s
    try:
        while len(records) < plan.bare_batches and time.monotonic() < deadline:
            if query.exception() is not None:
                raise RuntimeError(f"bare engine query failed: {query.exception()}")
            time.sleep(0.2)
    finally:
        query.stop()
    result = BareResult(rows, list(records), batch_rate(records), checked[0] if checked else None)
    r = result.rate
    log(
        f"{fp.fmt} bare engine: "
        + (f"{r.wall_per_s:,.0f} events/s" if r else "too few batches")
        + f" ({result.checked_events} of {rows:,} events counted in the warm-up check)"
    )
    return result


# -- report ---------------------------------------------------------------------------------------


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:,.0f} ms"


def _rate(v: float | None) -> str:
    return "–" if v is None else f"{v:,.0f}"


def display_path(p: str) -> str:
    """`p` relative to the repository root when inside it (symlinks not followed)."""
    try:
        return str(Path(os.path.abspath(p)).relative_to(ROOT))
    except ValueError:
        return p


def load_average() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def format_section(res: FormatResult, plan: Plan) -> list[str]:
    fp = res.plan
    d, s, b = res.drain, res.sustained, res.bare
    drain_r = d.rate.wall_per_s if d and d.rate else None
    best = s.best() if s else None
    bare_r = b.rate.wall_per_s if b and b.rate else None
    ratio = f"{drain_r / bare_r:.2f}" if drain_r and bare_r else "–"
    sus_ratio = f"{best.achieved_per_s / bare_r:.2f}" if best and bare_r else "–"
    split = ""
    if d is not None:
        shares = " / ".join(f"{x:.0%}" for x in d.shard_share)
        sizes = sorted(r["events"] for r in d.records)
        split = (
            f" Load split over the shards: {shares} (Zipf keys, sharded by card); the reader"
            " gives a shard's unused budget to the shards with backlog, and the drain's batches"
            f" held {sizes[0]:,} to {sizes[-1]:,} events."
            if sizes
            else ""
        )
    out = [
        f"### `{fp.fmt}`",
        "",
        f"Batch size (`source.max_events_per_batch`): {fp.batch_events:,} events." + split,
        "",
        "| measure | events/s | note |",
        "|---|---:|---|",
    ]
    if d is not None:
        note = (
            f"{d.prefilled_events:,} events pre-filled; {d.rate.batches} batches after the"
            f" warm-up one, {d.rate.events:,} events in {d.rate.wall_s:.1f} s; busy-time rate"
            f" {d.rate.busy_per_s:,.0f}/s"
            if d.rate
            else "fewer than 2 batches"
        )
        if not d.idle:
            note += "; did NOT drain within the time limit"
        elif d.events_in != d.prefilled_events:
            note += f"; MISMATCH: the pipeline counted {d.events_in:,} events in"
        if d.dead_letters:
            note += f"; {d.dead_letters:,} dead letters"
        out.append(f"| drain (pipeline, from Redis) | {_rate(drain_r)} | {note} |")
    if s is not None:
        note = (
            f"highest bounded step of {len(s.steps)} tried ({best.verdict.reason})"
            if best
            else f"no bounded step among {len(s.steps)} tried"
        )
        out.append(
            f"| sustained (bounded backlog) | {_rate(best.achieved_per_s if best else None)} |"
            f" {note} |"
        )
    if b is not None:
        note = (
            f"{b.rate.batches} batches after the warm-up one, back to back (trigger 0);"
            f" busy-time rate {b.rate.busy_per_s:,.0f}/s; in-memory Arrow streaming source,"
            f" {BARE_PARTITIONS} partitions, no-op write"
            if b.rate
            else "fewer than 2 batches"
        )
        if b.checked_events is not None and b.checked_events != b.batch_events:
            note += f"; MISMATCH: the warm-up batch counted {b.checked_events:,} good events"
        out.append(f"| bare engine (same plan, no Redis) | {_rate(bare_r)} | {note} |")
    out += [
        f"| ratio drain / bare | {ratio} | |",
        f"| ratio sustained / bare | {sus_ratio} | |",
        "",
    ]
    if s is not None and s.steps:
        out += [
            f"Sustained-rate steps ({plan.step_s:.0f} s each; bounded = no batch in the last two"
            " thirds of the step filled to the admission cap, backlog peaks not rising, final"
            f" backlog < {MAX_LAG_S:.0f} s of input):",
            "",
            "| target events/s | produced events/s | processed events/s | bounded | detail |",
            "|---:|---:|---:|---|---|",
        ]
        for st in s.steps:
            out.append(
                f"| {st.target_per_s:,.0f} | {st.achieved_per_s:,.0f} |"
                f" {st.processed_per_s:,.0f} | {'yes' if st.verdict.bounded else 'no'} |"
                f" {st.verdict.reason} |"
            )
        out.append("")
    return out


def freshness_table(results: Sequence[FormatResult]) -> list[str]:
    out = [
        "| format | load events/s | probes sent | probes seen | p50 | p99 | max |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        f = res.sustained.freshness if res.sustained else None
        if f is None:
            out.append(f"| `{res.plan.fmt}` | – | – | – | – | – | – |")
            continue
        lat = f.latencies_ms
        out.append(
            f"| `{res.plan.fmt}` | {f.achieved_per_s:,.0f} | {f.sent} | {len(lat)} |"
            f" {_ms(percentile(lat, 0.5))} | {_ms(percentile(lat, 0.99))} |"
            f" {_ms(max(lat) if lat else None)} |"
        )
    wrong = {
        r.plan.fmt: r.sustained.freshness.wrong_counts
        for r in results
        if r.sustained and r.sustained.freshness and r.sustained.freshness.wrong_counts
    }
    if wrong:
        out += ["", f"Probes whose count was not exactly 1: {wrong}."]
    return out


@dataclass
class RunInfo:
    command: str
    started: str
    load_start: float | None
    load_end: float | None = None
    duration_s: float = 0.0


def render_markdown(
    results: Sequence[FormatResult], plan: Plan, run: RunInfo, png: Path, md: Path
) -> str:
    png_rel = os.path.relpath(png, md.parent)
    mode = "quick smoke mode (small sizes, short steps)" if plan.quick else "full mode"
    lines = [
        f"Command: `{run.command}` (from the repository root), {mode}; took"
        f" {run.duration_s / 60:.1f} min.",
        "",
        f"Date: {run.started}. Machine: {machine_note(run.load_start, run.load_end)}. Numbers"
        " are single runs; treat them as indicative."
        + (
            " Quick mode: batches are small and the sustained steps last only"
            f" {plan.step_s:.0f} s, so the bounded/unbounded verdicts are weak; this run checks"
            " that the benchmark works, the full run gives the numbers to quote."
            if plan.quick
            else ""
        ),
        "",
        "Setup: 3 metrics (`txn_count` count by card, `amount_sum` sum of amount by merchant,"
        " `card_max` max of amount by card), schema {ts: long, card: string, merchant: string,"
        " amount: double}, 2 shards, 10 s slices, 1 h retention; Spark `local[2]`, 500 ms"
        " trigger, 2 shuffle partitions; embedded Redis (AOF everysec) in a fresh temporary"
        " state_dir per run. Load: `sluice.source.loadgen.EventGenerator` events (Zipf keys),"
        " pre-encoded as XADDs (jsonl: 500 events per entry) and written over a raw socket, so"
        " the producer costs little CPU; it still shares the 2 cores with Redis and Spark.",
        "",
        "Drain = pre-filled backlog, events/s from the batch records excluding the first (warm-up)"
        " batch, over wall time from the end of the warm-up batch to the end of the last batch."
        " Sustained = highest fixed produce rate whose backlog stayed bounded. Bare engine ="
        " `explode_updates` + `fold_updates` + a no-op write fed by an in-memory Arrow"
        " *streaming* Python data source (same columns as `output_schema`, built with the real"
        " `Decoder`) at the same batch size, batches back to back (trigger 0), rate computed the"
        " same way. Busy-time rate = events over the sum of the batches' own durations (no gaps"
        " between batches).",
        "",
    ]
    for res in results:
        lines += format_section(res, plan)
    lines += [
        "### Freshness (produce → queryable)",
        "",
        "At about half the sustained rate (half the lowest rate tried if none was bounded), a"
        f" probe event with a unique card every {PROBE_EVERY_S * 1000:.0f} ms; a poller queries"
        f" `txn_count` (window {PROBE_WINDOW}) every {POLL_EVERY_S * 1000:.0f} ms until it counts"
        " 1. Latency = first poll reply showing it − send time (so up to one poll interval high).",
        "",
        *freshness_table(results),
        "",
        f"![batch throughput and backlog]({png_rel})",
        "",
    ]
    return "\n".join(lines)


def print_summary(results: Sequence[FormatResult]) -> None:
    print("Sluice throughput benchmark")
    print(f"{'format':<8} {'drain ev/s':>12} {'sustained':>12} {'bare ev/s':>12} {'ratio':>6}"
          f" {'fresh p50':>10} {'p99':>10}")  # fmt: skip
    for res in results:
        d = res.drain.rate.wall_per_s if res.drain and res.drain.rate else None
        best = res.sustained.best() if res.sustained else None
        b = res.bare.rate.wall_per_s if res.bare and res.bare.rate else None
        f = res.sustained.freshness if res.sustained else None
        lat = f.latencies_ms if f else []
        ratio = f"{d / b:.2f}" if d and b else "–"
        print(
            f"{res.plan.fmt:<8} {_rate(d):>12} {_rate(best.achieved_per_s if best else None):>12}"
            f" {_rate(b):>12} {ratio:>6} {_ms(percentile(lat, 0.5)):>10}"
            f" {_ms(percentile(lat, 0.99)):>10}"
        )


# -- plot -----------------------------------------------------------------------------------------


def _batch_points(records: Sequence[dict[str, Any]], t0_ms: int) -> tuple[list[float], list[float]]:
    """(end time s since t0, events/s over the batch's own duration) per batch."""
    rs = sorted(records, key=lambda r: r["batch"])
    xs = [(r["done_ms"] - t0_ms) / 1000 for r in rs]
    ys = [r["events"] / max(r["done_ms"] - r["started_ms"], 1) * 1000 for r in rs]
    return xs, ys


def plot(results: Sequence[FormatResult], png: Path) -> None:
    """Per format: per-batch events/s in the drain and bare runs (left), and the sustained run's
    per-batch events/s with the backlog (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(13, 4.2 * len(results)), squeeze=False)
    for row, res in zip(axes, results, strict=True):
        _plot_batches(row[0], res)
        _plot_sustained(row[1], res)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)


def _plot_batches(ax: Any, res: FormatResult) -> None:
    for label, recs, marker in (
        ("pipeline drain", res.drain.records if res.drain else [], "o"),
        ("bare engine", res.bare.records if res.bare else [], "s"),
    ):
        if not recs:
            continue
        t0 = min(r["started_ms"] for r in recs)
        xs, ys = _batch_points(recs, t0)
        ax.plot(xs, ys, marker=marker, label=label)
        if len(xs):
            ax.annotate("warm-up", (xs[0], ys[0]), fontsize=7)
    ax.set_title(f"{res.plan.fmt}: per-batch events/s (batch {res.plan.batch_events:,})")
    ax.set_xlabel("s since the first batch started")
    ax.set_ylabel("events/s within a batch")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _plot_sustained(ax: Any, res: FormatResult) -> None:
    from matplotlib.lines import Line2D

    s = res.sustained
    ax.set_title(f"{res.plan.fmt}: sustained-rate steps, then the freshness load")
    ax.set_xlabel("s since the first step")
    ax.set_ylabel("events/s")
    ax.grid(alpha=0.3)
    if s is None or not s.steps:
        return
    recs = [r for r in s.records if r["done_ms"] >= s.t0_ms]
    xs, ys = _batch_points(recs, s.t0_ms)
    ax.plot(xs, ys, ".", color="tab:blue")
    spans = [(st.t_start_s, st.t_end_s, st.achieved_per_s,
              "tab:green" if st.verdict.bounded else "tab:red") for st in s.steps]  # fmt: skip
    if s.freshness is not None:
        f = s.freshness
        spans.append((f.t_start_s, f.t_end_s, f.achieved_per_s, "tab:purple"))
    for t_start, t_end, rate, color in spans:
        ax.hlines(rate, t_start, t_end, colors=color, linewidth=2.5)
        ax.axvspan(t_start, t_end, color=color, alpha=0.07)
    twin = ax.twinx()
    if s.samples:
        tx, by = zip(*sorted(s.samples), strict=True)
        twin.plot(tx, by, color="tab:orange", linewidth=1)
    twin.set_ylabel("backlog (events)", color="tab:orange")
    handles = [
        Line2D([], [], marker=".", linestyle="", color="tab:blue", label="batch events/s"),
        Line2D([], [], color="tab:green", lw=2.5, label="produced, bounded"),
        Line2D([], [], color="tab:red", lw=2.5, label="produced, not bounded"),
        Line2D([], [], color="tab:purple", lw=2.5, label="produced, freshness run"),
        Line2D([], [], color="tab:orange", lw=1, label="backlog (right axis)"),
    ]
    ax.legend(handles=handles, loc="upper right", fontsize=7)


# -- main -----------------------------------------------------------------------------------------


def run_format(
    spark: SparkSession, plan: Plan, fp: FormatPlan, ws: Workspace, budget_s: float
) -> FormatResult:
    """Every measurement for one source format, within about `budget_s`."""
    deadline = Deadline(budget_s)
    res = FormatResult(fp)
    res.drain, res.sustained = measure_pipeline(spark, plan, fp, ws, deadline)
    res.bare = measure_bare(spark, plan, fp, ws)
    return res


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="~2 minute smoke run with small sizes")
    p.add_argument("--formats", default="jsonl,fields", help="comma-separated: jsonl,fields")
    p.add_argument("--budget-s", type=float, default=None,
                   help="time budget for the whole run (default 900, quick 180)")  # fmt: skip
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--md", type=Path, default=ROOT / "docs" / "benchmarks.md")
    p.add_argument("--png", type=Path, default=ROOT / "docs" / "throughput.png")
    p.add_argument("--keep-state", action="store_true", help="keep the temporary state dirs")
    args = p.parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    bad = [f for f in formats if f not in ("jsonl", "fields")]
    if bad or not formats:
        p.error(f"--formats: expected jsonl and/or fields, got {args.formats!r}")
    args.format_list = formats
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("SLUICE_SPARK_LOG_LEVEL", "ERROR")  # read by build_spark
    plan = make_plan(args.quick, args.format_list, args.budget_s, args.seed)
    run = RunInfo(
        command=shlex.join(
            [display_path(sys.executable), display_path(sys.argv[0]), *sys.argv[1:]]
        ),
        started=dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        load_start=load_average(),
    )
    ws = Workspace(args.keep_state)
    t0 = time.monotonic()
    results: list[FormatResult] = []
    spark: SparkSession | None = None
    try:
        mode = "quick" if plan.quick else "full"
        log(f"building Spark ({mode} run, budget {plan.budget_s:.0f} s)")
        spark = build_spark(
            bench_config("jsonl", ws.state_dir("spark"), 1), app_name="sluice-bench"
        )
        spark.dataSource.register(ArrowFileSource)
        for i, fp in enumerate(plan.formats):
            share_s = (plan.budget_s - (time.monotonic() - t0)) / (len(plan.formats) - i)
            log(f"== {fp.fmt} (time share {share_s:.0f} s)")
            results.append(run_format(spark, plan, fp, ws, share_s))
    finally:
        if spark is not None:
            spark.stop()
        ws.cleanup()
    run.load_end = load_average()
    run.duration_s = time.monotonic() - t0
    body = render_markdown(results, plan, run, args.png, args.md)
    replace_section(args.md, HEADING, body)
    plot(results, args.png)
    log(f"wrote {display_path(str(args.md))} and {display_path(str(args.png))}"
        f" in {time.monotonic() - t0:.0f} s")  # fmt: skip
    print_summary(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
