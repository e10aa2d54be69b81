"""`bench/offline.py --part minmax`: a training set of a count, a maximum and a last value,
three ways.

On the training part's archive and largest spine, with a config of three metrics by card on
1 m slices, `txn_count` (count), `amount_max` (max of `amount`) and `amount_last` (last of
`amount`), three windows each:

- **running**: `training_set` as it runs, the maximum and the last value by range queries in
  the running pass (`sluice.offline.prefix`);
- **frames**: the same call with the planner told that only summed states take the running
  pass (`Agg.running` patched on the driver, where the plan is made), so the maximum and the
  last value go through the cells, window frames and t's own slice, as they did before;
- **range join**: a plain PySpark range join computing the same values.

Each writes its table as Parquet; rounds alternate the three. The running table is checked
against DuckDB on a sample of rows, and every table against the range join's.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import pandas as pd

from lib.offline import timed
from lib.offline_training import (
    COUNT_SUM,
    SLICE,
    Feature,
    compare,
    duckdb_answers,
    range_join,
    training_config,
)
from sluice.config import Config
from sluice.slices.aggs import Agg

METRICS: list[dict[str, Any]] = [
    {"name": "txn_count", "key": ["card"], "agg": "count", "slice": SLICE, "retention": "30d"},
    {"name": "amount_max", "key": ["card"], "agg": "max", "value": "amount", "slice": SLICE,
     "retention": "30d"},
    {"name": "amount_last", "key": ["card"], "agg": "last", "value": "amount", "slice": SLICE,
     "retention": "30d"},
]  # fmt: skip
METHODS = ("range_join", "frames", "running")


def minmax_config(state_dir: Path, shuffle_partitions: int, driver_memory: str) -> Config:
    return training_config(state_dir, shuffle_partitions, driver_memory, METRICS)


FEATURES = (
    *COUNT_SUM[:1],
    Feature("amount_max", lambda F, inside: F.max(F.when(inside, F.col("amount"))),
            "max(e.amount) FILTER (WHERE {inside})", None, True),
    # The last value: the greatest (time, amount), as the fold orders its structs.
    Feature("amount_last",
            lambda F, inside: F.max(F.when(inside, F.struct("ets", "amount")))["amount"],
            "first(e.amount ORDER BY e.ts DESC, e.amount DESC) FILTER (WHERE {inside})", None,
            True),
)  # fmt: skip


def _summed_only(self: Agg) -> bool:
    return self.name in ("count", "sum", "avg")


def minmax_part(spark: Any, cfg: Config, events_dir: Path, spine_path: Path, n_rows: int,
                windows: Sequence[str], rounds: int, out_root: Path, seed: int,
                log: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """A warm-up of each method, then `rounds` rounds of the three, alternating."""
    from sluice.offline.events import read_archive
    from sluice.offline.training import training_set

    feats = {m["name"]: list(windows) for m in METRICS}
    spine = spark.read.parquet(str(spine_path))

    def run(method: str, rnd: int) -> dict[str, Any]:
        out = out_root / f"minmax-{method}"

        def build() -> None:
            if method == "range_join":
                archive = spark.read.parquet(str(events_dir))
                table = range_join(spark, archive, spine, windows, FEATURES)
            else:
                events = read_archive(spark, str(events_dir), None, cfg.source.schema_)
                planner = (
                    mock.patch.object(Agg, "running", property(_summed_only))
                    if method == "frames"
                    else contextlib.nullcontext()
                )
                with planner:
                    table = training_set(spark, cfg, spine, feats, "ts", events=events)
            table.write.mode("overwrite").parquet(str(out))

        _, wall, cores, stages = timed(spark, build)
        got = pd.read_parquet(out)
        res: dict[str, Any] = {"method": method, "round": rnd, "wall_s": wall, "cores": cores,
                               "per_s": n_rows / wall, "stages": stages}  # fmt: skip
        if method == "running":
            sample = got.sample(min(200, len(got)), random_state=seed + rnd)
            want = duckdb_answers(events_dir, sample, windows, FEATURES)
            res["duckdb"] = compare(got, want, windows, feats=FEATURES)
        if method != "range_join" and (out_root / "minmax-range_join").exists():
            rival = pd.read_parquet(out_root / "minmax-range_join")
            res["vs_range_join"] = compare(got, rival, windows, feats=FEATURES)
        log(f"minmax {method} round {rnd}: {res['per_s']:,.0f} rows/s ({wall:.1f} s)"
            f" {res.get('duckdb', {}).get('mismatched', '')}"
            f" {res.get('vs_range_join', {}).get('mismatched', '')}")  # fmt: skip
        return res

    runs = [run(m, 0) | {"cold": True} for m in METHODS]
    for rnd in range(1, rounds + 1):
        order = METHODS if rnd % 2 else METHODS[::-1]
        runs += [run(m, rnd) for m in order]
    warm = [r for r in runs if not r.get("cold")]

    def med(method: str) -> float:
        return statistics.median(r["wall_s"] for r in warm if r["method"] == method)

    def pairs(a: str, b: str) -> list[float]:
        by = {(r["method"], r["round"]): r["wall_s"] for r in warm}
        return [by[(b, k)] / by[(a, k)] for k in range(1, rounds + 1)]

    checked = [r for r in runs if "vs_range_join" in r or "duckdb" in r]
    exact = all(
        r.get("duckdb", {}).get("mismatched", 0) == 0
        and r.get("vs_range_join", {}).get("mismatched", 0) == 0
        for r in checked
    )
    return {
        "runs": runs,
        "summary": {
            **{f"{m}_wall_s": med(m) for m in METHODS},
            **{f"{m}_per_s": n_rows / med(m) for m in METHODS},
            "running_vs_frames": statistics.median(pairs("running", "frames")),
            "running_vs_frames_each": pairs("running", "frames"),
            "running_vs_range_join": statistics.median(pairs("running", "range_join")),
            "running_vs_range_join_each": pairs("running", "range_join"),
            "exact": exact,
            "checked_runs": len(checked),
        },
    }
