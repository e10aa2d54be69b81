"""A fold's warm-up (what a standby runs before it may lead): the batch plan as a streaming query
over made-up events, in the real Spark session. It reads nothing from the log, writes nothing to
Redis or to the query's checkpoint, leaves no checkpoint of its own, can run again, and the
query that starts after it counts the log exactly. A standby told to stop while it repeats its
warm-up returns only after the warm-up ended; a leader gone during the first warm-up is taken
over at once, not after it."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from sluice.pipeline import standby
from sluice.pipeline.fold import FoldQuery
from sluice.pipeline.lease import Keeper, Lease
from sluice.pipeline.run import Pipeline
from sluice.redis.connection import RedisHandle
from sluice.redis.keys import PROCESSES_KEY, STATS_KEY
from tests.conftest import make_config, wait_until
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


def _behind_a_leader(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path
) -> tuple[Pipeline, Lease, Keeper]:
    """A pipeline (prepared, not run) whose leases another process holds, and keeps."""
    cfg = make_config(redis_url, tmp_path / "state")
    pipeline = Pipeline(cfg, RedisHandle(redis_url), spark)
    pipeline.prepare()
    assert pipeline.lease is not None
    leader = Lease(r, pipeline.lease.claims, cfg.lease.ttl)
    assert leader.try_acquire() is None
    keeper = Keeper(leader, lambda reason: None)
    keeper.start()
    return pipeline, leader, keeper


def test_a_standby_stopped_during_its_re_warm_up_returns_after_it(
    spark: Any,
    r: redis.Redis,
    redis_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`sluice run` stops the Spark session once the roles return: a re-warm-up still running
    then would die under it (Spark logs a crashed Python worker, the warm-up logs a failure).
    So the roles wait for it, whenever the stop comes."""
    monkeypatch.setattr(standby, "WARM_EVERY_S", 0.0)  # re-warm as soon as one ends
    pipeline, leader, keeper = _behind_a_leader(spark, r, redis_url, tmp_path)
    runner = threading.Thread(target=pipeline.run_forever, daemon=True)
    runner.start()
    try:
        wait_until(lambda: pipeline.roles is not None and pipeline.roles._warming(), 180,
                   "a re-warm-up to run")  # fmt: skip
        warming = pipeline.roles._warm_thread  # type: ignore[union-attr]
        assert warming is not None
        with caplog.at_level(logging.DEBUG, logger="sluice"):
            pipeline.request_stop()
            runner.join(180)
        assert not runner.is_alive()
        assert not warming.is_alive()  # the session may stop now
        assert "waiting for the standby's warm-up to end" in caplog.messages
        assert "standby warm-up failed" not in caplog.messages
        assert not spark.streams.active  # the armed query is dropped as well
    finally:
        pipeline.request_stop()
        keeper.stop()
        leader.release()


def test_a_leader_gone_during_the_first_warm_up_is_taken_over_at_once(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """The first warm-up takes 10-30 s here. It runs beside the lease polls: the standby is
    listed meanwhile, and a leader that goes during it is taken over at once, the queries
    started cold; the warm-up ends on its own after."""
    produce_now(r, 40)
    pipeline, leader, keeper = _behind_a_leader(spark, r, redis_url, tmp_path)
    assert pipeline.lease is not None
    fold = pipeline.queries[0]
    real, gate, entered = fold.warm_up, threading.Event(), threading.Event()

    def slow_warm_up() -> None:  # the real warm-up, then held for as long as the test needs
        real()
        entered.set()
        gate.wait(180)

    fold.warm_up = slow_warm_up  # type: ignore[method-assign]
    runner = threading.Thread(target=pipeline.run_forever, daemon=True)
    runner.start()
    try:
        entered.wait(180)
        roles = pipeline.roles
        assert roles is not None and roles._warming() and not roles.warm
        owner = pipeline.lease.owner

        def listed() -> bool:
            raw = r.hget(PROCESSES_KEY, owner)
            return raw is not None and orjson.loads(raw)["role"] == "standby"

        wait_until(listed, 30, "the warming standby to be listed")
        keeper.stop()
        leader.release()
        t0 = time.monotonic()
        wait_until(lambda: roles.role == "leader", 30, "the standby to take over")
        assert roles._warming()  # the warm-up is still held: it was not waited for
        assert time.monotonic() - t0 < 10
        wait_until(lambda: int(r.hget(STATS_KEY, "events_in") or 0) == 40, 120, "40 events in")
        gate.set()
        wait_until(lambda: not roles._warming(), 60, "the warm-up to end")
        assert roles.role == "leader"
    finally:
        gate.set()
        pipeline.request_stop()
        runner.join(180)
        keeper.stop()
        leader.release()
    assert not runner.is_alive()
    assert int(r.hget(STATS_KEY, "events_aggregated") or 0) == 40
