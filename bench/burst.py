"""Backpressure under a burst: the same offered-load profile against every flow controller.

    .venv/bin/python bench/burst.py            # full run, about 15 minutes
    .venv/bin/python bench/burst.py --quick    # smoke run, about 6 minutes

Capacity C is a drain with a slow store and no controller; then per controller 0.5 C, 3 C and
0.5 C through the ingest valve (`lib.sdk_load`) on a Redis with a `maxmemory`, sampled every
100 ms, then a drain (or, if stuck, a settling restart without limits). bench/templates/burst.md
says what each number means. Writes bench/results/<--name, default burst>[.quick].json.
"""

from __future__ import annotations

import argparse
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

from lib import stats
from lib.load import bench_config, build_pool, now_ms
from lib.procs import Workspace, count_metric_total, drain, input_level, pipeline_run, stat_counter
from lib.results import Run, log, parser
from lib.sdk_load import LoadProfile, ProfileProducer
from sluice.config import Config
from sluice.errors import PipelineError
from sluice.flow.board import Board
from sluice.flow.levels import memory_fraction
from sluice.pipeline.fold import FoldQuery
from sluice.pipeline.spark import build_spark
from sluice.redis.connection import RedisHandle, client_for
from sluice.redis.keys import FLOW_SIGNALS_KEY
from sluice.source.loadgen import EventGenerator, produce_frame
from sluice.source.producer import Producer
from sluice.status.snapshot import backlog, source_log
from sluice.testing.faults import SlowStore
from sluice.units import parse_size_bytes

CONTROLLERS = ("none", "fixed", "pid", "aimd", "stepwise")
SAMPLE_EVERY_S = 0.1
HEALTH_EVERY_S = 1.0
LOW_FACTOR, HIGH_FACTOR = 0.5, 3.0
PEAK_TARGET = 1.1  # x high watermark
CV_TARGET = 0.10
WARM_UP_EVENTS = 2_000
# A sample: t_s, backlog entries and exact bytes (MEMORY USAGE ... SAMPLES 0), bytes as the
# gate measures them (the log's backlog), Redis used_memory, the Spark task's controller rate
# (None = unlimited), its batch limit and backpressure flag, the ingest gate's flag and state.
FIELDS = ("t_s", "entries", "bytes", "gate_bytes", "used_memory", "spark_rate", "spark_limit",
          "spark_bp", "ingest_bp", "gate_open")  # fmt: skip


def burst_config(state_dir: Path, a: argparse.Namespace, controller: str, rate: float) -> Config:
    """The bench config (jsonl, 2 shards, 3 metrics, 10 s slices) with this controller."""
    bp = {"controller": controller, "high_watermark": a.hw, "low_watermark": a.lw,
          "fixed_rate": rate if controller == "fixed" else None}  # fmt: skip
    return bench_config("jsonl", state_dir, a.batch_events, backpressure=bp)


def measure_capacity(spark: Any, a: argparse.Namespace, ws: Workspace) -> dict[str, Any]:
    """Drain a pre-filled backlog with controller `none` and the slow store (also warms Spark)."""
    cfg = burst_config(ws.state_dir("capacity"), a, "none", 0.0)
    with pipeline_run(spark, cfg, write_delay_ms=a.write_delay_ms) as (pipeline, handle):
        pool = build_pool(cfg, min(a.capacity_events, 100_000), a.seed, now_ms())
        d = drain(pipeline, handle, cfg, pool, a.capacity_events, 300.0, "capacity")
    return {"prefilled": d["prefilled"], **(d["rate"] or {"per_s": None})}


def root_cause(text: str) -> str:
    """The innermost `SomeError: message` line of a (py4j-wrapped) traceback, else the start."""
    for line in reversed(text.splitlines()):
        if m := re.match(r"^\s*([\w.]+(?:Error|Exception)\b):?(.*)$", line):
            msg = " ".join(m.group(2).split())
            return f"{m.group(1)}: {msg if len(msg) <= 160 else '…' + msg[-160:]}"
    return " ".join(text.split())[:300]


class ControllerRun:
    """The profile against one controller, on its own pipeline and embedded Redis."""

    def __init__(self, spark: Any, a: argparse.Namespace, cfg: Config, profile: LoadProfile):
        self.spark, self.a, self.cfg, self.profile = spark, a, cfg, profile
        self.controller = cfg.backpressure.controller
        self.samples: list[list[Any]] = []
        self.batches: list[dict[str, Any]] = []
        self.failures: list[tuple[float, str]] = []
        self.restarts: list[float] = []
        self.t0_ms = 0
        self.idle_at_s: float | None = None
        self.producer_end_s: float | None = None
        self.lifted_at_s: float | None = None

    def run(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Warm up, set `maxmemory`, offer the profile, drain (or settle); (results, series)."""
        a, cfg = self.a, self.cfg
        with pipeline_run(self.spark, cfg, write_delay_ms=a.write_delay_ms,
                          on_batch=self.batches.append) as (pipeline, handle):  # fmt: skip
            client = client_for(handle.url)
            pipeline.start()
            warm = Producer.from_config(cfg, client, flow=False)
            frame = EventGenerator(cfg, seed=a.seed + 1000, late_fraction=0.0)
            produce_frame(warm, frame.frame(WARM_UP_EVENTS, now_ms()), warm.shard_by)
            if not pipeline.wait_idle(120.0):  # the query's first (slow) batch is not measured
                raise PipelineError("the warm-up events did not drain within 120 s")
            client.config_set("maxmemory-policy", "noeviction")
            client.config_set("maxmemory", a.maxmemory)
            before = {k: stat_counter(client, k) for k in ("events_in", "dead_letters")}
            stored0 = count_metric_total(client, "txn_count")
            self.t0_ms = now_ms() + 100
            producer = ProfileProducer(cfg, client_for(handle.url), self.profile, a.seed,
                                       a.block_timeout_s, self.t0_ms)  # fmt: skip
            log(f"{self.controller}: offering {self.profile}")
            producer.start()
            self.watch(pipeline, client, producer, a.drain_timeout_s)
            producer.join(5.0)
            if producer.failed():
                raise RuntimeError(f"{self.controller}: the producer failed") from producer.error
            # The controller's own flow history, before any settling.
            timeline = Board(client).timeline(1000)
            timeline = [e for e in timeline if int(e.get("updated_ms", 0)) >= self.t0_ms]
            signals = int(client.xlen(FLOW_SIGNALS_KEY))
            if self.idle_at_s is None:
                self.settle(pipeline, handle)
            counts = vars(producer.counts) | {
                "counted": stat_counter(client, "events_in") - before["events_in"],
                "dead_letters": stat_counter(client, "dead_letters") - before["dead_letters"],
                "stored": count_metric_total(client, "txn_count") - stored0,
                "queued_end": backlog(client, cfg)[0], "signals": signals,
                "flow_changes": dict(Counter(str(e.get("stage")) for e in timeline)),
                "producer_error": None if producer.error is None else str(producer.error),
            }  # fmt: skip
            client.close()
        self.batches = [b for b in self.batches if b["started_ms"] >= self.t0_ms]
        series = {"samples": self.samples, "producer": producer.series,
                  "profile": vars(self.profile), "lifted_at_s": self.lifted_at_s}  # fmt: skip
        return self.summary(counts, series), series

    def watch(self, pipeline: FoldQuery, client: Any, producer: Any, timeout_s: float) -> None:
        """Sample every SAMPLE_EVERY_S, restarting a failed query with backoff (as `sluice run`
        does), until the pipeline is idle after the producer ended (now, if there is none), or
        `timeout_s` after that."""
        board = Board(client)
        since = None if producer is not None else self.t_s()
        next_health, last_log, backoff_s, restart_at = 0.0, -10.0, 1.0, None
        while True:
            t = self.t_s()
            self.samples.append(self.sample(client, board, t))
            if t >= next_health:
                next_health = t + HEALTH_EVERY_S
                q = pipeline.query
                try:
                    if q is not None and not q.isActive:
                        raise RuntimeError(str(q.exception()))
                    if q is None and restart_at is not None and time.monotonic() >= restart_at:
                        pipeline.start()
                        self.restarts.append(t)
                        restart_at = None
                except Exception as e:  # noqa: BLE001 - recorded, retried like run_forever does
                    self.failures.append((t, root_cause(str(e))))
                    log(f"{self.controller}: the query failed at {t:.1f} s: {self.failures[-1][1]}")
                    pipeline.stop(grace_s=1.0)
                    restart_at, backoff_s = time.monotonic() + backoff_s, min(backoff_s * 2, 8.0)
            if t - last_log >= 10.0:
                last_log = t
                log(f"{self.controller}: {dict(zip(FIELDS, self.samples[-1][:5], strict=False))}")
            if since is None and not producer.is_alive():
                since = self.producer_end_s = t
            if since is not None:
                if pipeline.query is not None and self.idle(pipeline, client):
                    self.idle_at_s = t
                    return
                if t - since > timeout_s:
                    return
            time.sleep(max(0.0, SAMPLE_EVERY_S - (self.t_s() - t)))

    def t_s(self) -> float:
        return (now_ms() - self.t0_ms) / 1000

    def sample(self, client: Any, board: Board, t_s: float) -> list[Any]:
        entries, exact = input_level(client, self.cfg.source.shard_keys())
        level = source_log(client, self.cfg).level()  # the bytes the gate compares
        st: dict[str, dict[str, Any]] = {}
        for task in board.all_tasks().values():
            st.setdefault(str(task.get("stage")), task)
        sp, ing = st.get("spark", {}), st.get("ingest", {})
        gate = ing.get("gate_open")
        return [t_s, entries, exact, level.bytes, memory_fraction(client)[0], sp.get("rate"),
                sp.get("batch_limit"), bool(sp.get("backpressure")),
                bool(ing.get("backpressure")), None if gate is None else bool(gate)]  # fmt: skip

    def idle(self, pipeline: FoldQuery, client: Any) -> bool:
        if backlog(client, self.cfg)[0]:
            return False
        try:
            return pipeline.wait_idle(timeout_s=0.05)
        except PipelineError:
            return False  # restarted on the next health check

    def settle(self, pipeline: FoldQuery, handle: RedisHandle) -> None:
        """The controller did not drain in time. As an operator would: lift `maxmemory` and
        restart on the same checkpoint with controller `none`, so every acknowledged event can
        still be looked for (within `settle_timeout_s`)."""
        log(f"{self.controller}: not idle after the load; lifting maxmemory, controller none")
        pipeline.stop(grace_s=5.0)
        handle.client.config_set("maxmemory", 0)
        self.lifted_at_s = self.t_s()
        bp = self.cfg.backpressure.model_copy(update={"controller": "none"})
        cfg = self.cfg.model_copy(update={"backpressure": bp})
        rescue = FoldQuery(cfg, handle, self.spark, on_batch=self.batches.append)
        rescue.writer = SlowStore(self.a.write_delay_ms)
        rescue.start()
        try:
            self.watch(rescue, handle.client, None, self.a.settle_timeout_s)
        finally:
            rescue.stop()

    def summary(self, c: dict[str, Any], series: dict[str, Any]) -> dict[str, Any]:
        """Every figure the docs show for this controller."""
        a, p, t0 = self.a, self.profile, self.t0_ms
        s = [dict(zip(FIELDS, x, strict=True)) for x in self.samples]
        prof = [x for x in s if x["t_s"] <= p.total_s]
        pre = max((x["bytes"] for x in prof if p.before_s / 3 <= x["t_s"] < p.before_s), default=0)
        adm = stats.admitted_per_s(self.batches, t0, p.total_s, self.cfg.spark.trigger,
                                   self.restarts)  # fmt: skip
        series["admitted"] = adm
        last, before = adm[-int(a.oscillation_s) :], adm[int(p.before_s / 3) : int(p.before_s)]
        pre_share = sum(before) / len(before) / p.low_per_s if before else 0.0
        win_s = p.total_s - a.oscillation_s
        win = [x for x in prof if x["t_s"] >= win_s]
        sizes = [
            b["events"] for b in self.batches if win_s <= (b["started_ms"] - t0) / 1000 < p.total_s
        ]
        limits = [x["spark_limit"] for x in win if x["spark_limit"] is not None]
        ratios = sorted(x["gate_bytes"] / x["bytes"] for x in prof if x["bytes"] >= 1_000_000)
        peak, cv = max((x["bytes"] for x in s), default=0), stats.coefficient_of_variation(last)
        backlog_t = [(x["t_s"], x["bytes"]) for x in prof]
        drain_s = stats.settle_time_s(backlog_t, p.burst_end_s, p.total_s, max(pre, a.lw))
        done = sum(b["events"] for b in self.batches if b["done_ms"] - t0 <= p.total_s * 1000)
        lifted, idle = self.lifted_at_s, self.idle_at_s
        return c | {
            "controller": self.controller,
            "lost": None if idle is None else c["acked"] - c["counted"],
            "peak_entries": max((x["entries"] for x in s), default=0), "peak_bytes": peak,
            "peak_hw": peak / a.hw, "peak_memory": max((x["used_memory"] for x in s), default=0),
            "peak_gate_bytes": max((x["gate_bytes"] for x in s), default=0),
            "gate_error": ratios and [ratios[len(ratios) // 10], ratios[len(ratios) * 9 // 10]],
            "failures": len(self.failures), "first_failure": (self.failures or [None])[0],
            "restarts": len(self.restarts), "pre_burst_share": pre_share,
            "steady_before": pre_share >= 0.9, "drain_s": drain_s if pre_share >= 0.9 else None,
            "cv": cv, "last_mean_per_s": sum(last) / len(last) if last else 0.0,
            "last_vs_offered": sum(last) / len(last) / p.low_per_s if last else 0.0,
            "throughput_per_s": done / p.total_s, "max_admitted_per_s": max(adm, default=0.0),
            "fresh_burst": stats.batch_freshness(self.batches, t0, p.before_s, p.burst_end_s),
            "fresh_after": stats.batch_freshness(self.batches, t0, p.burst_end_s, p.total_s),
            "last_batch_events": [min(sizes), max(sizes)] if sizes else None,
            "last_spark_limit": [min(limits), max(limits)] if limits else None,
            "last_backlog_mean": sum(x["bytes"] for x in win) / max(1, len(win)),
            "spark_throttles": stats.rises([x["spark_bp"] for x in prof]),
            "spark_throttles_last": stats.rises([x["spark_bp"] for x in win]),
            "gate_closes": stats.rises([x["gate_open"] is False for x in prof]),
            "peak_ok": peak <= PEAK_TARGET * a.hw, "cv_ok": cv is not None and cv <= CV_TARGET,
            "settle": None if lifted is None else {
                "lifted_at_s": lifted, "after_load_s": lifted - (self.producer_end_s or 0),
                "idle_after_s": None if idle is None else idle - lifted,
                "still_busy_after_s": s[-1]["t_s"] - lifted},
        }  # fmt: skip


def main() -> None:
    p = parser(__doc__)
    add = p.add_argument
    add("--controllers", default=",".join(CONTROLLERS), help="a comma-separated subset of those")
    add("--capacity", type=float, help="events/s to use as C instead of measuring it")
    add("--write-delay-ms", type=float, default=200.0, help="store time per 1,000 slice updates")
    add("--batch-events", type=int, default=20_000, help="source.max_events_per_batch")
    add("--high-watermark", default="8MB")
    add("--low-watermark", default="1MB")
    add("--maxmemory", default="40MB", help="Redis maxmemory per controller run")
    add("--seed", type=int, default=7)
    add("--keep-state", action="store_true", help="keep the temporary state dirs")
    add("--name", default="burst", help="result name (bench/results/<name>.json)")
    a = p.parse_args()
    names = [c.strip() for c in a.controllers.split(",") if c.strip()]
    if not names or any(c not in CONTROLLERS for c in names):
        p.error(f"--controllers: expected some of {','.join(CONTROLLERS)}, got {a.controllers!r}")
    # the profile's phases, the oscillation window, the capacity drain, and the timeouts
    a.before_s, a.burst_s, a.after_s, a.oscillation_s, a.capacity_events = (
        (8.0, 8.0, 16.0, 8.0, 100_000) if a.quick else (30.0, 30.0, 60.0, 30.0, 300_000)
    )
    a.drain_timeout_s, a.settle_timeout_s = (20.0, 60.0) if a.quick else (30.0, 90.0)
    a.block_timeout_s = 0.05
    a.hw, a.lw = parse_size_bytes(a.high_watermark), parse_size_bytes(a.low_watermark)
    a.maxmemory = parse_size_bytes(a.maxmemory)
    run, ws, results, series, spark = Run(a.name, a), Workspace(a.keep_state), [], [], None
    try:
        spark = build_spark(burst_config(ws.state_dir("spark"), a, "none", 0.0), "sluice-bench")
        cap = {"per_s": a.capacity, "given": True} if a.capacity else measure_capacity(spark, a, ws)
        if not cap["per_s"]:
            raise SystemExit("could not measure the capacity (no drain rate); nothing to offer")
        c = cap["per_s"]
        profile = LoadProfile(LOW_FACTOR * c, HIGH_FACTOR * c, a.before_s, a.burst_s, a.after_s)
        for name in names:
            log(f"== {name}")
            cfg = burst_config(ws.state_dir(name), a, name, c)
            res, ser = ControllerRun(spark, a, cfg, profile).run()
            results.append(res)
            series.append(ser)
    finally:
        if spark is not None:
            spark.stop()
        ws.cleanup()
    keep = ("batch_events", "write_delay_ms", "hw", "lw", "maxmemory", "before_s", "burst_s",
            "after_s", "oscillation_s", "drain_timeout_s", "settle_timeout_s",
            "block_timeout_s")  # fmt: skip
    params = {k: getattr(a, k) for k in keep} | {
        "low_per_s": profile.low_per_s, "high_per_s": profile.high_per_s, "cv_target": CV_TARGET,
        "peak_target": PEAK_TARGET, "warm_up_events": WARM_UP_EVENTS, "sample_ms": 100,
    }  # fmt: skip
    run.write(params, {"capacity": cap, "controllers": results}, {"controllers": series})


if __name__ == "__main__":
    main()
