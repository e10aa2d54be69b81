"""Offline: a backfill against the bare engine, a training set against a plain range join.

    .venv/bin/python bench/offline.py                      # both parts, about 50 minutes on 2 cores
    .venv/bin/python bench/offline.py --quick              # small sizes, 1 round, about 6 minutes
    .venv/bin/python bench/offline.py --part backfill      # one part (-> offline-backfill.json)
    .venv/bin/python bench/offline.py --part backfill --conf-after 'auto-aof-rewrite-percentage 0'
                                      # each backfill again with that line (-> ...-conf.json)
    .venv/bin/python bench/offline.py --part backfill --script-after
                                      # each backfill again through the slice script only
    .venv/bin/python bench/offline.py --part training
    .venv/bin/python bench/offline.py --part training --keys zipf --cells headline \
        --range-timeout-s 600                 # hot cards (-> offline-training-zipf.json)
    .venv/bin/python bench/offline.py --part stages   # a training set's stages, each timed
    .venv/bin/python bench/offline.py --part minmax   # a count and a max: running pass, frames,
                                                      # range join (-> offline-minmax.json)

Backfill (`--part backfill`). Per workload, an archive of `--events` events is written as
ARCHIVE_FILES Parquet files in time order, times uniform over the `--span-h` hours before a
minute edge (`until`): **zipf**, the throughput benchmark's events (Zipf keys) with the ingest
benchmark's 3 metrics, and **highcard**, keys uniform over 100,000 cards and 200 merchants with
its six metrics (`lib.load`); each metric kept for `lib.offline.RETENTION`, so that nothing of
the archive expires. In one Spark session (`local[2]`), rounds alternate the bare engine (the
same read, `archive_events` and fold, with a no-op write, over the backfill's shuffle
partitions: `lib.offline.bare_fold`) and `sluice.offline.backfill` into a fresh embedded Redis
(the default one: AOF on, `appendfsync everysec`), bare first. Round 0 is the cold start (the
session's first reads of that archive) and is reported apart, not in the medians. Per run: events
/ wall time, Spark's stages' times, the cores each process used (Redis, the JVM, its Python
workers, the driver) and, for a backfill, the slices written and the store's `txn_count` summed
against the events. With `--conf-after LINE`, every round runs the backfill a second time, right
after the first, into a Redis whose config has LINE added, and reports the two side by side
(offline-backfill-conf.json): what a server setting (say, fewer AOF rewrites) buys the write.
With `--script-after`, every round runs the backfill a second time with every slice hash through
`write_slices.lua` (`restore_new=False`), the way backfills wrote before new hashes were created
with RESTORE, and reports the two side by side.

Training sets (`--part training`). An archive of `--train-events` card transactions (cards
uniform over `--cards`, or with `--keys zipf` drawn as the load generator draws keys, Zipf
`--zipf-a` ranks folded onto the cards, so that a few are hot; times uniform over
`--span-days` days, 16 Parquet files) and spines of
labelled rows drawn from it (`lib.offline_training`). `sluice.offline.training.training_set`
and a plain PySpark range join (`lib.offline_training.range_join`) compute a count and a sum
per card over each window, and each writes its table as Parquet; rows/s = spine rows / wall
time. The headline pair (3 windows of both metrics, the largest spine) runs `--rounds` times,
alternating (range join first); then (`--cells all`) single runs as the spine grows and as the
window list grows. A zipf run writes offline-training-zipf.json.
Each training set is checked against DuckDB over the archive on a sample of 200 spine rows, and
against the range join on every row where both ran. A range join over `--range-timeout-s` is
cancelled and recorded as such. Writes bench/results/offline[.quick].json.

Stages (`--part stages`, `lib.offline_stages`): on the training part's archive and largest spine,
the training set's stages one at a time (read, plan, shuffle, sort by the key's text or by its
hash, to Python), then the whole training set and the range join, each to Spark's no-op sink,
`--rounds` rounds alternating (-> offline-stages.json).

Minima and maxima (`--part minmax`, `lib.offline_minmax`): on the same archive and largest
spine, a count and a maximum by card over 3 windows each, by the running pass, by the slice
frames (the way every non-summed metric went before), and by a range join, `--rounds` rounds
alternating after a warm-up of each (-> offline-minmax.json).
"""

from __future__ import annotations

import os
import shutil
import statistics
import threading
from functools import partial
from pathlib import Path
from typing import Any

import pandas as pd
import redis

from lib.load import now_ms
from lib.offline import (
    ARCHIVE_FILES,
    RETENTION,
    archive_frame,
    bare_fold,
    stored_count,
    timed,
    workload_config,
    write_archive,
)
from lib.offline_minmax import METRICS as MINMAX_METRICS
from lib.offline_minmax import minmax_config, minmax_part
from lib.offline_stages import stages_part
from lib.offline_training import (
    WINDOWS,
    compare,
    duckdb_answers,
    features,
    range_join,
    training_config,
    write_events,
    write_spine,
)
from lib.procs import Workspace
from lib.results import Run, log, parser
from sluice.offline.backfill import backfill
from sluice.offline.events import read_archive
from sluice.redis.embedded import EmbeddedRedis
from sluice.slices.window import slice_start

PARTS = ("backfill", "training")  # `all`; `stages` runs on its own
WORKLOADS = ("zipf", "highcard")
SAMPLE_ROWS = 200
# (quick): backfill events per workload, training events, spines, cards
SIZES = {False: (2_000_000, 10_000_000, (100_000, 1_000_000), 100_000),
         True: (100_000, 300_000, (10_000, 30_000), 10_000)}  # fmt: skip


def load1() -> float:
    return os.getloadavg()[0]


# -- backfill --------------------------------------------------------------------------------


def backfill_workload(spark: Any, ws: Workspace, workload: str, a: Any) -> dict[str, Any]:
    """Round 0 (cold) and `a.rounds` rounds of (bare, backfill) over one archive."""
    cfg = workload_config(workload, ws.state_dir(f"cfg-{workload}"))
    until = slice_start(now_ms(), 60_000)  # a minute edge: every metric's seam
    df = archive_frame(cfg, workload, a.events, a.seed, until, int(a.span_h * 3_600_000))
    where = ws.state_dir(f"archive-{workload}")
    size = write_archive(df, where)
    del df
    parts = max(cfg.spark.shuffle_partitions, 2 * spark.sparkContext.defaultParallelism)
    rounds = []
    for rnd in range(a.rounds + 1):
        fold_job = partial(bare_fold, spark, cfg, str(where), until, now_ms(), parts)
        _, wall, cores, stages = timed(spark, fold_job)
        bare = {"wall_s": wall, "per_s": a.events / wall, "cores": cores, "stages": stages}
        log(f"{workload} round {rnd}: bare {bare['per_s']:,.0f} events/s")
        run_fill = partial(backfill_run, spark, ws, cfg, str(where), until, a, f"{workload}-{rnd}")
        fill = run_fill(())
        log(f"{workload} round {rnd}: backfill {fill['per_s']:,.0f} events/s,"
            f" {fill['slices']:,} slices, Redis {fill['cores']['redis']:.2f} cores,"
            f" exact {fill['exact']}")  # fmt: skip
        rnd_out = {"round": rnd, "bare": bare, "backfill": fill,
                   "ratio": fill["per_s"] / bare["per_s"]}  # fmt: skip
        if a.conf_after:  # the same backfill into a Redis with the lines added, right after
            conf = run_fill(tuple(a.conf_after))
            log(
                f"{workload} round {rnd}: backfill with {a.conf_after}: {conf['per_s']:,.0f}"
                f" events/s, Redis {conf['cores']['redis']:.2f} cores, exact {conf['exact']}"
            )
            rnd_out |= {"conf": conf, "conf_ratio": conf["per_s"] / fill["per_s"]}
        if a.rerun:  # the same backfill again over the store it filled, two ways
            rerun = rerun_pair(spark, ws, cfg, str(where), until, a, f"{workload}-{rnd}", rnd)
            log(f"{workload} round {rnd}: re-run {rerun['probe']['per_s']:,.0f} events/s,"
                f" through the script only {rerun['script']['per_s']:,.0f}, exact"
                f" {rerun['exact']}")  # fmt: skip
            rnd_out |= {"rerun": rerun}
        if a.script_after:  # the same backfill with every hash through the slice script
            script = run_fill((), restore_new=False)
            log(f"{workload} round {rnd}: backfill through the script only:"
                f" {script['per_s']:,.0f} events/s, Redis {script['cores']['redis']:.2f} cores,"
                f" exact {script['exact']}")  # fmt: skip
            rnd_out |= {"script": script, "script_ratio": fill["per_s"] / script["per_s"]}
        rounds.append(rnd_out)
    return summarize_backfill(workload, a, size, parts, rounds)


def backfill_run(spark: Any, ws: Workspace, cfg: Any, where: str, until: int, a: Any,
                 name: str, extra_config: tuple[str, ...],
                 restore_new: bool = True) -> dict[str, Any]:  # fmt: skip
    """One backfill of the archive at `where` into a fresh embedded Redis (its config with
    `extra_config` added; with `restore_new` False, every hash through the slice script): its
    rate, cores, stages and what the store holds after it."""
    tag = ("-conf" if extra_config else "") + ("" if restore_new else "-script")
    srv = EmbeddedRedis(ws.state_dir(f"redis-{name}{tag}"), extra_config=extra_config).start()
    try:
        job = partial(backfill, spark, cfg, where, until_ms=until, url=srv.url,
                      restore_new=restore_new)  # fmt: skip
        report, wall, cores, stages = timed(spark, job, srv.pid)
        with redis.Redis.from_url(srv.url) as c:
            stored = stored_count(c, "txn_count")
            memory = c.info("memory")["used_memory"]
            rewrites = c.info("stats").get("total_forks", 0)  # AOF rewrites: no RDB saves
            hashes = sum(1 for _ in c.scan_iter("sluice:s:*", count=10_000))
    finally:
        srv.stop()
    r = report.as_dict()
    fill = {"wall_s": wall, "per_s": a.events / wall, "cores": cores, "stages": stages,
            "stored_txn_count": stored, "used_memory": memory, "hashes": hashes,
            "aof_rewrites": rewrites, "slices_per_s": r["slices"] / wall,
            **{k: r[k] for k in ("events", "slices", "expired", "after_seam", "partitions",
                                 "dead", "elapsed_s")}}  # fmt: skip
    fill["exact"] = (stored == a.events == r["events"] and not r["dead"] and not r["expired"]
                     and not r["after_seam"])  # fmt: skip
    return fill


def rerun_pair(spark: Any, ws: Workspace, cfg: Any, where: str, until: int, a: Any,
               name: str, rnd: int) -> dict[str, Any]:  # fmt: skip
    """A nightly re-run: one backfill into a fresh embedded Redis, then the same backfill again
    into the store it filled (`fresh`: every partition written again), twice, in alternating
    order per round: as users run it (each task asks whether its hashes exist before building
    RESTOREs) and with every hash through the slice script. Rates of the re-runs; exact when
    each left the store's `txn_count` summing to the events."""
    srv = EmbeddedRedis(ws.state_dir(f"redis-{name}-rerun")).start()
    try:
        backfill(spark, cfg, where, until_ms=until, url=srv.url)
        out: dict[str, Any] = {}
        for side in ("probe", "script") if rnd % 2 else ("script", "probe"):
            job = partial(backfill, spark, cfg, where, until_ms=until, url=srv.url, fresh=True,
                          restore_new=side == "probe")  # fmt: skip
            report, wall, cores, _ = timed(spark, job, srv.pid)
            with redis.Redis.from_url(srv.url) as c:
                stored = stored_count(c, "txn_count")
            out[side] = {
                "wall_s": wall,
                "per_s": a.events / wall,
                "cores": cores,
                "slices": report.slices,
                "exact": stored == a.events == report.events,
            }
    finally:
        srv.stop()
    out["ratio"] = out["probe"]["per_s"] / out["script"]["per_s"]
    out["exact"] = out["probe"]["exact"] and out["script"]["exact"]
    return out


def summarize_rerun(warm: list[dict[str, Any]], bare: float) -> dict[str, Any]:
    """The re-runs (`rerun_pair`) over the rounds: medians, and per round side by side."""
    probe = statistics.median(r["rerun"]["probe"]["per_s"] for r in warm)
    return {
        "probe_per_s": probe,
        "script_per_s": statistics.median(r["rerun"]["script"]["per_s"] for r in warm),
        "ratio": statistics.median(r["rerun"]["ratio"] for r in warm),
        "ratio_each": [r["rerun"]["ratio"] for r in warm],
        "probe_bare_ratio": probe / bare,
        "redis_cores": statistics.median(r["rerun"]["probe"]["cores"]["redis"] for r in warm),
        "exact": all(r["rerun"]["exact"] for r in warm),
    }


def summarize_backfill(workload: str, a: Any, size: int, parts: int,
                       rounds: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    warm = rounds[1:]

    def med(side: str, key: str) -> float:
        return statistics.median(r[side][key] for r in warm)

    def cores(side: str) -> dict[str, float]:
        keys = warm[0][side]["cores"]
        return {k: statistics.median(r[side]["cores"][k] for r in warm) for k in keys}

    def phases(side: str) -> dict[str, float]:
        """Medians of the last stage's seconds (the bare engine's final merge, or the
        backfill's write), the stages before it (read, explode, the partial fold, the shuffle
        and, in the backfill, the final merge and its shuffle by slice hash), and the rest of
        the wall time (planning, the driver's own work)."""
        split = []
        for r in warm:
            st, wall = r[side]["stages"], r[side]["wall_s"]
            last = st[-1]["s"] if st else 0.0
            before = sum(x["s"] for x in st[:-1])
            split.append({"before_s": before, "last_s": last,
                          "rest_s": max(0.0, wall - before - last)})  # fmt: skip
        return {k: statistics.median(x[k] for x in split) for k in split[0]}

    bare, fill = med("bare", "per_s"), med("backfill", "per_s")
    slices = statistics.median(r["backfill"]["slices"] for r in warm)
    return {
        "workload": workload, "events": a.events, "archive_bytes": size, "files": ARCHIVE_FILES,
        "partitions": parts, "bare_per_s": bare, "backfill_per_s": fill, "ratio": fill / bare,
        "ratio_each": [r["ratio"] for r in warm], "bare_each": [r["bare"]["per_s"] for r in warm],
        "backfill_each": [r["backfill"]["per_s"] for r in warm],
        "slices": slices, "slices_per_event": slices / a.events,
        "slices_per_s": med("backfill", "slices_per_s"),
        "redis_us_per_slice": statistics.median(
            r["backfill"]["cores"]["redis"] * r["backfill"]["wall_s"] * 1e6
            / r["backfill"]["slices"] for r in warm),
        "bare_cores": cores("bare"), "backfill_cores": cores("backfill"),
        "bare_phases": phases("bare"), "backfill_phases": phases("backfill"),
        "used_memory": med("backfill", "used_memory"),
        "hashes": med("backfill", "hashes"),
        "exact": all(r["backfill"]["exact"] for r in rounds),
        **({"conf": summarize_conf(warm)} if "conf" in warm[0] else {}),
        **({"script": summarize_script(warm, bare)} if "script" in warm[0] else {}),
        **({"rerun": summarize_rerun(warm, bare)} if "rerun" in warm[0] else {}),
        "cold": {"bare_per_s": rounds[0]["bare"]["per_s"],
                 "backfill_per_s": rounds[0]["backfill"]["per_s"], "ratio": rounds[0]["ratio"]},
        "rounds": rounds,
    }  # fmt: skip


def summarize_conf(warm: list[dict[str, Any]]) -> dict[str, Any]:
    """The backfill into a Redis with `--conf-after`'s lines against the default one, per
    round side by side (medians)."""

    def med(side: str, key: str) -> float:
        return statistics.median(r[side][key] for r in warm)

    def redis_us(side: str) -> float:
        return statistics.median(r[side]["cores"]["redis"] * r[side]["wall_s"] * 1e6
                                 / r[side]["slices"] for r in warm)  # fmt: skip

    return {
        "default_per_s": med("backfill", "per_s"), "conf_per_s": med("conf", "per_s"),
        "ratio": statistics.median(r["conf_ratio"] for r in warm),
        "ratio_each": [r["conf_ratio"] for r in warm],
        "default_redis_us_per_slice": redis_us("backfill"),
        "conf_redis_us_per_slice": redis_us("conf"),
        "default_rewrites": med("backfill", "aof_rewrites"),
        "conf_rewrites": med("conf", "aof_rewrites"),
        "default_redis_cores": statistics.median(r["backfill"]["cores"]["redis"] for r in warm),
        "conf_redis_cores": statistics.median(r["conf"]["cores"]["redis"] for r in warm),
        "exact": all(r["conf"]["exact"] for r in warm),
    }  # fmt: skip


def summarize_script(warm: list[dict[str, Any]], bare: float) -> dict[str, Any]:
    """The backfill as users run it (new hashes created with RESTORE) against the same backfill
    with every hash through the slice script, per round side by side (medians)."""

    def med(side: str, key: str) -> float:
        return statistics.median(r[side][key] for r in warm)

    def redis_us(side: str) -> float:
        return statistics.median(r[side]["cores"]["redis"] * r[side]["wall_s"] * 1e6
                                 / r[side]["slices"] for r in warm)  # fmt: skip

    def last_s(side: str) -> float:
        return statistics.median(r[side]["stages"][-1]["s"] if r[side]["stages"] else 0.0
                                 for r in warm)  # fmt: skip

    def cores(side: str, *keys: str) -> float:
        return statistics.median(sum(r[side]["cores"][k] for k in keys) for r in warm)

    return {
        "restore_per_s": med("backfill", "per_s"), "script_per_s": med("script", "per_s"),
        "ratio": statistics.median(r["script_ratio"] for r in warm),
        "ratio_each": [r["script_ratio"] for r in warm],
        "script_bare_ratio": med("script", "per_s") / bare,
        "restore_redis_us_per_slice": redis_us("backfill"),
        "script_redis_us_per_slice": redis_us("script"),
        "restore_last_s": last_s("backfill"), "script_last_s": last_s("script"),
        "restore_redis_cores": cores("backfill", "redis"),
        "script_redis_cores": cores("script", "redis"),
        "restore_spark_cores": cores("backfill", "jvm", "python_workers"),
        "script_spark_cores": cores("script", "jvm", "python_workers"),
        "same_store": all(r["script"]["stored_txn_count"] == r["backfill"]["stored_txn_count"]
                          and r["script"]["hashes"] == r["backfill"]["hashes"]
                          and r["script"]["slices"] == r["backfill"]["slices"]
                          for r in warm),
        "exact": all(r["script"]["exact"] for r in warm),
    }  # fmt: skip


def backfill_part(spark: Any, ws: Workspace, a: Any) -> dict[str, Any]:
    load0 = load1()
    out = [backfill_workload(spark, ws, w, a) for w in WORKLOADS]
    return {"workloads": out, "load_start": load0, "load_end": load1(),
            "params": {"events": a.events, "rounds": a.rounds, "span_h": a.span_h,
                       "retention": RETENTION, "files": ARCHIVE_FILES,
                       "driver_memory": a.driver_memory, "conf_after": a.conf_after,
                       "script_after": a.script_after, "rerun": a.rerun}}  # fmt: skip


# -- training sets ---------------------------------------------------------------------------


def cancel_after(spark: Any, group: str, timeout_s: float | None) -> threading.Timer | None:
    if timeout_s is None:
        return None
    timer = threading.Timer(timeout_s, spark.sparkContext.cancelJobGroup, [group])
    timer.daemon = True
    timer.start()
    return timer


def train_run(spark: Any, ws: Workspace, a: Any, method: str, spine_n: int,
              windows: list[str], rnd: int = 0) -> dict[str, Any]:  # fmt: skip
    """One training set (or range join) written as Parquet; its rate, cores and checks."""
    from sluice.offline.training import training_set

    out_dir = ws.root / f"out-{method}-{spine_n}-{len(windows)}"
    spine = spark.read.parquet(str(a.spines[spine_n]))

    def build() -> None:
        if method == "training_set":
            events = read_archive(spark, str(a.events_dir), None, a.train_cfg.source.schema_)
            table = training_set(spark, a.train_cfg, spine, features(windows), "ts", events=events)
        else:
            table = range_join(spark, spark.read.parquet(str(a.events_dir)), spine, windows)
        table.write.mode("overwrite").parquet(str(out_dir))

    group = f"bench-{method}-{spine_n}-{len(windows)}-{rnd}"
    spark.sparkContext.setJobGroup(group, group, interruptOnCancel=True)
    timer = cancel_after(spark, group, a.range_timeout_s if method == "range_join" else None)
    run: dict[str, Any] = {"method": method, "spine": spine_n, "windows": windows,
                           "features": 2 * len(windows), "round": rnd}  # fmt: skip
    try:
        _, wall, cores, stages = timed(spark, build)
    except Exception as e:  # a cancelled range join is a result, said so
        if timer is None or timer.is_alive():
            raise
        log(f"{method} spine {spine_n:,} x {len(windows)} windows: cancelled after"
            f" {a.range_timeout_s:,.0f} s ({type(e).__name__})")  # fmt: skip
        shutil.rmtree(out_dir, ignore_errors=True)  # what it wrote is not a table to compare
        return run | {"cancelled_after_s": a.range_timeout_s}
    finally:
        if timer is not None:
            timer.cancel()
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)
    run |= {"wall_s": wall, "per_s": spine_n / wall, "cores": cores, "stages": stages,
            "out": str(out_dir)}  # fmt: skip
    got = pd.read_parquet(out_dir)
    if method == "training_set":
        sample = got.sample(min(SAMPLE_ROWS, len(got)), random_state=a.seed + rnd)
        run["duckdb"] = compare(got, duckdb_answers(a.events_dir, sample, windows), windows)
    rival = out_dir.with_name(out_dir.name.replace(method, other(method)))
    if rival.exists():
        run["vs_" + other(method)] = compare(got, pd.read_parquet(rival), windows)
    log(f"{method} spine {spine_n:,} x {len(windows)} windows round {rnd}: {run['per_s']:,.0f}"
        f" rows/s ({wall:.0f} s); checks {run.get('duckdb', '')} {run.get('vs_range_join', '')}"
        f" {run.get('vs_training_set', '')}")  # fmt: skip
    return run


def other(method: str) -> str:
    return "range_join" if method == "training_set" else "training_set"


def training_data(spark: Any, ws: Workspace, a: Any, spine_sizes: list[int]) -> int:
    """The training archive (`a.events_dir`) and a spine per size (`a.spines`), with the
    session's shuffle partitions set for both methods. Returns the archive's bytes."""
    spark.conf.set("spark.sql.shuffle.partitions", str(a.train_partitions))
    a.events_dir = ws.state_dir("train-events")
    size = write_events(a.events_dir, a.train_events, a.cards, a.span_days, now_ms(), a.seed,
                        keys=a.keys, zipf_a=a.zipf_a)  # fmt: skip
    a.spines = {}
    for n in spine_sizes:
        a.spines[n] = ws.state_dir(f"spine-{n}")
        write_spine(a.events_dir, a.spines[n], n, a.seed + n)
    log(f"training: {a.train_events:,} events ({size / 1e6:.0f} MB), spines {spine_sizes}")
    return size


def training_part(spark: Any, ws: Workspace, a: Any) -> dict[str, Any]:
    load0 = load1()
    size = training_data(spark, ws, a, a.spine_sizes)
    big, small = max(a.spine_sizes), min(a.spine_sizes)
    runs = [train_run(spark, ws, a, "training_set", small, WINDOWS[3]) | {"cold": True}]
    for rnd in range(1, a.rounds + 1):  # the headline pair, alternating, range join first
        for method in ("range_join", "training_set"):
            if method == "range_join" and any("cancelled_after_s" in r for r in runs):
                continue  # cancelled once, it would be again: its bound stands
            runs.append(train_run(spark, ws, a, method, big, WINDOWS[3], rnd))
    if a.cells == "all":
        for method in ("range_join", "training_set"):  # the spine grows
            runs.append(train_run(spark, ws, a, method, small, WINDOWS[3]))
        for k in (1, 5, 20):  # the window list grows
            for method in ("range_join", "training_set"):
                runs.append(train_run(spark, ws, a, method, big, WINDOWS[k]))
    return {"runs": runs, "summary": summarize_training(runs, big),
            "load_start": load0, "load_end": load1(),
            "params": {"events": a.train_events, "cards": a.cards, "span_days": a.span_days,
                       "key_dist": a.keys, "zipf_a": a.zipf_a, "cells": a.cells,
                       "spines": a.spine_sizes, "rounds": a.rounds, "sample": SAMPLE_ROWS,
                       "partitions": a.train_partitions, "driver_memory": a.driver_memory,
                       "range_timeout_s": a.range_timeout_s, "windows": WINDOWS,
                       "archive_bytes": size}}  # fmt: skip


def stages(spark: Any, ws: Workspace, a: Any) -> dict[str, Any]:
    """`--part stages` (`lib.offline_stages`): the training set's stages on the headline cell's
    archive and spine (3 windows per metric, the largest spine)."""
    load0 = load1()
    big = max(a.spine_sizes)
    size = training_data(spark, ws, a, [big])
    spine = spark.read.parquet(str(a.spines[big]))
    out = stages_part(spark, a.train_cfg, str(a.events_dir), spine, WINDOWS[3], a.rounds, log)
    return out | {"load_start": load0, "load_end": load1(),
                  "params": {"events": a.train_events, "cards": a.cards, "key_dist": a.keys,
                             "span_days": a.span_days, "spine": big, "windows": WINDOWS[3],
                             "rounds": a.rounds, "partitions": a.train_partitions,
                             "archive_bytes": size}}  # fmt: skip


def minmax(spark: Any, ws: Workspace, a: Any) -> dict[str, Any]:
    """`--part minmax` (`lib.offline_minmax`): a count and a maximum three ways, on the
    headline cell's archive and spine."""
    load0 = load1()
    big = max(a.spine_sizes)
    size = training_data(spark, ws, a, [big])
    cfg = minmax_config(ws.state_dir("cfg-minmax"), a.train_partitions, a.driver_memory)
    out = minmax_part(spark, cfg, a.events_dir, a.spines[big], big, WINDOWS[3], a.rounds,
                      ws.root, a.seed, log)  # fmt: skip
    return out | {"load_start": load0, "load_end": load1(),
                  "params": {"events": a.train_events, "cards": a.cards, "key_dist": a.keys,
                             "span_days": a.span_days, "spine": big, "windows": WINDOWS[3],
                             "rounds": a.rounds, "partitions": a.train_partitions,
                             "archive_bytes": size,
                             "features": len(MINMAX_METRICS) * len(WINDOWS[3])}}  # fmt: skip


def summarize_training(runs: list[dict[str, Any]], big: int) -> dict[str, Any]:
    """Medians per (spine, windows, method) over the warm runs; the speed-up per pair."""
    cells: dict[tuple[int, int], dict[str, Any]] = {}
    for r in runs:
        if r.get("cold"):
            continue
        cell = cells.setdefault((r["spine"], len(r["windows"])),
                                {"spine": r["spine"], "windows": len(r["windows"]),
                                 "features": r["features"]})  # fmt: skip
        cell.setdefault(r["method"], []).append(r)
    out = []
    for (spine, k), cell in sorted(cells.items(), key=lambda x: (x[0][1] != 3, x[0])):
        row = {key: cell[key] for key in ("spine", "windows", "features")}
        for method in ("training_set", "range_join"):
            done = [r for r in cell.get(method, []) if "per_s" in r]
            row[method] = {
                "runs": len(cell.get(method, [])),
                "per_s": statistics.median(r["per_s"] for r in done) if done else None,
                "each": [r["per_s"] for r in done],
                "cancelled_after_s": next((r["cancelled_after_s"] for r in cell.get(method, [])
                                           if "cancelled_after_s" in r), None),
                "cores": {c: statistics.median(r["cores"][c] for r in done)
                          for c in done[0]["cores"]} if done else None,
            }  # fmt: skip
        ts, rj = row["training_set"]["per_s"], row["range_join"]["per_s"]
        row["speedup"] = ts / rj if ts and rj else None
        cut = row["range_join"]["cancelled_after_s"]
        # A range join cancelled after `cut` s: the training set is at least cut / its time faster.
        row["speedup_at_least"] = cut * ts / spine if ts and cut and not rj else None
        checks = [r for r in cell.get("training_set", []) if "duckdb" in r]
        row["duckdb_mismatched"] = sum(r["duckdb"]["mismatched"] for r in checks)
        row["duckdb_rows"] = sum(r["duckdb"]["rows"] for r in checks)
        vs = [r["vs_range_join"] for r in cell.get("training_set", []) + cell.get("range_join", [])
              if "vs_range_join" in r] + [r["vs_training_set"] for r in cell.get("range_join", [])
              if "vs_training_set" in r]  # fmt: skip
        row["vs_range_join_mismatched"] = sum(v["mismatched"] for v in vs) if vs else None
        row["vs_range_join_rows"] = max((v["rows"] for v in vs), default=None)
        row["headline"] = spine == big and k == 3
        out.append(row)
    return {"rows": out}


# -- the run ---------------------------------------------------------------------------------


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--part", choices=(*PARTS, "stages", "minmax", "all"), default="all")
    p.add_argument("--rounds", type=int, help="measured rounds (default 3; quick 1)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--events", type=int, help="backfill: events per workload (default 2M)")
    p.add_argument("--span-h", type=float, default=6.0, help="backfill: hours the archive spans")
    p.add_argument("--train-events", type=int, help="training: archived events (default 10M)")
    p.add_argument("--spines", help="training: spine sizes, comma-separated (default 100k,1M)")
    p.add_argument("--cards", type=int, help="training: cards (default 100,000)")
    p.add_argument("--span-days", type=int, default=30, help="training: days the archive spans")
    p.add_argument(
        "--keys",
        choices=("uniform", "zipf"),
        default="uniform",
        help="training: how cards are drawn (zipf: as the load generator, hot cards)",
    )
    p.add_argument("--zipf-a", type=float, default=1.3, help="training: the Zipf exponent")
    p.add_argument("--cells", choices=("all", "headline"), default="all",
                   help="training: every cell, or only the headline pair's rounds")  # fmt: skip
    p.add_argument("--train-partitions", type=int, default=8,
                   help="training: spark.sql.shuffle.partitions, for both methods")  # fmt: skip
    p.add_argument("--driver-memory", default="8g", help="the Spark driver's heap")
    p.add_argument("--range-timeout-s", type=float, default=3600.0,
                   help="training: cancel a range join after this long")  # fmt: skip
    p.add_argument("--conf-after", action="append", metavar="LINE",
                   help="backfill: per round, the backfill again into a Redis with this"
                        " redis.conf line added (repeatable; -> offline-backfill-conf.json)",
                   )  # fmt: skip
    p.add_argument("--rerun", action="store_true",
                   help="backfill: per round, the backfill again over the store it filled, as"
                        " users run it and through the slice script only, side by side"
                        " (-> offline-backfill-rerun.json)")  # fmt: skip
    p.add_argument("--script-after", action="store_true",
                   help="backfill: per round, the backfill again with every hash through the"
                        " slice script (no RESTORE), side by side")  # fmt: skip
    a = p.parse_args()
    if (a.conf_after or a.script_after or a.rerun) and a.part != "backfill":
        p.error("--conf-after, --script-after and --rerun need --part backfill")
    events, train_events, spines, cards = SIZES[a.quick]
    a.rounds = a.rounds or (1 if a.quick else 3)
    a.events, a.train_events = a.events or events, a.train_events or train_events
    a.spine_sizes = [int(float(x)) for x in a.spines.split(",")] if a.spines else list(spines)
    a.cards = a.cards or cards
    if a.part != "all" and a.out is None:
        suffix = ".quick.json" if a.quick else ".json"
        keys = "-zipf" if a.part in ("training", "stages", "minmax") and a.keys == "zipf" else ""
        keys += "-conf" if a.conf_after else "-rerun" if a.rerun else ""
        a.out = Path(__file__).parent / "results" / f"offline-{a.part}{keys}{suffix}"
    run = Run("offline", a)
    from sluice.pipeline.spark import build_spark

    ws = Workspace()
    a.train_cfg = training_config(ws.state_dir("cfg"), a.train_partitions, a.driver_memory)
    spark = build_spark(a.train_cfg, "sluice-bench-offline")
    results: dict[str, Any] = {}
    try:
        for part in PARTS if a.part == "all" else (a.part,):
            # a side run (a config line, re-runs) is not the backfill section's run
            key = "backfill_conf" if a.conf_after else "backfill_rerun" if a.rerun else part
            fn = {"backfill": backfill_part, "training": training_part, "stages": stages,
                  "minmax": minmax}[part]  # fmt: skip
            results[key] = fn(spark, ws, a)
            run.write({"part": a.part, "seed": a.seed}, results)  # so far
    finally:
        spark.stop()
        ws.cleanup()


if __name__ == "__main__":
    main()
