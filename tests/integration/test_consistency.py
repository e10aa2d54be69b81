"""`sluice consistency` on a real Spark session and a real Redis: answers the engine gave over
a store filled from an archive all match what the archive recomputes, for every aggregation,
resolutions and a derived metric; a slice changed in Redis is reported as a mismatch; answers
whose last slice was still filling are skipped, and ones the archive cannot reach are
missing."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pandas as pd
import pytest
import redis

from sluice.offline.backfill import backfill
from sluice.offline.consistency import check
from sluice.query.engine import QueryEngine
from sluice.redis.keys import ANSWERS_KEY, CONSISTENCY_KEY, encode_key, slice_hash_key
from sluice.slices.window import slice_start
from tests.conftest import make_config
from tests.e2e.test_oracle import make_events

pytestmark = [pytest.mark.spark]

HOUR = 3_600_000
METRICS = ["txn_count", "amount_sum", "qty_sum", "card_min", "card_max", "avg_amount",
           "pair_count", "card_merchants", "amount_q", "card_last", "card_first", "amount_std",
           "qty_var", "txn_res", "amount_res", "avg_ticket"]  # fmt: skip
CARD_KEYED = {"txn_count", "card_min", "card_max", "card_merchants", "card_last", "card_first",
              "txn_res"}  # fmt: skip


def log_answer(r: redis.Redis, ans: dict[str, Any], window_ms: int, served_ms: int) -> None:
    """An answer as the server logs it (`server.log_answers`)."""
    r.xadd(ANSWERS_KEY, {
        "metric": ans["metric"], "key": orjson.dumps(ans["key"]), "window_ms": window_ms,
        "end_ms": ans["end"], "value": orjson.dumps(ans["value"]),
        "covered_start": ans["covered_start"], "covered_end": ans["covered_end"],
        "served_ms": served_ms,
    })  # fmt: skip


def test_answers_match_the_archive_and_a_changed_slice_does_not(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    now_ms = slice_start(time.time_ns() // 1_000_000, HOUR)
    events = make_events(now_ms, 8_000)
    path = tmp_path / "events.parquet"
    events.to_parquet(path)
    cfg = make_config(redis_url, tmp_path)
    backfill(spark, cfg, str(path), until_ms=now_ms)
    engine = QueryEngine(cfg, r)
    rng = np.random.default_rng(2)
    cards = events["card"].value_counts().index[:10].tolist()
    merchants = events["merchant"].value_counts().index[:6].tolist()
    asked = []
    for i in range(160):
        metric = METRICS[i % len(METRICS)]
        if metric == "pair_count":
            key = [str(rng.choice(cards)), str(rng.choice(merchants))]
        else:
            key = [str(rng.choice(cards if metric in CARD_KEYED else merchants))]
        window = str(rng.choice(["45s", "10m", "17m"]))
        end = int(rng.integers(now_ms - 40 * 60_000, now_ms - 30 * 60_000))
        ans = engine.query(metric, key, window, end)
        log_answer(r, ans, engine.lookup(metric, key, window, end).window_ms, now_ms + 5_000)
        asked.append((metric, key, ans))
    fresh = engine.query("txn_count", [cards[0]], "1m", now_ms - 1)
    log_answer(r, fresh, 60_000, now_ms - 1)  # served while its last slice was filling
    early = engine.query("txn_count", [cards[0]], "1h", now_ms - 2 * HOUR + 5)
    log_answer(r, early, HOUR, now_ms + 5_000)  # before the archive's first event

    input_df = spark.read.parquet(str(path))
    report = check(spark, cfg, r, input_df, str(path), sample=1000)
    assert report.samples == 162 and report.skipped == 1 and report.missing == 1
    assert report.matched == 160 and report.mismatched == 0, report.examples
    assert set(report.metrics) == set(METRICS)
    assert orjson.loads(r.get(CONSISTENCY_KEY))["matched"] == 160

    # A slice changed behind Sluice's back: every logged answer that covered it mismatches.
    metric, key, ans = next(a for a in asked if a[0] == "txn_count" and a[2]["value"] > 0)
    hkey = slice_hash_key("txn_count", encode_key(key))
    slices = sorted(int(f) for f in r.hkeys(hkey) if f not in (b"_m", b"_b"))
    inside = [s for s in slices if ans["covered_start"] <= s < ans["covered_end"]]
    token, _, count = r.hget(hkey, str(inside[0])).decode().partition(":")
    r.hset(hkey, str(inside[0]), f"{token}:{int(count) + 5}")
    window_ms = ans["end"] - ans["start"]
    again = engine.query(metric, key, f"{window_ms}ms", ans["end"])
    log_answer(r, again, window_ms, now_ms + 5_000)
    report = check(spark, cfg, r, input_df, str(path), sample=1)
    assert report.mismatched == 1 and report.metrics["txn_count"]["mismatched"] == 1
    bad = report.examples[0]
    assert bad["online"] == bad["offline"] + 5 and bad["key"] == key
    assert orjson.loads(r.get(CONSISTENCY_KEY))["mismatched"] == 1
    assert isinstance(pd.Timestamp(report.at_ms, unit="ms"), pd.Timestamp)
