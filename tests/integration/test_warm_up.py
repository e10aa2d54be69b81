"""A fold's warm-up (what a standby runs before it may lead): the batch plan as a streaming query
over made-up events, in the real Spark session. It reads nothing from the log, writes nothing to
Redis or to the query's checkpoint, leaves no checkpoint of its own, can run again, and the
query that starts after it counts the log exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis

from sluice.pipeline.fold import FoldQuery
from sluice.redis.connection import RedisHandle
from sluice.redis.keys import STATS_KEY
from tests.conftest import make_config
from tests.integration.helpers import produce_now


def test_warm_up_touches_nothing_and_the_query_after_it_is_exact(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    cfg = make_config(redis_url, tmp_path / "state")
    produce_now(r, 40)
    keys = sorted(r.keys("*"))
    fold = FoldQuery(cfg, RedisHandle(redis_url), spark)
    fold.warm_up()
    fold.warm_up()  # a standby repeats it
    assert sorted(r.keys("*")) == keys  # no slice, stats, dead letter or timing written
    assert [r.xlen(k) for k in ("events:0", "events:1")] == [20, 20]  # nothing read away
    assert not fold.ckpt.exists()
    assert not any((tmp_path / "state" / "warm-up").glob("*"))
    assert not [q for q in spark.streams.active if q.name.endswith("-warm-up")]
    fold.start()
    try:
        assert fold.wait_idle(120)
    finally:
        fold.stop()
    assert int(r.hget(STATS_KEY, "events_in") or 0) == 40
    assert int(r.hget(STATS_KEY, "events_aggregated") or 0) == 40
