"""Audit benchmark: what the per-batch XOR completeness audit costs, and how fast `sluice run`
comes back from a `kill -9`.

    .venv/bin/python bench/audit.py            # full run, about 14 minutes
    .venv/bin/python bench/audit.py --quick    # smoke run, about 6 minutes

1. cost: per format (`jsonl`, `fields`), drain a pre-filled backlog with `audit.enabled` true and
   false, alternating in ABBA order (on/off, off/on, on/off, ...) in one Spark session, a fresh
   embedded Redis and state_dir per run; events/s from the batch records (warm-up batch
   excluded, as in bench/throughput.py), medians and the on/off ratio, and the per-batch
   `audit_ms` (source-side Lua read + XOR) from the records.
2. memory: the ledger's Redis footprint (`MEMORY USAGE ... SAMPLES 0` of the ledger hashes and
   the failures list) after the audited drains, and filled to its bound through the real
   `Ledger.record`; the driver's transient memory in `source_xor` (tracemalloc over one direct
   call against a real stream).
3. recovery: `sluice run -c <yaml>` as a child process against an embedded Redis this script
   starts, a paced producer beside it; SIGKILL the process group at random moments, restart it
   at once, and time restart -> first recorded batch and kill -> backlog back to its pre-kill
   level. At the end: events_in == events produced, the store's `txn_count` total, audit_ok vs
   batches.

Results go to the `## Audit cost and crash recovery (bench/audit.py)` section of
docs/benchmarks.md, the recovery timeline to docs/audit_recovery.png, a summary to stdout,
progress to stderr.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import yaml
from pyspark.sql import SparkSession

from _audit_util import (
    LedgerMemory,
    Sample,
    SluiceProcess,
    SteadyProducer,
    XorMemory,
    XorTiming,
    fill_ledger,
    is_busy,
    ledger_cap,
    ledger_memory,
    sample,
    source_xor_memory,
    source_xor_scaling,
)
from _burst_util import count_metric_total
from _util import (
    JSONL_EVENTS_PER_ENTRY,
    METRICS,
    SCHEMA,
    SHARDS,
    BatchRate,
    LoadPool,
    batch_rate,
    bench_config,
    build_pool,
    log,
    prefill,
    replace_section,
)
from sluice.config import AuditConfig, Config, config_from_dict
from sluice.flow.board import TIMELINE_LEN, Board
from sluice.flow.stages import SPARK
from sluice.pipeline.audit import LEDGER_KEEP, SOURCE_CHUNK
from sluice.pipeline.job import Pipeline
from sluice.pipeline.spark import build_spark
from sluice.pipeline.status import backlog, recent_batches
from sluice.redis.connection import client_for
from sluice.redis.embedded import EmbeddedRedis
from throughput import (
    Workspace,
    display_path,
    load_average,
    machine_note,
    now_ms,
    pipeline_run,
    stat_counter,
)

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## Audit cost and crash recovery (bench/audit.py)"
STREAM = "events"
LEDGER_SHARDS = AuditConfig().ledger_shards
SEED_003_BYTES = 20  # seed 003's acker: about 20 bytes per tracked tuple
SAMPLE_S = 0.2  # recovery: Redis is sampled this often
PREKILL_WINDOW_S = 5.0  # pre-kill backlog level = its peak over this long before the kill
FIRST_BATCH_TIMEOUT_S = 240.0
RECOVER_TIMEOUT_S = 180.0
CAUGHT_UP_S = 4.0  # before the steady run: backlog under this many seconds of input


# -- plan ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CostPlan:
    fmt: str
    batch_events: int  # source.max_events_per_batch
    drain_events: int  # pre-filled per run
    pool_events: int  # distinct pre-generated events, cycled


@dataclass(frozen=True)
class Plan:
    quick: bool
    costs: tuple[CostPlan, ...]
    pairs: int  # on/off pairs per format
    xor_events: dict[str, int]  # events written for the direct source_xor call
    scaling_entries: tuple[int, ...]  # jsonl entries per Lua call, for the scaling sweep
    kills: int
    kill_rate_per_s: float
    kill_batch_events: int
    kill_pool_events: int
    steady_s: tuple[float, float]  # run this long (uniform) before each kill
    controller: str  # backpressure.controller for every run
    seed: int


# Batch caps as in bench/throughput.py (jsonl's 1M is also the config default).
QUICK_COSTS = {
    "jsonl": CostPlan("jsonl", 100_000, 400_000, 100_000),
    "fields": CostPlan("fields", 20_000, 80_000, 40_000),
}
FULL_COSTS = {
    "jsonl": CostPlan("jsonl", 1_000_000, 3_000_000, 200_000),
    "fields": CostPlan("fields", 200_000, 800_000, 100_000),
}


def make_plan(args: argparse.Namespace) -> Plan:
    q = args.quick
    costs = QUICK_COSTS if q else FULL_COSTS
    return Plan(
        quick=q,
        costs=tuple(costs[f] for f in args.format_list),
        pairs=args.pairs or (1 if q else 3),
        xor_events={"jsonl": 50_000, "fields": 12_000} if q else
                   {"jsonl": 100_000, "fields": 30_000},
        scaling_entries=(20, 200) if q else (20, 100, 400, 2000),
        kills=args.kills or (2 if q else 4),
        kill_rate_per_s=args.kill_rate or (10_000.0 if q else 50_000.0),
        kill_batch_events=100_000 if q else 1_000_000,
        kill_pool_events=50_000 if q else 200_000,
        steady_s=(3.0, 6.0) if q else (5.0, 10.0),
        controller=args.controller,
        seed=args.seed,
    )  # fmt: skip


# -- 1. cost: drains with the audit on and off ------------------------------------------------


@dataclass
class DrainRun:
    fmt: str
    audit: bool
    seq: int  # position in the run order (per format)
    prefilled: int
    idle: bool
    events_in: int
    batches: int
    audit_ok: int
    audit_failed: int
    events_admitted: int
    records: list[dict[str, Any]]
    rate: BatchRate | None
    ledger: LedgerMemory | None
    busy_polls: int  # the bench's polls answered BUSY (a script ran over lua-time-limit)

    def measured(self) -> list[dict[str, Any]]:
        """The batch records the rate is taken over (the warm-up batch dropped)."""
        return sorted(self.records, key=lambda r: r["batch"])[1:]

    def problems(self) -> list[str]:
        out = []
        if not self.idle:
            out.append("did not drain in time")
        if self.events_in != self.prefilled:
            out.append(f"events_in {self.events_in:,} != {self.prefilled:,} written")
        if self.audit and (self.audit_ok != self.batches or self.audit_failed):
            out.append(f"audit_ok {self.audit_ok} / failed {self.audit_failed}, {self.batches}"
                       " batches")  # fmt: skip
        if self.audit and self.events_admitted != self.events_in:
            out.append(f"events_admitted {self.events_admitted:,} != events_in")
        return out


def audited_config(
    fmt: str, state_dir: Path, batch_events: int, audit: bool, controller: str = "none"
) -> Config:
    """`bench_config` with the audit on or off and `backpressure.controller` set."""
    cfg = bench_config(fmt, state_dir, batch_events)
    return cfg.model_copy(
        update={
            "audit": cfg.audit.model_copy(update={"enabled": audit}),
            "backpressure": cfg.backpressure.model_copy(update={"controller": controller}),
        }
    )


def drain_once(
    spark: SparkSession, cp: CostPlan, ws: Workspace, pool: LoadPool, audit: bool, seq: int,
    n_events: int, timeout_s: float, controller: str,
) -> DrainRun:  # fmt: skip
    """Pre-fill `n_events` into a fresh embedded Redis, start a Pipeline, wait until idle."""
    label = f"{cp.fmt}-{'on' if audit else 'off'}-{seq}"
    cfg = audited_config(cp.fmt, ws.state_dir(label), cp.batch_events, audit, controller)
    with pipeline_run(spark, cfg) as (pipeline, handle):
        sent = prefill(handle.url, pool, n_events)
        pipeline.start()
        idle, busy = wait_drained(pipeline, handle.client, cfg, timeout_s, label)
        c = handle.client
        records = recent_batches(c, 600)
        run = DrainRun(
            fmt=cp.fmt, audit=audit, seq=seq, prefilled=sent, idle=idle,
            events_in=stat_counter(c, "events_in"), batches=stat_counter(c, "batches"),
            audit_ok=stat_counter(c, "audit_ok"), audit_failed=stat_counter(c, "audit_failed"),
            events_admitted=stat_counter(c, "events_admitted"), records=records,
            rate=batch_rate(records),
            ledger=ledger_memory(c, STREAM, LEDGER_SHARDS) if audit else None, busy_polls=busy,
        )  # fmt: skip
    r = run.rate
    log(
        f"{label}: {sent:,} events, {len(records)} batches, "
        + (f"{r.wall_per_s:,.0f} events/s" if r else "too few batches")
        + (f"; PROBLEM: {'; '.join(run.problems())}" if run.problems() else "")
    )
    return run


def wait_drained(
    pipeline: Pipeline, client: Any, cfg: Config, timeout_s: float, what: str
) -> tuple[bool, int]:
    """`Pipeline.wait_idle` in 5 s slices with a progress line each, riding out BUSY replies
    (Redis refuses other clients while a script runs over 5 s). (idle, BUSY polls)."""
    deadline = time.monotonic() + timeout_s
    busy = 0
    while time.monotonic() < deadline:
        try:
            if pipeline.wait_idle(timeout_s=min(5.0, max(0.1, deadline - time.monotonic()))):
                return True, busy
            entries, _ = backlog(client, cfg)
        except redis.exceptions.ResponseError as e:
            if not is_busy(e):
                raise
            busy += 1
            log(f"{what}: redis answers BUSY (a Lua script has run over 5 s)")
            time.sleep(1.0)
            continue
        log(f"{what}: {stat_counter(client, 'events_in'):,} events in, {entries:,} entries left")
    return False, busy


def run_costs(spark: SparkSession, plan: Plan, ws: Workspace) -> list[DrainRun]:
    """Per format: one uncounted warm-up drain, then `plan.pairs` pairs in ABBA order."""
    runs: list[DrainRun] = []
    timeout_s = 120.0 if plan.quick else 300.0
    for cp in plan.costs:
        pool = build_pool(
            audited_config(cp.fmt, ws.root, cp.batch_events, True), cp.pool_events, plan.seed,
            now_ms(),
        )  # fmt: skip
        log(f"== cost {cp.fmt}: warm-up drain, audit off (not counted)")
        drain_once(spark, cp, ws, pool, False, 0, 2 * cp.batch_events, timeout_s, plan.controller)
        seq = 0
        for pair in range(plan.pairs):
            for audit in (True, False) if pair % 2 == 0 else (False, True):
                seq += 1
                runs.append(drain_once(spark, cp, ws, pool, audit, seq, cp.drain_events,
                                       timeout_s, plan.controller))  # fmt: skip
    return runs


# -- 2. memory -----------------------------------------------------------------------------------


@dataclass
class MemoryResult:
    bound: LedgerMemory
    bound_batches: int  # records written to reach it
    xor: list[XorMemory]
    scaling: list[XorTiming]


def run_memory(plan: Plan, ws: Workspace) -> MemoryResult:
    """The ledger at its bound, and `source_xor` per format, on one fresh embedded Redis."""
    with EmbeddedRedis(ws.state_dir("memory") / "redis") as server:
        client = client_for(server.url, timeout_s=60)
        n = ledger_cap(LEDGER_SHARDS) + LEDGER_SHARDS * 64
        log(f"== memory: {n:,} ledger records through Ledger.record")
        bound = fill_ledger(client, STREAM, LEDGER_SHARDS, n, 1_000_000, plan.seed)
        xors: list[XorMemory] = []
        for cp in plan.costs:
            client.flushall()
            cfg = bench_config(cp.fmt, ws.root, cp.batch_events)
            pool = build_pool(cfg, min(cp.pool_events, plan.xor_events[cp.fmt]), plan.seed,
                              now_ms())  # fmt: skip
            x = source_xor_memory(server.url, cfg, pool, plan.xor_events[cp.fmt])
            log(
                f"memory {cp.fmt}: source_xor over {x.events:,} events ({x.entries:,} entries):"
                f" peak {x.peak_bytes / 1e6:.1f} MB above baseline, {x.bytes_per_event:.1f} B"
                f" per event of the largest chunk ({x.chunk_events:,} events), {x.call_ms:.0f} ms"
            )
            xors.append(x)
        client.close()
    cfg = bench_config("jsonl", ws.root, 1)
    # Cycled for the larger sizes; the first shard gets about 2/3 of the events.
    n_pool = min(200_000, round(max(plan.scaling_entries) * JSONL_EVENTS_PER_ENTRY * 1.6))
    pool = one_shard(build_pool(cfg, n_pool, plan.seed, now_ms()), cfg.source.shard_keys()[0])
    scaling: list[XorTiming] = []
    for entries in plan.scaling_entries:
        with EmbeddedRedis(ws.state_dir(f"lua-{entries}") / "redis") as server:
            (t,) = source_xor_scaling(server.url, cfg, pool, [entries])
        log(f"source_xor over {t.entries:,} jsonl entries ({t.events:,} events) on"
            f" a fresh Redis: {t.call_ms:,.0f} ms = {t.us_per_event:.2f} us per event; longest"
            f" PING meanwhile {t.ping_max_ms:,.0f} ms, {t.ping_busy} BUSY")  # fmt: skip
        scaling.append(t)
    return MemoryResult(bound, n, xors, scaling)


def one_shard(pool: LoadPool, shard: str) -> LoadPool:
    """The pool's XADDs to `shard` only (`_util` shards by the fixed SHARDS)."""
    key = shard.encode()
    keep = [i for i, c in enumerate(pool.commands) if c.split(b"\r\n")[4] == key]
    return LoadPool(
        [pool.commands[i] for i in keep],
        [pool.events[i] for i in keep],
        (sum(pool.events[i] for i in keep),),
    )


# -- 3. recovery after kill -9 -------------------------------------------------------------------


@dataclass
class Cycle:
    """One incarnation of `sluice run`: started cold (index 0) or right after a SIGKILL."""

    index: int
    spawn_ms: int  # the process was started (right after the kill, for index > 0)
    killed_ms: int | None = None  # the previous incarnation was killed
    prekill_level: int | None = None  # backlog peak over PREKILL_WINDOW_S before the kill
    backlog_at_kill: int | None = None
    last_batch_at_kill: int | None = None
    steady_before_kill_s: float | None = None  # how long the previous one ran after recovery
    supervisor_ms: int | None = None  # first heartbeat of the new supervisor (JVM + session up)
    query_ms: int | None = None  # the new streaming query started (health -> running)
    first_batch: int | None = None
    first_done_ms: int | None = None  # the first batch this incarnation recorded
    back_ms: int | None = None  # first sample after that with backlog <= prekill_level
    peak_backlog: int = 0
    gave_up_ms: int | None = None  # the backlog was not back within RECOVER_TIMEOUT_S
    first_record: dict[str, Any] | None = None  # the first recorded batch's record
    catchup: list[dict[str, Any]] = field(default_factory=list)  # records after it, to back_ms
    throttled_rates: list[float] = field(default_factory=list)  # Spark admission under pressure

    def catchup_until_ms(self) -> int | None:
        """The end of the catch-up: back at the pre-kill level, or given up."""
        return self.back_ms if self.back_ms is not None else self.gave_up_ms

    def first_batch_s(self) -> float | None:
        return _span_s(self.spawn_ms, self.first_done_ms)

    def back_s(self) -> float | None:
        return _span_s(self.killed_ms, self.back_ms)


def _span_s(a: int | None, b: int | None) -> float | None:
    return None if a is None or b is None else (b - a) / 1000


@dataclass
class RecoveryResult:
    rate_per_s: float
    batch_events: int
    trigger_s: float
    cycles: list[Cycle] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    t0_ms: int = 0
    produced: int = 0
    achieved_per_s: float = 0.0
    drained: bool = False
    final: dict[str, int] = field(default_factory=dict)
    txn_count_total: int | None = None
    exit_code: int | None = None
    errors_logged: int = 0
    busy_polls: int = 0  # samples Redis refused with BUSY (a script ran over lua-time-limit)
    busy_replies: int = 0  # producer commands refused with BUSY (and sent again)
    stopped: str = ""  # why the run made fewer kills than planned
    records: list[dict[str, Any]] = field(default_factory=list)  # every batch record, at the end
    flow: list[dict[str, Any]] = field(default_factory=list)  # the Spark task's state changes

    def kills(self) -> list[Cycle]:
        return [c for c in self.cycles if c.killed_ms is not None]


def recovery_yaml(url: str, state_dir: Path, batch_events: int, controller: str) -> dict[str, Any]:
    """`bench_config("jsonl", ...)` as a sluice.yaml, plus the bench's Redis and the audit on."""
    return {
        "redis": url,
        "state_dir": str(state_dir),
        "audit": {"enabled": True},
        "backpressure": {"controller": controller},
        "source": {
            "stream": STREAM, "shards": SHARDS, "format": "jsonl", "schema": SCHEMA,
            "time_field": "ts", "max_events_per_batch": batch_events,
        },
        "metrics": METRICS,
    }  # fmt: skip


class WaitTimeout(RuntimeError):
    """The recovery run waited in vain (the pipeline did not catch up in time)."""


class Recovery:
    """Drives one recovery run: the process, the producer and the sampling loop."""

    def __init__(self, plan: Plan, root: Path, url: str, rng: random.Random) -> None:
        self.plan = plan
        self.rng = rng
        data = recovery_yaml(url, root / "state", plan.kill_batch_events, plan.controller)
        self.cfg = config_from_dict(data)
        (root / "sluice.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        self.log_path = root / "sluice.log"
        self.proc = SluiceProcess(root / "sluice.yaml", self.log_path)
        self.client = client_for(url)
        pool = build_pool(self.cfg, plan.kill_pool_events, plan.seed + 1, now_ms())
        self.per_entry = pool.events_per_entry()
        self.producer = SteadyProducer(url, pool, plan.kill_rate_per_s)
        self.res = RecoveryResult(
            plan.kill_rate_per_s, plan.kill_batch_events, self.cfg.spark.trigger / 1000
        )

    def look(self) -> Sample:
        s = sample(self.client, self.cfg, self.per_entry)
        self.res.samples.append(s)
        return s

    def wait_for(self, ok: Callable[[Sample], bool], timeout_s: float, what: str) -> Sample:
        """Sample every SAMPLE_S until `ok`; raise if the process or the producer died."""
        deadline = time.monotonic() + timeout_s
        next_log = time.monotonic() + 10
        while True:
            try:
                s = self.look()
            except redis.exceptions.ResponseError as e:
                if not is_busy(e):
                    raise
                self.res.busy_polls += 1
                if time.monotonic() > deadline:
                    raise WaitTimeout(
                        f"timed out after {timeout_s:.0f} s waiting for {what}"
                    ) from e
                time.sleep(SAMPLE_S)
                continue
            if ok(s):
                return s
            if not self.proc.alive():
                raise RuntimeError(f"`sluice run` exited while waiting for {what};"
                                   f" see {self.log_path}")  # fmt: skip
            if self.producer.error is not None:
                raise RuntimeError(f"the producer failed: {self.producer.error}")
            if time.monotonic() > deadline:
                raise WaitTimeout(f"timed out after {timeout_s:.0f} s waiting for {what}")
            if time.monotonic() > next_log:
                log(f"recovery: waiting for {what}; backlog {s.backlog_events:,} events,"
                    f" health {s.state!r}")  # fmt: skip
                next_log += 10
            time.sleep(SAMPLE_S)

    def run(self) -> RecoveryResult:
        res = self.res
        res.t0_ms = now_ms()
        self.producer.start()
        try:
            try:
                cycle: Cycle | None = Cycle(0, self._spawn())
                for k in range(self.plan.kills + 1):
                    assert cycle is not None
                    back = self._come_back(cycle)
                    res.cycles.append(cycle)
                    if k == self.plan.kills or not back:
                        break
                    cycle = self._run_then_kill(k + 1)
                    if cycle is None:
                        break
            finally:
                self.producer.stop()
                self.producer.join(timeout=30)
            res.produced = self.producer.sent_events
            res.achieved_per_s = self.producer.achieved_per_s()
            res.busy_replies = self.producer.busy_replies
            self._drain_and_check()
        finally:
            if self.proc.alive():
                self.proc.stop(timeout_s=30)
            self.client.close()
        return res

    def _spawn(self) -> int:
        self.proc.start()
        return now_ms()

    def _come_back(self, c: Cycle) -> bool:
        """Wait for the incarnation's first recorded batch, then (after a kill) for the backlog
        to be back at its pre-kill level. False if it was not back within RECOVER_TIMEOUT_S."""
        s = self.wait_for(
            lambda s: s.last_done_ms is not None and s.last_done_ms > c.spawn_ms,
            FIRST_BATCH_TIMEOUT_S, f"the first batch of start {c.index + 1}",
        )  # fmt: skip
        c.first_batch, c.first_done_ms = s.last_batch, s.last_done_ms
        since = [x for x in self.res.samples if x.t_ms >= c.spawn_ms]
        beats = [x.heartbeat_ms for x in since if x.heartbeat_ms and x.heartbeat_ms > c.spawn_ms]
        starts = [x.changed_ms for x in since if x.changed_ms and x.changed_ms > c.spawn_ms]
        c.supervisor_ms = min(beats) if beats else None
        c.query_ms = min(starts) if starts else None
        back = True
        if c.prekill_level is not None:
            level = c.prekill_level
            try:
                s = self.wait_for(lambda s: s.backlog_events <= level, RECOVER_TIMEOUT_S,
                                  "the backlog to come back to its pre-kill level")  # fmt: skip
                c.back_ms = s.t_ms
            except WaitTimeout as e:
                log(f"recovery: {e}; no further kills")
                self.res.stopped = (
                    f"start {c.index + 1}: backlog not back within {RECOVER_TIMEOUT_S:.0f} s"
                )
                c.gave_up_ms = now_ms()
                back = False
        c.peak_backlog = max(x.backlog_events for x in self.res.samples if x.t_ms >= c.spawn_ms)
        log(
            f"recovery: start {c.index + 1}: first batch {c.first_batch} after"
            f" {c.first_batch_s():.1f} s"
            + (f", backlog back after {c.back_s():.1f} s (peak {c.peak_backlog:,})"
               if c.back_ms else "")
        )  # fmt: skip
        return back

    def _run_then_kill(self, index: int) -> Cycle | None:
        """Run steadily, SIGKILL, restart; None (no kill) if the backlog never got small."""
        caught_up = self.plan.kill_rate_per_s * CAUGHT_UP_S
        try:
            self.wait_for(lambda s: s.backlog_events <= caught_up, RECOVER_TIMEOUT_S,
                          f"the backlog to fall under {CAUGHT_UP_S:.0f} s of input")  # fmt: skip
        except WaitTimeout as e:
            log(f"recovery: {e}; no further kills")
            self.res.stopped = (
                f"before kill {index}: backlog not under {CAUGHT_UP_S:.0f} s of input"
            )
            return None
        steady_s = self.rng.uniform(*self.plan.steady_s)
        until = now_ms() + steady_s * 1000
        steady_from = now_ms()
        self.wait_for(lambda s: s.t_ms >= until, steady_s + 30, "the steady run")
        since = max(steady_from, until - PREKILL_WINDOW_S * 1000)
        window = [x for x in self.res.samples if x.t_ms >= since]
        last = self.res.samples[-1]
        killed_ms = now_ms()
        self.proc.kill9()
        c = Cycle(index, self._spawn(), killed_ms=killed_ms)
        c.prekill_level = max(x.backlog_events for x in window)
        c.backlog_at_kill = last.backlog_events
        c.last_batch_at_kill = last.last_batch
        c.steady_before_kill_s = steady_s
        log(f"recovery: SIGKILL {index} after {steady_s:.1f} s steady (last batch"
            f" {last.last_batch}, backlog {last.backlog_events:,}); restarted")  # fmt: skip
        return c

    def _drain_and_check(self) -> None:
        res = self.res
        produced = res.produced
        try:
            self.wait_for(lambda s: s.backlog_events == 0 and s.events_in >= produced,
                          2 * RECOVER_TIMEOUT_S, "the final drain")  # fmt: skip
            res.drained = True
        except WaitTimeout as e:
            log(f"recovery: {e}")
        time.sleep(2.0)  # let a last record settle
        c = self.client
        res.final = {
            k: stat_counter(c, k)
            for k in ("events_in", "batches", "audit_ok", "audit_failed", "audit_replays",
                      "events_admitted", "dead_letters", "events_aggregated")
        }  # fmt: skip
        res.txn_count_total = count_metric_total(c, "txn_count")
        res.records = sorted(recent_batches(c, 600), key=lambda r: r["batch"])
        by_id = {r["batch"]: r for r in res.records}
        res.flow = sorted(
            (st for st in Board(c).timeline(TIMELINE_LEN) if st.get("stage") == SPARK),
            key=lambda st: st["updated_ms"],
        )
        for cycle in res.cycles:
            cycle.first_record = by_id.get(cycle.first_batch)
            hi_ms = cycle.catchup_until_ms()
            if cycle.first_done_ms is not None and hi_ms is not None:
                lo, hi = cycle.first_done_ms, hi_ms
                cycle.catchup = [r for r in res.records if lo < r["done_ms"] <= hi]
                cycle.throttled_rates = [
                    float(st["rate"]) for st in res.flow
                    if cycle.spawn_ms <= st["updated_ms"] <= hi and st.get("backpressure")
                ]  # fmt: skip
        res.exit_code = self.proc.stop()
        text = self.log_path.read_text(errors="replace")
        res.errors_logged = text.count("level=ERROR")


def run_recovery(plan: Plan, ws: Workspace) -> RecoveryResult:
    root = ws.state_dir("recovery")
    rng = random.Random(plan.seed)
    log(f"== recovery: {plan.kills} SIGKILLs, producer at {plan.kill_rate_per_s:,.0f} events/s")
    with EmbeddedRedis(root / "redis") as server:
        return Recovery(plan, root, server.url, rng).run()


# -- report -------------------------------------------------------------------------------------


def _n(v: float | None, fmt: str = ",.0f", unit: str = "") -> str:
    return "–" if v is None else f"{v:{fmt}}{unit}"


def _median(vs: Sequence[float]) -> float | None:
    return statistics.median(vs) if vs else None


def _audit_ms(runs: Sequence[DrainRun]) -> list[float]:
    return [r["audit"]["audit_ms"] for run in runs for r in run.measured() if "audit" in r]


def cost_table(runs: Sequence[DrainRun], plan: Plan) -> list[str]:
    out = [
        "| format | batch cap | audit on: events/s, median | audit off: events/s, median |"
        " on / off | runs, on (in run order) | runs, off | `audit_ms` per batch: median / max |"
        " audit_ms / batch time |",
        "|---|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for cp in plan.costs:
        on = [r for r in runs if r.fmt == cp.fmt and r.audit]
        off = [r for r in runs if r.fmt == cp.fmt and not r.audit]
        m_on = _median([r.rate.wall_per_s for r in on if r.rate])
        m_off = _median([r.rate.wall_per_s for r in off if r.rate])
        ratio = f"{m_on / m_off:.2f}" if m_on and m_off else "–"
        ams = _audit_ms(on)
        busy_ms = sum(r["done_ms"] - r["started_ms"] for run in on for r in run.measured())
        share = f"{sum(ams) / busy_ms:.1%}" if busy_ms and ams else "–"
        out.append(
            f"| `{cp.fmt}` | {cp.batch_events:,} | {_n(m_on)} | {_n(m_off)} | {ratio} |"
            f" {_runs(on)} | {_runs(off)} | {_n(_median(ams), ',.0f', ' ms')} /"
            f" {_n(max(ams) if ams else None, ',.0f', ' ms')} | {share} |"
        )
    return out


def _runs(runs: Sequence[DrainRun]) -> str:
    return ", ".join(
        f"#{r.seq}: {r.rate.wall_per_s / 1000:,.0f}k" if r.rate else f"#{r.seq}: –" for r in runs
    )


def cost_notes(runs: Sequence[DrainRun], plan: Plan) -> list[str]:
    lines = []
    for cp in plan.costs:
        rs = [r for r in runs if r.fmt == cp.fmt]
        sizes = [r["events"] for run in rs for r in run.measured()]
        busy = {
            a: _median([r.rate.busy_per_s for r in rs if r.audit is a and r.rate])
            for a in (True, False)
        }
        by_pos = audit_ms_by_position([r for r in rs if r.audit])
        lines.append(
            f"- `{cp.fmt}`: {len(rs)} runs of {cp.drain_events:,} events; measured batches held"
            f" {min(sizes, default=0):,} to {max(sizes, default=0):,} events; busy-time rate"
            f" (events over the batches' own durations) median {_n(busy[True])}/s on,"
            f" {_n(busy[False])}/s off. `audit_ms` by batch number within an audited run"
            " (median over the runs; batch 0, the warm-up, included; each run has a fresh"
            " Redis): "
            + ", ".join(f"{i}: {_n(v, ',.0f', ' ms')}" for i, v in enumerate(by_pos))
            + "."
        )
    busy_runs = [f"{r.fmt} #{r.seq} ({'on' if r.audit else 'off'}): {r.busy_polls}" for r in runs
            if r.busy_polls]  # fmt: skip
    lines.append(
        "- Polls of the benchmark answered BUSY (Redis refuses every other client while a script"
        " has run over `lua-time-limit`, 5 s): "
        + (", ".join(busy_runs) if busy_runs else "none")
        + "."
    )
    bad = [f"{r.fmt} #{r.seq}: {'; '.join(r.problems())}" for r in runs if r.problems()]
    lines.append(
        "- Checks per run: events_in == events written"
        + ", and with the audit on audit_ok == batches, audit_failed == 0, events_admitted =="
        " events_in: " + ("all passed." if not bad else "FAILED: " + " | ".join(bad))
    )
    return lines


def audit_ms_by_position(runs: Sequence[DrainRun]) -> list[float | None]:
    """Median `audit_ms` of the i-th batch of each run, for i = 0, 1, ..."""
    per_run = [
        [r["audit"]["audit_ms"] for r in sorted(run.records, key=lambda r: r["batch"])
         if "audit" in r]
        for run in runs
    ]  # fmt: skip
    n = max((len(p) for p in per_run), default=0)
    return [_median([p[i] for p in per_run if i < len(p)]) for i in range(n)]


def scaling_table(mem: MemoryResult) -> list[str]:
    out = [
        "| jsonl entries read | events | `source_xor` time | per event | another"
        " client's longest PING meanwhile | PINGs answered BUSY |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for t in mem.scaling:
        out.append(
            f"| {t.entries:,} | {t.events:,} | {t.call_ms:,.0f} ms | {t.us_per_event:.2f} µs |"
            f" {t.ping_max_ms:,.0f} ms | {t.ping_busy} |"
        )
    for x in mem.xor:
        if x.fmt == "fields":
            out.append(f"| (fields, 2 shards) {x.entries:,} | {x.events:,} | {x.call_ms:,.0f} ms |"
                       f" {x.call_ms * 1000 / max(x.events, 1):.2f} µs | – | – |")  # fmt: skip
    return out


def memory_table(runs: Sequence[DrainRun], mem: MemoryResult | None) -> list[str]:
    seed = f"~{SEED_003_BYTES} B per tracked tuple, for as long as it is in flight"
    out = [
        "| what | measured | constant per … | per event | seed 003 |",
        "|---|---|---|---:|---|",
    ]
    for fmt in sorted({r.fmt for r in runs if r.audit}):
        on = [r for r in runs if r.fmt == fmt and r.audit and r.ledger and r.ledger.records]
        if not on:
            continue
        led = on[-1].ledger
        assert led is not None
        per_rec = led.bytes_per_record or 0.0
        ev = _median([r["events"] for run in on for r in run.measured()]) or 0
        out.append(
            f"| ledger in Redis after a `{fmt}` drain | {led.ledger_bytes:,} B in {led.keys}"
            f" hashes for {led.records} batch records = {per_rec:,.0f} B per record (JSON value"
            f" {led.record_json_bytes:,.0f} B) | batch | {per_rec / ev:.5f} B at {ev:,.0f}"
            f" events per batch | {seed} |"
        )
        out.append(
            f"| audit failures list after the `{fmt}` drains | {led.failures_bytes:,} B"
            f" ({led.failures} entries; at most 1,000 failed attempts are kept) | failed attempt |"
            " 0 | – |"
        )
    if mem is not None:
        b = mem.bound
        out.append(
            f"| ledger at its bound ({LEDGER_SHARDS} shards x {LEDGER_KEEP:,} records), filled"
            f" through `Ledger.record` with {mem.bound_batches:,} batches | {b.ledger_bytes:,} B"
            f" ({b.ledger_bytes / 1e6:.1f} MB) for {b.records:,} records ="
            f" {b.bytes_per_record or 0:,.0f} B per record | the whole pipeline (bounded) | 0 |"
            f" grows with tuples in flight |"
        )
        for x in mem.xor:
            events_per_entry = x.chunk_events / x.chunk_entries if x.chunk_entries else 0
            chunk = SOURCE_CHUNK[x.fmt]
            full = chunk * events_per_entry * x.bytes_per_event
            out.append(
                f"| driver, transient: one `source_xor` call (`{x.fmt}`, {x.events:,} events in"
                f" {x.entries:,} entries; tracemalloc) | peak {x.peak_bytes / 1e6:,.2f} MB"
                f" above the baseline; a Lua chunk holds {chunk:,} entries ="
                f" {x.chunk_events:,} events, so about {full / 1e6:,.2f} MB a chunk | freed after"
                f" each chunk of {chunk:,} entries, whatever the batch size |"
                f" {x.bytes_per_event:,.1f} B (of a chunk's events) | {seed} |"
            )
    return out


def recovery_table(rec: RecoveryResult) -> list[str]:
    out = [
        "| start | ran before the kill | backlog at kill (pre-kill peak) | restart → supervisor"
        " up | → query started | → first batch recorded | first batch (last before kill):"
        " events, own time, updates applied / duplicate | kill → backlog back | backlog peak |"
        " catch-up batches after the first: n, median events | Spark admission backpressured"
        " meanwhile: lowest rate |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for c in rec.cycles:
        kind = "cold (fresh checkpoint)" if c.killed_ms is None else f"after SIGKILL {c.index}"
        out.append(
            f"| {kind} | {_n(c.steady_before_kill_s, '.1f', ' s')} |"
            f" {_n(c.backlog_at_kill)} ({_n(c.prekill_level)}) |"
            f" {_n(_span_s(c.spawn_ms, c.supervisor_ms), '.1f', ' s')} |"
            f" {_n(_span_s(c.spawn_ms, c.query_ms), '.1f', ' s')} |"
            f" {_n(c.first_batch_s(), '.1f', ' s')} | {c.first_batch}"
            f" ({'–' if c.last_batch_at_kill is None else c.last_batch_at_kill}): {_first(c)} |"
            f" {_back(c)} | {c.peak_backlog:,} | {_catchup(c)} |"
            f" {_throttle(c)} |"
        )
    kills = rec.kills()
    for name, vals in (
        ("restart → first batch recorded", [c.first_batch_s() for c in kills]),
        ("kill → backlog back at its pre-kill level", [c.back_s() for c in kills]),
        ("restart → supervisor up", [_span_s(c.spawn_ms, c.supervisor_ms) for c in kills]),
    ):
        vs = [v for v in vals if v is not None]
        out.append(
            f"| **{name}**, over {len(vs)} of {len(kills)} kills | | | | |"
            f" median {_n(_median(vs), '.1f', ' s')},"
            f" max {_n(max(vs) if vs else None, '.1f', ' s')} | | | | | |"
        )
    return out


def audit_drift_line(rec: RecoveryResult) -> str:
    """`audit_ms` per event over the recovery run, whose Redis (and Lua VM) lives throughout."""
    big = [r for r in rec.records if "audit" in r and r["events"] >= 10_000]
    if len(big) < 6:
        return "Too few batches of 10,000+ events to follow `audit_ms` over the run."
    third = len(big) // 3

    def us(rs: Sequence[dict[str, Any]]) -> str:
        return _n(_median([r["audit"]["audit_ms"] * 1000 / r["events"] for r in rs]), ".1f", " µs")

    worst = max(big, key=lambda r: r["audit"]["audit_ms"])
    return (
        f"`audit_ms` over the recovery run (one Redis, so one Lua VM, for all"
        f" {len(rec.records)} batches; the {len(big)} batches of 10,000+ events): per event,"
        f" median {us(big[:third])} in the first third, {us(big[-third:])} in the last third;"
        f" the longest was {worst['audit']['audit_ms']:,.0f} ms (batch {worst['batch']},"
        f" {worst['events']:,} events)."
    )


def _back(c: Cycle) -> str:
    if c.gave_up_ms is not None:
        return f"not within {RECOVER_TIMEOUT_S:.0f} s"
    return _n(c.back_s(), ".1f", " s")


def _catchup(c: Cycle) -> str:
    if c.catchup_until_ms() is None:
        return "–"
    sizes = [r["events"] for r in c.catchup]
    return f"{len(sizes)}, {_n(_median(sizes))}"


def _throttle(c: Cycle) -> str:
    if c.catchup_until_ms() is None:
        return "–"
    if not c.throttled_rates:
        return "no"
    return f"yes, {min(c.throttled_rates):,.0f} events/s"


def _first(c: Cycle) -> str:
    r = c.first_record
    if r is None:
        return "–"
    return (
        f"{r['events']:,} events, {(r['done_ms'] - r['started_ms']) / 1000:.1f} s,"
        f" {r['applied']:,} / {r['duplicates']:,}"
    )


def exactness_line(rec: RecoveryResult) -> str:
    f = rec.final
    produced = rec.produced
    checks = [
        ("events_in == events produced", f.get("events_in") == produced),
        ("`txn_count` total in the store == events aggregated",
         rec.txn_count_total == f.get("events_aggregated")),
        ("events_admitted == events_in", f.get("events_admitted") == f.get("events_in")),
        ("audit_failed == 0", f.get("audit_failed") == 0),
        ("audit_ok == batches", f.get("audit_ok") == f.get("batches")),
    ]  # fmt: skip
    verdicts = "; ".join(f"{name}: {'yes' if ok else '**no**'}" for name, ok in checks)
    return (
        f"Exactness after the last restart (producer stopped, backlog drained:"
        f" {'yes' if rec.drained else '**no**'}): {produced:,} events produced, counters"
        f" {f}, `txn_count` summed over the store {rec.txn_count_total:,}. {verdicts}."
        f" `sluice run` exit code on the final SIGTERM: {rec.exit_code}; ERROR lines in its log:"
        f" {rec.errors_logged}. (`audit_ok` and `batches` are both counted once per writer token,"
        " so a batch replayed after a kill counts once in each.)"
    )


@dataclass
class RunInfo:
    command: str
    started: str
    load_start: float | None
    load_end: float | None = None
    duration_s: float = 0.0
    code: str = ""


def code_version() -> str:
    """The commit measured, and whether src/ differed from it (the audit is being worked on)."""

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True)
        return out.stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", "src")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"
    return f"`{head}`" + (" with uncommitted changes under src/" if dirty else "")


def render(
    plan: Plan, run: RunInfo, runs: Sequence[DrainRun], mem: MemoryResult | None,
    rec: RecoveryResult | None, png: Path, md: Path,
) -> str:  # fmt: skip
    mode = "quick smoke mode (small sizes, 1 pair, 2 kills)" if plan.quick else "full mode"
    lines = [
        f"Command: `{run.command}` (from the repository root), {mode}; took"
        f" {run.duration_s / 60:.1f} min.",
        "",
        f"Date: {run.started}. Code: {run.code}."
        f" Machine: {machine_note(run.load_start, run.load_end)}. Medians of"
        " few runs on a noisy machine: treat differences under ~10 % as noise."
        + (
            " Quick mode checks that the benchmark works; quote the full run." if plan.quick else ""
        ),
        "",
        "Setup as in bench/throughput.py: 3 metrics (`txn_count`, `amount_sum`, `card_max`), 2"
        " shards, 10 s slices, `local[2]`, 500 ms trigger, `EventGenerator` load pre-encoded as"
        " XADDs (jsonl: 500 events per entry); audit config `ledger_shards: 16`, `retries: 2`."
        f" `backpressure.controller: {plan.controller}` in every run"
        + (
            " (not the default `stepwise`): in trial runs of this script on this loaded machine,"
            " stepwise cut Spark's admission well below the batch cap at times (a drain ran in"
            " dozens of small batches; a catch-up after a kill fell further behind instead), so"
            " the numbers measured the controller rather than the audit or the restart. Rerun"
            " with `--controller stepwise` to see it."
            if plan.controller == "none"
            else "."
        ),
        "",
        "### Throughput cost",
        "",
        "Batch caps (`source.max_events_per_batch`) as in bench/throughput.py. "
        f"Per format, one uncounted warm-up drain (audit off), then {plan.pairs} on/off pairs in"
        " ABBA order"
        " (on, off | off, on | ...) in one Spark session; every run drains a freshly pre-filled"
        " backlog on a fresh embedded Redis and state_dir. events/s = events of the batches"
        " after the warm-up batch / wall time from the end of the warm-up batch to the end of"
        " the last (as in bench/throughput.py). `audit_ms` = the batch record's"
        " `audit.audit_ms`: the source side only (offset-log read, Lua read of the batch's"
        " entry ids, numpy XOR), taken once per batch; the plan's extra columns and the ledger"
        " write are in the on/off difference, not in `audit_ms`.",
        "",
        *cost_table(runs, plan),
        "",
        *cost_notes(runs, plan),
        "",
    ]
    if mem is not None and mem.scaling:
        lines += [
            "Where `audit_ms` goes: one direct call of `sluice.pipeline.audit.source_xor` over"
            " one jsonl shard of n entries (500 events each), a fresh embedded Redis per n; it"
            f" reads {SOURCE_CHUNK['jsonl']:,} jsonl entries per Lua call, and the script counts"
            " each entry's lines. A cost linear in the events shows a constant time per event"
            " (entries of the larger sizes repeat the load pool's events, which costs the"
            " script the same). Meanwhile another client PINGs"
            " every 50 ms: Redis serves no one while a script runs, and once a script has run"
            " for `lua-time-limit` (5 s) it answers everyone else BUSY. The last row is the"
            " `fields` call of the memory measurement below (2 shards, several calls), for"
            " contrast.",
            "",
            *scaling_table(mem),
            "",
        ]
    lines += [
        "### Memory per in-flight event",
        "",
        "Seed 003's acker holds an entry of about 20 bytes per tuple in flight. The audit holds"
        " nothing per event between batches: the ledger keeps one JSON record per batch"
        " (`MEMORY USAGE <key> SAMPLES 0`, summed over the ledger hashes), so its cost per"
        " event is a record divided by the batch size, and the whole ledger is capped at"
        f" {LEDGER_SHARDS} x {LEDGER_KEEP:,} records. The only per-event memory is transient:"
        " the driver's numpy arrays in `source_xor` (peak measured with tracemalloc over one"
        " direct call against a real stream, per Lua chunk of at most"
        f" {SOURCE_CHUNK['jsonl']:,} jsonl entries (up to"
        f" {SOURCE_CHUNK['jsonl'] * JSONL_EVENTS_PER_ENTRY:,} events) or"
        f" {SOURCE_CHUNK['fields']:,} fields entries),"
        " and in the executors two 64-bit columns per update row (`u`, `fx`) and two per"
        " folded row (`ux`, `fx`) for the length of the batch (from the code, not measured).",
        "",
        *memory_table(runs, mem),
        "",
        "Reading the jsonl figure against the code: per event, `source_xor` builds 8-byte arrays"
        " (the in-entry index from `arange` - `repeat`, the repeated entry ms (then cast) and"
        " seq), and `event_ids` copies ms and index to uint64 and makes `_mix64` temporaries, so"
        " about eight 8-byte arrays (~64 B) are alive at the peak, not the two (16 B) of the"
        " ids alone. In `fields` (one event per entry) the per-entry Python objects dominate:"
        " the reply's id bytes and counts, `parse_id` tuples and the list of them.",
        "",
    ]
    if rec is not None:
        lines += recovery_section(plan, rec, png, md)
    return "\n".join(lines)


def recovery_section(plan: Plan, rec: RecoveryResult, png: Path, md: Path) -> list[str]:
    png_rel = os.path.relpath(png, md.parent)
    return [
        "### Recovery after `kill -9`",
        "",
        f"`{' '.join(['python', '-m', 'sluice.cli', 'run', '-c', 'sluice.yaml'])}` as a child"
        " process (its own process group) against an embedded Redis started by the benchmark"
        " (`redis:` in the yaml, so the kill does not take Redis down); jsonl, batch cap"
        f" {rec.batch_events:,}, audit on; a paced producer at {rec.rate_per_s:,.0f} events/s"
        f" (achieved {rec.achieved_per_s:,.0f}/s) throughout. After each start has caught up,"
        f" it runs {plan.steady_s[0]:.0f}–{plan.steady_s[1]:.0f} s (uniform random), then the"
        " whole process group (driver, Spark JVM, Python workers) gets SIGKILL and is"
        f" restarted at once. The pre-kill level is taken over the steady run only (at most its"
        f" last {PREKILL_WINDOW_S:.0f} s). Redis is sampled every {SAMPLE_S * 1000:.0f} ms."
        " Supervisor up ="
        " its first heartbeat in `sluice:{stats}:health` (the JVM, Spark session and Pipeline"
        " exist); query started = the health state's change to `running`; first batch recorded"
        " = a new `done_ms` in `sluice:{stats}` `last_batch` (exact, from the record). A batch"
        " that the killed process had already recorded but Spark had not committed is replayed"
        " first and not recorded again (same writer token), so it is not the one seen here."
        " Backlog back = the first sample after the first batch whose backlog (uncommitted"
        " entries x 500) is at or below the pre-kill level, the backlog's peak just before the"
        " kill (the top of the steady sawtooth). Catch-up batches = the batch records between"
        " the first batch and that moment; Spark admission backpressured = the Spark task's"
        " state changes in `sluice:{flow}:timeline` (controller"
        f" `{plan.controller}`) in that span with the backpressure flag set, and the lowest"
        " admission rate"
        " among them (the lower plot shows them as rate x trigger, next to each batch's size).",
        "",
        *recovery_table(rec),
        "",
        exactness_line(rec),
        "",
        f"BUSY: {rec.busy_polls} of the benchmark's Redis samples and {rec.busy_replies} producer"
        " XADDs (sent again) were refused because a script had run over 5 s.",
        "",
        audit_drift_line(rec),
        "",
        f"![backlog through the kills]({png_rel})",
        "",
    ]


def plot(rec: RecoveryResult, png: Path) -> None:
    """The recovery run's backlog over time, with the kills and each start's first batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(12, 6.5), sharex=True,
                                  gridspec_kw={"height_ratios": [2, 1]})  # fmt: skip
    t0 = rec.t0_ms
    xs = [(s.t_ms - t0) / 1000 for s in rec.samples]
    ax.plot(xs, [s.backlog_events for s in rec.samples], color="tab:orange", lw=1,
            label="backlog (events)")  # fmt: skip
    for i, c in enumerate(rec.cycles):
        if c.killed_ms is not None:
            ax.axvline((c.killed_ms - t0) / 1000, color="tab:red", lw=1.5,
                       label="SIGKILL + restart" if i == 1 else None)  # fmt: skip
        if c.first_done_ms is not None:
            ax.axvline((c.first_done_ms - t0) / 1000, color="tab:green", ls="--", lw=1,
                       label="first batch recorded" if i == 0 else None)  # fmt: skip
        if c.back_ms is not None:
            ax.axvline((c.back_ms - t0) / 1000, color="tab:blue", ls=":", lw=1,
                       label="backlog back at pre-kill level" if i == 1 else None)  # fmt: skip
    ax.set_ylabel("backlog (events)")
    ax.set_title(f"sluice run, SIGKILLed {len(rec.kills())} times; producer"
                 f" {rec.rate_per_s:,.0f} events/s")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    # Below: what each batch admitted, and the Spark task's admission rate when under pressure.
    xs_b = [(r["done_ms"] - t0) / 1000 for r in rec.records]
    ax2.plot(xs_b, [r["events"] for r in rec.records], ".", color="tab:blue", ms=4,
             label="events per batch")  # fmt: skip
    pressed = [st for st in rec.flow if st.get("backpressure")]
    if pressed:
        ax2.plot([(st["updated_ms"] - t0) / 1000 for st in pressed],
                 [float(st["rate"]) * rec.trigger_s for st in pressed], "x", color="tab:red",
                 label="Spark admission under backpressure: rate x trigger")  # fmt: skip
    audited = [r for r in rec.records if "audit" in r]
    if audited:
        twin = ax2.twinx()
        xs_a = [(r["done_ms"] - t0) / 1000 for r in audited]
        twin.plot(xs_a, [r["audit"]["audit_ms"] for r in audited], "_", color="tab:purple", ms=5)
        twin.set_ylabel("audit_ms (dashes)", color="tab:purple")
    ax2.set_xlabel("s since the producer started")
    ax2.set_ylabel("events")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)


def print_summary(runs: Sequence[DrainRun], plan: Plan, rec: RecoveryResult | None) -> None:
    print("Sluice audit benchmark")
    for cp in plan.costs:
        on = _median([r.rate.wall_per_s for r in runs if r.fmt == cp.fmt and r.audit and r.rate])
        off = _median(
            [r.rate.wall_per_s for r in runs if r.fmt == cp.fmt and not r.audit and r.rate]
        )
        ams = _median(_audit_ms([r for r in runs if r.fmt == cp.fmt and r.audit]))
        ratio = f"{on / off:.2f}" if on and off else "–"
        print(f"{cp.fmt:<7} on {_n(on):>9}/s  off {_n(off):>9}/s  ratio {ratio}"
              f"  audit_ms p50 {_n(ams)}")  # fmt: skip
    if rec is not None:
        kills = rec.kills()
        fb = [v for c in kills if (v := c.first_batch_s()) is not None]
        bb = [v for c in kills if (v := c.back_s()) is not None]
        print(f"recovery over {len(kills)} kills: restart->first batch median"
              f" {_n(_median(fb), '.1f')} s max {_n(max(fb) if fb else None, '.1f')} s;"
              f" kill->backlog back median {_n(_median(bb), '.1f')} s max"
              f" {_n(max(bb) if bb else None, '.1f')} s")  # fmt: skip
        print(exactness_line(rec))


# -- main -----------------------------------------------------------------------------------------


PARTS = ("cost", "memory", "recovery")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="~6 minute smoke run with small sizes")
    p.add_argument("--formats", default="jsonl,fields", help="comma-separated: jsonl,fields")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated: " + ",".join(PARTS))
    p.add_argument("--pairs", type=int, default=None, help="on/off pairs per format (3; quick 1)")
    p.add_argument("--kills", type=int, default=None, help="SIGKILLs (4; quick 2)")
    p.add_argument("--kill-rate", type=float, default=None,
                   help="producer events/s in the recovery run (50000; quick 10000)")  # fmt: skip
    p.add_argument("--controller", default="none",
                   choices=["none", "stepwise", "aimd", "pid", "fixed"],
                   help="backpressure.controller of every run (default: none)")  # fmt: skip
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--md", type=Path, default=ROOT / "docs" / "benchmarks.md")
    p.add_argument("--png", type=Path, default=ROOT / "docs" / "audit_recovery.png")
    p.add_argument("--keep-state", action="store_true", help="keep the temporary state dirs")
    args = p.parse_args(argv)
    args.format_list = [f.strip() for f in args.formats.split(",") if f.strip()]
    if not args.format_list or any(f not in ("jsonl", "fields") for f in args.format_list):
        p.error(f"--formats: expected jsonl and/or fields, got {args.formats!r}")
    args.part_list = [x.strip() for x in args.parts.split(",") if x.strip()]
    if not args.part_list or any(x not in PARTS for x in args.part_list):
        p.error(f"--parts: expected some of {','.join(PARTS)}, got {args.parts!r}")
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
    runs: list[DrainRun] = []
    mem: MemoryResult | None = None
    rec: RecoveryResult | None = None
    try:
        if "cost" in args.part_list:
            log(f"building Spark ({'quick' if plan.quick else 'full'} run)")
            spark = build_spark(bench_config("jsonl", ws.state_dir("spark"), 1),
                                app_name="sluice-bench-audit")  # fmt: skip
            try:
                runs = run_costs(spark, plan, ws)
            finally:
                spark.stop()  # before the recovery run starts its own JVM
        if "memory" in args.part_list:
            mem = run_memory(plan, ws)
        if "recovery" in args.part_list:
            rec = run_recovery(plan, ws)
    finally:
        ws.cleanup()
    run.load_end = load_average()
    run.duration_s = time.monotonic() - t0
    replace_section(args.md, HEADING, render(plan, run, runs, mem, rec, args.png, args.md))
    if rec is not None:
        plot(rec, args.png)
    log(f"wrote {display_path(str(args.md))} in {run.duration_s:.0f} s")
    print_summary(runs, plan, rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
