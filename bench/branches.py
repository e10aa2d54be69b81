"""Hop-by-hop backpressure against Heron-style source throttling, on two branches.

    .venv/bin/python bench/branches.py            # 2 runs per mode: 25 s warm, 40 slow, 20 after
    .venv/bin/python bench/branches.py --quick    # 1 run per mode, 25/25/10 s

The experiment is `sluice.testing.branches`; each propagation mode runs it in turn on one Spark
session and one embedded Redis. Writes bench/results/branches[.quick].json.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from lib.results import Run, log, parser
from sluice.logs import setup_logging
from sluice.pipeline.spark import build_spark
from sluice.redis.embedded import EmbeddedRedis
from sluice.testing.branches import BRANCHES, Result, branch_config, run_experiment

MODES = ("hop", "source")
MEASURES = ("rate_before", "rate_slow", "latency_p50_s", "latency_max_s")


def summarize(results: list[Result]) -> dict[str, Any]:
    """Per mode and branch, each measure's median over the runs and every run's value."""
    rows = []
    for mode in MODES:
        sums = [r.summary() for r in results if r.propagation == mode]
        flagged = sorted({f for s in sums for f in s["flagged"]})
        for b in BRANCHES:
            row: dict[str, Any] = {"mode": mode, "branch": b, "flagged": flagged}
            for key in MEASURES:
                vals = [s[b][key] for s in sums if s[b][key] is not None]
                row[key] = {"median": statistics.median(vals) if vals else None, "each": vals}
            rows.append(row)
    return {"rows": rows}


def series(results: list[Result]) -> dict[str, Any]:
    """The first run of each mode, for the plot: per sample t, and per branch the latency and
    the events folded."""
    first = {r.propagation: r for r in reversed(results)}
    return {m: {
        "slow": [r.slow_from_s, r.slow_until_s], "t": [s.t_s for s in r.samples],
        "latency": {b: [r.latency_s(s, b) for s in r.samples] for b in BRANCHES},
        "folded": {b: [s.folded[b] for s in r.samples] for b in BRANCHES},
    } for m in MODES if (r := first.get(m))}  # fmt: skip


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--rate", type=float, default=1000.0)
    args = ap.parse_args()
    runs = args.runs or (1 if args.quick else 2)
    warm, slow, tail = (25.0, 25.0, 10.0) if args.quick else (25.0, 40.0, 20.0)
    setup_logging("warning")
    run = Run("branches", args)
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="sluice-bench-branches-") as tmp:
        server = EmbeddedRedis(Path(tmp) / "redis").start()
        spark: Any = None
        try:
            spark = build_spark(branch_config(server.url, Path(tmp) / "s", "hop"))
            for i in range(runs):
                for mode in MODES:
                    log(f"run {i + 1}/{runs}: propagation {mode}")
                    results.append(run_experiment(
                        server.url, spark, Path(tmp) / f"{mode}-{i}", mode, rate=args.rate,
                        warm_s=warm, slow_s=slow, tail_s=tail, progress=True,
                    ))  # fmt: skip
                    log(f"  {results[-1].summary()}")
        finally:
            if spark is not None:
                spark.stop()
            server.stop()
    params = {"rate": args.rate, "runs": runs, "warm_s": warm, "slow_s": slow, "tail_s": tail}
    run.write(params, summarize(results), series(results))


if __name__ == "__main__":
    main()
