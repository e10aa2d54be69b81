"""Ingest against the bare engine, before and after a change, in one run (issue 15's targets).

    .venv/bin/python bench/ingest.py                    # 3 rounds, about 40 minutes on 2 cores
    .venv/bin/python bench/ingest.py --quick            # 1 round, small sizes, about 8 minutes
    .venv/bin/python bench/ingest.py --before db2d2f0   # the revision to compare with
    .venv/bin/python bench/ingest.py --bare-audit       # the bare engine, audit columns or not
    .venv/bin/python bench/ingest.py --bare-slots --cells fields:highcard,jsonl:highcard --rounds 6
                                                        # ... columns shared between groups or not
    .venv/bin/python bench/ingest.py --audit-pairs 8    # the audit's cost: 8 on/off drain pairs
    .venv/bin/python bench/ingest.py --cap-pairs 3 --cells fields:zipf,jsonl:zipf
                                                        # ... twice the batch cap, with ladders
    .venv/bin/python bench/ingest.py --partial-sweep    # partial aggregation or not, by cells/row
    .venv/bin/python bench/ingest.py --cells fields:zipf --rounds 1   # some cells only

Two revisions of src/ are measured: `--before` (exported with `git archive` into a temporary
directory) and the working tree (`after`). Each round starts one worker process per revision, in
alternating order (before first in odd rounds, after first in even ones), so both see the same
machine; the load average is recorded around every worker. A worker holds one Spark session and, per
format (Redis Streams `fields` and `jsonl`) and workload (`zipf`, the throughput benchmark's events;
`highcard`, `lib.load.highcard_frame` with the six metrics of `lib.load.HIGHCARD_METRICS`), drains a
pre-filled backlog on a fresh embedded Redis, then runs a short rate ladder (sustained), the same
drain with the audit off (`zipf`; before the audited drain in odd rounds, after it in even ones),
and the bare engine (`lib.bare.bare_run`, the same Spark plan fed from in-memory Arrow with a no-op
write, with the worker's own plan). Both workers do the same work in the same order: a session that
has run more is warmer, and when only the `after` worker ran the ladder and the audit-off drain, it
came out 15-25 % ahead on the zipf cells of a change that left their plan alone. Every worker first
drains a small backlog of each format, not measured, so that no cell pays for the JVM's warm-up
(the first drain of a fresh session ran about a quarter slower than the same drain after it).

Per drain: events/s, slice updates per event, store updates/s, exact counts (events counted,
and the `txn_count` metric summed in the store, against the events written; every batch
audited), the per-batch time breakdown (Spark's own durations, the write's time, Redis's time
per command) and the cores each component used. Writes bench/results/ingest[.quick].json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lib.bare import bare_run
from lib.load import (
    HIGHCARD,
    HIGHCARD_METRICS,
    WORKLOADS,
    KeySpace,
    PacedProducer,
    bench_config,
    build_pool,
    now_ms,  # fmt: skip
    prefill,
)
from lib.procs import (
    CpuSampler,
    CpuSnapshot,
    Workspace,
    children,
    command_usec,
    count_metric_total,
    descendants,
    pipeline_run,
    stat_counter,
    wait_idle,  # fmt: skip
)
from lib.results import ROOT, Run, log, parser
from lib.revisions import REVISIONS, export, order
from lib.stats import batch_rate, judge_step, median
from sluice.status.snapshot import backlog, recent_batches

FORMATS = ("fields", "jsonl")
# (quick, format, workload): (source.max_events_per_batch, events drained)
SIZES = {
    (False, "fields", "zipf"): (100_000, 1_500_000), (False, "jsonl", "zipf"): (500_000, 2_500_000),
    (False, "fields", "highcard"): (50_000, 200_000),
    (False, "jsonl", "highcard"): (50_000, 250_000),
    (True, "fields", "zipf"): (20_000, 100_000), (True, "jsonl", "zipf"): (100_000, 500_000),
    (True, "fields", "highcard"): (10_000, 40_000), (True, "jsonl", "highcard"): (10_000, 40_000),
}  # fmt: skip
POOL_EVENTS = 100_000  # zipf entries are cycled; highcard ones are drawn afresh, up to
MAX_POOL_EVENTS = 300_000  # ... this many
STEP_S, MAX_STEPS, MAX_LAG_S = 10.0, 4, 15.0
LUA = ("evalsha", "eval", "evalsha_ro", "eval_ro", "fcall")
READS = ("xrange", "xrevrange", "xread")
SPARK_PLAN = ("latestOffset", "getBatch", "queryPlanning")
SPARK_COMMIT = ("walCommit", "commitOffsets")


# -- the worker: one revision, one Spark session ---------------------------------------------


def command_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def parties(redis_pid: int | None) -> dict[str, list[int]]:
    """Pids per component: Redis, the JVM (a `java` child of this process), the Python workers
    (the JVM's descendants: the pyspark daemon and the workers it forks), the driver (this
    process). A worker that exits between two snapshots takes its CPU with it (an undercount)."""
    jvms = [p for p in children(os.getpid()) if "java" in command_of(p).split(" ")[0]]
    workers = [w for j in jvms for w in descendants(j)]
    out = {"redis": [redis_pid] if redis_pid else [], "jvm": jvms, "python_workers": workers}
    return out | {"driver": [os.getpid()]}


def progress_durations(query: Any, batches: set[int]) -> list[dict[str, Any]]:
    """Spark's per-batch durations (ms) of `batches` (those that recorded a batch)."""
    out = {}
    for p in query.recentProgress if query is not None else []:
        if p.batchId in batches and "addBatch" in p.durationMs:
            out[p.batchId] = {"batch": p.batchId, **dict(p.durationMs)}
    return list(out.values())


def breakdown(records: list[dict[str, Any]], durations: list[dict[str, Any]],
              usec: dict[str, int]) -> dict[str, Any]:  # fmt: skip
    """Mean ms per batch (without the first, the warm-up), by part: planning (Spark's
    latestOffset, getBatch, queryPlanning), the Redis side of the reads (XRANGE), the rest of the
    Spark tasks (decode, explode, fold, shuffle, collect, and the batch record), the write
    (the slowest partition's) split into Lua (Redis's script time, at most the write) and Python,
    commit (walCommit, commitOffsets), and the audit's source side (concurrent with the batch).

    A batch written behind (`pipeline.behind`) waits for the previous batch's write (`wait`)
    instead of writing within its own time: its write ran beside the next batch, so it is
    reported (`behind`) but not part of the batch's time."""
    recs = sorted(records, key=lambda r: r["batch"])[1:]
    durs = sorted(durations, key=lambda d: d["batch"])[1:]
    n_all = max(1, len(records))
    if not recs or not durs:
        return {}

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    write = mean([r.get("write_ms") or 0.0 for r in recs])
    lua = min(write, sum(usec.get(c, 0) for c in LUA) / 1000 / n_all)
    behind = mean([1.0 if r.get("behind") else 0.0 for r in recs]) >= 0.5
    wait = mean([r.get("wait_ms") or 0.0 for r in recs])
    in_batch = 0.0 if behind else write
    read = sum(usec.get(c, 0) for c in READS) / 1000 / n_all
    add = mean([d.get("addBatch", 0) for d in durs])
    plan = mean([sum(d.get(k, 0) for k in SPARK_PLAN) for d in durs])
    commit = mean([sum(d.get(k, 0) for k in SPARK_COMMIT) for d in durs])
    total = mean([d.get("triggerExecution", 0) for d in durs])
    audit = mean([(r.get("audit") or {}).get("audit_ms") or 0.0 for r in recs])
    return {
        "plan": plan, "read_redis": read,
        "spark_tasks": max(0.0, add - in_batch - read - wait), "wait": wait,
        "write_python": (write - lua) if not behind else 0.0,
        "write_lua": lua if not behind else 0.0, "commit": commit,
        "other": max(0.0, total - plan - add - commit), "audit_source": audit,
        "behind": behind, "write_ms": write, "write_lua_ms": lua,
        "batch_ms": total, "events_per_batch": mean([r["events"] for r in recs]),
        "redis_usec_by_command": {k: v for k, v in sorted(usec.items()) if v},
    }  # fmt: skip


def drain_cell(spark: Any, ws: Workspace, fmt: str, workload: str, a: Any,
               audit: bool = True, sustained: bool = False,
               partial: str = "auto", cap_scale: float = 1.0) -> dict[str, Any]:  # fmt: skip
    """Pre-fill, start the fold, wait until idle: the drain's numbers (and the ladder's).
    `partial`: `spark.partial_aggregation` (left out of the config when `auto`, the default,
    so that a revision without the setting runs too); `cap_scale` multiplies the cell's batch
    cap (`source.max_events_per_batch`)."""
    cap, n_events = SIZES[(a.quick, fmt, workload)]
    cap = round(cap * cap_scale)
    label = f"{fmt}-{workload}{'' if audit else '-noaudit'}"
    label += "" if partial == "auto" else f"-partial-{partial}"
    label += "" if cap_scale == 1.0 else f"-cap-{cap}"
    extra: dict[str, Any] = {"metrics": HIGHCARD_METRICS} if workload == "highcard" else {}
    if not audit:
        extra["audit"] = {"enabled": False}
    if partial != "auto":
        extra["spark"] = {"partial_aggregation": partial}
    cfg = bench_config(fmt, ws.state_dir(label), cap, **extra)
    out: dict[str, Any] = {"format": fmt, "workload": workload, "audit": audit,
                           "partial": partial, "batch_events": cap}  # fmt: skip
    with pipeline_run(spark, cfg) as (pipeline, handle):
        pool_n = n_events if workload == "highcard" else POOL_EVENTS
        pool = build_pool(cfg, pool_n, a.seed, now_ms(), workload, a.space)
        sent = prefill(handle.url, pool, n_events)
        redis_pid = handle.embedded.pid if handle.embedded else None
        usec0 = command_usec(handle.client)
        sampler = CpuSampler(lambda: parties(redis_pid))
        sampler.start()
        try:
            pipeline.start()
            idle, _ = wait_idle(pipeline, handle.client, cfg, a.timeout_s, f"{a.worker} {label}")
        finally:
            sampler.stop()
        usec1 = command_usec(handle.client)
        usec = {k: v - usec0.get(k, 0) for k, v in usec1.items()}
        records = sorted(recent_batches(handle.client, 600), key=lambda r: r["batch"])
        # The cores over the rate's own window, from the first batch's end to the last's (the
        # query's start-up and the wait for idleness left out), else over the whole drain.
        first, last = sampler.samples[0][1], sampler.samples[-1][1]
        cpu_whole = last.cores_since(first)
        cpu = (sampler.cores_between(records[0]["done_ms"], records[-1]["done_ms"])
               if len(records) > 1 else None) or cpu_whole  # fmt: skip
        durations = progress_durations(pipeline.query, {r["batch"] for r in records})
        rate = batch_rate(records) or {}
        counted = stat_counter(handle.client, "events_in")
        stored = count_metric_total(handle.client, "txn_count")
        updates = sum(r["updates_applied"] for r in records)
        write_s = sum((r.get("write_ms") or 0.0) for r in records) / 1000
        audited = [r for r in records if r.get("events")]
        out |= {
            "events": sent, "idle": idle, "batches": len(records), "per_s": rate.get("per_s"),
            "cores": cpu, "cores_whole": cpu_whole,
            "exact": idle and counted == sent and stored == sent,
            "counted": counted, "stored_txn_count": stored,
            "audit_ok": all((r.get("audit") or {}).get("ok") for r in audited) if audit else None,
            "updates": updates, "updates_per_event": updates / sent if sent else None,
            "pipeline_updates_per_s": (rate.get("per_s") or 0) * updates / sent if sent else None,
            "store_updates_per_s": updates / write_s if write_s else None,
            "batch_sizes": [r["events"] for r in records],
            "cells_per_row": cells_per_row(records),
            "breakdown": breakdown(records, durations, usec),
        }  # fmt: skip
        log(f"{a.worker} {label}: {rate.get('per_s') or 0:,.0f} events/s, exact {out['exact']},"
            f" {out['updates_per_event'] or 0:.2f} updates/event")  # fmt: skip
        if sustained and idle and out["per_s"]:
            out["steps"] = ladder(pipeline, handle, cfg, a, workload, out["per_s"], redis_pid)
            bounded = [s["achieved_per_s"] for s in out["steps"] if s["bounded"]]
            out["sustained_per_s"] = max(bounded) if bounded else None
    return out


def ladder(pipeline: Any, handle: Any, cfg: Any, a: Any, workload: str,
           drain_per_s: float, redis_pid: int | None) -> list[dict[str, Any]]:  # fmt: skip
    """Produce for STEP_S at 0.9 x the drain rate, then 1.25 x after a bounded step or 0.7 x
    after an unbounded one until both kinds were seen, then halfway between the best bounded
    and the lowest unbounded rate, at most MAX_STEPS (`lib.stats.judge_step` judges each).
    Each step also records the cores each component used while the producer ran (the producer
    is a thread of this process: `driver`), Redis's own time per command (`redis_usec`), and
    its batches' sizes."""
    steps: list[dict[str, Any]] = []
    factor, cap = 0.9, cfg.source.max_events_per_batch
    lo: float | None = None  # the highest bounded factor so far
    hi: float | None = None  # the lowest unbounded one
    for i in range(MAX_STEPS):
        rate = factor * drain_per_s
        n = POOL_EVENTS if workload == "zipf" else min(MAX_POOL_EVENTS, int(rate * STEP_S) + 1)
        pool = build_pool(cfg, n, a.seed + 10 + i, now_ms(), workload)
        per = pool.events_per_entry()
        producer = PacedProducer(handle.url, pool, rate, STEP_S)
        usec0, cpu0 = command_usec(handle.client), CpuSnapshot.take(parties(redis_pid))
        t0, start_ms = time.monotonic(), now_ms()
        producer.start()
        samples: list[tuple[float, int]] = []
        while producer.is_alive():
            producer.join(0.5)
            samples.append((time.monotonic() - t0, round(backlog(handle.client, cfg)[0] * per)))
        end_ms = now_ms()
        cores = CpuSnapshot.take(parties(redis_pid)).cores_since(cpu0)
        usec = {k: v - usec0.get(k, 0) for k, v in command_usec(handle.client).items()}
        drained, deadline = False, time.monotonic() + 60.0
        while not drained and time.monotonic() < deadline:
            drained = pipeline.wait_idle(timeout_s=0.5)
        judged_from = start_ms + (end_ms - start_ms) / 3
        admitted = [r["events"] for r in recent_batches(handle.client, 600)
                    if judged_from <= r["started_ms"] <= end_ms]  # fmt: skip
        achieved = producer.achieved_per_s()
        bounded, reason = judge_step(samples, achieved, MAX_LAG_S, admitted, cap)
        steps.append({"target_per_s": rate, "achieved_per_s": achieved, "bounded": bounded,
                      "reason": reason, "drained": drained, "cores": cores,
                      "redis_usec": {k: v for k, v in usec.items() if v > 0},
                      "step_s": (end_ms - start_ms) / 1000, "batch_events": admitted})  # fmt: skip
        log(f"{a.worker} sustained {cfg.source.format}-{workload}: {steps[-1]}")
        if not drained:
            break
        if bounded:
            lo = factor if lo is None else max(lo, factor)
        else:
            hi = factor if hi is None else min(hi, factor)
        factor = (
            (lo + hi) / 2
            if lo is not None and hi is not None
            else factor * (1.25 if bounded else 0.7)
        )
    return steps


def bare_cell(spark: Any, ws: Workspace, fmt: str, workload: str, a: Any,
              audit: bool = True, slots: bool = True, partial: str = "auto",
              space: KeySpace = HIGHCARD) -> dict[str, Any]:  # fmt: skip
    """The bare engine on batches of the cell's cap (`lib.bare.bare_run`); its plan carries
    the audit's columns unless `audit` is False, shares columns between metric groups unless
    `slots` is False, and sets Spark's partial aggregation as `partial` says, as the fold's
    does; `highcard` events fall over `space`."""
    cap = SIZES[(a.quick, fmt, workload)][0]
    extra: dict[str, Any] = {"metrics": HIGHCARD_METRICS} if workload == "highcard" else {}
    if not audit:
        extra["audit"] = {"enabled": False}
    cfg = bench_config(fmt, (d := ws.state_dir(f"{fmt}-{workload}-bare")), cap, **extra)
    bare, _ = bare_run(spark, cfg, d, cap, a.seed + 7, a.bare_batches, a.timeout_s, workload,
                       slots, partial, space)  # fmt: skip
    log(f"bare {fmt}-{workload}{'' if audit else ' (audit off)'}{'' if slots else ' (no slots)'}"
        f"{'' if partial == 'auto' else f' (partial {partial})'}: {bare}")  # fmt: skip
    return {"format": fmt, "workload": workload, "bare": bare, "audit": audit, "slots": slots,
            "partial": partial}  # fmt: skip


# What `--bare-<toggle>` and `--<toggle>-pairs` compare: (the value measured as "on", as "off").
TOGGLES: dict[str, tuple[Any, Any]] = {
    "audit": (True, False), "slots": (True, False), "partial": ("on", "off"),
    "cap_scale": (2.0, 1.0),  # `--cap-pairs`: twice the batch cap, against the cell's own
}  # fmt: skip


def bare_ab(a: Any, toggle: str) -> None:
    """`--bare-audit`, `--bare-slots` and `--bare-partial` (TOGGLES): the bare engine with the
    audit's columns and without, with columns shared between metric groups and without, or
    with Spark's partial aggregation and without, per cell of `--cells`, `rounds` times in
    alternating order, in this process (the working tree's src/); writes
    bench/results/ingest-bare-<toggle>[.quick|.cells].json."""
    from sluice.pipeline.spark import build_spark
    from sluice.testing.arrow_source import ArrowFileSource

    run, ws, cells, spark = Run(f"ingest-bare-{toggle}", a), Workspace(), [], None
    try:
        spark = build_spark(bench_config("jsonl", ws.state_dir("spark"), 1), "sluice-bench")
        spark.dataSource.register(ArrowFileSource)
        bare_cell(spark, ws, "fields", "zipf", a)  # warm-up, not counted
        for rnd in range(a.rounds or 3):
            for fmt, wl in a.cells:
                for on in (True, False) if rnd % 2 == 0 else (False, True):
                    value = TOGGLES[toggle][0 if on else 1]
                    c = bare_cell(spark, ws, fmt, wl, a, **{toggle: value})
                    cells.append(c | {"round": rnd + 1, "on": on})
    finally:
        if spark is not None:
            spark.stop()
        ws.cleanup()
    rows = []
    for fmt, wl in a.cells:
        mine = [c for c in cells if (c["format"], c["workload"]) == (fmt, wl)]
        on, off = ([c["bare"]["per_s"] for c in mine if c["on"] == x and c["bare"].get("per_s")]
                   for x in (True, False))  # fmt: skip
        m_on, m_off = median(on), median(off)
        cost = 1 - m_on / m_off if m_on and m_off else None
        rows.append({"format": fmt, "workload": wl, "on_per_s": m_on, "off_per_s": m_off,
                     "on_each": on, "off_each": off, "cost": cost})  # fmt: skip
    sizes = {f"{f} {w}": SIZES[(a.quick, f, w)][0] for f, w in a.cells}
    run.write({"bare_batches": a.bare_batches, "sizes": sizes},
              {"rows": rows, "load_1m": os.getloadavg()[0]})  # fmt: skip


# `--partial-sweep`: key spaces of the high-cardinality workload from dense to sparse, so that a
# batch's exploded rows fold into from a few hundredths of a cell per row up to HIGHCARD's 0.72.
SWEEP = (
    KeySpace(100, 20, 60_000), KeySpace(100, 20, 300_000), KeySpace(300, 20, 300_000),
    KeySpace(300, 30, 450_000), KeySpace(300, 50, 600_000), KeySpace(1_000, 200, 600_000),
    KeySpace(3_000, 200, 600_000), HIGHCARD,
)  # fmt: skip


def partial_sweep(a: Any) -> None:
    """`--partial-sweep`: where Spark's partial aggregation stops paying. The bare engine on the
    high-cardinality workload's metrics, per format of `--cells` and key space of SWEEP, with
    the partial step and without, in alternating order, `rounds` times, in one Spark session
    (the working tree's src/). Cells per row: the warm-up batch's, what `auto` judges by.
    Writes bench/results/ingest-partial-sweep[.quick].json."""
    from sluice.pipeline.plan import PARTIAL_OFF_CELLS_PER_ROW
    from sluice.pipeline.spark import build_spark
    from sluice.testing.arrow_source import ArrowFileSource

    run, ws, cells, spark = Run("ingest-partial-sweep", a), Workspace(), [], None
    formats = [f for f in FORMATS if (f, "highcard") in a.cells]
    spaces = SWEEP[::3] if a.quick else SWEEP
    try:
        spark = build_spark(bench_config("jsonl", ws.state_dir("spark"), 1), "sluice-bench")
        spark.dataSource.register(ArrowFileSource)
        bare_cell(spark, ws, "fields", "highcard", a)  # warm-up, not counted
        for rnd in range(a.rounds or 3):
            for fmt in formats:
                for i, space in enumerate(spaces):
                    log(f"partial sweep: round {rnd + 1}, {fmt}, {space}")
                    for on in (True, False) if (rnd + i) % 2 == 0 else (False, True):
                        c = bare_cell(spark, ws, fmt, "highcard", a, partial="on" if on else "off",
                                      space=space)  # fmt: skip
                        cells.append(c | {"round": rnd + 1, "on": on, "space": space._asdict()})
    finally:
        if spark is not None:
            spark.stop()
        ws.cleanup()
    rows = []
    for fmt in formats:
        for space in spaces:
            mine = [c for c in cells if c["format"] == fmt and c["space"] == space._asdict()]
            on, off = ([c["bare"]["per_s"] for c in mine if c["on"] == x and c["bare"].get("per_s")]
                       for x in (True, False))  # fmt: skip
            per_row = [c["bare"]["fold_cells"] / c["bare"]["fold_rows"] for c in mine
                       if c["bare"].get("fold_rows")]  # fmt: skip
            m_on, m_off = median(on), median(off)
            rows.append({"format": fmt, "space": space._asdict(),
                         "cells_per_row": median(per_row), "on_per_s": m_on, "off_per_s": m_off,
                         "on_each": on, "off_each": off,
                         "ratio": m_off / m_on if m_on and m_off else None})  # fmt: skip
    run.write({"bare_batches": a.bare_batches, "events": SIZES[(a.quick, "fields", "highcard")][0],
               "metrics": HIGHCARD_METRICS, "threshold": PARTIAL_OFF_CELLS_PER_ROW},
              {"rows": rows, "load_1m": os.getloadavg()[0]})  # fmt: skip


PAIR_KEYS = ("format", "workload", "audit", "per_s", "exact", "audit_ok", "cells_per_row",
             "sustained_per_s", "batch_events")  # fmt: skip


def best_step(cell: dict[str, Any]) -> dict[str, Any] | None:
    """The ladder's best bounded step of a drain that ran one."""
    bounded = [s for s in cell.get("steps") or [] if s["bounded"]]
    return max(bounded, key=lambda s: s["achieved_per_s"]) if bounded else None


def cells_per_row(records: list[dict[str, Any]]) -> list[float]:
    """Per batch, the cells its exploded rows folded into per row (what `auto` judges by)."""
    return [round(r["fold_cells"] / r["fold_rows"], 3) for r in records if r.get("fold_rows")]


def drain_pairs(a: Any, toggle: str, n_pairs: int) -> None:
    """`--audit-pairs N`, `--partial-pairs N` and `--cap-pairs N`: per cell of `--cells`, after
    a warm-up drain, N pairs of drains with the audit (Spark's partial aggregation, twice the
    batch cap) on and off, in alternating order, in one Spark session (the working tree's
    src/); the cap's drains also run the rate ladder (sustained). A pair's ratio (on / off) is
    taken in one stretch of the machine's load, so its median is steadier than a ratio of
    medians. `highcard` events fall over `--space`. Writes
    bench/results/ingest-<toggle>[.quick|.cells].json (`cap_scale`: ingest-cap)."""
    from sluice.pipeline.spark import build_spark

    name = "cap" if toggle == "cap_scale" else toggle
    run, ws, cells, spark = Run(f"ingest-{name}", a), Workspace(), [], None
    a = argparse.Namespace(**{**vars(a), "worker": f"{name} pairs"})
    warm = argparse.Namespace(**{**vars(a), "quick": True, "worker": "warm-up"})
    try:
        spark = build_spark(bench_config("jsonl", ws.state_dir("spark"), 1), "sluice-bench")
        for fmt, wl in a.cells:
            drain_cell(spark, ws, fmt, "zipf", warm)
            for pair in range(n_pairs):
                log(f"{name} pairs: {fmt} {wl}, pair {pair + 1} of {n_pairs}")
                for on in (True, False) if pair % 2 == 0 else (False, True):
                    value = TOGGLES[toggle][0 if on else 1]
                    c = drain_cell(spark, ws, fmt, wl, a, sustained=toggle == "cap_scale",
                                   **{toggle: value})  # fmt: skip
                    kept = {k: c.get(k) for k in PAIR_KEYS}
                    step = best_step(c)
                    if step is not None:  # where the cores went at the sustained rate
                        kept["sustained_idle"] = step["cores"].get("idle")
                        kept["sustained_batch"] = median(step["batch_events"])
                    cells.append(kept | {"pair": pair + 1, "on": on})
    finally:
        if spark is not None:
            spark.stop()
        ws.cleanup()
    rows = []
    for fmt, wl in a.cells:
        ran = [c for c in cells if (c["format"], c["workload"]) == (fmt, wl)]
        pairs = []
        for pair in range(1, n_pairs + 1):
            on, off = ([c["per_s"] for c in ran if c["pair"] == pair and c["on"] == x]
                       for x in (True, False))  # fmt: skip
            if on and off and on[0] and off[0]:
                pairs.append({"pair": pair, "on": on[0], "off": off[0], "ratio": on[0] / off[0]})
        ratio = median([x["ratio"] for x in pairs])
        cells_per_row = [x for c in ran for x in (c.get("cells_per_row") or [])]
        side = {on: [c for c in ran if c["on"] == on] for on in (True, False)}
        sustained = {
            f"{k}_{'on' if on else 'off'}": median([c[k] for c in cs if c.get(k) is not None])
            for on, cs in side.items()
            for k in ("sustained_per_s", "sustained_idle", "sustained_batch")
        }
        rows.append({"format": fmt, "workload": wl, "pairs": pairs, "ratio": ratio, **sustained,
                     "sustained_each": [(c["pair"], c["on"], c.get("sustained_per_s"))
                                        for c in ran],
                     "cost": None if ratio is None else 1 - ratio,
                     "on_per_s": median([x["on"] for x in pairs]),
                     "off_per_s": median([x["off"] for x in pairs]),
                     "cells_per_row": median(cells_per_row) if cells_per_row else None,
                     "exact": all(c["exact"] for c in ran) if ran else None,
                     "audit_ok": all(c["audit_ok"] for c in ran if c["audit"]) if ran
                     else None})  # fmt: skip
    run.write({"pairs": n_pairs, "sizes": {f"{f} {w}": SIZES[(a.quick, f, w)]
               for f, w in a.cells}, "space": a.space._asdict(),
               "cap_scale": TOGGLES["cap_scale"][0]},
              {"rows": rows, "load_1m": os.getloadavg()[0]})  # fmt: skip


def worker(a: Any) -> None:
    """Measure every cell of one revision; write the cells as JSON to `a.result`."""
    from sluice.pipeline.spark import build_spark
    from sluice.testing.arrow_source import ArrowFileSource

    ws, cells, spark = Workspace(), [], None
    try:
        spark = build_spark(bench_config("jsonl", ws.state_dir("spark"), 1), "sluice-bench")
        spark.dataSource.register(ArrowFileSource)
        warm = argparse.Namespace(**{**vars(a), "quick": True, "worker": f"{a.worker} warm-up"})
        for fmt in FORMATS:  # the JVM's warm-up, not measured
            if any(f == fmt for f, _ in a.cells):
                drain_cell(spark, ws, fmt, "zipf", warm)
        for fmt in FORMATS:
            for workload in WORKLOADS:
                if (fmt, workload) not in a.cells:
                    continue
                # The same work in both revisions' workers (module docstring).
                runs: list[Any] = [(drain_cell, (spark, ws, fmt, workload, a, True, True))]
                if workload == "zipf":
                    off = (drain_cell, (spark, ws, fmt, workload, a, False))
                    runs.insert(a.round % 2, off)  # the order alternates between rounds
                runs.append((bare_cell, (spark, ws, fmt, workload, a)))  # its own plan
                for fn, args in runs:
                    try:
                        cells.append(fn(*args))
                    except Exception as e:  # noqa: BLE001 - recorded; the other cells go on
                        log(f"{a.worker} {fmt}-{workload} {fn.__name__}: failed: {e!r}")
                        cells.append({"format": fmt, "workload": workload, "error": repr(e),
                                      "audit": fn is drain_cell and args[5]})  # fmt: skip
                    Path(a.result).write_text(json.dumps(cells, default=str))  # so far
    finally:
        if spark is not None:
            spark.stop()
        ws.cleanup()


# -- the driver: rounds of workers, then the medians -----------------------------------------


def run_worker(label: str, src: Path, tmp: Path, a: Any, rnd: int) -> dict[str, Any]:
    result = tmp / f"{label}-{rnd}.json"
    args = [sys.executable, __file__, "--worker", label, "--result", str(result), "--seed",
            str(a.seed + rnd), "--round", str(rnd), "--cells", a.cells_arg] + (
            ["--quick"] if a.quick else [])  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{ROOT / 'bench'}"}
    load0, t0 = os.getloadavg(), time.monotonic()
    log(f"round {rnd + 1}: {label} ({src})")
    proc = subprocess.run(args, env=env, timeout=a.worker_timeout_s, check=False)
    took = time.monotonic() - t0
    cells = json.loads(result.read_text()) if result.exists() else []
    return {"round": rnd + 1, "revision": label, "exit": proc.returncode, "took_s": round(took),
            "load_before": list(load0), "load_after": list(os.getloadavg()),
            "cells": cells}  # fmt: skip


def summarize(workers: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds, per revision, format and workload; ratios against the bare
    engine's median with that revision's plan (results from before every worker ran the bare
    engine have it from the `after` workers only, and use it for both)."""
    rows = []
    for fmt in FORMATS:
        for wl in WORKLOADS:

            def cells(rev: str, audit: bool = True, f: str = fmt, w: str = wl) -> list[Any]:
                return [c for x in workers if x["revision"] == rev for c in x["cells"]
                        if c["format"] == f and c["workload"] == w and "bare" not in c
                        and "error" not in c and c["audit"] == audit]  # fmt: skip

            def bares(rev: str | None, f: str = fmt, w: str = wl) -> float | None:
                return median([c["bare"]["per_s"] for x in workers for c in x["cells"]
                               if rev in (None, x["revision"]) and c["format"] == f
                               and c["workload"] == w and "bare" in c
                               and c["bare"].get("per_s")])  # fmt: skip

            for rev in REVISIONS:
                cs, bare = cells(rev), bares(rev) or bares(None)

                def med(key: str, cs: list[Any] = cs) -> float | None:
                    return median([c[key] for c in cs if c.get(key) is not None])

                drain, sus = med("per_s"), med("sustained_per_s")
                row = {
                    "format": fmt, "workload": wl, "revision": rev, "runs": len(cs),
                    "errors": [c["error"] for x in workers if x["revision"] == rev
                               for c in x["cells"] if c["format"] == fmt
                               and c["workload"] == wl and "error" in c],
                    "drain_per_s": drain, "drain_each": [c.get("per_s") for c in cs],
                    "sustained_per_s": sus,
                    "sustained_each": [c.get("sustained_per_s") for c in cs if "steps" in c],
                    "bare_per_s": bare,
                    "drain_vs_bare": drain / bare if drain and bare else None,
                    "sustained_vs_bare": sus / bare if sus and bare else None,
                    "updates_per_event": med("updates_per_event"),
                    "pipeline_updates_per_s": med("pipeline_updates_per_s"),
                    "store_updates_per_s": med("store_updates_per_s"),
                    "exact": all(c.get("exact") for c in cs) if cs else None,
                    "audit_ok": all(c.get("audit_ok") for c in cs) if cs else None,
                    "breakdown": {k: median([c["breakdown"].get(k) or 0.0 for c in cs
                                             if c.get("breakdown")])
                                  for k in (*BREAKDOWN, "audit_source", "batch_ms",
                                            "events_per_batch")}
                    | {"behind": any((c.get("breakdown") or {}).get("behind") for c in cs)},
                    "cores": {k: median([c["cores"][k] for c in cs if c.get("cores")])
                              for k in CORES},
                    "cores_whole": {k: median([c["cores_whole"][k] for c in cs])
                                    for k in CORES}
                    if cs and all(c.get("cores_whole") for c in cs) else None,
                    "ladder": ladder_summary(cs),
                }  # fmt: skip
                off = cells(rev, audit=False)
                if off:
                    on_off = median([c["per_s"] for c in off if c.get("per_s")])
                    row["drain_audit_off_per_s"] = on_off
                    row["audit_cost"] = 1 - drain / on_off if drain and on_off else None
                    row["drain_audit_off_each"] = [c.get("per_s") for c in off]
                rows.append(row)
    loads = [x["load_before"][0] for x in workers] + [x["load_after"][0] for x in workers]
    return {"rows": rows, "load_1m": {"min": min(loads, default=None),
                                      "max": max(loads, default=None),
                                      "median": median(loads)},
            "workers": [{k: v for k, v in x.items() if k != "cells"} for x in workers]}  # fmt: skip


def ladder_summary(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Each run's best bounded ladder step, and the slowest unbounded step above it: medians of
    their rates, cores per component, Redis's ms per second in each of LADDER_COMMANDS, and
    events per batch; the unbounded steps' reasons. Runs whose steps carry no `cores` (older
    results) are left out."""
    best, over = [], []
    for c in cells:
        steps = [s for s in c.get("steps") or [] if s.get("cores")]
        bounded = [s for s in steps if s["bounded"]]
        top = max((s["achieved_per_s"] for s in bounded), default=0.0)
        best += [s for s in bounded if s["achieved_per_s"] == top][:1]
        above = [s for s in steps if not s["bounded"] and s["achieved_per_s"] > top]
        over += sorted(above, key=lambda s: s["achieved_per_s"])[:1]

    def view(steps: list[dict[str, Any]]) -> dict[str, Any] | None:
        if not steps:
            return None
        return {
            "runs": len(steps),
            "per_s": median([s["achieved_per_s"] for s in steps]),
            "cores": {k: median([s["cores"].get(k, 0.0) for s in steps]) for k in CORES},
            "redis_ms_per_s": {cmd: median([s["redis_usec"].get(cmd, 0) / 1000 / s["step_s"]
                                            for s in steps]) for cmd in LADDER_COMMANDS},
            "events_per_batch": median([sum(s["batch_events"]) / len(s["batch_events"])
                                        for s in steps if s["batch_events"]]),
            "reasons": [s["reason"] for s in steps],
        }  # fmt: skip

    return {"bounded": view(best), "unbounded": view(over)}


LADDER_COMMANDS = ("xadd", "xrange", "evalsha")
BREAKDOWN = (
    "plan",
    "read_redis",
    "spark_tasks",
    "wait",
    "write_python",
    "write_lua",
    "commit",
    "other",
    "write_ms",
    "write_lua_ms",
)
CORES = ("redis", "jvm", "python_workers", "driver", "loadgen", "other", "idle")


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--before", default="db2d2f0", help="the revision to compare with")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 3, quick 1)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--worker", choices=REVISIONS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--bare-audit", action="store_true",
                   help="only the bare engine with and without the audit's columns")  # fmt: skip
    p.add_argument("--bare-slots", action="store_true",
                   help="only the bare engine with and without columns shared between metric"
                   " groups")  # fmt: skip
    p.add_argument("--bare-partial", action="store_true",
                   help="only the bare engine with and without Spark's partial"
                   " aggregation")  # fmt: skip
    p.add_argument("--partial-sweep", action="store_true",
                   help="only the bare engine with and without Spark's partial aggregation,"
                   " over key spaces from dense to sparse")  # fmt: skip
    p.add_argument("--partial-pairs", type=int, metavar="N",
                   help="only N pairs of drains with Spark's partial aggregation on and"
                   " off")  # fmt: skip
    p.add_argument("--cells", default=",".join(f"{f}:{w}" for f in FORMATS for w in WORKLOADS),
                   help="format:workload pairs to measure, comma-separated (default: all);"
                   " a subset goes to bench/results/ingest.cells.json")  # fmt: skip
    p.add_argument("--space", default=",".join(map(str, HIGHCARD)), metavar="C,M,MS",
                   help="where the drain pairs' highcard events fall: cards, merchants, spread"
                   " in ms (default %(default)s)")  # fmt: skip
    p.add_argument("--audit-pairs", type=int, metavar="N",
                   help="only the audit's cost: N pairs of drains with it on and off")  # fmt: skip
    p.add_argument("--cap-pairs", type=int, metavar="N",
                   help="only N pairs of drains, each with its ladder, at twice the batch cap"
                   " and at the cell's own")  # fmt: skip
    a = p.parse_args()
    a.cells_arg, a.cells = a.cells, cells_of(p, a.cells)
    try:
        a.space = KeySpace(*(int(x) for x in a.space.split(",")))
    except (TypeError, ValueError):
        p.error(f"--space: want cards,merchants,spread_ms (three whole numbers), got {a.space!r}")
    if a.space != HIGHCARD and not (a.audit_pairs or a.partial_pairs or a.cap_pairs):
        p.error(
            "--space applies to drain pairs only (--audit-pairs, --partial-pairs or --cap-pairs)"
        )
    if len(a.cells) < len(FORMATS) * len(WORKLOADS) and a.out is None and not a.worker:
        name = (
            "ingest-audit" if a.audit_pairs
            else "ingest-cap" if a.cap_pairs
            else "ingest-partial" if a.partial_pairs
            else "ingest-bare-audit" if a.bare_audit
            else "ingest-bare-slots" if a.bare_slots
            else "ingest-bare-partial" if a.bare_partial
            else "ingest-partial-sweep" if a.partial_sweep
            else "ingest"
        )  # fmt: skip
        a.out = Path(__file__).parent / "results" / f"{name}.cells.json"
    a.timeout_s, a.bare_batches = (120.0, 4) if a.quick else (240.0, 5)
    if a.worker:
        worker(a)
        return
    if a.partial_sweep:
        partial_sweep(a)
        return
    if a.bare_audit or a.bare_slots or a.bare_partial:
        bare_ab(a, "audit" if a.bare_audit else "slots" if a.bare_slots else "partial")
        return
    pairs = {"audit": a.audit_pairs, "partial": a.partial_pairs, "cap_scale": a.cap_pairs}
    for toggle, n_pairs in pairs.items():
        if n_pairs:
            drain_pairs(a, toggle, n_pairs)
            return
    rounds = a.rounds or (1 if a.quick else 3)
    a.worker_timeout_s = 900 if a.quick else 1200
    run = Run("ingest", a)
    workers: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sluice-bench-ingest-") as t:
        tmp = Path(t)
        (tmp / "before").mkdir()
        srcs = {"before": export(a.before, tmp / "before"), "after": ROOT / "src"}
        for rnd in range(rounds):
            for rev in order(rnd):
                workers.append(run_worker(rev, srcs[rev], tmp, a, rnd))
                run.write(params(a, rounds), summarize(workers), series(workers))  # so far


def cells_of(p: argparse.ArgumentParser, text: str) -> list[tuple[str, str]]:
    """`--cells`: "fields:zipf,jsonl:highcard" -> [(format, workload), ...]."""
    cells = [tuple(c.strip().split(":", 1)) for c in text.split(",") if c.strip()]
    known = [(f, w) for f in FORMATS for w in WORKLOADS]
    bad = [":".join(c) for c in cells if c not in known]
    if bad or not cells:
        p.error(f"--cells: unknown {', '.join(bad) or 'empty list'}; known:"
                f" {', '.join(f'{f}:{w}' for f, w in known)}")  # fmt: skip
    return [c for c in known if c in cells]


def params(a: Any, rounds: int) -> dict[str, Any]:
    return {"before": a.before, "rounds": rounds, "sizes": {"|".join(map(str, k)): v
            for k, v in SIZES.items() if k[0] == a.quick}, "step_s": STEP_S,
            "max_steps": MAX_STEPS, "max_lag_s": MAX_LAG_S, "metrics": HIGHCARD_METRICS,
            "bare_batches": a.bare_batches, "cells": [":".join(c) for c in a.cells],
            "same_work": True, "bare_each_revision": True}  # fmt: skip


def series(workers: list[dict[str, Any]]) -> dict[str, Any]:
    return {"workers": [{"round": x["round"], "revision": x["revision"], "cells": x["cells"]}
                        for x in workers]}  # fmt: skip


if __name__ == "__main__":
    main()
