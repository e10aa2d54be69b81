"""The seam between a backfill and the live fold, end to end (real Spark, Redis, Redis Streams):
the archive holds every event, the stream only the newer ones (from a little before the seam
on, late arrivals included), and whichever of the two runs first, every answer over a window
that spans the seam equals DuckDB over the union of the events: none counted twice, none
missing. A late event for a slice before the seam is the archive's: the live fold skips it
(`updates_before_seam`), and a backfill re-run from an archive that has it counts it once."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd
import pytest
import redis

from sluice.config import Config
from sluice.offline.backfill import BackfillReport, backfill
from sluice.pipeline.fold import FoldQuery
from sluice.query.engine import QueryEngine
from sluice.redis.connection import RedisHandle
from sluice.slices.window import slice_start
from sluice.source.loadgen import produce_frame
from sluice.source.producer import Producer
from tests.conftest import make_config
from tests.e2e.test_oracle import CARD_KEYED, SPAN_MS, check, make_events

pytestmark = [pytest.mark.spark, pytest.mark.slow]

TEN_MIN = 600_000
# Coarsest slices of at most 10 minutes, so that every metric's seam is `until` (a 10-minute
# edge); a filter, `last`, several resolutions, a sketch (quantile) and a HyperLogLog.
METRICS = ("txn_count", "amount_sum", "card_last", "amount_res", "card_merchants", "amount_q")
STATS = "sluice:{stats}"


@dataclass
class Scene:
    until: int  # every metric's seam
    archive: Path  # a directory of Parquet files: every event
    events: pd.DataFrame  # what the archive holds
    stream: pd.DataFrame  # the newer part, in arrival order


def make_scene(tmp_path: Path) -> Scene:
    now = time.time_ns() // 1_000_000
    until = slice_start(now - 12 * 60_000, TEN_MIN)
    recent = make_events(now, 12_000)  # the last 40 minutes, in arrival order
    older = make_events(now - SPAN_MS, 3_000)  # 40 to 80 minutes ago: in the archive only
    # The stream: the arrivals from the first event at or after `until - 3 min` on. An event's
    # arrival is never before its time, so it holds every event at or after the seam, and
    # events before it (arrived before the seam, or late after it) that the live fold skips.
    first = int((recent.ts >= until - 3 * 60_000).to_numpy().argmax())
    stream = recent.iloc[first:]
    assert (stream.ts < until).sum() > 500 and (stream.ts >= until).sum() > 500
    archive = tmp_path / "archive"
    archive.mkdir()
    older.to_parquet(archive / "older.parquet")
    recent.to_parquet(archive / "recent.parquet")
    return Scene(until, archive, pd.concat([older, recent], ignore_index=True), stream)


def scene_config(tmp_path: Path, redis_url: str) -> Config:
    cfg = make_config(redis_url, tmp_path / "state", derived=[])
    return cfg.model_copy(update={"metrics": [m for m in cfg.metrics if m.name in METRICS]})


def produce(cfg: Config, r: redis.Redis, frame: pd.DataFrame) -> None:
    producer = Producer.from_config(cfg, r, batch_events=500)
    produce_frame(producer, frame, producer.shard_by)


def fold_stream(cfg: Config, r: redis.Redis, spark: Any, frame: pd.DataFrame) -> FoldQuery:
    """Produce `frame` into the stream and start the live fold on it, drained; the caller
    stops it."""
    produce(cfg, r, frame)
    fold = FoldQuery(cfg, RedisHandle(cfg.redis or ""), spark)
    fold.start()
    drain(fold)
    return fold


def drain(fold: FoldQuery) -> None:
    try:
        assert fold.wait_idle(300), "the live fold did not drain the stream"
    except BaseException:
        fold.stop()
        raise


def spanning_queries(events: pd.DataFrame, until: int, n: int = 150) -> list[dict[str, Any]]:
    """Frequent keys (and one absent), each window from before the seam to after it."""
    rnd = random.Random(11)
    cards = [*events.card.value_counts().index[:30], "absent-key"]
    merchants = [*events.merchant.value_counts().index[:30], "absent-key"]
    out = []
    for _ in range(n):
        metric = rnd.choice(METRICS)
        key = rnd.choice(cards if metric in CARD_KEYED else merchants)
        end = until + rnd.randint(1, 11 * 60_000)
        window = f"{rnd.randint((end - until) // 1000 + 1, 3600)}s"
        out.append({"metric": metric, "key": [key], "window": window, "end": end})
    return out


def check_spanning(cfg: Config, r: redis.Redis, events: pd.DataFrame, until: int) -> None:
    """Every answer over a window that spans the seam equals DuckDB over exactly the events its
    slices cover (`test_oracle.check`)."""
    engine = QueryEngine(cfg, r)
    con = duckdb.connect()
    con.register("ev", events)
    for q in spanning_queries(events, until):
        ans = engine.query(q["metric"], q["key"], q["window"], q["end"])
        assert ans["covered_start"] < until < ans["covered_end"], ans
        check(con, ans)


def before_seam(r: redis.Redis) -> int:
    return int(r.hget(STATS, "updates_before_seam") or 0)


def test_backfill_then_live_fold_then_a_late_event(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    s = make_scene(tmp_path)
    cfg = scene_config(tmp_path, redis_url)
    report = backfill(spark, cfg, str(s.archive), until_ms=s.until)
    assert report.seams == dict.fromkeys(METRICS, s.until) and report.warnings == []
    fold = fold_stream(cfg, r, spark, s.stream)
    try:
        # (a) the stream's events before the seam were skipped: the archive counted them.
        assert before_seam(r) > 0
        check_spanning(cfg, r, s.events, s.until)
        # (c) late events for a slice before the seam, after the backfill ran: the live fold
        # skips them, for a key the backfill wrote and for one it did not (its hash holds no
        # seam yet), a count and a distinct alike; the answers stay those of the archive.
        card, merchant = s.events.card.mode()[0], s.events.merchant.mode()[0]
        late = pd.DataFrame({"ts": [s.until - 30_000 + 123, s.until - 30_000 + 456],
                             "card": [card, "late-card"], "merchant": [merchant, merchant],
                             "amount": [77.7, 1.5], "qty": [5, 1]})  # fmt: skip
        skipped = before_seam(r)
        produce(cfg, r, late)
        drain(fold)
        assert before_seam(r) > skipped
    finally:
        fold.stop()
    engine = QueryEngine(cfg, r)
    window = {"window": "10m", "end": s.until + 60_000}
    n_before = engine.query("txn_count", [card], **window)["value"]
    for metric in ("txn_count", "card_merchants"):
        assert engine.query(metric, ["late-card"], **window)["value"] == 0, metric
    check_spanning(cfg, r, s.events, s.until)
    # A backfill re-run from an archive that has it: counted once.
    late.to_parquet(s.archive / "late.parquet")
    again = backfill(spark, cfg, str(s.archive), until_ms=s.until)
    assert again.run != report.run and again.partitions_skipped == 0
    assert engine.query("txn_count", [card], **window)["value"] == n_before + 1
    for metric in ("txn_count", "card_merchants"):
        assert engine.query(metric, ["late-card"], **window)["value"] == 1, metric
    check_spanning(cfg, r, pd.concat([s.events, late], ignore_index=True), s.until)


def test_live_fold_then_backfill(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    s = make_scene(tmp_path)
    cfg = scene_config(tmp_path, redis_url)
    fold_stream(cfg, r, spark, s.stream).stop()
    assert before_seam(r) == 0  # no seam yet: the live fold wrote every slice it folded
    report: BackfillReport = backfill(spark, cfg, str(s.archive), until_ms=s.until)
    # The live fold began after the seam: the backfill says that events of the stream before
    # then may be in neither side (here the fold read the stream from its start: none are).
    # One line for the metrics that began together, with one seam, naming each.
    (line,) = report.warnings
    assert line.startswith("the live fold began folding 'txn_count', "), line
    assert all(repr(m) in line for m in METRICS), line
    check_spanning(cfg, r, s.events, s.until)
