"""`sluice demo-offline`: the offline side end to end, on an embedded Redis and a local Spark.

    three days of made-up payments ─▶ archive (Parquet) ─▶ sluice backfill ─▶ the store answers
    labelled rows (a spine)        ─▶ sluice training-set (windows chosen now) ─▶ training.parquet
    answers the server logged      ─▶ sluice consistency ─▶ matched / mismatched / missing

Everything it makes is under `state_dir/offline/`; it prints what it does and the first rows
of the training table.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sluice.config import Config, config_from_dict
from sluice.demo import DEMO_CONFIG
from sluice.slices.window import slice_start

DAY_MS = 86_400_000
FEATURES = {"txn_count": ["10m", "1h", "1d", "3d"], "amount_sum": ["1h", "1d"],
            "card_max_amount": ["6h"], "avg_ticket": ["1d"]}  # fmt: skip


def offline_demo_config(state_dir: Path) -> Config:
    """The live demo's config with a week's retention and one-minute slices (hourly ones too
    for `txn_count`), as history wants."""
    metrics = []
    for m in DEMO_CONFIG["metrics"]:
        m = {**m, "slice": "1m", "retention": "7d"}
        if m["name"] == "txn_count":
            m["resolutions"] = ["1m", "1h"]
        metrics.append(m)
    return config_from_dict({**DEMO_CONFIG, "metrics": metrics,
                             "state_dir": str(state_dir.resolve())})  # fmt: skip


def make_archive(now_ms: int, events: int, seed: int = 1) -> pd.DataFrame:
    """Payments over the three days before `now_ms`: Zipf cards and merchants, lognormal
    amounts with a few refunds, 2% of them arriving up to an hour late (`arrived`)."""
    rng = np.random.default_rng(seed)
    arrived = np.sort(rng.integers(now_ms - 3 * DAY_MS, now_ms - 60_000, events))
    late = rng.random(events) < 0.02
    ts = np.where(late, arrived - rng.integers(0, 3_600_000, events), arrived)
    amount = np.round(rng.lognormal(3.0, 1.0, events), 2)
    amount[rng.random(events) < 0.02] *= -1
    return pd.DataFrame({
        "ts": ts.astype(np.int64),
        "card": [f"card-{i}" for i in (rng.zipf(1.3, events) - 1) % 2000],
        "merchant": [f"merchant-{i}" for i in (rng.zipf(1.5, events) - 1) % 100],
        "amount": amount,
        "arrived": arrived.astype(np.int64),
    })  # fmt: skip


def make_spine(archive: pd.DataFrame, now_ms: int, rows: int, seed: int = 2) -> pd.DataFrame:
    """Labelled rows: a card and a merchant seen in the archive, a time in the last two days,
    and a made-up label."""
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(archive), rows)
    return pd.DataFrame({
        "card_id": archive["card"].to_numpy()[pick],
        "merchant": archive["merchant"].to_numpy()[pick],
        "event_time": pd.to_datetime(rng.integers(now_ms - 2 * DAY_MS, now_ms, rows), unit="ms"),
        "is_fraud": rng.random(rows) < 0.03,
    })  # fmt: skip


def run_offline_demo(
    state_dir: Path, events: int = 300_000, rows: int = 2_000, spark: Any = None,
    url: str | None = None, say: Any = print,
) -> dict[str, Any]:  # fmt: skip
    """Run it (module docstring); returns what it measured. `spark` and `url` reuse a session
    and a Redis (tests); by default it starts both, embedded."""
    from sluice.offline.backfill import backfill
    from sluice.offline.consistency import check
    from sluice.offline.training import training_set
    from sluice.offline_cli import format_progress
    from sluice.pipeline.spark import build_spark
    from sluice.query.answers import AnswerLog
    from sluice.query.engine import QueryEngine
    from sluice.redis.connection import open_redis

    where = state_dir / "offline"
    where.mkdir(parents=True, exist_ok=True)
    cfg = offline_demo_config(state_dir)
    if url is not None:
        cfg = cfg.model_copy(update={"redis": url})
    out: dict[str, Any] = {}
    with open_redis(cfg.redis, cfg.state_dir, durability=cfg.durability) as handle:
        cfg = cfg.model_copy(update={"redis": handle.url})
        now_ms = slice_start(int(time.time() * 1000), 3_600_000)
        say(f"1. an archive of {events:,} payments over three days -> {where / 'archive'}")
        archive = make_archive(now_ms, events)
        (where / "archive").mkdir(exist_ok=True)
        archive.to_parquet(where / "archive" / "part-0.parquet")
        spine = make_spine(archive, now_ms, rows)
        spine.to_parquet(where / "labels.parquet", coerce_timestamps="ms")
        if spark is None:
            say("   starting Spark (takes a few seconds)...")
            spark = build_spark(cfg, app_name="sluice-demo-offline")
        say("2. sluice backfill: the archive folded into the store, up to the hour")
        t0 = time.monotonic()
        report = backfill(spark, cfg, str(where / "archive"), until_ms=now_ms, url=handle.url,
                          progress=lambda p: say(f"   {format_progress(p)}"))  # fmt: skip
        out["backfill_s"] = round(time.monotonic() - t0, 1)
        say(f"   {report.events:,} events -> {report.slices:,} slices in {out['backfill_s']} s")
        engine = QueryEngine(cfg, handle.client, answer_log=AnswerLog(1.0, 10_000))
        busiest = str(archive["card"].value_counts().index[0])
        for window in ("1h", "1d", "3d"):
            ans = engine.query("txn_count", [busiest], window, now_ms - 1)
            say(f"   txn_count {busiest} over {window:>2}: {ans['value']:,} (served, and logged)")
        say(f"3. sluice training-set: {rows:,} labelled rows, windows chosen now: "
            + "; ".join(f"{m} {', '.join(ws)}" for m, ws in FEATURES.items()))  # fmt: skip
        t0 = time.monotonic()
        table = training_set(spark, cfg, spark.read.parquet(str(where / "labels.parquet")),
                             FEATURES, ts="event_time", keys={"card": "card_id"},
                             events=spark.read.parquet(str(where / "archive")))  # fmt: skip
        table.write.mode("overwrite").parquet(str(where / "training.parquet"))
        out["training_s"] = round(time.monotonic() - t0, 1)
        head = pd.read_parquet(where / "training.parquet").head(5)
        say(f"   -> {where / 'training.parquet'} in {out['training_s']} s; its first rows:")
        with pd.option_context("display.width", 160, "display.max_columns", 20):
            say(head.to_string(index=False))
        say("4. sluice consistency: the logged answers recomputed from the archive")
        result = check(spark, cfg, handle.client, spark.read.parquet(str(where / "archive")),
                       str(where / "archive"), settle_ms=0)  # fmt: skip
        say(f"   {result.matched} matched, {result.mismatched} mismatched, {result.missing}"
            f" missing of {result.samples} logged answers")  # fmt: skip
        out.update(events=report.events, slices=report.slices, rows=len(head),
                   matched=result.matched, mismatched=result.mismatched)  # fmt: skip
    return out
