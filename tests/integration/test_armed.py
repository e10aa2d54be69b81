"""A standby's query started ahead of its takeover (`source.arm`), in the real Spark session:
armed, it reads neither the log nor the checkpoint; let go, it resumes from the checkpoint as it
is then and counts exactly; dropped, it ends without an error and its planner process exits.
On one Redis and on a Redis Cluster (the armed key has the lease's hash tag)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from sluice.config import Config
from sluice.pipeline.fold import FoldQuery
from sluice.redis.cluster import node_clients
from sluice.redis.connection import RedisHandle, client_for
from sluice.redis.keys import STATS_KEY
from tests.conftest import make_config, wait_until
from tests.integration.helpers import produce_now

OWNER = "test-host:1:armed"


@pytest.fixture(params=["redis", "cluster"])
def store(request: pytest.FixtureRequest) -> str:
    """The URL of an emptied Redis: the session's single server, or its cluster."""
    if request.param == "cluster":
        cluster = request.getfixturevalue("redis_cluster")
        cluster.flushall()
        return str(cluster.url)
    request.getfixturevalue("r")  # empties it
    return str(request.getfixturevalue("redis_url"))


def _events_in(r: Any) -> int:
    return int(r.hget(STATS_KEY, "events_in") or 0)


def _waiting_planners(r: Any) -> int:
    """Connections blocked on an armed query's key: its planner, waiting for its word."""
    return sum(1 for node in node_clients(r) for c in node.client_list() if c.get("cmd") == "blpop")


def _kept(r: Any, cfg: Config) -> list[int]:
    return [r.xlen(k) for k in cfg.source.shard_keys()]


def _offset_files(ckpt: Path) -> list[str]:
    return sorted(p.name for p in (ckpt / "offsets").iterdir() if p.name.isdigit())


def test_an_armed_query_reads_nothing_until_let_go_then_resumes_exactly(
    spark: Any, store: str, tmp_path: Path
) -> None:
    """The old leader's checkpoint moving on while a standby is armed is shown with real
    processes (tests/e2e/test_standby.py): one JVM runs one run of a query at a time."""
    cfg = make_config(store, tmp_path / "state")
    r = client_for(store)
    produce_now(r, 40, cfg.source.shard_keys())
    first = FoldQuery(cfg, RedisHandle(store), spark)
    first.start()
    try:
        assert first.wait_idle(120)
    finally:
        first.stop()
    assert _events_in(r) == 40
    planned = _offset_files(first.ckpt)
    kept = sum(_kept(r, cfg))  # what the release left

    standby = FoldQuery(cfg, RedisHandle(store), spark)
    standby.lease_owner = OWNER
    standby.arm()
    standby.arm()  # idempotent while the armed query runs
    try:
        wait_until(lambda: _waiting_planners(r) == 1, 120, "the armed query's planner to wait")
        produce_now(r, 30, cfg.source.shard_keys())
        time.sleep(1.0)  # a trigger or two: an armed query plans and reads nothing
        assert standby.query is None and _events_in(r) == 40
        assert sum(_kept(r, cfg)) == kept + 30
        assert _offset_files(standby.ckpt) == planned
        query = standby.start()  # the takeover: its word is `go`
        assert query.isActive and standby.query is query
        assert standby.wait_idle(120)
    finally:
        standby.stop()
    assert _events_in(r) == 70  # nothing lost, nothing counted twice
    assert int(r.hget(STATS_KEY, "events_aggregated") or 0) == 70
    assert int(query.recentProgress[0]["batchId"]) == int(planned[-1]) + 1
    wait_until(lambda: _waiting_planners(r) == 0, 30, "no planner left waiting")


def test_a_dropped_armed_query_ends_without_error_and_its_planner_exits(
    spark: Any, store: str, tmp_path: Path
) -> None:
    cfg = make_config(store, tmp_path / "state")
    r = client_for(store)
    produce_now(r, 10, cfg.source.shard_keys())
    standby = FoldQuery(cfg, RedisHandle(store), spark)
    standby.lease_owner = OWNER
    standby.arm()
    wait_until(lambda: _waiting_planners(r) == 1, 120, "the armed query's planner to wait")
    armed = standby._armed
    assert armed is not None
    standby.stop()  # a standby that stops: the armed query is dropped
    assert not armed[1].isActive and armed[1].exception() is None
    wait_until(lambda: _waiting_planners(r) == 0, 30, "the planner to exit")
    assert _events_in(r) == 0 and _offset_files(standby.ckpt) == []
    assert _kept(r, cfg) == [5, 5]
