"""The bare engine with Spark's pre-shuffle partial aggregation and without it, per cell
(docs/spark.md, "Partial aggregation, per batch"; `sluice.pipeline.partial`).

    .venv/bin/python bench/partial.py          # 3 rounds of the three default cells
    .venv/bin/python bench/partial.py --quick  # 1 round, smaller batches

The fold's own plan fed from in-memory Arrow with a no-op write (`ingest.bare_cell`, batches of
the ingest benchmark's caps), once with `spark.sql.execution.bypassPartialAggregation` off
(Spark's default: partial step, shuffle, final step) and once on (shuffle, one aggregation),
in alternating order, in one Spark session after an unmeasured warm-up; medians over the
rounds. Also per cell: folded rows per exploded row, the ratio the fold chooses by. Writes
bench/results/partial[.quick].json.
"""

from __future__ import annotations

import statistics
from typing import Any

import pyarrow as pa

from ingest import SIZES, bare_cell, cells_of
from lib.bare import write_arrow_batch
from lib.load import HIGHCARD_METRICS, bench_config
from lib.procs import Workspace
from lib.results import Run, log, parser
from sluice.pipeline import plan
from sluice.pipeline.partial import BYPASS_AT, BYPASS_PARTIAL


def folded_per_exploded(spark: Any, ws: Workspace, fmt: str, workload: str, a: Any) -> float:
    """Folded rows per exploded row of one batch of the cell (the choice's ratio)."""
    cap = SIZES[(a.quick, fmt, workload)][0]
    extra: dict[str, Any] = {"metrics": HIGHCARD_METRICS} if workload == "highcard" else {}
    cfg = bench_config(fmt, (d := ws.state_dir(f"{fmt}-{workload}-ratio")), cap, **extra)
    write_arrow_batch(cfg, cap, a.seed + 7, d / "batch.arrow", workload)
    specs = plan.metric_specs(cfg, plan.check_expressions(spark, cfg))
    with pa.OSFile(str(d / "batch.arrow"), "rb") as f:
        events = spark.createDataFrame(pa.ipc.open_file(f).read_all())
    exploded = plan.explode_updates(events, cfg, specs).where("g >= 0").cache()
    rows_in = exploded.count()
    rows_out = plan.fold_updates(exploded, plan.fold_columns(specs, cfg.audit.enabled)).count()
    exploded.unpersist()
    return rows_out / rows_in


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--cells", default="fields:highcard,jsonl:highcard,fields:zipf",
                   help="format:workload pairs, comma-separated")  # fmt: skip
    p.add_argument("--rounds", type=int, help="rounds (default 3, quick 1)")
    p.add_argument("--seed", type=int, default=7)
    a = p.parse_args()
    a.cells = cells_of(p, a.cells)
    a.rounds = a.rounds or (1 if a.quick else 3)
    a.timeout_s, a.bare_batches = (120.0, 4) if a.quick else (240.0, 5)
    from sluice.pipeline.spark import build_spark
    from sluice.testing.arrow_source import ArrowFileSource

    run, ws, spark = Run("partial", a), Workspace(), None
    rates: dict[tuple[str, str, bool], list[float]] = {}
    try:
        spark = build_spark(bench_config("jsonl", ws.state_dir("spark"), 1), "sluice-bench")
        if not spark.conf.isModifiable(BYPASS_PARTIAL):
            raise SystemExit(f"this Spark has no `{BYPASS_PARTIAL}` (Spark 4.3 or later has it)")
        spark.dataSource.register(ArrowFileSource)
        bare_cell(spark, ws, "fields", "zipf", a)  # warm-up, not counted
        ratios = {c: folded_per_exploded(spark, ws, *c, a) for c in a.cells}
        for rnd in range(a.rounds):
            for fmt, workload in a.cells:
                for bypass in (False, True) if rnd % 2 == 0 else (True, False):
                    spark.conf.set(BYPASS_PARTIAL, str(bypass).lower())
                    bare = bare_cell(spark, ws, fmt, workload, a)["bare"]
                    rates.setdefault((fmt, workload, bypass), []).append(bare["per_s"])
                    log(f"{fmt}:{workload} bypass={bypass}: {bare['per_s']:,.0f} events/s")
    finally:
        if spark is not None:
            spark.stop()
        ws.cleanup()
    rows = []
    for fmt, workload in a.cells:
        with_p, without = rates[(fmt, workload, False)], rates[(fmt, workload, True)]
        m_with, m_without = statistics.median(with_p), statistics.median(without)
        rows.append({"format": fmt, "workload": workload, "with_per_s": m_with,
                     "with_each": with_p, "without_per_s": m_without, "without_each": without,
                     "ratio": m_without / m_with, "folded_per_exploded": ratios[(fmt, workload)],
                     "skipped_by_fold": ratios[(fmt, workload)] >= BYPASS_AT})  # fmt: skip
    run.write({"rounds": a.rounds, "bare_batches": a.bare_batches, "bypass_at": BYPASS_AT},
              {"rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
