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

import numpy as np
import pandas as pd

from lib.offline import timed
from lib.offline_training import SCHEMA, SLICE, covered_start
from sluice.config import Config, config_from_dict
from sluice.query.engine import parse_window
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
    return config_from_dict({
        "state_dir": str(state_dir),
        "source": {"stream": "events", "format": "jsonl", "schema": SCHEMA, "time_field": "ts"},
        "metrics": METRICS,
        "spark": {"shuffle_partitions": shuffle_partitions,
                  "conf": {"spark.driver.memory": driver_memory}},
    })  # fmt: skip


def range_join(spark: Any, events: Any, spine: Any, windows: Sequence[str]) -> Any:
    """Per spine row, its card's events from the widest window's covered start to t, then a
    count, a maximum and the last value (the greatest (time, amount)) per window; a maximum or
    last value with no event is null, as online."""
    from pyspark.sql import functions as F

    ws = [(w, parse_window(w, "window")) for w in windows]
    widest = max(ms for _, ms in ws)
    s = spine.select("id", "card", F.col("ts").alias("t"))
    e = events.select(F.col("card").alias("ecard"), F.col("ts").alias("ets"), "amount")
    cond = ((F.col("ecard") == F.col("card")) & (F.col("ets") <= F.col("t"))
            & (F.col("ets") >= covered_start(F.col("t"), widest, F)))  # fmt: skip
    aggs = []
    for w, ms in ws:
        inside = F.col("ets") >= covered_start(F.col("t"), ms, F)
        last = F.max(F.when(inside, F.struct("ets", "amount")))["amount"]
        aggs += [F.count(F.when(inside, 1)).alias(f"txn_count_{w}"),
                 F.max(F.when(inside, F.col("amount"))).alias(f"amount_max_{w}"),
                 last.alias(f"amount_last_{w}")]  # fmt: skip
    per_row = s.join(e, cond).groupBy("id").agg(*aggs)
    return spine.join(per_row, "id", "left").na.fill({f"txn_count_{w}": 0 for w, _ in ws})


def duckdb_answers(events_dir: Path, sample: pd.DataFrame, windows: Sequence[str]) -> pd.DataFrame:
    import duckdb

    ws = [(w, parse_window(w, "window")) for w in windows]
    s = sample[["id", "card", "ts"]].copy()
    for w, ms in ws:
        s[f"cs_{w}"] = [covered_start(int(t), ms) for t in s["ts"]]
    s["cs_min"] = s[[f"cs_{w}" for w, _ in ws]].min(axis=1)
    cols = ", ".join(
        f'count(e.ts) FILTER (WHERE e.ts >= s."cs_{w}") AS "txn_count_{w}",'
        f' max(e.amount) FILTER (WHERE e.ts >= s."cs_{w}") AS "amount_max_{w}",'
        f' first(e.amount ORDER BY e.ts DESC, e.amount DESC) FILTER (WHERE e.ts >= s."cs_{w}")'
        f' AS "amount_last_{w}"'
        for w, _ in ws
    )
    con = duckdb.connect()
    con.register("s", s)
    return con.execute(f"""
        SELECT s.id, {cols} FROM s LEFT JOIN read_parquet('{events_dir}/*.parquet') e
          ON e.card = s.card AND e.ts <= s.ts AND e.ts >= s.cs_min
        GROUP BY s.id ORDER BY s.id""").df()  # fmt: skip


def compare(got: pd.DataFrame, want: pd.DataFrame, windows: Sequence[str]) -> dict[str, Any]:
    """Rows of `got` and `want` (by `id`) whose counts, maxima or last values differ (those are
    values of the archive: exact, nulls equal)."""
    m = got.merge(want, on="id", suffixes=("", "_want"))
    bad = np.zeros(len(m), dtype=bool)
    for w in windows:
        c = f"txn_count_{w}"
        bad |= m[c].to_numpy(np.int64) != m[f"{c}_want"].to_numpy(np.int64)
        for x in (f"amount_max_{w}", f"amount_last_{w}"):
            a, b = m[x].to_numpy(np.float64), m[f"{x}_want"].to_numpy(np.float64)
            bad |= ~((a == b) | (np.isnan(a) & np.isnan(b)))
    return {"rows": len(m), "of": len(want), "mismatched": int(bad.sum()),
            "examples": m[bad].head(3).to_dict("records")}  # fmt: skip


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
                table = range_join(spark, spark.read.parquet(str(events_dir)), spine, windows)
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
            res["duckdb"] = compare(got, duckdb_answers(events_dir, sample, windows), windows)
        if method != "range_join" and (out_root / "minmax-range_join").exists():
            res["vs_range_join"] = compare(
                got, pd.read_parquet(out_root / "minmax-range_join"), windows
            )
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
