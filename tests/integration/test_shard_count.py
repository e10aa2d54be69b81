"""`source.shards` changed for a deployment that has run (Redis Streams): raised, with a restart
from the same checkpoint, every event of old and new shards is counted once and every batch
balances its audit; lowered while a dropped shard holds unread entries, the source refuses to
plan (a clear error) instead of leaving them unread."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis

from sluice.config import Config
from sluice.errors import ConfigError
from sluice.pipeline.fold import FoldQuery
from sluice.redis.connection import RedisHandle
from sluice.redis.keys import STATS_KEY
from sluice.source.options import SourceOptions
from sluice.source.producer import Producer
from sluice.source.streams import RedisStreamsLog
from tests.conftest import make_config

METRICS = [
    {"name": "txn_count", "key": ["card"], "agg": "count", "slice": "10s", "retention": "1d"},
]


def _cfg(redis_url: str, state: Path, shards: int) -> Config:
    return make_config(redis_url, state, metrics=METRICS, derived=[], source={"shards": shards})


def _send(cfg: Config, r: redis.Redis, n: int, sent: Counter[str], offset: int) -> None:
    producer = Producer.from_config(cfg, r, flow=False)
    now = time.time_ns() // 1_000_000
    for i in range(n):
        card = f"card-{(offset + i) % 61}"
        producer.send({"ts": now - i % 5_000, "card": card, "merchant": "m", "amount": 1.0,
                       "qty": 1})  # fmt: skip
        sent[card] += 1
    producer.flush()


def _stored(r: redis.Redis) -> Counter[str]:
    out: Counter[str] = Counter()
    for key in r.scan_iter(match="sluice:s:{txn_count|*"):
        card = key.decode().split("|", 1)[1].rstrip("}")
        out[card] += sum(int(v.split(b":")[1]) for f, v in r.hgetall(key).items() if f != b"_m")
    return out


def _run_until_idle(cfg: Config, redis_url: str, spark: Any, more: Any = None) -> None:
    query = FoldQuery(cfg, RedisHandle(redis_url), spark)
    query.start()
    try:
        assert query.wait_idle(120), "the pipeline did not drain"
        if more is not None:
            more()  # while it runs
            assert query.wait_idle(120), "the pipeline did not drain"
    finally:
        query.stop()


def test_more_shards_after_a_restart_count_every_event_once(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    two, four = _cfg(redis_url, state, 2), _cfg(redis_url, state, 4)
    sent: Counter[str] = Counter()
    _send(two, r, 3_000, sent, 0)
    _run_until_idle(two, redis_url, spark, more=lambda: _send(two, r, 1_000, sent, 3_000))
    # The new count: new producers write to all four shards, one not yet switched to the first
    # two; the same checkpoint reads the two new shards from their start.
    _send(four, r, 2_000, sent, 4_000)
    _send(two, r, 500, sent, 6_000)
    assert r.xlen("events:2") > 0 and r.xlen("events:3") > 0
    _run_until_idle(four, redis_url, spark)
    assert _stored(r) == sent
    stats = {k.decode(): int(v) for k, v in r.hgetall(STATS_KEY).items() if v.isdigit()}
    assert stats["events_in"] == sum(sent.values()) == 6_500
    assert stats.get("audit_failed", 0) == 0 and stats["audit_ok"] == stats["batches"]


def test_fewer_shards_are_refused_while_a_dropped_shard_holds_unread_entries(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    four, two = _cfg(redis_url, tmp_path, 4), _cfg(redis_url, tmp_path, 2)
    _send(four, r, 400, Counter(), 0)
    read = RedisStreamsLog(SourceOptions.from_config(four, redis_url), r)
    start = read.plan(read.start_positions(), None, 0).end  # everything read so far
    fewer = RedisStreamsLog(SourceOptions.from_config(two, redis_url), r)
    fewer.plan(start, None, 0)  # the dropped shards were read to their end: nothing is left
    _send(four, r, 200, Counter(), 400)  # a producer still on the old count
    with pytest.raises(ConfigError, match=r"source\.shards.*events:2, events:3 still hold"):
        fewer.plan(start, None, 0)
