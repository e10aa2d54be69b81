"""The fold with and without Spark's pre-shuffle partial aggregation (`pipeline.partial`): the
same folded rows either way, and a choice that follows the batches' ratio of folded to exploded
rows unless `spark.conf` fixes it. Real Spark, real Redis."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from sluice.pipeline.fold import FoldQuery
from sluice.pipeline.partial import BYPASS_PARTIAL, PartialAggregation
from sluice.pipeline.plan import explode_updates, fold_updates
from sluice.redis.connection import RedisHandle
from tests.conftest import make_config
from tests.integration.helpers import decoded_table

pytestmark = pytest.mark.spark

NOW = time.time_ns() // 1_000_000
EVENTS = [
    {"ts": NOW - (i * 7_919) % 50_000, "card": f"c{i % 37}", "merchant": f"m{i % 4}",
     "amount": round((i % 13) * 1.5 - 3.0, 2), "qty": i % 5}
    for i in range(400)
]  # fmt: skip


def _plan(frame: Any) -> str:
    return str(frame._jdf.queryExecution().executedPlan().toString())


def _row(row: Any) -> str:
    """A folded row, less what depends on the order Spark merges in: a distinct set's order,
    a quantile sketch's bytes (its answers hold to the sketch's bound either way) and the last
    digits of a float sum."""
    out = {}
    for name, v in row.asDict().items():
        if name.startswith("kll"):
            continue
        if name.startswith("set") and v is not None:
            v = sorted(v)
        elif isinstance(v, float):
            v = float(f"{v:.12g}")
        out[name] = v
    return repr(sorted(out.items()))


def test_skipping_the_partial_step_folds_the_same_rows(
    spark: Any, redis_url: str, tmp_path: Path
) -> None:
    fold = FoldQuery(make_config(redis_url, tmp_path), RedisHandle(redis_url), spark)
    fold.prepare()
    exploded = explode_updates(spark.createDataFrame(decoded_table(fold.cfg, EVENTS, NOW)),
                               fold.cfg, list(fold.specs))  # fmt: skip
    folded = {}
    try:
        for bypass in ("false", "true"):
            spark.conf.set(BYPASS_PARTIAL, bypass)
            frame = fold_updates(exploded, fold._folds)
            assert ("partial_" in _plan(frame)) == (bypass == "false")
            folded[bypass] = sorted(map(_row, frame.collect()))
    finally:
        spark.conf.unset(BYPASS_PARTIAL)
    assert len(folded["true"]) > 100 and folded["true"] == folded["false"]


def test_the_choice_follows_the_ratio_unless_the_config_fixes_it(spark: Any) -> None:
    choice = PartialAggregation(spark, {})
    assert choice.adaptive and not choice.bypass  # Spark's default first
    try:
        choice.observe(rows_in=1_000, rows_out=700)  # most rows a cell of their own
        choice.apply(spark)
        assert choice.bypass and spark.conf.get(BYPASS_PARTIAL) == "true"
        choice.observe(rows_in=1_000, rows_out=90)  # cells repeat: the partial step pays
        choice.apply(spark)
        assert not choice.bypass and spark.conf.get(BYPASS_PARTIAL) == "false"
        choice.observe(rows_in=0, rows_out=0)  # an empty batch says nothing
        assert not choice.bypass
        fixed = PartialAggregation(spark, {BYPASS_PARTIAL: "true"})
        fixed.observe(rows_in=1_000, rows_out=10)
        fixed.apply(spark)
        assert not fixed.adaptive and spark.conf.get(BYPASS_PARTIAL) == "false"  # untouched
    finally:
        spark.conf.unset(BYPASS_PARTIAL)


def test_batch_records_carry_the_rows_the_fold_took_in_and_made(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    r.flushall()
    records: list[dict[str, Any]] = []
    cfg = make_config(redis_url, tmp_path, source={"max_events_per_batch": 100})
    fold = FoldQuery(cfg, RedisHandle(redis_url), spark, on_batch=records.append)
    fold.start()
    try:
        for i in range(0, len(EVENTS), 50):
            lines = b"\n".join(orjson.dumps(e) for e in EVENTS[i : i + 50])
            r.xadd(f"events:{i // 50 % 2}", {"d": lines})
        assert fold.wait_idle(120)
    finally:
        fold.stop()
        spark.conf.unset(BYPASS_PARTIAL)
    written = [rec for rec in records if rec["events"]]
    assert sum(rec["events"] for rec in written) == len(EVENTS)
    groups = max(sp.group for sp in fold.specs) + 1
    for rec in written:  # every good event is a row of each group it touches
        assert rec["events"] <= rec["rows_in"] <= groups * rec["events"]
        assert 0 < rec["rows_out"] <= rec["rows_in"]
    last = written[-1]
    assert fold.partial.bypass == (last["rows_out"] >= 0.5 * last["rows_in"])
