"""Backpressure under a burst: the same offered-load profile against every flow controller.

    .venv/bin/python bench/burst.py            # full run, about 15 minutes
    .venv/bin/python bench/burst.py --quick    # smoke run, about 6 minutes

1. capacity C: with a slow store (the writer's `write_delay_ms`) and controller `none`, drain a
   pre-filled backlog; C = events/s from the batch records, warm-up batch excluded.
2. per controller (`none`, `fixed`, `pid`, `aimd`, `stepwise`), on a fresh embedded Redis with a
   `maxmemory` (noeviction): one producer thread offers 0.5 C for 30 s, 3 C for 30 s, then 0.5 C
   for 60 s (quick: 8 / 8 / 16 s) through `Producer.from_config` (so through the ingest valve),
   while the backlog, Redis memory and the flow tasks' states are sampled every 100 ms. Then the
   pipeline drains; if it is not idle 30 s after the load, `maxmemory` is lifted and it restarts
   on its checkpoint with controller `none` (settling), so that every acknowledged event can be
   looked for in the counters and the store.

Results go to the `## Backpressure under a burst (bench/burst.py)` section of docs/benchmarks.md,
a plot to docs/burst.png, a summary to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

from _burst_util import (
    Freshness,
    LoadProfile,
    ProducerCounts,
    ProfileProducer,
    admitted_per_s,
    coefficient_of_variation,
    count_metric_total,
    drain_time_s,
    freshness,
    input_level,
    now_ms,
    rises,
)
from _util import (
    BatchRate,
    batch_rate,
    bench_config,
    build_pool,
    log,
    prefill,
    replace_section,
)
from sluice.config import BackpressureConfig, Config
from sluice.errors import PipelineError
from sluice.flow.board import Board
from sluice.flow.stages import memory_fraction, stream_level
from sluice.pipeline.job import Pipeline
from sluice.pipeline.spark import build_spark
from sluice.pipeline.status import backlog, recent_batches
from sluice.redis.connection import RedisHandle, client_for
from sluice.redis.keys import FLOW_SIGNALS_KEY
from sluice.source.loadgen import EventGenerator, produce_frame
from sluice.source.producer import Producer
from sluice.units import parse_size_bytes
from throughput import (
    Workspace,
    display_path,
    load_average,
    machine_note,
    pipeline_run,
    stat_counter,
    wait_idle_logged,
)

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## Backpressure under a burst (bench/burst.py)"
CONTROLLERS = ("none", "fixed", "pid", "aimd", "stepwise")
SAMPLE_EVERY_S = 0.1
HEALTH_EVERY_S = 1.0
LOW_FACTOR = 0.5
HIGH_FACTOR = 3.0
PEAK_TARGET = 1.1  # x high watermark
CV_TARGET = 0.10
WARM_UP_EVENTS = 2_000
BATCH_HISTORY = 600


# -- plan -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    quick: bool
    controllers: tuple[str, ...]
    before_s: float
    burst_s: float
    after_s: float
    oscillation_s: float  # the CV is taken over the last this many seconds of the profile
    batch_events: int  # source.max_events_per_batch, for every controller
    write_delay_ms: float  # the writer's extra store time per 1,000 slice updates
    high_watermark: int
    low_watermark: int
    maxmemory: int
    capacity_events: int  # pre-filled for the capacity drain
    capacity: float | None  # events/s given on the command line: no capacity drain
    drain_timeout_s: float  # after the profile, how long the pipeline may take to go idle
    settle_timeout_s: float  # then, settling (no maxmemory, controller none), how much longer
    block_timeout_s: float  # the producer's `block_timeout_s` per flush
    seed: int


def make_plan(args: argparse.Namespace) -> Plan:
    quick = bool(args.quick)
    return Plan(
        quick=quick,
        controllers=tuple(args.controller_list),
        before_s=8.0 if quick else 30.0,
        burst_s=8.0 if quick else 30.0,
        after_s=16.0 if quick else 60.0,
        oscillation_s=8.0 if quick else 30.0,
        batch_events=args.batch_events,
        write_delay_ms=args.write_delay_ms,
        high_watermark=parse_size_bytes(args.high_watermark),
        low_watermark=parse_size_bytes(args.low_watermark),
        maxmemory=parse_size_bytes(args.maxmemory),
        capacity_events=100_000 if quick else 300_000,
        capacity=args.capacity,
        drain_timeout_s=20.0 if quick else 30.0,
        settle_timeout_s=60.0 if quick else 90.0,
        block_timeout_s=0.05,
        seed=args.seed,
    )


def burst_config(state_dir: Path, plan: Plan, controller: str, fixed_rate: float | None) -> Config:
    """`_util.bench_config` (jsonl, 2 shards, 3 metrics, 10 s slices) with this controller."""
    bp = BackpressureConfig.model_validate(
        {
            "controller": controller,
            "high_watermark": plan.high_watermark,
            "low_watermark": plan.low_watermark,
            "fixed_rate": fixed_rate if controller == "fixed" else None,
        }
    )
    return bench_config("jsonl", state_dir, plan.batch_events).model_copy(
        update={"backpressure": bp}
    )


# -- 1. capacity ----------------------------------------------------------------------------------


@dataclass
class CapacityResult:
    events: int
    idle: bool
    rate: BatchRate | None
    given: float | None = None  # from --capacity instead of a measurement

    @property
    def per_s(self) -> float | None:
        if self.given is not None:
            return self.given
        return self.rate.wall_per_s if self.rate else None


def measure_capacity(spark: SparkSession, plan: Plan, ws: Workspace) -> CapacityResult:
    """Drain a pre-filled backlog with controller `none` and the slow store (also warms Spark)."""
    cfg = burst_config(ws.state_dir("capacity"), plan, "none", None)
    with pipeline_run(spark, cfg) as (pipeline, handle):
        pipeline.write_delay_ms = plan.write_delay_ms
        pool = build_pool(cfg, min(plan.capacity_events, 100_000), plan.seed, now_ms())
        sent = prefill(handle.url, pool, plan.capacity_events)
        log(f"capacity: pre-filled {sent:,} events; draining with controller none")
        pipeline.start()
        idle = wait_idle_logged(pipeline, handle.client, cfg, 300.0, "capacity")
        rate = batch_rate(recent_batches(handle.client, BATCH_HISTORY))
    result = CapacityResult(sent, idle, rate)
    log(
        "capacity: "
        + (f"{rate.wall_per_s:,.0f} events/s over {rate.batches} batches" if rate else "no rate")
    )
    return result


# -- 2. one controller under the profile ----------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    t_s: float
    entries: int
    bytes: int  # exact (MEMORY USAGE ... SAMPLES 0)
    gate_bytes: int  # as the flow valves measure it (`sluice.flow.stages.stream_level`)
    used_memory: int
    spark_rate: float | None  # the Spark task's controller rate (events/s), None = unlimited
    spark_limit: int | None  # events admitted per micro-batch
    spark_bp: bool
    ingest_rate: float | None
    ingest_bp: bool
    gate_open: bool | None


@dataclass
class RunResult:
    controller: str
    profile: LoadProfile
    t0_ms: int
    trigger_ms: int
    samples: list[Sample] = field(default_factory=list)
    batches: list[dict[str, Any]] = field(default_factory=list)
    producer_series: list[tuple[float, float, int]] = field(default_factory=list)
    counts: ProducerCounts = field(default_factory=ProducerCounts)
    acked: int = 0
    rejected: int = 0
    reject_errors: dict[str, int] = field(default_factory=dict)
    producer_error: str | None = None
    counted: int = 0  # events_in over the run
    stored: int = 0  # txn_count summed over the store, over the run
    dead_letters: int = 0
    idle: bool = False
    producer_end_s: float | None = None  # t of the producer's last delivery
    idle_at_s: float | None = None
    lifted_at_s: float | None = None  # settling began: maxmemory lifted, controller `none`
    queued_end: int = 0  # entries not yet committed when the run ended
    failures: list[tuple[float, str]] = field(default_factory=list)
    restarts: list[float] = field(default_factory=list)  # t of each query restart
    timeline: list[dict[str, Any]] = field(default_factory=list)
    signals: int = 0

    @property
    def lost(self) -> int | None:
        """Acked − counted; None while input is still queued (the count is not settled)."""
        return self.acked - self.counted if self.idle else None

    def lost_text(self) -> str:
        lost = self.lost
        return (
            f"{lost:,}" if lost is not None else f"unsettled ({self.queued_end:,} entries queued)"
        )


def _flow_states(board: Board) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for st in board.all_tasks().values():
        out.setdefault(str(st.get("stage")), st)
    return out


def take_sample(client: Any, cfg: Config, board: Board, t_s: float) -> Sample:
    entries, exact = input_level(client, cfg.source.shard_keys())
    level = stream_level(client, tuple(cfg.source.shard_keys()), cfg.backpressure)
    used, _ = memory_fraction(client)
    st = _flow_states(board)
    sp, ing = st.get("spark", {}), st.get("ingest", {})
    gate = ing.get("gate_open")
    return Sample(
        t_s=t_s,
        entries=entries,
        bytes=exact,
        gate_bytes=level.bytes,
        used_memory=used,
        spark_rate=sp.get("rate"),
        spark_limit=sp.get("batch_limit"),
        spark_bp=bool(sp.get("backpressure")),
        ingest_rate=ing.get("rate"),
        ingest_bp=bool(ing.get("backpressure")),
        gate_open=None if gate is None else bool(gate),
    )


def root_cause(text: str) -> str:
    """The innermost `SomeError: message` line of a (py4j-wrapped) traceback, else the start."""
    for line in reversed(text.splitlines()):
        m = re.match(r"^\s*([\w.]+(?:Error|Exception)\b):?(.*)$", line)
        if m:
            msg = " ".join(m.group(2).split())
            return f"{m.group(1)}: {msg if len(msg) <= 160 else '…' + msg[-160:]}"
    return " ".join(text.split())[:300]


class QueryKeeper:
    """Restarts a failed streaming query with exponential backoff, like `Pipeline.run_forever`,
    and records why it failed."""

    def __init__(self, pipeline: Pipeline, result: RunResult) -> None:
        self.pipeline = pipeline
        self.result = result
        self.backoff_s = 1.0
        self.restart_at: float | None = None

    def failed(self, t_s: float, err: object) -> None:
        msg = root_cause(str(err))
        self.result.failures.append((t_s, msg))
        log(f"{self.result.controller}: streaming query failed at {t_s:.1f} s: {msg[:160]}")
        self.pipeline.stop(grace_s=1.0)
        self.restart_at = time.monotonic() + self.backoff_s
        self.backoff_s = min(self.backoff_s * 2, 8.0)

    def check(self, t_s: float) -> None:
        q = self.pipeline.query
        if q is not None and not q.isActive:
            self.failed(t_s, q.exception())
        elif q is None and self.restart_at is not None and time.monotonic() >= self.restart_at:
            try:
                self.pipeline.start()
                self.result.restarts.append(t_s)
                self.restart_at = None
            except Exception as e:  # noqa: BLE001 - recorded, retried like run_forever does
                self.failed(t_s, e)


def warm_up(pipeline: Pipeline, client: Any, cfg: Config, seed: int) -> None:
    """A few events without flow control, so the query's first (slow) batch is not measured."""
    producer = Producer.from_config(cfg, client, flow=False)
    frame = EventGenerator(cfg, seed=seed + 1000, late_fraction=0.0).frame(WARM_UP_EVENTS, now_ms())
    produce_frame(producer, frame, producer.shard_by)
    if not pipeline.wait_idle(120.0):
        raise PipelineError("the warm-up events did not drain within 120 s")


def run_controller(
    spark: SparkSession, plan: Plan, ws: Workspace, controller: str, capacity: float
) -> RunResult:
    """The profile against `controller`; returns once the pipeline drained (or timed out)."""
    cfg = burst_config(ws.state_dir(controller), plan, controller, capacity)
    profile = LoadProfile(
        LOW_FACTOR * capacity, HIGH_FACTOR * capacity, plan.before_s, plan.burst_s, plan.after_s
    )
    batches: list[dict[str, Any]] = []
    with pipeline_run(spark, cfg) as (pipeline, handle):
        pipeline.write_delay_ms = plan.write_delay_ms
        pipeline.on_batch = batches.append
        client = client_for(handle.url)
        pipeline.start()
        warm_up(pipeline, client, cfg, plan.seed)
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", plan.maxmemory)
        events_in0 = stat_counter(client, "events_in")
        dead0 = stat_counter(client, "dead_letters")
        stored0 = count_metric_total(client, "txn_count")
        t0 = now_ms() + 100
        res = RunResult(controller, profile, t0, cfg.spark.trigger)
        producer = ProfileProducer(
            cfg, client_for(handle.url), profile, plan.seed, plan.block_timeout_s, t0
        )
        log(
            f"{controller}: offering {profile.low_per_s:,.0f} → {profile.high_per_s:,.0f} →"
            f" {profile.low_per_s:,.0f} events/s ({plan.before_s:.0f} / {plan.burst_s:.0f} /"
            f" {plan.after_s:.0f} s)"
        )
        producer.start()
        watch(pipeline, client, cfg, res, producer, plan.drain_timeout_s)
        producer.join(5.0)
        if producer.failed():
            raise RuntimeError(f"{controller}: the producer thread failed") from producer.error
        # The controller's own flow history, before any settling.
        board = Board(client)
        res.timeline = [e for e in board.timeline(1000) if int(e.get("updated_ms", 0)) >= t0]
        res.signals = int(client.xlen(FLOW_SIGNALS_KEY))
        if not res.idle:
            settle(spark, pipeline, handle, cfg, plan, res, batches.append)
        res.batches = [b for b in batches if b["started_ms"] >= t0]
        res.producer_series = list(producer.series)
        res.counts = producer.counts
        res.acked, res.rejected = producer.acked, producer.rejected
        res.reject_errors = producer.ack.tally.errors
        res.producer_error = None if producer.error is None else str(producer.error)
        res.counted = stat_counter(client, "events_in") - events_in0
        res.dead_letters = stat_counter(client, "dead_letters") - dead0
        res.stored = count_metric_total(client, "txn_count") - stored0
        res.queued_end = backlog(client, cfg)[0]
        client.close()
    log(
        f"{controller}: acked {res.acked:,}, counted {res.counted:,}, rejected {res.rejected:,},"
        f" held back {res.counts.held_back:,.0f}, peak backlog"
        f" {max((s.bytes for s in res.samples), default=0) / 1e6:.2f} MB"
        + (f", {len(res.failures)} query failures" if res.failures else "")
    )
    return res


def watch(
    pipeline: Pipeline,
    client: Any,
    cfg: Config,
    res: RunResult,
    producer: ProfileProducer | None,
    timeout_s: float,
) -> None:
    """Sample every SAMPLE_EVERY_S, keeping the query alive, until the pipeline is idle after
    the producer ended (now, if there is none), or `timeout_s` after that."""
    board = Board(client)
    keeper = QueryKeeper(pipeline, res)
    since = None if producer is not None else (now_ms() - res.t0_ms) / 1000
    next_health = 0.0
    last_log = -10.0
    while True:
        t = (now_ms() - res.t0_ms) / 1000
        res.samples.append(take_sample(client, cfg, board, t))
        if t >= next_health:
            keeper.check(t)
            next_health = t + HEALTH_EVERY_S
        if t - last_log >= 10.0:
            s = res.samples[-1]
            log(
                f"{res.controller}: t={t:5.1f} s backlog {s.entries:,} entries"
                f" {s.bytes / 1e6:.2f} MB, used_memory {s.used_memory / 1e6:.1f} MB,"
                + (f" acked {producer.acked:,}," if producer is not None else "")
                + f" spark limit {s.spark_limit}"
            )
            last_log = t
        if since is None and producer is not None and not producer.is_alive():
            since = res.producer_end_s = t
        if since is not None:
            if pipeline.query is not None and _idle(pipeline, client, cfg):
                res.idle, res.idle_at_s = True, t
                return
            if t - since > timeout_s:
                return
        time.sleep(max(0.0, SAMPLE_EVERY_S - ((now_ms() - res.t0_ms) / 1000 - t)))


def settle(
    spark: SparkSession,
    pipeline: Pipeline,
    handle: RedisHandle,
    cfg: Config,
    plan: Plan,
    res: RunResult,
    on_batch: Callable[[dict[str, Any]], None],
) -> None:
    """The controller did not drain in time. As an operator would: lift `maxmemory` and restart
    the pipeline on the same checkpoint with controller `none`, so every acknowledged event can
    still be looked for (within `plan.settle_timeout_s`)."""
    log(
        f"{res.controller}: not idle {plan.drain_timeout_s:.0f} s after the load; lifting"
        " maxmemory and restarting with controller none to settle the count"
    )
    pipeline.stop(grace_s=5.0)
    handle.client.config_set("maxmemory", 0)
    res.lifted_at_s = (now_ms() - res.t0_ms) / 1000
    bp = cfg.backpressure.model_copy(update={"controller": "none"})
    rescue = Pipeline(
        cfg.model_copy(update={"backpressure": bp}),
        handle,
        spark,
        on_batch=on_batch,
        write_delay_ms=plan.write_delay_ms,
    )
    rescue.start()
    try:
        watch(rescue, handle.client, cfg, res, None, plan.settle_timeout_s)
    finally:
        rescue.stop()
    if not res.idle:
        log(f"{res.controller}: still not idle; giving up")


def _idle(pipeline: Pipeline, client: Any, cfg: Config) -> bool:
    total, _ = backlog(client, cfg)
    if total:
        return False
    try:
        return pipeline.wait_idle(timeout_s=0.05)
    except PipelineError:
        return False  # the keeper restarts it on its next check


# -- analysis -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Summary:
    peak_entries: int
    peak_bytes: int
    peak_memory: int
    pre_burst_bytes: int
    pre_burst_share: float  # admitted / offered in the steady part of the first phase
    drain_threshold: int
    drain_s: float | None  # None: not drained, or no steady state before the burst
    cv: float | None
    admitted: list[float]
    max_admitted_per_s: float
    throughput_per_s: float
    fresh_burst: Freshness
    fresh_after: Freshness
    peak_gate_bytes: int  # the size the gate works from (`stream_level`)
    gate_error: tuple[float, float] | None  # p10, p90 of gate / exact (backlog ≥ 1 MB)
    last_mean_per_s: float  # admitted, over the oscillation window
    last_batch_events: tuple[int, int] | None  # smallest, largest batch started in it
    spark_throttles: int  # Spark task's flag off → on, over the profile
    spark_throttles_last: int  # ... in the oscillation window
    gate_closes: int  # ingest gate open → shut, over the profile
    last_spark_limit: tuple[int, int] | None  # Spark's batch limit, min and max, in the window
    last_backlog_mean: float  # bytes, over the window

    @property
    def steady_before(self) -> bool:
        """Did the controller keep up with 0.5 C before the burst? Else no drain time."""
        return self.pre_burst_share >= 0.9


def summarize_run(res: RunResult, plan: Plan) -> Summary:
    p = res.profile
    in_profile = [s for s in res.samples if s.t_s <= p.total_s]
    pre = [s.bytes for s in in_profile if p.before_s / 3 <= s.t_s < p.before_s]
    pre_bytes = max(pre, default=0)
    threshold = max(pre_bytes, plan.low_watermark)
    drain = drain_time_s(
        [(s.t_s, s.bytes) for s in in_profile], p.burst_end_s, p.total_s, threshold
    )
    admitted = admitted_per_s(res.batches, res.t0_ms, p.total_s, res.trigger_ms, res.restarts)
    last = admitted[-int(plan.oscillation_s) :] if admitted else []
    before = admitted[int(p.before_s / 3) : int(p.before_s)]
    pre_share = sum(before) / len(before) / p.low_per_s if before else 0.0
    in_time = [b for b in res.batches if b["done_ms"] - res.t0_ms <= p.total_s * 1000]
    window_s = p.total_s - plan.oscillation_s
    last_sizes = [
        b["events"]
        for b in res.batches
        if window_s * 1000 <= b["started_ms"] - res.t0_ms < p.total_s * 1000
    ]
    ratios = sorted(s.gate_bytes / s.bytes for s in in_profile if s.bytes >= 1_000_000)
    in_window = [s for s in in_profile if s.t_s >= window_s]
    limits = [s.spark_limit for s in in_window if s.spark_limit is not None]
    return Summary(
        peak_entries=max((s.entries for s in res.samples), default=0),
        peak_bytes=max((s.bytes for s in res.samples), default=0),
        peak_memory=max((s.used_memory for s in res.samples), default=0),
        pre_burst_bytes=pre_bytes,
        pre_burst_share=pre_share,
        drain_threshold=threshold,
        drain_s=drain if pre_share >= 0.9 else None,
        cv=coefficient_of_variation(last),
        admitted=admitted,
        max_admitted_per_s=max(admitted, default=0.0),
        throughput_per_s=sum(b["events"] for b in in_time) / p.total_s,
        fresh_burst=freshness(res.batches, res.t0_ms, p.before_s, p.burst_end_s),
        fresh_after=freshness(res.batches, res.t0_ms, p.burst_end_s, p.total_s),
        peak_gate_bytes=max((s.gate_bytes for s in res.samples), default=0),
        gate_error=(ratios[len(ratios) // 10], ratios[len(ratios) * 9 // 10]) if ratios else None,
        last_mean_per_s=sum(last) / len(last) if last else 0.0,
        last_batch_events=(min(last_sizes), max(last_sizes)) if last_sizes else None,
        spark_throttles=rises([s.spark_bp for s in in_profile]),
        spark_throttles_last=rises([s.spark_bp for s in in_window]),
        gate_closes=rises([s.gate_open is False for s in in_profile]),
        last_spark_limit=(min(limits), max(limits)) if limits else None,
        last_backlog_mean=sum(s.bytes for s in in_window) / len(in_window) if in_window else 0.0,
    )


def per_second(series: Sequence[tuple[float, float, int]], end_s: float) -> list[float]:
    """Acked events/s in each whole second, from the producer's cumulative (t, offered, acked)."""
    out: list[float] = []
    j = 0
    prev = 0
    for k in range(1, int(end_s) + 1):
        while j < len(series) and series[j][0] < k:
            j += 1
        cur = series[j - 1][2] if j else 0
        out.append(float(cur - prev))
        prev = cur
    return out


def flow_changes(res: RunResult) -> dict[str, int]:
    """State changes per stage in the flow timeline during the run (throttle flips etc.)."""
    return dict(Counter(str(e.get("stage")) for e in res.timeline))


# -- report ---------------------------------------------------------------------------------------


def _mb(b: float) -> str:
    return f"{b / 1e6:.1f} MB"


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v / 1000:.1f} s" if v >= 10_000 else f"{v:,.0f} ms"


def _fresh(f: Freshness) -> str:
    return f"{_ms(f.p50_ms)} / {_ms(f.p99_ms)}" if f.batches else "no batches"


def _top(errors: dict[str, int], n: int = 2) -> list[tuple[str, int]]:
    return sorted(errors.items(), key=lambda kv: -kv[1])[:n]


def _times(n: int) -> str:
    return f"{n} time" if n == 1 else f"{n} times"


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def code_version() -> str:
    """The commit under test, and whether src/ differed from it (others edit it meanwhile)."""
    try:
        git = ["git", "-C", str(ROOT)]
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run([*git, "status", "--porcelain", "src"], capture_output=True,
                               text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"commit {head}" + (" with uncommitted changes under src/" if dirty else "")


@dataclass
class RunInfo:
    command: str
    started: str
    load_start: float | None
    code: str = "unknown"
    load_end: float | None = None
    duration_s: float = 0.0


def loss_table(runs: Sequence[tuple[RunResult, Summary]], plan: Plan) -> list[str]:
    out = [
        "| controller | offered | acked | held back | rejected by Redis | counted | lost"
        " (acked − counted) | in the store | peak backlog | peak Redis memory | query failures |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for res, s in runs:
        c = res.counts
        fails = f"{len(res.failures)} ({len(res.restarts)} restarts)" if res.failures else "0"
        out.append(
            f"| `{res.controller}` | {c.offered:,.0f} | {res.acked:,} | {c.held_back:,.0f} |"
            f" {res.rejected:,} | {res.counted:,} | {res.lost_text()} | {res.stored:,} |"
            f" {s.peak_entries:,} entries, {_mb(s.peak_bytes)}"
            f" ({s.peak_bytes / plan.high_watermark:.2f} × HW) | {_mb(s.peak_memory)} |"
            f" {fails} |"
        )
    return out


def timing_table(runs: Sequence[tuple[RunResult, Summary]], plan: Plan) -> list[str]:
    out = [
        "| controller | freshness p50 / p99, burst | freshness p50 / p99, after |"
        f" drain time | oscillation (CV, last {plan.oscillation_s:.0f} s) | admitted / offered,"
        f" last {plan.oscillation_s:.0f} s | throughput | max 1 s admitted | peak ≤ 1.1 × HW |"
        " CV ≤ 10 % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for res, s in runs:
        drain = (
            f"n/a: behind before the burst ({s.pre_burst_share:.0%} admitted)"
            if not s.steady_before
            else "not drained"
            if s.drain_s is None
            else f"{s.drain_s:.1f} s"
        )
        cv = "–" if s.cv is None else f"{s.cv:.1%}"
        out.append(
            f"| `{res.controller}` | {_fresh(s.fresh_burst)} | {_fresh(s.fresh_after)} |"
            f" {drain} | {cv} | {s.last_mean_per_s / res.profile.low_per_s:.0%} |"
            f" {s.throughput_per_s:,.0f}/s | {s.max_admitted_per_s:,.0f}/s |"
            f" {_yes(s.peak_bytes <= PEAK_TARGET * plan.high_watermark)} |"
            f" {_yes(s.cv is not None and s.cv <= CV_TARGET)} |"
        )
    return out


def detail_lines(runs: Sequence[tuple[RunResult, Summary]], plan: Plan) -> list[str]:
    """Per controller, what the tables do not show: how the flow tasks behaved, and anything
    that went wrong."""
    out: list[str] = []
    win = f"the last {plan.oscillation_s:.0f} s"
    for res, s in runs:
        c = res.counts
        bits = []
        if s.last_batch_events is not None:
            lo, hi = s.last_batch_events
            bits.append(
                f"in {win} batches held {lo:,} to {hi:,} events and {s.last_mean_per_s:,.0f}"
                f" events/s were admitted on average (offered {res.profile.low_per_s:,.0f})"
            )
        if s.last_spark_limit is not None:
            lo_l, hi_l = s.last_spark_limit
            bits.append(
                f"Spark's batch limit in {win}: {lo_l:,}"
                + (f" to {hi_l:,}" if hi_l != lo_l else "")
                + f" events (cap {plan.batch_events:,})"
            )
        flow = f"the ingest gate shut {_times(s.gate_closes)}"
        if res.controller != "none":
            flow += (
                f", Spark's backpressure flag went up {_times(s.spark_throttles)}"
                f" ({s.spark_throttles_last} in {win})"
            )
        changes = flow_changes(res)
        if changes:
            flow += "; published state changes: " + ", ".join(
                f"{k} {v}" for k, v in sorted(changes.items())
            )
        bits.append(flow + f"; {res.signals} flow signals")
        off = s.gate_error is not None and (s.gate_error[0] < 0.9 or s.gate_error[1] > 1.1)
        if s.gate_error is not None and off and res.controller != "none":
            lo_r, hi_r = s.gate_error
            bits.append(
                f"the gate's measure of the backlog (`stream_level`, read just after the exact"
                f" size) was {lo_r:.2f}× to {hi_r:.2f}× the exact size (10th to 90th"
                f" percentile); its peak reading {_mb(s.peak_gate_bytes)}"
            )
        if res.rejected:
            errs = "; ".join(f"`{m}` × {n}" for m, n in _top(res.reject_errors))
            bits.append(f"Redis refused XADDs for {res.rejected:,} events ({errs})")
        if c.valve_errors:
            errs = "; ".join(f"`{m}` × {n}" for m, n in _top(c.valve_errors))
            bits.append(f"the ingest valve itself raised ({errs}), holding its flush back")
        if c.lagged >= 1:
            bits.append(f"the producer thread fell behind by {c.lagged:,.0f} events")
        if c.unsent:
            bits.append(f"{c.unsent:,} events were still in the producer's buffer at the end")
        if res.failures:
            first = res.failures[0]
            bits.append(
                f"the streaming query failed {len(res.failures)} times (restarted"
                f" {len(res.restarts)} times, as `sluice run` does), first at {first[0]:.1f} s:"
                f" `{first[1][:240]}`"
            )
        if res.lifted_at_s is not None:
            how = (
                f"it went idle {res.idle_at_s - res.lifted_at_s:.0f} s later"
                if res.idle_at_s is not None
                else f"it was still not idle {res.samples[-1].t_s - res.lifted_at_s:.0f} s later"
            )
            bits.append(
                f"the backlog had not drained {res.lifted_at_s - (res.producer_end_s or 0):.0f} s"
                f" after the load ended, so at {res.lifted_at_s:.0f} s `maxmemory` was lifted and"
                f" the pipeline restarted on its checkpoint with controller `none`; {how}"
            )
        if res.dead_letters:
            bits.append(f"{res.dead_letters:,} dead letters")
        if res.producer_error:
            bits.append(f"the producer stopped early: `{res.producer_error[:200]}`")
        out.append(f"- `{res.controller}`: " + "; ".join(bits) + ".")
    return out


def reading(runs: Sequence[tuple[RunResult, Summary]], plan: Plan) -> list[str]:
    """The claim, and whether this run's numbers support it (every figure from the run)."""
    by = {res.controller: (res, s) for res, s in runs}
    hw = plan.high_watermark
    out = [
        "Reading. The claim under test: stepwise control (seed 000) is smooth, with no load"
        f" oscillation (target: CV ≤ {CV_TARGET:.0%} over {plan.oscillation_s:.0f} s at steady"
        f" load after the burst), and keeps the backlog bounded (target: peak ≤"
        f" {PEAK_TARGET} × HW = {_mb(PEAK_TARGET * hw)}); and no controller loses an"
        " acknowledged event."
    ]
    if "stepwise" in by:
        res, s = by["stepwise"]
        cv = "–" if s.cv is None else f"{s.cv:.1%}"
        smooth = s.cv is not None and s.cv <= CV_TARGET
        bounded = s.peak_bytes <= PEAK_TARGET * hw
        offered = res.profile.low_per_s
        keeps_up = s.last_mean_per_s >= 0.9 * offered
        verdict = (
            "both targets were met in this run"
            if smooth and bounded
            else "the claim did **not** hold in this run"
        )
        line = (
            f"Stepwise: CV {cv} ({'met' if smooth else '**missed**'}), peak backlog"
            f" {s.peak_bytes / hw:.2f} × HW ({'met' if bounded else '**missed**'}): {verdict}."
        )
        if not keeps_up:
            line += (
                f" Over that window Spark admitted only {s.last_mean_per_s:,.0f} events/s of"
                f" the {offered:,.0f} offered ({s.last_mean_per_s / offered:.0%}; the producer"
                " was held back for the rest): it had not recovered to the offered load"
                + (", so the low CV is a steady shortfall, not a steady state." if smooth else ".")
            )
            lim = s.last_spark_limit
            if lim is not None and lim[0] == lim[1] and s.last_backlog_mean >= 0.8 * hw:
                line += (
                    f" Spark's batch limit stayed at {lim[0]:,} events for the whole window while"
                    f" the backlog averaged {_mb(s.last_backlog_mean)} (the high watermark is"
                    f" {_mb(hw)}): a cap that holds input back, but is not lifted."
                )
        if s.spark_throttles_last > 1:
            line += (
                f" In the last {plan.oscillation_s:.0f} s Spark's stepwise flag went up"
                f" {s.spark_throttles_last} times, so its admission was switching between"
                " throttled and released while the offered load was constant"
            )
        elif s.spark_throttles_last == 1:
            line += (
                f" In the last {plan.oscillation_s:.0f} s Spark's stepwise flag went up once"
                " (one throttle, no switching back and forth)"
            )
            if s.last_batch_events is not None:
                line += (
                    f" (batches of {s.last_batch_events[0]:,} to {s.last_batch_events[1]:,} events)"
                )
            line += "."
        out.append(line)
    others = [
        f"`{res.controller}` {s.cv:.0%}" if s.cv is not None else f"`{res.controller}` –"
        for res, s in runs
        if res.controller != "stepwise"
    ]
    if others:
        out.append("Oscillation of the others over the same window: " + ", ".join(others) + ".")
    behind = [
        f"`{res.controller}` {s.pre_burst_share:.0%}" for res, s in runs if not s.steady_before
    ]
    if behind:
        out.append(
            "Already before the burst, at 0.5 C, some controllers admitted less than was offered"
            " (share admitted over its last two thirds): " + ", ".join(behind) + "."
        )
    gated = [(res, s) for res, s in runs if res.controller != "none"]
    if gated:
        over = [f"`{r.controller}` {s.peak_bytes / hw:.2f}×" for r, s in gated]
        out.append(
            "Peak backlog with the ingest gate (every controller but `none`): "
            + ", ".join(over)
            + " HW."
        )
    if gated:
        held = [
            f"`{r.controller}` {r.counts.held_back / r.counts.offered:.0%}"
            for r, _ in gated
            if r.counts.offered > 0
        ]
        out.append("Share of the offered load held back at the producer: " + ", ".join(held) + ".")
    if "none" in by:
        res, s = by["none"]
        if res.rejected or res.failures:
            line = (
                f"Without control (`none`) the backlog reached {_mb(s.peak_bytes)} and Redis"
                f" {_mb(s.peak_memory)} of its {_mb(plan.maxmemory)} `maxmemory`: Redis refused"
                f" {res.rejected:,} events at the door (the producer saw the errors) and the"
                f" streaming query failed {len(res.failures)} times"
            )
            if res.lifted_at_s is not None and res.idle_at_s is not None:
                line += (
                    ", because the slice writes were refused too; the pipeline stayed stuck until"
                    " `maxmemory` was lifted, then drained"
                )
            out.append(line + ".")
        else:
            out.append(
                f"Without control (`none`) the backlog reached {_mb(s.peak_bytes)} and Redis"
                f" {_mb(s.peak_memory)}, within its {_mb(plan.maxmemory)} `maxmemory`."
            )
    losses = [f"`{r.controller}` {r.lost_text()}" for r, _ in runs if r.lost is None or r.lost != 0]
    out.append(
        "Acknowledged events lost: none for any controller."
        if not losses
        else "Acknowledged events not counted: " + ", ".join(losses) + "."
    )
    return [" ".join(out)]


def render_markdown(
    runs: Sequence[tuple[RunResult, Summary]],
    cap: CapacityResult,
    plan: Plan,
    run: RunInfo,
    png: Path,
    md: Path,
) -> str:
    png_rel = os.path.relpath(png, md.parent)
    c = cap.per_s or 0.0
    mode = "quick smoke mode (8 / 8 / 16 s profile)" if plan.quick else "full mode"
    cap_note = (
        f"given on the command line ({c:,.0f} events/s)"
        if cap.given is not None
        else (
            f"{c:,.0f} events/s, measured in the same run: {cap.events:,} events pre-filled and"
            f" drained with controller `none` ({cap.rate.batches} batches after the warm-up one,"
            f" {cap.rate.events:,} events in {cap.rate.wall_s:.1f} s)"
            if cap.rate
            else "not measured"
        )
    )
    lines = [
        f"Command: `{run.command}` (from the repository root), {mode}; took"
        f" {run.duration_s / 60:.1f} min.",
        "",
        f"Date: {run.started}. Code: {run.code}. Machine:"
        f" {machine_note(run.load_start, run.load_end)}. Numbers are single runs; treat them as"
        " indicative."
        + (
            " Quick mode: the phases are too short for the drain and oscillation figures to mean"
            " much; this run checks that the benchmark works."
            if plan.quick
            else ""
        ),
        "",
        "Setup: the throughput benchmark's pipeline (jsonl, 500 events per entry, 2 shards,"
        " 3 metrics with 10 s slices, Spark `local[2]`, 500 ms trigger) with"
        f" `source.max_events_per_batch` {plan.batch_events:,} for every controller, and a slow"
        f" store: the writer's test hook `write_delay_ms` = {plan.write_delay_ms:.0f} (that much"
        " extra time per 1,000 slice updates), so that 3× capacity is a rate one Python"
        f" producer thread can offer. Capacity C: {cap_note}.",
        "",
        f"Profile: {LOW_FACTOR:.1f} C = {LOW_FACTOR * c:,.0f} events/s for {plan.before_s:.0f} s,"
        f" {HIGH_FACTOR:.0f} C = {HIGH_FACTOR * c:,.0f} events/s for {plan.burst_s:.0f} s, then"
        f" {LOW_FACTOR * c:,.0f} events/s for {plan.after_s:.0f} s, from one thread through"
        f" `Producer.from_config` (the ingest valve; `block_timeout_s` {plan.block_timeout_s}),"
        " events from `EventGenerator` with no late events. While a flush is refused the thread"
        " makes no new events: those are *held back* (a client slowing down), not lost. The"
        " producer's pipeline reads every XADD's reply: an entry Redis refuses (e.g. OOM) is"
        " counted as *rejected* and not retried (the client saw the error; nothing was"
        " acknowledged), where the SDK's own `flush` would raise and keep its buffer.",
        "",
        f"Flow settings: `high_watermark` {_mb(plan.high_watermark)} (HW),"
        f" `low_watermark` {_mb(plan.low_watermark)}, every other `backpressure` field at its"
        f" default (tick 250 ms, sensitivity 2 s, step 0.5, store latency 1 s / 200 ms); `fixed`"
        f" runs at `fixed_rate` = C. Each controller gets a fresh embedded Redis with `maxmemory`"
        f" {_mb(plan.maxmemory)} (`noeviction`), set after a {WARM_UP_EVENTS:,}-event warm-up.",
        "",
        f"Drain and settling: after the load the pipeline gets {plan.drain_timeout_s:.0f} s to go"
        " idle; if it does not, `maxmemory` is lifted and the pipeline restarts on the same"
        " checkpoint with controller `none`, as an operator would, for at most"
        f" {plan.settle_timeout_s:.0f} s, so that the loss count can be settled.",
        "",
        "Measures: backlog = entries and exact bytes (`MEMORY USAGE … SAMPLES 0`) of the input"
        " streams, sampled"
        f" every {SAMPLE_EVERY_S * 1000:.0f} ms; memory = Redis `used_memory`. Lost = acknowledged"
        " by Redis − counted by the pipeline (`events_in`) after the drain; *in the store* ="
        " `txn_count` summed over every key and slice, a second count. Freshness per batch as"
        " `sluice status` computes it: p50 over (done − newest event) and (done − oldest event),"
        " p99 over (done − oldest event); burst = batches done in the burst, after = the rest of"
        " the profile. Drain time = from the end of the burst until the backlog is at or under"
        " its pre-burst peak (or the low watermark, if higher) for the rest of the profile; n/a"
        " for a controller that admitted under 90 % of the offered 0.5 C before the burst."
        " Oscillation = coefficient of variation of the per-second admitted rate (each batch's"
        " events spread over the time since the previous batch started) over the last"
        f" {plan.oscillation_s:.0f} s. Throughput = events in the batches done during the"
        " profile / its length.",
        "",
        *loss_table(runs, plan),
        "",
        *timing_table(runs, plan),
        "",
        *detail_lines(runs, plan),
        "",
        *reading(runs, plan),
        "",
        f"![backlog and admitted rate per controller]({png_rel})",
        "",
    ]
    return "\n".join(lines)


def print_summary(runs: Sequence[tuple[RunResult, Summary]], plan: Plan) -> None:
    print("Sluice burst benchmark")
    print(f"{'controller':<10} {'acked':>10} {'lost':>8} {'rejected':>9} {'peak MB':>8}"
          f" {'xHW':>5} {'mem MB':>7} {'drain s':>8} {'CV':>6} {'ev/s':>8}")  # fmt: skip
    for res, s in runs:
        drain = "–" if s.drain_s is None else f"{s.drain_s:.1f}"
        cv = "–" if s.cv is None else f"{s.cv:.1%}"
        print(
            f"{res.controller:<10} {res.acked:>10,} {res.lost_text():>8} {res.rejected:>9,}"
            f" {s.peak_bytes / 1e6:>8.2f} {s.peak_bytes / plan.high_watermark:>5.2f}"
            f" {s.peak_memory / 1e6:>7.1f} {drain:>8} {cv:>6} {s.throughput_per_s:>8,.0f}"
        )


# -- plot -----------------------------------------------------------------------------------------


def plot(runs: Sequence[tuple[RunResult, Summary]], plan: Plan, png: Path) -> None:
    """Per controller: backlog bytes and Redis memory (left); offered, acked and admitted
    events/s with the Spark controller's rate (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 2, figsize=(13, 3.2 * len(runs)), squeeze=False)
    for row, (res, s) in zip(axes, runs, strict=True):
        _plot_backlog(row[0], res, plan)
        _plot_rates(row[1], res, s)
        end_s = max([res.profile.total_s, *(x.t_s for x in res.samples)])
        for ax in row:
            ax.set_xlim(0, end_s)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=90)
    plt.close(fig)


def _shade_burst(ax: Any, p: LoadProfile) -> None:
    ax.axvspan(p.before_s, p.burst_end_s, color="tab:red", alpha=0.06)


def _plot_backlog(ax: Any, res: RunResult, plan: Plan) -> None:
    ts = [s.t_s for s in res.samples]
    ax.plot(ts, [s.bytes / 1e6 for s in res.samples], color="tab:orange", label="backlog")
    ax.plot(ts, [s.gate_bytes / 1e6 for s in res.samples], color="tab:orange", lw=0.6, ls=":",
            label="backlog as the gate measures it")  # fmt: skip
    ax.plot(ts, [s.used_memory / 1e6 for s in res.samples], color="tab:gray", lw=0.8,
            label="Redis used_memory")  # fmt: skip
    ax.axhline(plan.high_watermark / 1e6, color="tab:red", ls="--", lw=1, label="high watermark")
    ax.axhline(plan.maxmemory / 1e6, color="black", ls=":", lw=1, label="maxmemory")
    _shade_burst(ax, res.profile)
    if res.lifted_at_s is not None:
        ax.axvline(res.lifted_at_s, color="black", lw=1, label="settling: none, no maxmemory")
    ax.set_title(f"{res.controller}: input backlog")
    ax.set_xlabel("s since the profile started")
    ax.set_ylabel("MB")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")


def _plot_rates(ax: Any, res: RunResult, s: Summary) -> None:
    p = res.profile
    steps = [0.0, p.before_s, p.before_s, p.burst_end_s, p.burst_end_s, p.total_s]
    offered = [p.low_per_s, p.low_per_s, p.high_per_s, p.high_per_s, p.low_per_s, p.low_per_s]
    ax.plot(steps, offered, color="tab:red", lw=1.2, label="offered")
    acked = per_second(res.producer_series, p.total_s)
    ax.step(range(1, len(acked) + 1), acked, color="tab:green", lw=0.9, where="pre",
            label="acked by Redis")  # fmt: skip
    ax.step(range(1, len(s.admitted) + 1), s.admitted, color="tab:blue", lw=1.2, where="pre",
            label="admitted by Spark")  # fmt: skip
    lim = [(x.t_s, x.spark_rate) for x in res.samples if x.spark_rate is not None]
    if lim:
        ax.plot([t for t, _ in lim], [r for _, r in lim], color="tab:purple", lw=0.8, ls=":",
                label="Spark controller rate")  # fmt: skip
    _shade_burst(ax, p)
    ax.set_ylim(0, p.high_per_s * 1.3)
    ax.set_title(f"{res.controller}: events/s")
    ax.set_xlabel("s since the profile started")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")


def dump_runs(path: Path, runs: Sequence[tuple[RunResult, Summary]], cap: CapacityResult) -> None:
    """The raw material of the tables, for a closer look (not written by default)."""
    data = {
        "capacity_per_s": cap.per_s,
        "runs": [{"result": asdict(res), "summary": asdict(s)} for res, s in runs],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, default=str))


# -- main -----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="~6 minute smoke run (8/8/16 s profile)")
    p.add_argument("--controllers", default=",".join(CONTROLLERS),
                   help="comma-separated subset of " + ",".join(CONTROLLERS))  # fmt: skip
    p.add_argument("--capacity", type=float, default=None,
                   help="events/s to use as C instead of measuring it")  # fmt: skip
    p.add_argument("--write-delay-ms", type=float, default=200.0,
                   help="the writer's extra store time per 1,000 slice updates")  # fmt: skip
    p.add_argument("--batch-events", type=int, default=20_000,
                   help="source.max_events_per_batch")  # fmt: skip
    p.add_argument("--high-watermark", default="8MB")
    p.add_argument("--low-watermark", default="1MB")
    p.add_argument("--maxmemory", default="40MB", help="Redis maxmemory per controller run")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--md", type=Path, default=ROOT / "docs" / "benchmarks.md")
    p.add_argument("--png", type=Path, default=ROOT / "docs" / "burst.png")
    p.add_argument("--keep-state", action="store_true", help="keep the temporary state dirs")
    p.add_argument("--dump", type=Path, default=None,
                   help="also write every sample, batch and flow state change (JSON)")  # fmt: skip
    args = p.parse_args(argv)
    names = [c.strip() for c in args.controllers.split(",") if c.strip()]
    bad = [c for c in names if c not in CONTROLLERS]
    if bad or not names:
        p.error(
            f"--controllers: expected some of {','.join(CONTROLLERS)}, got {args.controllers!r}"
        )
    args.controller_list = names
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("SLUICE_SPARK_LOG_LEVEL", "ERROR")  # read by build_spark
    plan = make_plan(args)
    run = RunInfo(
        command=shlex.join(
            [display_path(sys.executable), display_path(sys.argv[0]), *sys.argv[1:]]
        ),
        started=dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        load_start=load_average(),
        code=code_version(),
    )
    ws = Workspace(args.keep_state)
    t0 = time.monotonic()
    runs: list[tuple[RunResult, Summary]] = []
    spark: SparkSession | None = None
    try:
        log(f"building Spark ({'quick' if plan.quick else 'full'} run)")
        spark = build_spark(burst_config(ws.state_dir("spark"), plan, "none", None), "sluice-bench")
        if plan.capacity is None:
            cap = measure_capacity(spark, plan, ws)
        else:
            cap = CapacityResult(0, True, None, given=plan.capacity)
        c = cap.per_s
        if not c:
            raise SystemExit("could not measure the capacity (no drain rate); nothing to offer")
        for name in plan.controllers:
            log(f"== {name}")
            res = run_controller(spark, plan, ws, name, c)
            runs.append((res, summarize_run(res, plan)))
    finally:
        if spark is not None:
            spark.stop()
        ws.cleanup()
    run.load_end = load_average()
    run.duration_s = time.monotonic() - t0
    body = render_markdown(runs, cap, plan, run, args.png, args.md)
    replace_section(args.md, HEADING, body)
    plot(runs, plan, args.png)
    if args.dump is not None:
        dump_runs(args.dump, runs, cap)
    log(f"wrote {display_path(str(args.md))} and {display_path(str(args.png))}"
        f" in {time.monotonic() - t0:.0f} s")  # fmt: skip
    print_summary(runs, plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
