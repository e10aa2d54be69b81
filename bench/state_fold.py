"""The fold with its slices kept in Spark's state store, against today's fold, before choosing
a stored format.

    .venv/bin/python bench/state_fold.py            # 3 rounds of 6 batches per cell, ~6 min
    .venv/bin/python bench/state_fold.py --quick    # 1 round of 4 smaller batches

A store written without reading (bench/store_layout.py: only whole values written by plain
commands get under the store target) needs the writer to know each touched slice's whole
value. Spark can keep it: the fold as a streaming aggregation (`groupBy` over the exploded
updates, output mode `update`) holds every cell in its state store across batches and emits,
per batch, the cells the batch changed, whole. This asks what that costs Spark on these cores.

Per workload (`highcard` with `lib.load.HIGHCARD_METRICS`, `zipf` with the benchmarks' 3
metrics, both `jsonl`), the bare engine (`lib.bare.bare_run`: the fold's own plan fed from
in-memory Arrow, a no-op write) runs `--batches` batches of `--events` events three ways, in
rotating order per round: **stateless** as the fold runs today (each batch folded on its own),
and **state (hdfs)** and **state (rocksdb)** with Spark's two state store providers. The Arrow
source replays the same decoded batch, so from the second batch on every cell is in the state
already (the state holds one batch's cells: a bound on the state's size, not a growing one).
Rates are events over the batches after the first (`lib.stats.batch_rate`), medians over the
rounds; the ratio is per round, against stateless. Writes bench/results/state_fold[.quick].json.
"""

from __future__ import annotations

import statistics
from typing import Any

from lib.bare import STATE_PROVIDERS, bare_run
from lib.load import HIGHCARD_METRICS, bench_config
from lib.procs import Workspace
from lib.results import Run, log, parser
from sluice.testing.arrow_source import ArrowFileSource

WAYS = ("stateless", *STATE_PROVIDERS)


def cell(spark: Any, ws: Workspace, workload: str, way: str, rnd: int, a: Any) -> dict[str, Any]:
    extra: dict[str, Any] = {"metrics": HIGHCARD_METRICS} if workload == "highcard" else {}
    d = ws.state_dir(f"{workload}-{way}-{rnd}")
    cfg = bench_config("jsonl", d, a.events, **extra)
    state = None if way == "stateless" else way
    rate, _ = bare_run(spark, cfg, d, a.events, a.seed, a.batches, a.timeout_s, workload,
                       state=state)  # fmt: skip
    return rate


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, help="rounds (default 3; quick 1)")
    p.add_argument("--events", type=int, help="events per batch (default 50,000; quick 10,000)")
    p.add_argument("--batches", type=int, help="batches per run (default 6; quick 4)")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--timeout-s", type=float, default=600.0)
    a = p.parse_args()
    a.rounds = a.rounds or (1 if a.quick else 3)
    a.events = a.events or (10_000 if a.quick else 50_000)
    a.batches = a.batches or (4 if a.quick else 6)
    run = Run("state_fold", a)
    from sluice.pipeline.spark import build_spark

    ws = Workspace()
    spark = build_spark(bench_config("jsonl", ws.state_dir("spark"), 1), "sluice-bench-state")
    spark.dataSource.register(ArrowFileSource)
    workloads = []
    try:
        for workload in ("highcard", "zipf"):
            rounds = []
            for rnd in range(a.rounds):
                order = WAYS[rnd % len(WAYS) :] + WAYS[: rnd % len(WAYS)]
                got = {way: cell(spark, ws, workload, way, rnd, a) for way in order}
                log(f"{workload} round {rnd}: " + ", ".join(
                    f"{w} {r['per_s']:,.0f} events/s" for w, r in got.items()))  # fmt: skip
                rounds.append(got)
            workloads.append(summarize(workload, rounds))
            run.write(params(a), {"workloads": workloads})  # so far
    finally:
        spark.stop()
        ws.cleanup()


def summarize(workload: str, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"workload": workload, "rounds": rounds,
                           "cells": rounds[0]["stateless"].get("fold_cells")}  # fmt: skip
    for way in WAYS:
        out[way] = {
            "per_s": statistics.median(r[way]["per_s"] for r in rounds),
            "each": [r[way]["per_s"] for r in rounds],
            "ratio": statistics.median(r[way]["per_s"] / r["stateless"]["per_s"] for r in rounds),
        }
    return out


def params(a: Any) -> dict[str, Any]:
    return {"events": a.events, "batches": a.batches, "rounds": a.rounds, "format": "jsonl"}


if __name__ == "__main__":
    main()
