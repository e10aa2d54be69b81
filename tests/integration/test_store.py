"""The Spark fold and the Redis slice store together: merge semantics, idempotent replay,
late events, retention, dead letters. Real Redis, real Spark."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa
import pytest
import redis
import redis.asyncio

from sluice.clock import ManualClock
from sluice.errors import BadQuery
from sluice.graph import StreamsSpec
from sluice.pipeline.fold import FoldQuery
from sluice.pipeline.plan import explode_updates
from sluice.pipeline.writer import write_partition
from sluice.query.engine import QueryEngine
from sluice.redis import marks
from sluice.redis.connection import RedisHandle
from sluice.redis.keys import STATS_KEY, WRITES_KEY, WRITING_KEY
from sluice.redis.mux import MuxClient
from sluice.source.decode import Decoder
from sluice.source.options import SourceOptions
from sluice.status.dead_letters import read_dead_letters
from sluice.testing.faults import DropEvery, PauseBetweenMetrics
from tests.conftest import make_config
from tests.integration.helpers import EXPRESSION_METRICS, decoded_table, slice_snapshot

pytestmark = pytest.mark.spark

HOUR_MS = 3_600_000
# Recent and aligned to the hour: slices expire by Redis's clock (newest slice + retention).
T0 = (time.time_ns() // 1_000_000 // HOUR_MS - 1) * HOUR_MS


def _pipeline(spark: Any, redis_url: str, tmp_path: Path, **overrides: Any) -> FoldQuery:
    cfg = make_config(redis_url, tmp_path, **overrides)
    fold = FoldQuery(cfg, RedisHandle(redis_url), spark)
    fold.prepare()
    return fold


def _apply(
    p: FoldQuery, spark: Any, events: list[dict[str, Any]], batch_id: int, ref_ms: int = T0 + 60_000
) -> dict[str, Any]:
    df = spark.createDataFrame(decoded_table(p.cfg, events, ref_ms))
    # A batch handed in has no offset log entry: the writer's reference time is the clock's.
    p.clock = ManualClock(ref_ms)
    return p.process_batch(explode_updates(df, p.cfg, list(p.specs)), batch_id)


def _ev(
    ts: int, card: str = "c1", merchant: str = "m1", amount: float = 1.0, qty: int = 1
) -> dict[str, Any]:
    return {"ts": ts, "card": card, "merchant": merchant, "amount": amount, "qty": qty}


EVENTS = [
    _ev(T0 + 1_000, "c1", "m1", 10.5, 3),
    _ev(T0 + 2_000, "c1", "m1", -2.0, 5),
    _ev(T0 + 12_000, "c1", "m2", 4.25, 7),
    _ev(T0 + 13_000, "c2", "m1", 1.0, 1),
]


def test_every_aggregation_merges_right(
    spark: Any, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    p = _pipeline(spark, redis_url, tmp_path)
    _apply(p, spark, EVENTS[:2], 0)
    _apply(p, spark, EVENTS[2:], 1)
    q = QueryEngine(p.cfg, r)
    end = T0 + 59_999
    assert q.query("txn_count", "c1", "1m", end)["value"] == 3
    assert q.query("txn_count", "c2", "1m", end)["value"] == 1
    assert q.query("amount_sum", "m1", "1m", end)["value"] == pytest.approx(11.5)  # filter > 0
    assert q.query("qty_sum", "m1", "1m", end)["value"] == 9
    assert q.query("merchant_txn", "m1", "1m", end)["value"] == 3
    assert q.query("card_min", "c1", "1m", end)["value"] == -2.0
    assert q.query("card_max", "c1", "1m", end)["value"] == 7
    assert q.query("avg_amount", "m1", "1m", end)["value"] == pytest.approx((10.5 - 2.0 + 1.0) / 3)
    assert q.query("avg_ticket", "m1", "1m", end)["value"] == pytest.approx(11.5 / 3)
    assert q.query("pair_count", ["c1", "m1"], "1h", end)["value"] == 2
    assert q.query("card_merchants", "c1", "1m", end)["value"] == 2
    assert q.query("card_last", "c1", "1m", end)["value"] == 4.25
    assert q.query("card_first", "c1", "1m", end)["value"] == 10.5
    amounts = [10.5, -2.0, 1.0]
    mean = sum(amounts) / 3
    var = sum((a - mean) ** 2 for a in amounts) / 2
    assert q.query("amount_std", "m1", "1m", end)["value"] == pytest.approx(var**0.5)
    assert q.query("qty_var", "m1", "1m", end)["value"] == pytest.approx(4.0)  # 3, 5, 1
    assert q.query("amount_q", "m1", "1m", end)["value"] == {"0.5": 1.0, "0.99": 10.5}
    # A 10s window over the first slice only, and the slices it reports covering.
    first = q.query("txn_count", "c1", "10s", T0 + 9_999)
    assert (first["value"], first["covered_start"], first["covered_end"]) == (2, T0, T0 + 10_000)
    # No data: count and sum are 0, min/max/avg null.
    assert q.query("txn_count", "nobody", "1m", end)["value"] == 0
    assert q.query("qty_sum", "nobody", "1m", end)["value"] == 0
    assert q.query("card_min", "nobody", "1m", end)["value"] is None
    assert q.query("avg_amount", "nobody", "1m", end)["value"] is None
    assert q.query("card_merchants", "nobody", "1m", end)["value"] == 0
    assert q.query("card_last", "nobody", "1m", end)["value"] is None
    assert q.query("card_first", "nobody", "1m", end)["value"] is None
    assert q.query("amount_std", "nobody", "1m", end)["value"] is None
    assert q.query("amount_q", "nobody", "1m", end)["value"] == {"0.5": None, "0.99": None}


def test_first_and_last_break_time_ties_by_value(
    spark: Any, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    """Events at the same time: `first` takes the smaller value and `last` the greater, whether
    the tie meets in Spark's fold (one batch) or in the store's merge (two batches). An earlier
    time wins `first` whatever its value. Integer values are answered as ints."""
    metrics = [
        {"name": f"{agg}_{field}", "key": ["card"], "agg": agg, "value": field,
         "slice": "10s", "retention": "1d"}
        for agg in ("first", "last")
        for field in ("amount", "qty")
    ]  # fmt: skip
    p = _pipeline(spark, redis_url, tmp_path, metrics=metrics, derived=[])
    t = T0 + 5_000
    tie = [_ev(t, "c1", amount=2.5, qty=4), _ev(t, "c1", amount=-1.0, qty=9)]
    tie += [_ev(t, "c2", amount=2.5, qty=4), _ev(t, "c2", amount=-1.0, qty=9)]
    tie += [_ev(T0 + 1_000, "c3", amount=100.0, qty=50)]
    _apply(p, spark, tie, 0)
    later = [_ev(t, "c1", amount=3.0, qty=1), _ev(t, "c2", amount=-5.0, qty=12)]
    later += [_ev(T0 + 9_000, "c3", amount=-100.0, qty=0)]
    _apply(p, spark, later, 1)
    q = QueryEngine(p.cfg, r)
    want = {
        # card: (first amount, last amount, first qty, last qty)
        "c1": (-1.0, 3.0, 1, 9),
        "c2": (-5.0, 2.5, 4, 12),
        "c3": (100.0, -100.0, 50, 0),
    }
    for card, values in want.items():
        got = tuple(
            q.query(name, card, "1m", T0 + 59_999)["value"]
            for name in ("first_amount", "last_amount", "first_qty", "last_qty")
        )
        assert got == values, card
        assert [type(v) for v in got] == [float, float, int, int], card


def test_same_batch_twice_leaves_slices_unchanged(
    spark: Any, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    p = _pipeline(spark, redis_url, tmp_path)
    first = _apply(p, spark, EVENTS, 5)
    before = slice_snapshot(r)
    again = _apply(p, spark, EVENTS, 5)
    assert slice_snapshot(r) == before
    # HyperLogLog cells (distinct) are re-added, which changes nothing; every other update
    # is recognised by its token and skipped.
    hll_cells = len(list(r.scan_iter(match="sluice:h:*")))
    assert hll_cells > 0
    assert again["updates_applied"] == hll_cells
    assert again["updates_duplicate"] == first["updates_applied"] - hll_cells > 0
    assert int(r.hget(STATS_KEY, "batches")) == 1
    assert int(r.hget(STATS_KEY, "events_in")) == len(EVENTS)


def _states(snapshot: dict[bytes, Any]) -> dict[bytes, Any]:
    """Slice states without the writer tokens (which differ between two clean runs)."""
    return {
        k: {f: v.split(b":", 1)[1] for f, v in h.items() if f != b"_m"}
        if isinstance(h, dict)
        else h
        for k, h in snapshot.items()
    }


def test_rerun_after_partial_write_converges(
    spark: Any, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    many = [
        _ev(T0 + i * 37, f"c{i % 300}", f"m{i % 250}", float(i % 7), i % 5) for i in range(1500)
    ]
    clean = _pipeline(spark, redis_url, tmp_path / "clean")
    _apply(clean, spark, many, 3)
    expected = _states(slice_snapshot(r))
    r.flushall()
    crashed = _pipeline(spark, redis_url, tmp_path / "crashed")
    crashed.writer = DropEvery(2)  # the first attempt loses every other slice update
    partial = _apply(crashed, spark, many, 3)
    assert partial["updates_applied"] < sum(
        len(h) if isinstance(h, dict) else 1 for h in expected.values()
    )
    crashed.writer = write_partition
    _apply(crashed, spark, many, 3)  # Spark re-runs the batch with the same id
    assert _states(slice_snapshot(r)) == expected


def test_late_event_updates_its_old_slice(
    spark: Any, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    p = _pipeline(spark, redis_url, tmp_path)
    _apply(p, spark, [_ev(T0 + 50_000)], 0)
    _apply(p, spark, [_ev(T0 + 1_000)], 1, ref_ms=T0 + 120_000)  # late by almost a minute
    q = QueryEngine(p.cfg, r)
    assert q.query("txn_count", "c1", "10s", T0 + 9_999)["value"] == 1
    assert q.query("txn_count", "c1", "1m", T0 + 59_999)["value"] == 2


def test_retention_removes_expired_slices(
    spark: Any, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    short = {"name": "recent", "key": ["card"], "agg": "count", "slice": "10s", "retention": "1m"}
    p = _pipeline(spark, redis_url, tmp_path, metrics=[short], derived=[])
    base = time.time_ns() // 1_000_000 // 10_000 * 10_000
    _apply(p, spark, [_ev(base)], 0, ref_ms=base)
    key = "sluice:s:{recent|c1}"
    assert r.hexists(key, str(base))
    later = base + 300_000
    _apply(p, spark, [_ev(later)], 1, ref_ms=later)
    assert not r.hexists(key, str(base))  # more than a retention behind the newest slice
    assert r.hexists(key, str(later))
    # Redis 6.2 has no PEXPIRETIME: check the TTL against the expected expiry instead.
    expected_ttl = later + 10_000 + 60_000 - time.time_ns() // 1_000_000
    assert abs(r.pttl(key) - expected_ttl) < 5_000


def test_a_window_as_long_as_the_retention_keeps_its_first_slice(
    spark: Any, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    """At t inside a key's newest slice, a window of the whole retention starts inside the slice
    a retention before it: the store keeps that slice, so the answer has every slice it claims."""
    one_day = {"name": "recent", "key": ["card"], "agg": "count", "slice": "10s", "retention": "1d"}
    p = _pipeline(spark, redis_url, tmp_path, metrics=[one_day], derived=[])
    edge = T0 - 24 * HOUR_MS
    # The newest slice first: the hash then expires by Redis's clock a retention after T0 (up
    # to two hours back), not after the edge.
    _apply(p, spark, [_ev(T0 + 1_000)], 0, ref_ms=T0 + 1_000)
    # Both in the slice a retention before the newest: the first more than a retention before
    # the batch's time, which was an `expired` dead letter when that slice was not kept.
    rec = _apply(p, spark, [_ev(edge + 500), _ev(edge + 5_000)], 1, ref_ms=T0 + 1_000)
    assert rec["dead"] == 0
    assert r.hexists("sluice:s:{recent|c1}", str(edge))
    q = QueryEngine(p.cfg, r, clock=ManualClock(T0 + 5_000))
    answer = q.query("recent", "c1", "1d")
    assert answer["value"] == 3 and answer["covered_start"] == edge
    # An `end` given a moment before now (a client that fixed it before its lookups): the
    # window starts in the same kept slice, so it is answered, not refused as past retention.
    for end in (T0 + 5_000, T0 + 4_950, T0):
        got = q.query("recent", "c1", "1d", end)
        assert (got["value"], got["covered_start"], got["end"]) == (3, edge, end)
    # Ending just before T0's slice, it still starts at the edge; a millisecond earlier, in the
    # slice before the edge, older than the retention kept
    assert q.query("recent", "c1", "1d", T0 - 1)["covered_start"] == edge
    with pytest.raises(BadQuery, match="before the retention of 'recent'"):
        q.query("recent", "c1", "1d", T0 - 2)


def test_an_event_stamped_in_the_future_leaves_the_keys_window_whole(
    spark: Any, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    """An event up to `source.max_future` ahead (a device's clock 30 minutes fast) makes its key's
    newest slice run ahead of now. A window of the whole retention ending now still counts the
    key's events from its start: the key kept them. It trimmed them before, keeping a
    retention before its newest slice only, and answered 1 where 2 is right."""
    hourly = {"name": "hourly", "key": ["card"], "agg": "count", "slice": "10s", "retention": "1h"}
    p = _pipeline(spark, redis_url, tmp_path, metrics=[hourly], derived=[])
    now = time.time_ns() // 1_000_000
    assert p.cfg.source.max_future >= HOUR_MS // 2
    rec = _apply(p, spark, [_ev(now - 50 * 60_000), _ev(now - 1_000)], 0, ref_ms=now)
    assert rec["dead"] == 0
    _apply(p, spark, [_ev(now + 30 * 60_000)], 1, ref_ms=now)
    q = QueryEngine(p.cfg, r, clock=ManualClock(now))
    assert q.query("hourly", "c1", "1h")["value"] == 2
    assert q.query("hourly", "c1", "1h", now + 31 * 60_000)["value"] == 2  # the last 1h, ahead


def test_bad_expired_and_future_events_are_dead_lettered_once(
    spark: Any, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    p = _pipeline(spark, redis_url, tmp_path)
    ref = T0 + 3 * 86_400_000
    events = [
        _ev(ref - 1000),
        {**_ev(ref - 2000), "_err": "bad_type", "_field": "amount", "amount": None},
        _ev(ref - 2 * 86_400_000),  # older than every retention (1d)
        _ev(ref + 2 * 3_600_000),  # further ahead than max_future (1h)
    ]
    rec = _apply(p, spark, events, 0, ref_ms=ref)
    assert rec["events"] == 4
    assert rec["dead"] == 3
    assert rec["dead_by_reason"] == {"bad_type": 1, "expired": 1, "future": 1}
    dead = r.xrange(p.cfg.source.dead_letter_stream)
    reasons = sorted(f[b"reason"].decode() for _, f in dead)
    assert reasons == ["bad_type", "expired", "future"]
    bad = next(f for _, f in dead if f[b"reason"] == b"bad_type")
    assert bad[b"field"] == b"amount" and bad[b"id"]
    _apply(p, spark, events, 0, ref_ms=ref)  # a re-run of the same batch
    assert r.xlen(p.cfg.source.dead_letter_stream) == 3
    q = QueryEngine(p.cfg, r)
    assert q.query("txn_count", "c1", "1d", ref)["value"] == 1


def test_future_and_expired_dead_letters_name_their_log_entries(
    spark: Any, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    """The source's decoder -> the fold -> the dead-letter stream. `future` and `expired` are
    found by the fold's plan, not the decoder; their dead letters still carry their entries'
    ids, as a malformed event's does."""
    p = _pipeline(spark, redis_url, tmp_path)
    ref = T0 + 3 * 86_400_000
    opts = dataclasses.replace(SourceOptions.from_config(p.cfg, redis_url), format="fields")
    times = [ref - 1_000, ref + 2 * HOUR_MS, ref - 2 * 86_400_000]  # good, future, expired
    entries = [
        [f"{T0 + i}-0".encode(), [x for k, v in (("ts", ts), ("card", "c1"), ("merchant", "m1"),
                                                  ("amount", 1.0), ("qty", 1))
                                  for x in (k.encode(), str(v).encode())]]
        for i, ts in enumerate(times)
    ]  # fmt: skip
    table = pa.Table.from_batches(list(Decoder(opts, ref, "events:0").decode(entries)))
    p.clock = ManualClock(ref)
    rec = p.process_batch(explode_updates(spark.createDataFrame(table), p.cfg, list(p.specs)), 0)
    assert rec["dead_by_reason"] == {"future": 1, "expired": 1}
    # The config reads two streams, whose entry ids may repeat: each id says its stream, and
    # the listing (`sluice dead-letters`, /v1/dead-letters) splits it out.
    items = read_dead_letters(r, p.cfg)["items"]
    assert {(i["reason"], i["entry_id"], i["stream"]) for i in items} == {
        ("future", f"events:0@{T0 + 1}-0", "events:0"),
        ("expired", f"events:0@{T0 + 2}-0", "events:0"),
    }
    # A source of one stream names its entries by their ids alone.
    r.delete(p.cfg.source.dead_letter_stream)
    single = dataclasses.replace(opts, log=StreamsSpec(("events",)))
    table = pa.Table.from_batches(list(Decoder(single, ref, "events").decode(entries)))
    p.process_batch(explode_updates(spark.createDataFrame(table), p.cfg, list(p.specs)), 1)
    dead = {f[b"reason"]: f[b"id"] for _, f in r.xrange(p.cfg.source.dead_letter_stream)}
    assert dead == {b"future": f"{T0 + 1}-0".encode(), b"expired": f"{T0 + 2}-0".encode()}


def test_a_value_expression_that_fails_or_is_not_finite_never_fails_the_batch(
    spark: Any, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    """A division by zero in a metric's `value`, or a computed NaN or infinity, is null for that
    metric only: the others count the event. Under Spark's ANSI mode the division failed the
    whole batch, on every retry; the NaN and the infinity were summed, and answered for good.
    A `count` of a string value counts it (it was cast to a number)."""
    with_merchant = {**EXPRESSION_METRICS[0], "name": "with_merchant", "value": "merchant"}
    metrics = [*EXPRESSION_METRICS, with_merchant]
    p = _pipeline(spark, redis_url, tmp_path, metrics=metrics, derived=[])
    events = [
        _ev(T0 + 1_000, amount=9.0, qty=0),  # per_unit: 9 / 0
        _ev(T0 + 2_000, amount=-1.0),  # root: NaN
        _ev(T0 + 3_000, amount=100.0),  # big: infinity
        _ev(T0 + 4_000, amount=4.0, qty=2),
    ]
    rec = _apply(p, spark, events, 0, ref_ms=T0 + 5_000)
    assert rec["dead"] == 0 and rec["events"] == 4
    q = QueryEngine(p.cfg, r)
    assert q.query("txn_count", "c1", "1m", T0 + 9_999)["value"] == 4
    assert q.query("with_merchant", "c1", "1m", T0 + 9_999)["value"] == 4
    assert q.query("per_unit", "c1", "1m", T0 + 9_999)["value"] == -1.0 + 100.0 + 2.0
    assert q.query("root", "c1", "1m", T0 + 9_999)["value"] == 3.0 + 10.0 + 2.0
    assert q.query("big", "c1", "1m", T0 + 9_999)["value"] == 9.0e307


def test_keys_with_separator_and_brace_characters(
    spark: Any, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    p = _pipeline(spark, redis_url, tmp_path)
    tricky = ["a|b", "{x}", "50%", "a%7Cb", "ключ"]
    _apply(p, spark, [_ev(T0 + i, card=c) for i, c in enumerate(tricky)], 0)
    q = QueryEngine(p.cfg, r)
    for c in tricky:
        assert q.query("txn_count", c, "1m", T0 + 59_999)["value"] == 1, c
    assert q.query("pair_count", ["a|b", "m1"], "1h", T0 + 59_999)["value"] == 1
    assert q.query("pair_count", ["a", "b|m1"], "1h", T0 + 59_999)["value"] == 0


def test_a_derived_metric_is_read_from_one_state_while_a_batch_is_written(
    spark: Any, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    """A batch's write takes a pause between its metrics (`PauseBetweenMetrics`): the count of
    each key holds the batch's event while its sum does not yet. A derived ticket = sum / count
    read meanwhile, through the sync and the asyncio paths, answers 10 (before the batch) or 20
    (after it), never the 0, 5 or 40 of a state no stream of events gave; and through the
    server's multiplexed client too."""
    metrics = [
        {"name": "cnt", "key": ["card"], "agg": "count", "slice": "10s", "retention": "1d"},
        {"name": "amt", "key": ["card"], "agg": "sum", "value": "amount", "slice": "10s",
         "retention": "1d"},
    ]  # fmt: skip
    p = _pipeline(spark, redis_url, tmp_path, metrics=metrics,
                  derived=[{"name": "ticket", "expr": "amt / cnt"}])  # fmt: skip
    cards = [f"c{i}" for i in range(20)]
    _apply(p, spark, [_ev(T0 + 1_000, c, amount=10.0) for c in cards], 0)
    q = QueryEngine(p.cfg, r, clock=ManualClock(T0 + 5_000))
    lookups = [q.lookup("ticket", c, "1m") for c in cards]
    assert {a["value"] for a in q.run(lookups)} == {10.0}

    p.writer = PauseBetweenMetrics(1.5)
    writer = threading.Thread(
        target=_apply, args=(p, spark, [_ev(T0 + 2_000, c, amount=30.0) for c in cards], 1)
    )
    seen: dict[str, list[Any]] = {"sync": [], "async": [], "mux": []}
    waited = dict.fromkeys(seen, 0.0)
    where = urlsplit(redis_url)

    async def aread(mux: bool = False) -> list[dict[str, Any]]:
        aclient: Any = (MuxClient(where.hostname or "", where.port or 6379) if mux
                        else redis.asyncio.Redis.from_url(redis_url))  # fmt: skip
        try:
            return await q.arun(lookups, aclient)
        finally:
            await aclient.aclose()

    def reader(how: str) -> None:  # each path reads on its own thread while the batch is written
        while writer.is_alive():
            t0 = time.monotonic()
            got = q.run(lookups) if how == "sync" else asyncio.run(aread(how == "mux"))
            waited[how] = max(waited[how], time.monotonic() - t0)
            seen[how] += [a["value"] for a in got]

    readers = [threading.Thread(target=reader, args=(how,)) for how in seen]
    writer.start()
    for t in readers:
        t.start()
    for t in [writer, *readers]:
        t.join(60)
    for how, values in seen.items():
        assert set(values) <= {10.0, 20.0}, (how, sorted(set(values)))
    assert max(waited.values()) > 0.5  # a read met the pause and waited for the write's end
    assert {a["value"] for a in q.run(lookups)} == {20.0}
    assert {a["value"] for a in asyncio.run(aread())} == {20.0}
    assert {a["value"] for a in asyncio.run(aread(mux=True))} == {20.0}
    assert not r.hgetall(WRITING_KEY) and int(r.get(WRITES_KEY)) % 2 == 0  # every write ended


def test_write_marks_of_several_writers_and_a_failed_one(r: redis.Redis) -> None:
    """Writes in flight are counted per (token, partition): one that ends leaves the others'
    marks; one that fails leaves its own until the batch is written again (`clear`)."""

    def now() -> Any:
        pipe = r.pipeline(transaction=False)
        for command in marks.READ:
            pipe.execute_command(*command)
        return marks.parse(pipe.execute(), time.time_ns() // 1_000_000)

    r.delete(WRITING_KEY, WRITES_KEY)
    with marks.writing(r, 7, "0"):
        assert now()[1] == {b"7:0"}
        with marks.writing(r, 8, "3"):  # another fold's batch, or a deposed leader's
            assert now()[1] == {b"7:0", b"8:3"}
        assert now() == (3, frozenset({b"7:0"}))
    for part in ("1", "2"):
        with pytest.raises(RuntimeError), marks.writing(r, 9, part):
            raise RuntimeError("the task failed mid-write")
    assert now() == (6, frozenset({b"9:1", b"9:2"}))  # half written until written again
    marks.clear(r, 9)
    assert now() == (8, frozenset())  # one count for each mark removed, as a write's end
