"""`sluice consistency` on a real Spark session and a real Redis: answers the HTTP server gave
(and logged, `server.log_answers`) over a store filled from an archive all match what the
archive recomputes, for every aggregation, resolutions and a derived metric; a slice changed in
Redis is reported as a mismatch; answers whose last slice was still filling are skipped, and
ones the archive cannot reach are missing."""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pandas as pd
import pytest
import redis
from fastapi.testclient import TestClient

from sluice.clock import ManualClock
from sluice.offline.backfill import backfill
from sluice.offline.consistency import check
from sluice.offline.events import read_archive
from sluice.redis.keys import ANSWERS_KEY, CONSISTENCY_KEY, encode_key, slice_hash_key
from sluice.server.app import create_app
from sluice.slices.window import slice_start
from tests.conftest import make_config, wait_until
from tests.e2e.test_oracle import make_events

pytestmark = [pytest.mark.spark]

HOUR = 3_600_000
METRICS = ["txn_count", "amount_sum", "qty_sum", "card_min", "card_max", "avg_amount",
           "pair_count", "card_merchants", "amount_q", "card_last", "card_first", "amount_std",
           "qty_var", "txn_res", "amount_res", "avg_ticket"]  # fmt: skip
CARD_KEYED = {"txn_count", "card_min", "card_max", "card_merchants", "card_last", "card_first",
              "txn_res"}  # fmt: skip


def ask(r: redis.Redis, cfg: Any, served_ms: int, queries: list[dict[str, Any]]) -> list[Any]:
    """POST /v1/query to the real app, whose clock reads `served_ms`; every answer is logged."""
    cfg = cfg.model_copy(update={"server": cfg.server.model_copy(update={"log_answers": 1.0})})
    before = r.xlen(ANSWERS_KEY)
    with TestClient(create_app(cfg, r, ManualClock(served_ms), history=False)) as http:
        resp = http.post("/v1/query", json={"queries": queries})
    assert resp.status_code == 200, resp.text
    wait_until(lambda: r.xlen(ANSWERS_KEY) >= before + len(queries), 10, "logged answers")
    gc.unfreeze()
    results: list[Any] = resp.json()["results"]
    return results


def test_answers_match_the_archive_and_a_changed_slice_does_not(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    now_ms = slice_start(time.time_ns() // 1_000_000, HOUR)
    events = make_events(now_ms, 8_000)
    path = tmp_path / "events.parquet"
    events.to_parquet(path)
    cfg = make_config(redis_url, tmp_path)
    backfill(spark, cfg, str(path), until_ms=now_ms)
    rng = np.random.default_rng(2)
    cards = events["card"].value_counts().index[:10].tolist()
    merchants = events["merchant"].value_counts().index[:6].tolist()
    queries = []
    for i in range(160):
        metric = METRICS[i % len(METRICS)]
        if metric == "pair_count":
            key = [str(rng.choice(cards)), str(rng.choice(merchants))]
        else:
            key = [str(rng.choice(cards if metric in CARD_KEYED else merchants))]
        window = str(rng.choice(["45s", "10m", "17m"]))
        end = int(rng.integers(now_ms - 40 * 60_000, now_ms - 30 * 60_000))
        queries.append({"metric": metric, "key": key, "window": window, "end": end})
    early = {"metric": "txn_count", "key": [cards[0]], "window": "1h", "end": now_ms - 2 * HOUR}
    answers = ask(r, cfg, now_ms + 5_000, [*queries, early])  # early: before the archive
    ask(
        r,
        cfg,
        now_ms - 1,
        [{"metric": "txn_count", "key": [cards[0]], "window": "1m", "end": now_ms - 1}],
    )  # served while its last slice was filling

    input_df = spark.read.parquet(str(path))
    report = check(spark, cfg, r, input_df, str(path), sample=1000)
    assert report.samples == 162 and report.skipped == 1 and report.missing == 1
    assert report.matched == 160 and report.mismatched == 0, report.examples
    assert set(report.metrics) == set(METRICS)
    assert orjson.loads(r.get(CONSISTENCY_KEY))["matched"] == 160
    # An archive that ends inside the answers' intervals lacks events, it does not contradict
    # the store: what differs is missing, never mismatched.
    cut = tmp_path / "cut.parquet"
    events[events.ts < now_ms - 35 * 60_000].to_parquet(cut)
    short = check(spark, cfg, r, spark.read.parquet(str(cut)), str(cut), sample=1000)
    assert short.mismatched == 0 and short.missing > 10 and short.matched > 10, short.metrics

    # A slice changed behind Sluice's back: every logged answer that covered it mismatches.
    ans = next(a for a in answers if a["metric"] == "txn_count" and a["value"] > 0)
    metric, key = ans["metric"], ans["key"]
    hkey = slice_hash_key("txn_count", encode_key(key))
    slices = sorted(int(f) for f in r.hkeys(hkey) if f not in (b"_m", b"_b"))
    inside = [s for s in slices if ans["covered_start"] <= s < ans["covered_end"]]
    token, _, count = r.hget(hkey, str(inside[0])).decode().partition(":")
    r.hset(hkey, str(inside[0]), f"{token}:{int(count) + 5}")
    window = f"{ans['end'] - ans['start']}ms"
    ask(r, cfg, now_ms + 5_000, [{"metric": metric, "key": key, "window": window,
                                  "end": ans["end"]}])  # fmt: skip
    report = check(spark, cfg, r, input_df, str(path), sample=1)
    assert report.mismatched == 1 and report.metrics["txn_count"]["mismatched"] == 1
    bad = report.examples[0]
    assert bad["online"] == bad["offline"] + 5 and bad["key"] == key
    assert orjson.loads(r.get(CONSISTENCY_KEY))["mismatched"] == 1
    assert isinstance(pd.Timestamp(report.at_ms, unit="ms"), pd.Timestamp)
    # The same archive as JSON lines, its time field read from each line: the same verdict.
    lines = tmp_path / "events.jsonl"
    events.to_json(lines, orient="records", lines=True)
    as_lines = read_archive(spark, str(lines), None, cfg.source.schema_)
    report = check(spark, cfg, r, as_lines, str(lines), sample=1)
    assert (report.mismatched, report.matched) == (1, 0), report.examples
