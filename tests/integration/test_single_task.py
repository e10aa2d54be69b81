"""A small batch folded in one task (`spark.single_task_events`): its plan has no shuffle, and a
stream folded that way answers every metric exactly as when every batch is shuffled. Likewise a
fold without Spark's partial aggregation (`spark.partial_aggregation`). Real Redis, real Spark,
streaming queries reading the log."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from sluice.config.runtime import BYPASS_PARTIAL_AGGREGATION
from sluice.pipeline.fold import FoldQuery
from sluice.pipeline.plan import PartialAggregation, explode_updates, fold_updates
from sluice.query.engine import QueryEngine
from sluice.redis.connection import RedisHandle
from sluice.redis.keys import STATS_KEY
from tests.conftest import make_config
from tests.integration.helpers import decoded_table

pytestmark = pytest.mark.spark

NOW = time.time_ns() // 1_000_000
EVENTS = [
    {"ts": NOW - (i * 7_919) % 50_000, "card": f"c{i % 11}", "merchant": f"m{i % 4}",
     "amount": round((i % 13) * 1.5 - 3.0, 2), "qty": i % 5}
    for i in range(600)
]  # fmt: skip


def _rounded(v: Any) -> Any:
    """Answers compared to 9 significant digits: a float sum may add in another order."""
    if isinstance(v, float):
        return float(f"{v:.9g}")
    if isinstance(v, dict):
        return {k: _rounded(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_rounded(x) for x in v]
    return v


def _plan(frame: Any) -> str:
    return str(frame._jdf.queryExecution().executedPlan().toString())


def _exploded(spark: Any, redis_url: str, tmp_path: Path) -> tuple[FoldQuery, Any]:
    """A fold of the test config (planned, not started) and 20 events exploded by its plan."""
    fold = FoldQuery(make_config(redis_url, tmp_path), RedisHandle(redis_url), spark)
    fold.prepare()
    df = spark.createDataFrame(decoded_table(fold.cfg, EVENTS[:20], NOW))
    return fold, explode_updates(df, fold.cfg, list(fold.specs))


def test_a_coalesced_batch_is_folded_without_a_shuffle(
    spark: Any, redis_url: str, tmp_path: Path
) -> None:
    fold, exploded = _exploded(spark, redis_url, tmp_path)
    assert "Exchange" in _plan(fold_updates(exploded, fold._folds))
    assert "Exchange" not in _plan(fold_updates(exploded.coalesce(1), fold._folds))


def test_without_partial_aggregation_the_plan_folds_once(
    spark: Any, redis_url: str, tmp_path: Path
) -> None:
    fold, exploded = _exploded(spark, redis_url, tmp_path)
    try:
        for setting, partial in (("on", True), ("off", False)):
            PartialAggregation(setting).apply(spark)
            plan = _plan(fold_updates(exploded, fold._folds))
            assert ("partial_" in plan) is partial, plan
            assert "Exchange" in plan  # shuffled either way
            # In one task there is no shuffle, and Spark folds once whatever the setting.
            one_task = _plan(fold_updates(exploded.coalesce(1), fold._folds))
            assert "partial_" not in one_task and "Exchange" not in one_task, one_task
        # A batch that runs again folds as its first attempt did, also in a new fold.
        auto = PartialAggregation("auto")
        assert auto.apply(spark, tmp_path, 7) is True
        auto.observe(rows=300, cells=214)
        assert auto.apply(spark, tmp_path, 7) is True
        assert spark.conf.get(BYPASS_PARTIAL_AGGREGATION) == "false"
        assert auto.apply(spark, tmp_path, 8) is False
        assert spark.conf.get(BYPASS_PARTIAL_AGGREGATION) == "true"
        assert PartialAggregation("auto").apply(spark, tmp_path, 8) is False
    finally:
        spark.conf.unset(BYPASS_PARTIAL_AGGREGATION)


def _answers(spark: Any, r: redis.Redis, redis_url: str, state: Path, single: int,
             partial: str = "auto") -> Any:  # fmt: skip
    r.flushall()
    cfg = make_config(redis_url, state, spark={"single_task_events": single,
                                               "partial_aggregation": partial},
                      source={"max_events_per_batch": 150})  # fmt: skip
    fold = FoldQuery(cfg, RedisHandle(redis_url), spark)
    fold.start()
    try:
        for i in range(0, len(EVENTS), 50):  # 50-event entries over both shards
            lines = b"\n".join(orjson.dumps(e) for e in EVENTS[i : i + 50])
            r.xadd(f"events:{i // 50 % 2}", {"d": lines})
        assert fold.wait_idle(120)
    finally:
        fold.stop()
    assert int(r.hget(STATS_KEY, "events_in") or 0) == len(EVENTS)
    assert int(r.hget(STATS_KEY, "batches") or 0) >= 2
    q = QueryEngine(cfg, r)
    out = {}
    for m in [*cfg.metrics, *cfg.derived]:
        key_fields = getattr(m, "key", None) or ["merchant"]
        for e in EVENTS[:44]:
            key = [e[f] for f in key_fields]
            out[(m.name, tuple(key))] = _rounded(q.query(m.name, key, "1h", NOW + 1)["value"])
    return out


def test_one_task_or_a_shuffle_the_answers_are_the_same(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    shuffled = _answers(spark, r, redis_url, tmp_path / "shuffled", single=0)
    one_task = _answers(spark, r, redis_url, tmp_path / "one-task", single=1_000_000)
    assert one_task == shuffled
    assert shuffled[("txn_count", ("c0",))] == sum(1 for e in EVENTS if e["card"] == "c0")


def test_with_or_without_partial_aggregation_the_answers_are_the_same(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    partial = _answers(spark, r, redis_url, tmp_path / "partial", single=0, partial="on")
    once = _answers(spark, r, redis_url, tmp_path / "once", single=0, partial="off")
    assert once == partial
    assert once[("txn_count", ("c0",))] == sum(1 for e in EVENTS if e["card"] == "c0")
