"""The store's overload signal judged by the work done (`flow.levels`): a long write of many
updates at the healthy cost per update is not an overload, a write whose updates each cost
several times the healthy one is, and a store slow from its first batch is still seen as slow.
Real Redis (its memory is part of the level), time from a ManualClock."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from sluice.clock import ManualClock
from sluice.flow.levels import (
    BASELINE_BATCHES,
    BASELINE_CAP_US,
    BASELINE_MIN_UPDATES,
    SLOWDOWN_HIGH,
    UpdateCost,
)
from sluice.flow.valves import StoreMonitor
from sluice.graph import graph_topology
from tests.conftest import make_config

NOW = 1_800_000_000_000


def _store(r: redis.Redis, redis_url: str, tmp_path: Path) -> StoreMonitor:
    store = {"latency_high": "1s", "latency_low": "200ms"}
    cfg = make_config(redis_url, tmp_path, backpressure={"store": store})
    return StoreMonitor(r, cfg.backpressure, graph_topology(cfg).flow["store"], ManualClock(NOW))


def _healthy(store: StoreMonitor, batches: int = 10, us: float = 6.0) -> None:
    for _ in range(batches):
        store.observe(us * 20_000 / 1000, us, 20_000)


def test_a_large_healthy_batch_is_not_an_overload(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    store = _store(r, redis_url, tmp_path)
    _healthy(store)
    store.observe(4_000.0, 6.5, 600_000)  # 4 s, but 6.5 µs an update, as usual
    level = store.tick()
    assert not level.overloaded and level.quiet
    assert level.detail["slowdown"] == pytest.approx(6.5 / 6.0, rel=0.01)


def test_updates_slower_than_usual_are_an_overload(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    store = _store(r, redis_url, tmp_path)
    _healthy(store)
    store.observe(1_500.0, 6.0 * SLOWDOWN_HIGH + 1, 60_000)
    level = store.tick()
    assert level.overloaded and not level.quiet
    store.observe(900.0, 30.0, 30_000)  # slow updates, but a short write: not yet
    assert not store.tick().overloaded


def test_a_store_slow_from_the_start_is_an_overload(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """No healthy batch seen: the baseline is the cap, a few µs an update being usual."""
    store = _store(r, redis_url, tmp_path)
    store.observe(2_000.0, 1_000.0, 2_000)  # 1 ms an update
    assert store.tick().overloaded


def test_without_a_per_update_time_the_write_time_decides(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    store = _store(r, redis_url, tmp_path)
    _healthy(store)
    store.observe(1_200.0)
    assert store.tick().overloaded
    store.observe(100.0)
    assert store.tick().quiet


def test_the_baseline_is_a_low_quartile_of_recent_batches_and_capped() -> None:
    cost = UpdateCost()
    assert cost.baseline_us() == BASELINE_CAP_US
    cost.add(1.0, BASELINE_MIN_UPDATES - 1)  # too few updates to count
    assert cost.baseline_us() == BASELINE_CAP_US
    for us in range(1, 9):
        cost.add(float(us), BASELINE_MIN_UPDATES)
    assert cost.baseline_us() == 3.0
    for _ in range(BASELINE_BATCHES):
        cost.add(500.0, BASELINE_MIN_UPDATES)  # slow for a whole window: up to the cap only
    assert cost.baseline_us() == BASELINE_CAP_US
