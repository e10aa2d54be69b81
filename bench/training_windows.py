"""Training sets as the window list grows: two revisions of src/ side by side.

    .venv/bin/python bench/training_windows.py --before REV        # 3 rounds, about 12 minutes
    .venv/bin/python bench/training_windows.py --before REV --quick  # 1 round, 1,000,000 events

The training part's workload (bench/offline.py --part training): an archive of `--events` card
transactions (10,000,000; cards uniform over 100,000; times over 30 days; 16 Parquet files)
and a spine of `--spine` labelled rows drawn from it (1,000,000), two metrics by card on 1 m
slices (a count and a sum of `amount`), each at 1, 5 and 20 windows (`lib.offline_training`).
Per round, one worker process per revision, in alternating order (`lib.revisions`): `before`
imports `sluice` from REV's src/ (exported with `git archive`), `after` from the working tree.
A worker starts Spark as the training part does (`local[2]`, 8g driver heap, 8 shuffle
partitions), runs one training set (3 windows) unmeasured, then one per window list, each
written as Parquet as users write it: its wall time and the CPU seconds of Spark's JVM and of
its Python workers. Medians over the rounds; after / before per window list, per round side by
side; each revision's rows/s at 20 windows over its own at 1 window. Every table of the after
revision is compared with the before revision's of the same round, row by row (counts equal,
sums within 1e-9 relative). Writes bench/results/training-windows.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lib.offline import cpu_s, parties
from lib.offline_training import (
    WINDOWS,
    features,
    training_config,
    write_events,
    write_spine,
)
from lib.procs import Workspace
from lib.results import ROOT, Run, log, parser
from lib.revisions import export, order

LISTS = (1, 5, 20)
END_MS = 1_800_000_000_000 - 1_800_000_000_000 % 60_000


def python_workers_s() -> float:
    """CPU seconds of the live Python processes under this process's JVM (`lib.offline.parties`:
    the worker daemon and its workers)."""
    return sum(map(cpu_s, parties(None)["python_workers"]))


def worker(job_path: Path) -> None:
    """One revision's round: a Spark session, a warm-up, then each window list once."""
    from pyspark import SparkContext

    from sluice.offline.events import read_archive
    from sluice.offline.training import training_set
    from sluice.pipeline.spark import build_spark

    job = json.loads(job_path.read_text())
    cfg = training_config(Path(job["state"]), 8, "8g")
    spark = build_spark(cfg, "bench-training-windows", sources=False)
    jvm = SparkContext._gateway.proc.pid  # type: ignore[union-attr]
    spine = spark.read.parquet(job["spine"])
    out: dict[str, Any] = {}
    for n in [3, *LISTS]:
        events = read_archive(spark, job["events"], None, cfg.source.schema_)
        table_dir = Path(job["tables"]) / f"w{n}"
        j0, p0, t0 = cpu_s(jvm), python_workers_s(), time.perf_counter()
        table = training_set(spark, cfg, spine, features(WINDOWS[n]), "ts", events=events)
        table.write.mode("overwrite").parquet(str(table_dir))
        wall = time.perf_counter() - t0
        python = python_workers_s() - p0
        if n != 3:  # the warm-up
            out[str(n)] = {"wall_s": wall, "jvm_cpu_s": cpu_s(jvm) - j0 - python,
                           "python_cpu_s": python, "load_1m": os.getloadavg()[0]}  # fmt: skip
    spark.stop()
    Path(job["out"]).write_text(json.dumps(out))


def same_tables(before: Path, after: Path, n: int) -> dict[str, int]:
    """Rows of the two revisions' tables for window list `n` that differ (counts exactly, sums
    to 1e-9 relative), in the spine's order."""
    import numpy as np
    import pandas as pd

    a, b = pd.read_parquet(before), pd.read_parquet(after)
    diff = np.zeros(len(a), dtype=bool) if len(a) == len(b) else np.ones(max(len(a), 1), bool)
    if len(a) == len(b):
        for metric, exact in (("txn_count", True), ("amount_sum", False)):
            for w in WINDOWS[n]:
                x, y = a[f"{metric}_{w}"].to_numpy(float), b[f"{metric}_{w}"].to_numpy(float)
                close = x == y if exact else np.isclose(x, y, rtol=1e-9, atol=0)
                diff |= ~(close | (np.isnan(x) & np.isnan(y)))
    return {"rows": len(b), "mismatched": int(diff.sum())}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--before", help="the commit to measure against (required)")
    p.add_argument("--rounds", type=int, help="rounds (default 3; quick 1)")
    p.add_argument("--events", type=int, help="archived events (default 10M; quick 1M)")
    p.add_argument("--spine", type=int, help="spine rows (default 1M; quick 100k)")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.worker)
        return
    if not a.before:
        p.error("--before REV is required: the commit to measure against")
    a.rounds = a.rounds or (1 if a.quick else 3)
    a.events = a.events or (1_000_000 if a.quick else 10_000_000)
    a.spine = a.spine or (100_000 if a.quick else 1_000_000)
    run = Run("training-windows", a)
    ws = Workspace()
    try:
        srcs = {"before": export(a.before, ws.root / "before"), "after": ROOT / "src"}
        events_dir, spine_dir = ws.root / "events", ws.root / "spine"
        log(f"{a.events:,} events, a {a.spine:,}-row spine")
        write_events(events_dir, a.events, 100_000, 30, END_MS, seed=7)
        write_spine(events_dir, spine_dir, a.spine, seed=7)
        rounds: list[dict[str, Any]] = []
        for rnd in range(a.rounds):
            got: dict[str, Any] = {}
            dirs: dict[str, Path] = {}
            for rev in order(rnd):
                dirs[rev] = ws.state_dir(f"{rev}-{rnd}")
                job = dirs[rev] / "job.json"
                job.write_text(json.dumps({
                    "state": str(job.parent / "state"), "events": str(events_dir),
                    "spine": str(spine_dir / "spine.parquet"), "tables": str(job.parent),
                    "out": str(job.with_name("out.json")),
                }))  # fmt: skip
                env = {
                    **os.environ,
                    "PYTHONPATH": os.pathsep.join([str(srcs[rev]), str(ROOT / "bench")]),
                }
                log(f"round {rnd + 1}: {rev}")
                subprocess.run([sys.executable, __file__, "--worker", str(job)], env=env,
                               check=True)  # fmt: skip
                got[rev] = json.loads(job.with_name("out.json").read_text())
                log(
                    f"round {rnd + 1} {rev}: "
                    + ", ".join(f"{n} windows {got[rev][str(n)]['wall_s']:.1f} s" for n in LISTS)
                )
            got["checks"] = {
                str(n): same_tables(dirs["before"] / f"w{n}", dirs["after"] / f"w{n}", n)
                for n in LISTS
            }
            for d in dirs.values():
                shutil.rmtree(d, ignore_errors=True)
            rounds.append(got)
    finally:
        ws.cleanup()
    results: dict[str, Any] = {"rounds": rounds}
    for rev in ("before", "after"):
        results[rev] = {
            str(n): {
                k: statistics.median(r[rev][str(n)][k] for r in rounds)
                for k in ("wall_s", "jvm_cpu_s", "python_cpu_s")
            }
            | {"rows_s": a.spine / statistics.median(r[rev][str(n)]["wall_s"] for r in rounds)}
            for n in LISTS
        }
        results[rev]["20_over_1"] = statistics.median(
            r[rev]["1"]["wall_s"] / r[rev]["20"]["wall_s"] for r in rounds
        )
    speedup = {  # before's wall time over after's, per round
        n: [r["before"][str(n)]["wall_s"] / r["after"][str(n)]["wall_s"] for r in rounds]
        for n in LISTS
    }
    results["after_over_before"] = {str(n): statistics.median(v) for n, v in speedup.items()}
    results["mismatched"] = sum(c["mismatched"] for r in rounds for c in r["checks"].values())
    run.write({"rounds": a.rounds, "events": a.events, "spine": a.spine, "before": a.before,
               "windows": {str(n): WINDOWS[n] for n in LISTS}}, results)  # fmt: skip


if __name__ == "__main__":
    main()
