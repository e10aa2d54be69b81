"""Backpressure end to end, with real Spark and real Redis.

A slow store (the writer's injected delay) makes the Spark stage throttle, the growing input
makes the producer block, the input stays under the high watermark plus one tick of slack, and
after the load stops every produced event is counted exactly once.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import redis

from sluice.flow.board import Board
from sluice.pipeline.fold import FoldQuery
from sluice.pipeline.writer import write_partition
from sluice.redis.connection import RedisHandle
from sluice.redis.keys import STATS_KEY
from sluice.source.loadgen import TICK_S, EventGenerator, produce_frame, run_load
from sluice.source.producer import Producer
from sluice.testing.faults import SlowStore
from tests.conftest import make_config
from tests.integration.helpers import stream_level

RATE = 4_000  # offered events/s
LOAD_S = 14.0  # at least this long; longer (up to MAX_LOAD_S) until both stages have throttled
MAX_LOAD_S = 45.0


def _count_in_store(r: redis.Redis, metric: str) -> int:
    """Sum a count metric's slice states over every key (`<token>:<count>` per slice field)."""
    total = 0
    for key in r.scan_iter(match=f"sluice:s:{{{metric}|*", count=1000):
        if b":r" in key.rsplit(b"}", 1)[1]:
            continue  # another resolution of the same metric
        for field, value in r.hgetall(key).items():
            if field != b"_m":
                total += int(value.split(b":")[1])
    return total


def _bytes_per_event(r: redis.Redis, cfg: Any, frame: int) -> float:
    """Stream bytes per event for frames of `frame` events, as the load generator writes them."""
    scratch = cfg.model_copy(update={"source": cfg.source.model_copy(update={"stream": "calib"})})
    producer = Producer.from_config(scratch, r, flow=False)
    gen = EventGenerator(scratch, seed=1)
    for _ in range(20):
        produce_frame(producer, gen.frame(frame, int(time.time() * 1000)), producer.shard_by)
    level = stream_level(r, tuple(scratch.source.shard_keys()), cfg.backpressure)
    for s in scratch.source.shard_keys():
        r.delete(s)
    return level.bytes / (20 * frame)


def _both_throttled(r: redis.Redis, min_s: float) -> Any:
    """A `run_load` stop: after `min_s`, once the timeline shows both stages throttled. On a
    loaded machine Spark's first batches can take most of `min_s`; the load then goes on."""
    t0 = time.monotonic()
    seen = {"at": 0.0, "both": False}

    def stop() -> bool:
        now = time.monotonic()
        if now - t0 < min_s:
            return False
        if now - seen["at"] >= 0.5:
            seen["at"] = now
            stages = {ev["stage"] for ev in Board(r).timeline(1000) if ev.get("backpressure")}
            seen["both"] = {"spark", "ingest"} <= stages
        return bool(seen["both"])

    return stop


def test_slow_store_throttles_spark_then_the_producer_and_nothing_is_lost(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    cfg = make_config(
        redis_url,
        tmp_path,
        metrics=[
            {"name": "txn_count", "key": ["card"], "agg": "count", "slice": "10s",
             "retention": "1d"},
            {"name": "qty_sum", "key": ["merchant"], "agg": "sum", "value": "qty",
             "slice": "1m", "retention": "1d"},
        ],
        derived=[],
        backpressure={
            "controller": "stepwise", "high_watermark": "400KB", "low_watermark": "40KB",
            "sensitivity": "1s", "tick": "100ms", "step": 0.5,
            "store": {"latency_high": "500ms", "latency_low": "150ms"},
        },
    )  # fmt: skip
    bp = cfg.backpressure
    streams = tuple(cfg.source.shard_keys())
    # About 1 s of store time per 1,000 slice updates: a store several times slower than the
    # offered load, so both hops must throttle.
    p = FoldQuery(cfg, RedisHandle(redis_url), spark)
    p.writer = SlowStore(1000.0)
    samples: list[tuple[int, int]] = []  # (bytes, entries) of the input over time
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            level = stream_level(r, streams, bp)
            samples.append((level.bytes, level.entries))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    p.start()
    try:
        watcher.start()
        result = run_load(cfg, r, RATE, MAX_LOAD_S, seed=7, stop=_both_throttled(r, LOAD_S))
        done.set()
        watcher.join()
        timeline = Board(r).timeline(1000)
        p.writer = write_partition  # a healthy store again: drain
        assert p.wait_idle(180), "the pipeline did not drain"
    finally:
        done.set()
        p.stop()

    sent = result["events"]
    assert sent > 0
    # The Spark stage throttled on the store's signal, the ingest task on the input's.
    throttled = {ev["stage"] for ev in timeline if ev.get("backpressure")}
    assert {"spark", "ingest"} <= throttled, timeline[:10]
    # The producer was held back: it delivered less than it was offered.
    assert result["held_back"] > 0
    # The input never went past the high watermark by more than one tick of the offered load
    # (the gate looks at the input once a tick), plus the frame in flight: the largest one the
    # generator sent, since a frame after a stalled tick (a loaded machine) makes up for it.
    peak = max(b for b, _ in samples)
    assert 0 < result["largest_frame"] <= RATE  # at most a second's worth made up at once
    frame = max(RATE * TICK_S, result["largest_frame"])
    slack = (RATE * bp.tick / 1000 + frame) * _bytes_per_event(r, cfg, int(RATE * TICK_S))
    assert peak <= bp.high_watermark + slack, (peak, bp.high_watermark, slack)
    # Nothing lost, nothing counted twice.
    stats = {k.decode(): v.decode() for k, v in r.hgetall(STATS_KEY).items()}
    assert int(stats["events_in"]) == sent
    assert int(stats["events_aggregated"]) == sent
    assert _count_in_store(r, "txn_count") == sent
