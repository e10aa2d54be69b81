"""The offline benchmark's training-set side: an archive of card transactions and a spine of
labelled ones, the same features by a plain PySpark range join, and DuckDB's answers for a
sample of spine rows.

Every method answers the same question: for a spine row (card, t) and a window W, the events of
that card with covered_start <= ts <= t, where covered_start = slice_start(t - W + 1, slice) (the
window (t - W, t] rounded outward to the metric's slice at its start edge; nothing after t).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from lib.load import SCHEMA
from sluice.config import Config, config_from_dict
from sluice.query.params import parse_window
from sluice.slices.window import slice_start
from sluice.source.loadgen import zipf_ids

SLICE = "1m"
SLICE_MS = 60_000
METRICS: list[dict[str, Any]] = [
    {"name": "txn_count", "key": ["card"], "agg": "count", "slice": SLICE, "retention": "30d"},
    {"name": "amount_sum", "key": ["card"], "agg": "sum", "value": "amount", "slice": SLICE,
     "retention": "30d"},
]  # fmt: skip
WINDOWS = {
    1: ["1d"],
    3: ["10m", "1h", "1d"],
    5: ["10m", "1h", "6h", "12h", "1d"],
    20: ["1m", "2m", "3m", "5m", "10m", "15m", "20m", "30m", "45m", "1h", "2h", "3h", "4h",
         "6h", "8h", "12h", "16h", "18h", "20h", "1d"],
}  # fmt: skip
DAY_MS = 86_400_000


def training_config(state_dir: Path, shuffle_partitions: int, driver_memory: str,
                    metrics: Sequence[dict[str, Any]] = METRICS) -> Config:  # fmt: skip
    """`metrics` (by default two by card, a count and a sum of `amount`, on 1 m slices)."""
    return config_from_dict({
        "state_dir": str(state_dir),
        "source": {"stream": "events", "format": "jsonl", "schema": SCHEMA, "time_field": "ts"},
        "metrics": list(metrics),
        "spark": {"shuffle_partitions": shuffle_partitions,
                  "conf": {"spark.driver.memory": driver_memory}},
    })  # fmt: skip


def features(windows: Sequence[str]) -> dict[str, list[str]]:
    return {m["name"]: list(windows) for m in METRICS}


def card_ids(rng: np.random.Generator, n: int, cards: int, keys: str, zipf_a: float) -> Any:
    """`uniform` over `cards`, or `zipf`: as the load generator draws its keys (`zipf_ids`), so
    that a few cards are hot."""
    return zipf_ids(rng, n, zipf_a, cards) if keys == "zipf" else rng.integers(0, cards, n)


def write_events(where: Path, n_events: int, cards: int, span_days: int, end_ms: int,
                 seed: int, files: int = 16, keys: str = "uniform",
                 zipf_a: float = 1.3) -> int:  # fmt: skip
    """`n_events` transactions, cards drawn by `card_ids`, times uniform over the `span_days`
    before `end_ms`, amounts log-normal; as `files` Parquet files in time order. Returns bytes."""
    where.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    ts = np.sort(end_ms - rng.integers(1, span_days * DAY_MS, n_events).astype(np.int64))
    ids = card_ids(rng, n_events, cards, keys, zipf_a)
    names = np.array([f"card-{i}" for i in range(cards)], dtype=object)
    amount = np.round(rng.lognormal(3.0, 1.0, n_events), 2)
    step = -(-n_events // files)
    for i in range(files):
        sl = slice(i * step, (i + 1) * step)
        pd.DataFrame({"ts": ts[sl], "card": names[ids[sl]], "merchant": "m", "amount": amount[sl]}
                     ).to_parquet(where / f"part-{i:03d}.parquet", index=False)  # fmt: skip
    return sum(p.stat().st_size for p in where.glob("*.parquet"))


def write_spine(events_dir: Path, where: Path, n_rows: int, seed: int) -> None:
    """`n_rows` labelled transactions drawn from the archive (distinct events, their card and
    time): columns `id`, `card`, `ts`, `label`, as one Parquet file."""
    import duckdb

    where.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect()
    con.execute("SELECT setseed(?)", [(seed % 1000) / 1000])
    con.execute(f"""
        COPY (SELECT row_number() OVER () - 1 AS id, card, ts, (random() < 0.02) AS label
              FROM (SELECT card, ts FROM read_parquet('{events_dir}/*.parquet')
                    USING SAMPLE {n_rows} ROWS (reservoir, {seed})))
        TO '{where}/spine.parquet' (FORMAT parquet)""")  # fmt: skip


def covered_start(t: Any, window_ms: int, F: Any = None) -> Any:
    """slice_start(t - W + 1, SLICE_MS) of a number, or of a Spark column given `F`."""
    lo = t - window_ms + 1
    return lo - F.pmod(lo, F.lit(SLICE_MS)) if F is not None else slice_start(lo, SLICE_MS)


class Feature(NamedTuple):
    """One metric as the references compute it over the events inside a window: its Spark
    aggregate (`spark(F, inside)`, `inside` a boolean column over the columns `ets` and
    `amount`), its DuckDB aggregate (`sql`, filtered by `{inside}`, over `e.ts` and
    `e.amount`), its value with no event (None: null), and whether it must match exactly (else
    to a relative tolerance: sums of doubles in another order differ in the last bits)."""

    name: str
    spark: Callable[[Any, Any], Any]
    sql: str
    empty: Any
    exact: bool


COUNT_SUM = (
    Feature("txn_count", lambda F, inside: F.count(F.when(inside, 1)),
            "count(e.ts) FILTER (WHERE {inside})", 0, True),
    Feature("amount_sum", lambda F, inside: F.sum(F.when(inside, F.col("amount"))),
            "coalesce(sum(e.amount) FILTER (WHERE {inside}), 0)", 0.0, False),
)  # fmt: skip


def range_join(spark: Any, events: Any, spine: Any, windows: Sequence[str],
               feats: Sequence[Feature] = COUNT_SUM) -> Any:  # fmt: skip
    """The features by a plain range join: the spine joined with the events of its card from
    the widest window's covered_start to t, then per row each feature per window. Spine rows
    without events get each feature's `empty` (a count and a sum answer 0 with no data)."""
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
        aggs += [f.spark(F, inside).alias(f"{f.name}_{w}") for f in feats]
    per_row = s.join(e, cond).groupBy("id").agg(*aggs)
    fill = {f"{f.name}_{w}": f.empty for w, _ in ws for f in feats if f.empty is not None}
    return spine.join(per_row, "id", "left").na.fill(fill)


def duckdb_answers(events_dir: Path, sample: pd.DataFrame, windows: Sequence[str],
                   feats: Sequence[Feature] = COUNT_SUM) -> pd.DataFrame:  # fmt: skip
    """DuckDB over the archive's Parquet: each sample row's features per window, by the same
    rule (module docstring), one row per `id`."""
    import duckdb

    ws = [(w, parse_window(w, "window")) for w in windows]
    s = sample[["id", "card", "ts"]].copy()
    for w, ms in ws:
        s[f"cs_{w}"] = [covered_start(int(t), ms) for t in s["ts"]]
    s["cs_min"] = s[[f"cs_{w}" for w, _ in ws]].min(axis=1)
    cols = ", ".join(
        f.sql.format(inside=f'e.ts >= s."cs_{w}"') + f' AS "{f.name}_{w}"'
        for w, _ in ws
        for f in feats
    )
    con = duckdb.connect()
    con.register("s", s)
    return con.execute(f"""
        SELECT s.id, {cols} FROM s LEFT JOIN read_parquet('{events_dir}/*.parquet') e
          ON e.card = s.card AND e.ts <= s.ts AND e.ts >= s.cs_min
        GROUP BY s.id ORDER BY s.id""").df()  # fmt: skip


def compare(got: pd.DataFrame, want: pd.DataFrame, windows: Sequence[str], rel: float = 1e-9,
            feats: Sequence[Feature] = COUNT_SUM) -> dict[str, Any]:  # fmt: skip
    """Rows of `got` and `want` (by `id`) where an exact feature differs (nulls equal), or
    another differs by more than `rel` relative."""
    m = got.merge(want, on="id", suffixes=("", "_want"))
    bad = np.zeros(len(m), dtype=bool)
    for w in windows:
        for f in feats:
            c = f"{f.name}_{w}"
            a, b = m[c].to_numpy(np.float64), m[f"{c}_want"].to_numpy(np.float64)
            both_null = np.isnan(a) & np.isnan(b)
            if f.exact:
                bad |= ~((a == b) | both_null)
            else:
                bad |= ~(both_null | (np.abs(a - b) <= rel * np.maximum(1.0, np.abs(b))))
    return {"rows": len(m), "of": len(want), "mismatched": int(bad.sum()),
            "examples": m[bad].head(3).to_dict("records")}  # fmt: skip
