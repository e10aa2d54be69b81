"""`training_set` on a real Spark session against DuckDB over the same events: every
aggregation, windows shorter and longer than a slice, times on slice edges, late events,
resolutions, a derived metric, no leakage, as known at; and the values a backfilled store
answers online, the same to the bit (distinct and quantile estimates included)."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pandas as pd
import pytest
import redis

from sluice.errors import BadQuery, UnknownMetric
from sluice.offline.backfill import backfill
from sluice.offline.events import ArchiveError, TimeBounds, archive_events, read_archive
from sluice.offline.features import bad_rows, events_reach, parse_features, reach_problems
from sluice.offline.store import UNANSWERED
from sluice.offline.training import training_set
from sluice.pipeline.spark import expression_semantics
from sluice.query.engine import QueryEngine
from sluice.slices.hll import estimate
from sluice.slices.window import slice_start
from sluice.units import parse_duration_ms
from tests.conftest import make_config
from tests.e2e.test_oracle import REFERENCE_SQL, check_quantiles, make_events
from tests.integration.helpers import EXPRESSION_METRICS

pytestmark = [pytest.mark.spark]

N = 20_000
HOUR = 3_600_000
WINDOWS = ["1s", "10s", "45s", "1m", "90s", "17m", "1h", "2h"]
FEATURES = {
    "txn_count": WINDOWS, "merchant_txn": ["1h"], "amount_sum": ["90s"], "qty_sum": ["2h"],
    "card_min": ["45s"], "card_max": ["1h"], "avg_amount": ["17m"], "pair_count": ["2h"],
    "card_merchants": ["1h"], "amount_q": ["17m"], "card_last": ["1s"], "card_first": ["2h"],
    "amount_std": ["1h"], "qty_var": ["17m"], "txn_res": ["45s", "2h"], "amount_res": ["90s"],
    "avg_ticket": ["1h"],
}  # fmt: skip


@pytest.fixture(scope="module")
def now_ms() -> int:
    return slice_start(time.time_ns() // 1_000_000, HOUR)


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory, now_ms: int) -> tuple[Path, pd.DataFrame]:
    events = make_events(now_ms, N)
    path = tmp_path_factory.mktemp("archive") / "events.parquet"
    events.to_parquet(path)
    return path, events


def spine_rows(events: pd.DataFrame, now_ms: int, n: int = 150) -> pd.DataFrame:
    """Frequent keys (and an absent one), times spread over the span and on slice edges."""
    rng = np.random.default_rng(3)
    cards = [*events["card"].value_counts().index[:20].tolist(), "absent-card"]
    merchants = [*events["merchant"].value_counts().index[:12].tolist(), "absent-m"]
    t = rng.integers(now_ms - 45 * 60_000, now_ms, n)
    edge = slice_start(int(now_ms - 20 * 60_000), 60_000)
    t[:8] = [edge, edge - 1, edge + 1, edge + 9_999, edge + 10_000, now_ms - 1, now_ms - 2, edge]
    return pd.DataFrame({
        "card_id": rng.choice(cards, n), "merchant": rng.choice(merchants, n), "t": t,
        "label": rng.integers(0, 2, n),
    })  # fmt: skip


def reference(con: Any, metric: str, key: list[str], lo: int, t: int) -> Any:
    sql = REFERENCE_SQL[metric].format(w="AND ts >= ? AND ts <= ?")
    row = con.execute(sql, [*key, lo, t]).fetchone()
    return None if row is None else row[0]


def check_row(con: Any, cfg: Any, row: pd.Series, metric: str, window: str) -> None:
    got = row[f"{metric}_{window}"]
    got = None if isinstance(got, float) and math.isnan(got) else got
    from sluice.units import parse_duration_ms

    w_ms = parse_duration_ms(window)
    t = int(row["t"])
    name = "amount_sum" if metric == "avg_ticket" else metric
    finest = cfg.metric(name).slice_lengths()[0]
    lo = slice_start(t - w_ms + 1, finest)
    keys = {"pair_count": [row.card_id, row.merchant]}
    card_keyed = cfg.metric(name).key == ["card"]
    key = keys.get(metric, [row.card_id] if card_keyed else [row.merchant])
    what = (metric, window, key, t, got)
    if metric == "avg_ticket":
        total = reference(con, "amount_sum", key, lo, t)
        n = reference(con, "merchant_txn", key, lo, t)
        want = None if n == 0 else total / n
        assert (got is None and want is None) or got == pytest.approx(want, rel=1e-9), what
        return
    want = reference(con, metric, key, lo, t)
    if metric == "amount_q":
        check_quantiles({"value": got or {"0.5": None, "0.99": None}}, want)
    elif metric == "card_merchants":
        members = con.execute(
            "SELECT list(DISTINCT merchant) FROM ev WHERE card = ? AND ts >= ? AND ts <= ?",
            [*key, lo, t],
        ).fetchone()[0]
        assert got == estimate(members or []), what  # Redis's own estimate of those members
    elif want is None or got is None:
        assert got == want, what
    elif metric in ("avg_amount", "amount_sum", "amount_std", "qty_var"):
        assert got == pytest.approx(float(want), rel=1e-9, abs=1e-9), (what, want)
    else:
        assert got == want, (what, want)


def check_rows(cfg: Any, events: pd.DataFrame, out: pd.DataFrame,
               features: dict[str, list[str]]) -> None:  # fmt: skip
    """Every feature of every row of a training set against DuckDB over the same events."""
    con = duckdb.connect()
    con.register("ev", events)
    for _, row in out.iterrows():
        for metric, windows in features.items():
            for window in windows:
                check_row(con, cfg, row, metric, window)


def test_values_match_the_reference_for_every_aggregation(
    spark: Any, redis_url: str, tmp_path: Path, archive: Any, now_ms: int
) -> None:
    path, events = archive
    cfg = make_config(redis_url, tmp_path)
    spine = spine_rows(events, now_ms)
    out = training_set(
        spark, cfg, spark.createDataFrame(spine), FEATURES, ts="t", keys={"card": "card_id"},
        events=spark.read.parquet(str(path)),
    ).toPandas()  # fmt: skip
    assert len(out) == len(spine)
    assert list(out.columns[:4]) == ["card_id", "merchant", "t", "label"]
    cols = ["card_id", "merchant", "t", "label"]
    assert sorted(map(tuple, out[cols].values.tolist())) == sorted(
        map(tuple, spine[cols].values.tolist())
    )  # every spine row once, passed through
    check_rows(cfg, events, out, FEATURES)


def test_the_archive_is_read_only_for_times_a_row_can_count(
    spark: Any, redis_url: str, tmp_path: Path, archive: Any, now_ms: int
) -> None:
    """A spine of the last 10 minutes reads the events from its earliest row's widest window's
    covered start to its latest row (the plan's filter says so), and answers exactly."""
    path, events = archive
    cfg = make_config(redis_url, tmp_path)
    spine = spine_rows(events, now_ms, n=200)
    spine = spine[spine["t"] >= now_ms - 10 * 60_000].reset_index(drop=True)
    features = {"txn_count": ["1m", "17m"], "amount_sum": ["90s"], "card_min": ["45s"]}
    out = training_set(
        spark, cfg, spark.createDataFrame(spine), features, ts="t",
        keys={"card": "card_id"}, events=spark.read.parquet(str(path)),
    )  # fmt: skip
    lo, hi = int(spine["t"].min()), int(spine["t"].max())
    start = min(
        slice_start(lo - parse_duration_ms(w) + 1, cfg.metric(m).slice_lengths()[0])
        for m, ws in features.items()
        for w in ws
    )
    assert int(events["ts"].min()) < start  # the archive reaches further back
    plan = out._jdf.queryExecution().optimizedPlan().toString()
    assert f">= {start})" in plan and f"< {hi + 1})" in plan, plan
    check_rows(cfg, events, out.toPandas(), features)


def test_an_archive_in_epoch_seconds_is_said_to_be_out_of_reach(
    spark: Any, redis_url: str, tmp_path: Path, archive: Any, now_ms: int
) -> None:
    """Event times in epoch seconds are read as ms (January 1970), so no row's reach holds one:
    the bad rows are none, the good ones within reach none, and the reason is said."""
    _, events = archive
    cfg = make_config(redis_url, tmp_path)
    raw = spark.createDataFrame(events.assign(ts=events["ts"] // 1000))
    reach = events_reach(cfg, parse_features(cfg, ["txn_count:1h"]), now_ms - 1, now_ms)
    assert bad_rows(archive_events(raw, cfg, reach)) == ({}, 0)
    (line,) = reach_problems(archive_events(raw, cfg, TimeBounds()), reach)
    assert line.startswith("no archived event is within the spine's reach ("), line
    assert "1970-01" in line and "looks like epoch seconds" in line, line
    in_ms = archive_events(spark.createDataFrame(events), cfg, reach)
    assert bad_rows(in_ms)[1] > 0  # the same events in ms are within it


def test_a_sparse_spine_reads_only_the_events_within_its_keys_reach(
    spark: Any, redis_url: str, tmp_path: Path, archive: Any, now_ms: int
) -> None:
    """One row per key over the archive's 40 minutes, windows of at most 5 minutes: each key's
    events are read only from its row's widest window's covered start to its time (a join
    on the key's hash in the plan), for the running pass and the slice frames alike, and
    every value is DuckDB's."""
    from sluice.offline import training

    path, events = archive
    cfg = make_config(redis_url, tmp_path)
    rng = np.random.default_rng(11)
    cards = events["card"].value_counts().index[:30].tolist()
    spine = pd.DataFrame({
        "card_id": cards, "merchant": "m-0", "label": 0,
        "t": rng.integers(now_ms - 40 * 60_000, now_ms, len(cards)),
    })  # fmt: skip
    features = {"txn_count": ["1m", "5m"], "card_min": ["45s"], "card_merchants": ["5m"]}
    out = training_set(
        spark, cfg, spark.createDataFrame(spine), features, ts="t",
        keys={"card": "card_id"}, events=spark.read.parquet(str(path)),
    )  # fmt: skip
    plan = out._jdf.queryExecution().optimizedPlan().toString()
    # the running pass, the frames' cells and t's own slice (the same rows, read twice)
    assert plan.count("Join LeftSemi") == 3, plan
    check_rows(cfg, events, out.toPandas(), features)
    # The choice, by rows per key: 1 row per key over 40 minutes reaches 5 minutes of each
    # key's 45; 10 rows per key reach most of them; with no keys known, every event is read.
    dense = training._Spine(training.TimeBounds(0, 45 * 60_000), 30, 40 * 60_000, {("card",): 30})
    members = [(0, training._Metric(cfg.metric("txn_count"), None, True, (300_000,)))]
    assert training._reaches_less(members, dense)
    assert not training._reaches_less(members, dense._replace(rows=300))  # 10 rows per key
    assert not training._reaches_less(members, dense._replace(keys={}))


@pytest.mark.parametrize("broadcast", [True, False])
def test_one_group_of_summed_metrics_answers_every_row_in_the_spine_order(
    spark: Any, redis_url: str, tmp_path: Path, archive: Any, now_ms: int, broadcast: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Counts, sums and averages of one key group (and a formula over them) come from running
    totals in one pass (`offline.prefix`): the same values, every spine row once, in the
    spine's order, whether the answers are broadcast back to the spine (a small spine) or the
    spine's columns ride along through the pass (a large one: nothing joined back)."""
    from sluice.offline import training
    from sluice.offline.features import ROW

    monkeypatch.setattr(training, "BROADCAST_BYTES", training.BROADCAST_BYTES if broadcast else 0)
    path, events = archive
    cfg = make_config(redis_url, tmp_path)
    spine = spine_rows(events, now_ms, n=300)
    features = {"amount_sum": ["1s", "90s", "1h"], "qty_sum": ["2h"], "avg_amount": ["17m"],
                "merchant_txn": ["10s", "1h"], "avg_ticket": ["1h"]}  # fmt: skip
    out = training_set(
        spark, cfg, spark.createDataFrame(spine), features, ts="t",
        keys={"card": "card_id"}, events=spark.read.parquet(str(path)),
    )  # fmt: skip
    plan = out._jdf.queryExecution().optimizedPlan().toString()
    if broadcast:
        assert "Join LeftOuter" in plan, plan
        assert f"Sort [{ROW}" not in plan, plan  # no sort to restore the spine's order
    else:
        assert "Join" not in plan, plan  # one part: nothing joined back
    got = out.toPandas()
    cols = ["card_id", "merchant", "t", "label"]
    assert list(got.columns[:4]) == cols
    assert got[cols].values.tolist() == spine[cols].values.tolist()  # in the spine's order
    check_rows(cfg, events, got, features)


def test_minima_and_maxima_of_one_group_answer_in_its_running_pass(
    spark: Any, redis_url: str, tmp_path: Path, archive: Any, now_ms: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """min and max take range queries in the running pass (`offline.prefix`): a key group of a
    count, a min and a max is answered by that pass alone, the spine's columns riding along
    (nothing joined back), with DuckDB's values."""
    from sluice.offline import training

    monkeypatch.setattr(training, "BROADCAST_BYTES", 0)
    path, events = archive
    cfg = make_config(redis_url, tmp_path)
    spine = spine_rows(events, now_ms, n=300)
    features = {"txn_count": ["1s", "1h"], "card_min": ["10s", "45s", "2h"],
                "card_max": ["1s", "17m", "1d"]}  # fmt: skip
    out = training_set(
        spark, cfg, spark.createDataFrame(spine), features, ts="t",
        keys={"card": "card_id"}, events=spark.read.parquet(str(path)),
    )  # fmt: skip
    plan = out._jdf.queryExecution().optimizedPlan().toString()
    assert "Join" not in plan and "Window" not in plan, plan
    got = out.toPandas()
    cols = ["card_id", "merchant", "t", "label"]
    assert got[cols].values.tolist() == spine[cols].values.tolist()
    assert got["card_max_1d"].notna().any() and got["card_min_10s"].isna().any()
    check_rows(cfg, events, got, features)


def test_every_running_fold_is_the_merge_of_its_events_units(spark: Any) -> None:
    """The per-event states of a running pass (`Agg.unit_columns`) merged by each column's
    `Fold.merge` (sum, least, greatest) are what the fold's own aggregates make of the same
    cell, nulls (events a metric does not count) included."""
    from pyspark.sql import functions as F

    from sluice.offline.features import fold_aggs
    from sluice.slices.aggs import AGGS, N

    rng = np.random.default_rng(9)
    rows = [(int(k), int(t), None if rng.random() < 0.2 else float(v), int(v))
            for k, t, v in zip(rng.integers(0, 7, 500), rng.integers(0, 10**6, 500),
                               np.round(rng.lognormal(2, 1, 500), 2), strict=True)]  # fmt: skip
    df = spark.createDataFrame(rows, "k long, t long, x double, i long")
    running = [agg for agg in AGGS.values() if agg.running]
    assert {a.name for a in running} == {"count", "sum", "avg", "min", "max", "first", "last"}
    merge = {"sum": F.sum, "min": F.min, "max": F.max}
    for agg in running:
        kinds = {f.column: f.merge for f in (N, *agg.folds)}
        for col in ("x", "i"):
            v, t = F.col(col), F.col("t")
            folded = df.groupBy("k").agg(*fold_aggs(agg, v, t, lambda c: c)).toPandas()
            units = df.select("k", *[u.alias(c) for c, u in agg.unit_columns(v, t)])
            merged = units.groupBy("k").agg(
                *[merge[kinds[c]](c).alias(c) for c in units.columns[1:]]
            )
            want = folded.set_index("k").sort_index()
            got = merged.toPandas().set_index("k").sort_index()[want.columns]
            pd.testing.assert_frame_equal(got.fillna(0), want.fillna(0), check_dtype=False,
                                          rtol=1e-12)  # fmt: skip


@pytest.mark.parametrize("broadcast", [True, False])
def test_no_event_after_t_counts(
    spark: Any, redis_url: str, tmp_path: Path, broadcast: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not one in t's own slice, not one at t + 1; the event at t itself counts: whether the
    spine's rows are broadcast to the events' tasks for t's own slice (a small spine) or both
    sides are shuffled (a large one)."""
    from sluice.offline import training

    monkeypatch.setattr(training, "BROADCAST_BYTES", training.BROADCAST_BYTES if broadcast else 0)
    cfg = make_config(redis_url, tmp_path)
    t = 1_700_000_005_000  # mid-slice of txn_count's 10 s slices
    old = t - 3 * 86_400_000  # past txn_count's retention: the archive still counts it
    assert cfg.metric("txn_count").retention < 4 * 86_400_000
    ev = pd.DataFrame({
        "ts": [t - 20_000, t - 1, t, t + 1, t + 4_000, t + 60_000, old],
        "card": ["c"] * 7, "merchant": ["m"] * 7, "amount": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0],
        "qty": [1, 2, 3, 4, 5, 6, 7],
    })  # fmt: skip
    spine = spark.createDataFrame(pd.DataFrame({"card": ["c", "c"], "merchant": ["m", "m"],
                                                "t": [t, t - 1]}))  # fmt: skip
    out = training_set(
        spark, cfg, spine, ["txn_count:1s,10s,1h,4d", "card_max:1h", "card_last:1h", "qty_sum:1h"],
        ts="t", events=spark.createDataFrame(ev),
    ).toPandas().set_index("t")  # fmt: skip
    assert out.loc[t, "txn_count_1s"] == 2  # slice [t - 5 s, t]: t - 1 and t
    assert out.loc[t, "txn_count_10s"] == 2 and out.loc[t, "txn_count_1h"] == 3
    assert out.loc[t, "card_max_1h"] == 3 and out.loc[t, "card_last_1h"] == 3.0
    assert out.loc[t, "qty_sum_1h"] == 6
    assert out.loc[t - 1, "txn_count_1h"] == 2 and out.loc[t - 1, "card_last_1h"] == 2.0
    assert out.loc[t, "txn_count_4d"] == 4 and out.loc[t - 1, "txn_count_4d"] == 3


def test_a_value_expression_that_fails_or_is_not_finite_is_folded_as_online(
    spark: Any, redis_url: str, tmp_path: Path
) -> None:
    """As the live fold (tests/integration/test_store.py): a division by zero or a computed NaN
    or infinity in `value` is null for that metric only, on a session whose caller runs Spark's
    ANSI mode, which is theirs again after the call; whichever features are asked for."""
    cfg = make_config(redis_url, tmp_path, metrics=EXPRESSION_METRICS, derived=[])
    t = 1_700_000_010_000
    ev = pd.DataFrame({
        "ts": [t - 4_000, t - 3_000, t - 2_000, t - 1_000], "card": ["c"] * 4,
        "merchant": ["m"] * 4, "amount": [9.0, -1.0, 100.0, 4.0], "qty": [0, 1, 1, 2],
    })  # fmt: skip
    spine = spark.createDataFrame(pd.DataFrame({"card": ["c"], "t": [t]}))
    want = {"txn_count_1m": 4, "per_unit_1m": 101.0, "root_1m": 15.0, "big_1m": 9.0e307}
    spark.conf.set("spark.sql.ansi.enabled", "true")
    try:
        out = training_set(
            spark, cfg, spine, ["txn_count:1m", "per_unit:1m", "root:1m", "big:1m"], ts="t",
            events=spark.createDataFrame(ev),
        ).toPandas()  # fmt: skip
        assert spark.conf.get("spark.sql.ansi.enabled") == "true"
        alone = training_set(spark, cfg, spine, ["txn_count:1m"], ts="t",
                             events=spark.createDataFrame(ev)).toPandas()  # fmt: skip
    finally:
        spark.conf.set("spark.sql.ansi.enabled", "false")
    assert {c: out.iloc[0][c] for c in want} == want
    assert alone.iloc[0]["txn_count_1m"] == 4


def test_offline_calls_that_overlap_on_one_session_keep_its_expression_semantics(
    spark: Any,
) -> None:
    """Two offline calls on one session in two threads: the first ends while the second still
    plans. The second keeps planning with Sluice's semantics, and the caller's setting is back
    once both ended (the first gave it back while the second ran; the second then kept it)."""
    ansi = "spark.sql.ansi.enabled"
    a_in, a_out, b_in = threading.Event(), threading.Event(), threading.Event()
    seen: list[str | None] = []

    @expression_semantics
    def first(s: Any) -> None:
        a_in.set()
        b_in.wait(60)

    @expression_semantics
    def second(s: Any) -> None:
        b_in.set()
        a_out.wait(60)
        seen.append(s.conf.get(ansi))

    spark.conf.set(ansi, "true")
    try:
        one = threading.Thread(target=lambda: (first(spark), a_out.set()))
        one.start()
        assert a_in.wait(60)
        two = threading.Thread(target=second, args=(spark,))
        two.start()
        one.join(60)
        two.join(60)
        assert seen == ["false"]
        assert spark.conf.get(ansi) == "true"
    finally:
        spark.conf.set(ansi, "false")


def test_as_known_at_counts_only_what_had_arrived(
    spark: Any, redis_url: str, tmp_path: Path, now_ms: int
) -> None:
    cfg = make_config(redis_url, tmp_path)
    rng = np.random.default_rng(5)
    n = 4000
    ts = rng.integers(now_ms - 40 * 60_000, now_ms, n)
    late = rng.random(n) < 0.2
    arrival = ts + np.where(late, rng.integers(10_000, 15 * 60_000, n), rng.integers(0, 900, n))
    ev = pd.DataFrame({"ts": ts, "card": [f"c{i}" for i in rng.integers(0, 8, n)],
                       "merchant": [f"m{i}" for i in rng.integers(0, 3, n)],
                       "amount": rng.random(n) * 10, "qty": rng.integers(0, 9, n),
                       "arrived": arrival})  # fmt: skip
    spine = pd.DataFrame({"card": [f"c{i}" for i in rng.integers(0, 8, 120)],
                          "merchant": [f"m{i}" for i in rng.integers(0, 3, 120)],
                          "t": rng.integers(now_ms - 30 * 60_000, now_ms, 120)})  # fmt: skip
    feats = ["txn_count:10s,5m,1h", "card_max:5m", "qty_sum:17m", "card_last:1h"]
    out = training_set(spark, cfg, spark.createDataFrame(spine), feats, ts="t",
                       events=spark.createDataFrame(ev), arrival="arrived").toPandas()  # fmt: skip
    con = duckdb.connect()
    con.register("ev", ev)
    sql = {
        "txn_count": "SELECT count(*) FROM ev WHERE card = ? AND ts >= ? AND ts <= ?"
                     " AND arrived <= ?",
        "card_max": "SELECT max(qty) FROM ev WHERE card = ? AND ts >= ? AND ts <= ?"
                    " AND arrived <= ?",
        "qty_sum": "SELECT coalesce(sum(qty), 0) FROM ev WHERE merchant = ? AND ts >= ?"
                   " AND ts <= ? AND arrived <= ?",
        "card_last": "SELECT amount FROM ev WHERE card = ? AND ts >= ? AND ts <= ? AND"
                     " arrived <= ? ORDER BY ts DESC, amount DESC LIMIT 1",
    }  # fmt: skip
    differs = 0
    for _, row in out.iterrows():
        t = int(row.t)
        for metric, window, w_ms, s in [("txn_count", "10s", 10_000, 10_000),
                                        ("txn_count", "5m", 300_000, 10_000),
                                        ("txn_count", "1h", HOUR, 10_000),
                                        ("card_max", "5m", 300_000, 10_000),
                                        ("qty_sum", "17m", 17 * 60_000, 60_000),
                                        ("card_last", "1h", HOUR, 10_000)]:  # fmt: skip
            key = row.merchant if metric == "qty_sum" else row.card
            lo = slice_start(t - w_ms + 1, s)
            got = con.execute(sql[metric], [key, lo, t, t]).fetchone()
            want = None if got is None else got[0]
            assert row[f"{metric}_{window}"] == want, (metric, window, t, key)
            everything = con.execute(sql[metric].replace("AND arrived <= ?", ""),
                                     [key, lo, t]).fetchone()  # fmt: skip
            differs += (None if everything is None else everything[0]) != want
    assert differs > 20  # late events made a difference the check above saw


def test_the_store_answers_as_online_and_offline_agree_on_it(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path, archive: Any, now_ms: int
) -> None:
    """A backfilled store: the engine's answer at end = t and the training set's value are the
    same to the bit for rows whose t ends a slice (distinct and quantile included); from the
    store itself, those rows are answered and a mid-slice one is refused with its reason."""
    path, events = archive
    cfg = make_config(redis_url, tmp_path)
    backfill(spark, cfg, str(path), until_ms=now_ms)
    rng = np.random.default_rng(9)
    cards = events["card"].value_counts().index[:15].tolist()
    merchants = events["merchant"].value_counts().index[:8].tolist()
    ends = [slice_start(int(x), 60_000) - 1 for x in rng.integers(now_ms - 40 * 60_000, now_ms, 60)]
    spine = pd.DataFrame({"card": rng.choice(cards, 60), "merchant": rng.choice(merchants, 60),
                          "t": ends})  # fmt: skip
    spine.loc[0, "t"] = ends[0] - 25_000  # inside a slice: the store cannot answer it
    feats = {"txn_count": ["10m"], "card_merchants": ["30m"], "amount_q": ["1h"],
             "card_max": ["17m"], "amount_sum": ["1h"], "avg_ticket": ["1h"]}  # fmt: skip
    offline = training_set(spark, cfg, spark.createDataFrame(spine), feats, ts="t",
                           events=spark.read.parquet(str(path))).toPandas()  # fmt: skip
    stored = training_set(spark, cfg, spark.createDataFrame(spine), feats, ts="t").toPandas()
    engine = QueryEngine(cfg, r)
    for i, row in offline.iterrows():
        for metric, windows in feats.items():
            card_keyed = metric in ("txn_count", "card_merchants", "card_max")
            key = [row.card] if card_keyed else [row.merchant]
            ans = engine.query(metric, key, windows[0], int(row.t))["value"]
            col = f"{metric}_{windows[0]}"
            if i == 0:
                assert stored.loc[i, col] is None or pd.isna(stored.loc[i, col])
                continue
            assert (
                row[col] == pytest.approx(ans, rel=1e-12)
                if isinstance(ans, float)
                else (_same(row[col], ans))
            ), (metric, key, row.t, row[col], ans)
            assert _same(stored.loc[i, col], ans), (metric, key, row.t)
    reasons = list(stored.loc[0, UNANSWERED])
    assert len(reasons) == len(feats) and "inside a 10s slice of 'txn_count'" in reasons[0]
    assert all(len(x) == 0 for x in stored.loc[1:, UNANSWERED])


def test_the_store_answers_only_what_a_backfill_or_the_live_fold_wrote(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path, archive: Any, now_ms: int
) -> None:
    """From the store, a window after a backfill's seam is refused while nothing folded live,
    and one in the gap between the seam and a later start of the live fold, or between two
    backfills' spans; a window before the seam is answered as the archive answers it."""
    from sluice.redis.keys import FOLDING_KEY

    path, events = archive
    cfg = make_config(redis_url, tmp_path)
    seam = now_ms - 30 * 60_000  # txn_count's slices are 10 s: the seam is --until itself
    backfill(spark, cfg, str(path), metrics=["txn_count"], until_ms=seam)
    card = events["card"].value_counts().index[0]
    before, after = seam - 20 * 60_000 - 1, now_ms - 10 * 60_000 - 1
    spine = spark.createDataFrame(pd.DataFrame({"card": [card, card], "t": [before, after]}))
    feats = {"txn_count": ["1m", "10m"]}
    offline = training_set(spark, cfg, spine, feats, ts="t",
                           events=spark.read.parquet(str(path))).toPandas()  # fmt: skip
    stored = training_set(spark, cfg, spine, feats, ts="t").toPandas()
    assert stored.loc[0, "txn_count_10m"] == offline.loc[0, "txn_count_10m"] > 0
    assert list(stored.loc[0, UNANSWERED]) == []
    assert pd.isna(stored.loc[1, "txn_count_10m"]) and pd.isna(stored.loc[1, "txn_count_1m"])
    reasons = list(stored.loc[1, UNANSWERED])
    assert len(reasons) == 2 and all("past 'txn_count''s backfill seam" in x for x in reasons)
    r.hset(FOLDING_KEY, "txn_count", now_ms - 15 * 60_000)  # the live fold began after the seam
    stored = training_set(spark, cfg, spine, feats, ts="t").toPandas()
    reasons = list(stored.loc[1, UNANSWERED])
    assert len(reasons) == 1 and "txn_count_10m: the window reaches into the gap" in reasons[0]
    r.hset(FOLDING_KEY, "txn_count", seam - 60_000)  # ... or before it: no gap
    stored = training_set(spark, cfg, spine, feats, ts="t").toPandas()
    assert [list(x) for x in stored[UNANSWERED]] == [[], []]
    # A backfill from --start wrote nothing before it: a window reaching back past it is
    # refused, one within it answered as the archive answers it.
    start = before - 5 * 60_000 + 1
    backfill(spark, cfg, str(path), metrics=["merchant_txn"], start_ms=start, until_ms=seam)
    merchant = events["merchant"].value_counts().index[0]
    spine = spark.createDataFrame(pd.DataFrame({"merchant": [merchant], "t": [before]}))
    feats = {"merchant_txn": ["5m", "10m"]}
    offline = training_set(spark, cfg, spine, feats, ts="t",
                           events=spark.read.parquet(str(path))).toPandas()  # fmt: skip
    stored = training_set(spark, cfg, spine, feats, ts="t").toPandas()
    assert stored.loc[0, "merchant_txn_5m"] == offline.loc[0, "merchant_txn_5m"] > 0
    assert pd.isna(stored.loc[0, "merchant_txn_10m"]) and offline.loc[0, "merchant_txn_10m"] > 0
    reasons = list(stored.loc[0, UNANSWERED])
    assert len(reasons) == 1 and "before the history a backfill wrote" in reasons[0]
    # Two runs that leave a gap between them: a window reaching into it is refused, one after it
    # answered; a third run that fills the gap joins the spans.
    later = seam + 10 * 60_000
    backfill(spark, cfg, str(path), metrics=["merchant_txn"], start_ms=later,
             until_ms=now_ms - 5 * 60_000)  # fmt: skip
    t = later + 5 * 60_000 - 1
    spine = spark.createDataFrame(pd.DataFrame({"merchant": [merchant], "t": [t]}))
    offline = training_set(spark, cfg, spine, feats, ts="t",
                           events=spark.read.parquet(str(path))).toPandas()  # fmt: skip
    stored = training_set(spark, cfg, spine, feats, ts="t").toPandas()
    assert stored.loc[0, "merchant_txn_5m"] == offline.loc[0, "merchant_txn_5m"] > 0
    assert pd.isna(stored.loc[0, "merchant_txn_10m"]) and offline.loc[0, "merchant_txn_10m"] > 0
    (reason,) = stored.loc[0, UNANSWERED]
    assert "which no backfill of 'merchant_txn' wrote" in reason, reason
    backfill(spark, cfg, str(path), metrics=["merchant_txn"], start_ms=seam, until_ms=later)
    stored = training_set(spark, cfg, spine, feats, ts="t").toPandas()
    assert stored.loc[0, "merchant_txn_10m"] == offline.loc[0, "merchant_txn_10m"]
    assert list(stored.loc[0, UNANSWERED]) == []


def test_a_spine_key_of_another_type_is_read_as_its_field(
    spark: Any, redis_url: str, tmp_path: Path, archive: Any, now_ms: int
) -> None:
    """A key field typed `long` and a spine whose column pandas made float64 (it has a gap):
    42.0 is the key 42, from the archive and from the store alike, and the gap is no key (its
    features null, said so). A key that is no long at all is warned about before the job."""
    from pyspark.sql import functions as F

    from sluice.config import config_from_dict
    from sluice.offline.features import spine_problems
    from tests.conftest import config_data

    path, events = archive
    data = config_data(redis_url, tmp_path)
    data["metrics"].append({"name": "qty_txn", "key": ["qty"], "agg": "count", "slice": "10s",
                            "retention": "1d"})  # fmt: skip
    cfg = config_from_dict(data)
    backfill(spark, cfg, str(path), metrics=["qty_txn"], until_ms=now_ms)
    t = slice_start(now_ms - 5 * 60_000, 10_000) - 1  # a slice's end: the store answers it
    qtys = events["qty"].value_counts().index[:3].tolist()
    # The last rows: a gap, a fraction (cut, it would be another key's) and a row at the
    # largest long (a "no end" marker), which counts nothing in its window.
    spine = pd.DataFrame({"qty": [float(q) for q in qtys] + [np.nan, qtys[0] + 0.5, qtys[0]],
                          "t": [t] * 5 + [2**63 - 1]})  # fmt: skip
    assert spine["qty"].dtype == np.float64
    feats = {"qty_txn": ["10m"]}
    offline = training_set(spark, cfg, spark.createDataFrame(spine), feats, ts="t",
                           events=spark.read.parquet(str(path))).toPandas()  # fmt: skip
    stored = training_set(spark, cfg, spark.createDataFrame(spine), feats, ts="t").toPandas()
    lo = t - 10 * 60_000 + 1
    for i, q in enumerate(qtys):
        want = int(((events["qty"] == q) & (events["ts"] >= lo) & (events["ts"] <= t)).sum())
        assert want > 0 and offline.loc[i, "qty_txn_10m"] == stored.loc[i, "qty_txn_10m"] == want
    for i in (3, 4):
        assert pd.isna(offline.loc[i, "qty_txn_10m"]) and pd.isna(stored.loc[i, "qty_txn_10m"])
        assert list(stored.loc[i, UNANSWERED]) == ["qty_txn_10m: no time or key"]
    assert offline.loc[5, "qty_txn_10m"] == 0
    odd = spark.createDataFrame(pd.DataFrame({"qty": ["7", "N/A", None, "8", "6.5"],
                                              "t": [t, t, t, t // 1000, t * 1000]}))  # fmt: skip
    said = spine_problems(odd, F.col("t"), "t", {"qty": "long"})
    assert f"1 rows have a 't' that looks like epoch seconds (e.g. {t // 1000})" in " ".join(said)
    assert f"1 rows have a 't' past the year 5000 (e.g. {t * 1000})" in " ".join(said)
    assert "2 rows have a key that is not of its field's type" in " ".join(said)
    assert any("1 rows lack a key" in x for x in said)


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, dict):
        return dict(got or {}) == want
    if want is None:
        return got is None or (isinstance(got, float) and math.isnan(got))
    return bool(got == want)


def test_clear_errors(spark: Any, redis_url: str, tmp_path: Path) -> None:
    cfg = make_config(redis_url, tmp_path)
    spine = spark.createDataFrame(pd.DataFrame({"card": ["c"], "t": [1]}))
    ev = spark.createDataFrame(pd.DataFrame({"ts": [1], "card": ["c"], "merchant": ["m"],
                                             "amount": [1.0], "qty": [1]}))  # fmt: skip
    with pytest.raises(UnknownMetric, match="unknown metric 'nope'"):
        training_set(spark, cfg, spine, ["nope:1h"], ts="t", events=ev)
    with pytest.raises(BadQuery, match="is not a duration"):
        training_set(spark, cfg, spine, ["txn_count:soon"], ts="t", events=ev)
    with pytest.raises(BadQuery, match="METRIC:WINDOW"):
        training_set(spark, cfg, spine, ["txn_count"], ts="t", events=ev)
    with pytest.raises(BadQuery, match="no time column 'when'"):
        training_set(spark, cfg, spine, ["txn_count:1h"], ts="when", events=ev)
    with pytest.raises(BadQuery, match="no column 'merchant' for key field 'merchant'"):
        training_set(spark, cfg, spine, ["merchant_txn:1h"], ts="t", events=ev)
    with pytest.raises(BadQuery, match=r"or keys=\{'merchant': COLUMN\} in Python"):
        training_set(spark, cfg, spine, ["merchant_txn:1h"], ts="t", events=ev)
    # Columns Sluice adds itself, keys that name no key field, and a double for a string key.
    with pytest.raises(BadQuery, match="'_sluice_row', a name Sluice uses"):
        training_set(spark, cfg, spine.withColumn("_sluice_row", spine.t), ["txn_count:1h"],
                     ts="t", events=ev)  # fmt: skip
    with pytest.raises(BadQuery, match="'sluice_unanswered', which a training set from the"):
        training_set(spark, cfg, spine.withColumn("sluice_unanswered", spine.t),
                     ["txn_count:1h"], ts="t")  # fmt: skip
    with pytest.raises(BadQuery, match="already has columns TXN_COUNT_1H, which features would"):
        training_set(spark, cfg, spine.withColumn("TXN_COUNT_1H", spine.t), ["txn_count:1h"],
                     ts="t", events=ev)  # fmt: skip
    with pytest.raises(BadQuery, match="keys name 'card_no', which is no metric's key field"):
        training_set(spark, cfg, spine, ["txn_count:1h"], ts="t", keys={"card_no": "card"},
                     events=ev)  # fmt: skip
    floats = spark.createDataFrame(pd.DataFrame({"card": [7.0, np.nan], "t": [1, 1]}))
    with pytest.raises(BadQuery, match="'card' is double, and key field 'card' is a string"):
        training_set(spark, cfg, floats, ["txn_count:1h"], ts="t", events=ev)
    # A pandas spine, or events of another kind, are named for what they are.
    with pytest.raises(TypeError, match=r"a Spark DataFrame, not DataFrame \(spark.createData"):
        training_set(spark, cfg, spine.toPandas(), ["txn_count:1h"], ts="t", events=ev)
    with pytest.raises(TypeError, match="events must be a Spark DataFrame or the archive's path"):
        training_set(spark, cfg, spine, ["txn_count:1h"], ts="t", events=42)  # type: ignore[arg-type]


def test_events_may_be_the_archives_path(
    spark: Any, redis_url: str, tmp_path: Path, archive: tuple[Path, pd.DataFrame], now_ms: int
) -> None:
    path, events = archive
    cfg = make_config(redis_url, tmp_path)
    spine = spark.createDataFrame(spine_rows(events, now_ms, 20))
    keys = {"card": "card_id"}
    by_path = training_set(spark, cfg, spine, ["txn_count:1h"], "t", keys, events=str(path))
    frame = read_archive(spark, str(path), None, cfg.source.schema_)
    by_frame = training_set(spark, cfg, spine, ["txn_count:1h"], "t", keys, events=frame)
    got, want = by_path.toPandas(), by_frame.toPandas()
    assert got["txn_count_1h"].sum() > 0 and got.equals(want)


def test_archive_keys_and_times_are_read_as_written(
    spark: Any, redis_url: str, tmp_path: Path, now_ms: int
) -> None:
    """Hive partitions `card=0042`, `card=042`, `card=42` are three cards (Spark's inference
    would read one integer); inputs that take in one file twice are refused; and times with no
    zone are UTC on a session set to another zone."""
    cfg = make_config(redis_url, tmp_path)
    t = slice_start(now_ms - HOUR, 60_000) - 1
    cards = ["0042", "042", "42"]
    events = pd.DataFrame({"ts": [t - 1000 * i for i in range(30)], "card": cards * 10,
                           "merchant": "m", "amount": 1.0, "qty": 1})  # fmt: skip
    hive = tmp_path / "hive"
    events.to_parquet(hive, partition_cols=["card"], index=False)
    spine = spark.createDataFrame(pd.DataFrame({"card": cards, "t": [t] * 3}))
    got = training_set(spark, cfg, spine, ["txn_count:1h"], "t", events=str(hive)).toPandas()
    assert got["txn_count_1h"].tolist() == [10, 10, 10]
    one = next(hive.glob("card=42/*.parquet"))
    with pytest.raises(ArchiveError, match=r"both take in .*: its events would count twice"):
        read_archive(spark, [str(hive), str(one)], None, cfg.source.schema_)
    assert read_archive(spark, [str(one), str(one)], None, cfg.source.schema_).count() == 10
    # Naive times (pandas writes them as timestamp_ntz) and zone-less ISO text, on a session
    # in New York: read as UTC, as the CLI's session reads them.
    naive = events.assign(ts=pd.to_datetime(events["ts"], unit="ms"))
    naive.to_parquet(tmp_path / "naive.parquet", index=False, coerce_timestamps="ms")
    iso = pd.DataFrame({"card": cards, "t": [pd.Timestamp(t, unit="ms").isoformat()] * 3})
    events.to_parquet(tmp_path / "epoch.parquet", index=False)
    before = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", "America/New_York")
    try:  # each time form against epoch ms on the other side
        naive_events = training_set(
            spark, cfg, spine, ["txn_count:1h"], "t", events=str(tmp_path / "naive.parquet")
        ).toPandas()
        iso_spine = training_set(
            spark,
            cfg,
            spark.createDataFrame(iso),
            ["txn_count:1h"],
            "t",
            events=str(tmp_path / "epoch.parquet"),
        ).toPandas()
    finally:
        spark.conf.set("spark.sql.session.timeZone", before)
    assert naive_events["txn_count_1h"].tolist() == [10, 10, 10]
    assert iso_spine["txn_count_1h"].tolist() == [10, 10, 10]
