"""The XOR completeness audit with real Spark and real Redis: every batch balances; a store
that loses one slice update is caught, and the replay repairs it, in place or after a restart."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.pipeline.behind import logged_batches, read_mark
from sluice.pipeline.fold import FoldQuery
from sluice.pipeline.plan import check_expressions, explode_updates, metric_specs
from sluice.redis.connection import RedisHandle
from sluice.redis.keys import STATS_KEY, slice_hash_key
from sluice.source.decode import spark_schema_ddl
from sluice.source.ids import event_ids, parse_id, xor_all
from sluice.source.options import SourceOptions
from sluice.status.ledger import Ledger
from sluice.status.snapshot import read_status
from sluice.status.views import format_status
from sluice.testing.faults import LoseOne, RemoveFirst
from tests.conftest import make_config

METRICS = [
    {"name": "txn_count", "key": ["card"], "agg": "count", "slice": "10s", "retention": "1d"},
    {"name": "qty_sum", "key": ["merchant"], "agg": "sum", "value": "qty", "slice": "1m",
     "retention": "1d", "filter": "qty > 0"},
    {"name": "card_merchants", "key": ["card"], "agg": "distinct", "value": "merchant",
     "slice": "1m", "retention": "1d"},
]  # fmt: skip


def _cfg(redis_url: str, tmp_path: Path, **kw: Any) -> Any:
    return make_config(redis_url, tmp_path, metrics=METRICS, derived=[], **kw)


def _produce(r: redis.Redis, n_entries: int, per_entry: int, bad_every: int = 0) -> int:
    """jsonl entries over both shards; some lines bad, some blank. Returns the events written.

    The two shards get the same entry ids (`<now>-0`, `<now>-1`, ...), as two shards written in
    the same millisecond do: their events must still have distinct audit ids."""
    now = time.time_ns() // 1_000_000
    events = 0
    for i in range(n_entries):
        lines = []
        for j in range(per_entry):
            if bad_every and (i * per_entry + j) % bad_every == 0:
                lines.append(b"{not json")
            else:
                ev = {"ts": now - j, "card": f"c{j % 37}", "merchant": f"m{j % 5}", "amount": 1.0,
                      "qty": j % 3}  # fmt: skip
                lines.append(orjson.dumps(ev))
            events += 1
        payload = b"\n".join(lines) + b"\n\n   \n"  # trailing blank lines are not events
        r.xadd(f"events:{i % 2}", {"d": payload, "n": per_entry}, id=f"{now}-{i // 2}")
    return events


def _stored_count(r: redis.Redis) -> int:
    total = 0
    for key in r.scan_iter(match="sluice:s:{txn_count|*"):
        for field, value in r.hgetall(key).items():
            if field != b"_m":
                total += int(value.split(b":")[1])
    return total


def _stats(r: redis.Redis) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in r.hgetall(STATS_KEY).items()}


def test_event_ids_agree_between_the_decoder_and_the_audit_script(r: redis.Redis) -> None:
    """The source side reads the stream with a Lua script; the ids must be the decoder's."""
    from sluice.source.decode import Decoder
    from sluice.source.log import Span
    from sluice.source.options import SourceOptions
    from sluice.source.streams import RedisStreamsLog, raw_client, read_range

    ids = [
        r.xadd("events:0", {"d": b'{"ts":1}\n\n{"ts":2}\r\n \t\n{"ts":3}'}),
        r.xadd("events:0", {"d": b""}),
        r.xadd("events:0", {"x": b"no d"}),
        r.xadd("events:0", {"d": b"[1,2]\n{bad"}),
    ]
    cfg = _cfg("redis://unused", Path("."))
    url = f"redis://127.0.0.1:{r.connection_pool.connection_kwargs['port']}"
    opts = SourceOptions.from_config(cfg, url)
    admitted = RedisStreamsLog(opts, r).admitted([Span("events:0", "0-0", ids[-1].decode())])
    x, events, entries = admitted.xor, admitted.events, admitted.entries
    assert (events, entries) == (3 + 1 + 1 + 2, 4)
    decoder = Decoder(opts, 0, "events:0")
    decoded = []
    for chunk in read_range(raw_client(url), "events:0", "0-0", ids[-1].decode()):
        for batch in decoder.decode(chunk):
            decoded += batch.column("_e").to_pylist()
    assert len(decoded) == events
    assert xor_all(decoded) == x
    ms, seq = parse_id(ids[0])
    assert decoded[:3] == event_ids([ms] * 3, [seq] * 3, [0, 1, 2], "events:0").tolist()


def test_fields_ids_agree_between_the_columnar_read_and_the_audit(r: redis.Redis) -> None:
    """`fields`: the batch reads columnar replies, the audit plain ones parsed by hiredis, over
    chunks of both sizes; the ids (and a bad or oversize entry's) must be the same."""
    from sluice.source.log import Span
    from sluice.source.options import SourceOptions
    from sluice.source.streams import RedisStreamsLog

    for i in range(25_000):
        r.xadd("events:0", {"ts": i, "card": f"c{i % 9}", "merchant": "m", "amount": 1.5})
    r.xadd("events:0", {"ts": "x"})
    last = r.xadd("events:0", {"card": "y" * 3000}).decode()
    cfg = _cfg("redis://unused", Path("."), source={"format": "fields", "shards": 1})
    url = f"redis://127.0.0.1:{r.connection_pool.connection_kwargs['port']}"
    opts = dataclasses.replace(SourceOptions.from_config(cfg, url), max_entry_bytes=2000)
    log = RedisStreamsLog(opts, r)
    span = Span("events:0", "0-0", last)
    admitted = log.admitted([span])
    decoded = [e for b in log.read(span, 0) for e in b.column("_e").to_pylist()]
    assert (admitted.events, admitted.entries) == (len(decoded), len(decoded)) == (25_002, 25_002)
    assert xor_all(decoded) == admitted.xor


def test_the_plan_computes_each_audit_id_once_per_event(spark: Any, redis_url: str,
                                                       tmp_path: Path) -> None:  # fmt: skip
    """Each event's update ids are hashed once, however many rows and XORs use them: written
    inline in every row and in `fx`, they were hashed again for each (on six metric groups that
    cost the fold a third of its speed)."""
    cfg = _cfg(redis_url, tmp_path)
    specs = metric_specs(cfg, check_expressions(spark, cfg))
    groups = len({sp.group for sp in specs})
    events = spark.createDataFrame([], spark_schema_ddl(SourceOptions.from_config(cfg, redis_url)))
    plan = explode_updates(events, cfg, specs)._jdf.queryExecution().optimizedPlan().toString()
    assert groups == 3 and plan.count("xxhash64(") == groups + 1  # one per group, one dead


def test_every_batch_balances_and_the_counters_add_up(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    cfg = _cfg(redis_url, tmp_path)
    p = FoldQuery(cfg, RedisHandle(redis_url), spark)
    p.start()
    try:
        sent = 0
        for _ in range(3):
            sent += _produce(r, 20, 50, bad_every=97)
            time.sleep(0.3)
        assert p.wait_idle(120)
    finally:
        p.stop()
    st = _stats(r)
    batches = int(st["batches"])
    assert int(st["audit_ok"]) == batches and "audit_failed" not in st
    assert int(st["events_admitted"]) == int(st["events_in"]) == sent
    assert int(st["events_in"]) == int(st["events_aggregated"]) + int(st["dead_letters"])
    assert int(st["dead_bad_json"]) == int(st["dead_letters"]) > 0
    records = Ledger(r, "events", cfg.audit.ledger_shards).recent(batches - 1, batches)
    assert len(records) == batches and all(rec["ok"] and rec["attempt"] == 1 for rec in records)
    assert sum(rec["events"] for rec in records) == sent


def test_fields_batches_balance_with_the_planners_source_side(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """`fields` under a budget: the planner's walk gives the source side, logged with the
    offsets, and every batch balances against it."""
    src = {"format": "fields", "shards": 1, "max_events_per_batch": 700}
    cfg = _cfg(redis_url, tmp_path, source=src)
    for i in range(3_000):
        r.xadd("events", {"ts": int(time.time() * 1000), "card": f"c{i % 13}", "merchant": "m",
                          "amount": 2.5, "qty": 1})  # fmt: skip
    p = FoldQuery(cfg, RedisHandle(redis_url), spark)
    p.start()
    try:
        assert p.wait_idle(120)
    finally:
        p.stop()
    st = _stats(r)
    assert int(st["batches"]) >= 5 and int(st["audit_ok"]) == int(st["batches"])
    assert int(st["events_admitted"]) == int(st["events_in"]) == 3_000
    logged = [json.loads(f.read_text().splitlines()[2]) for f in
              sorted((tmp_path / "checkpoint" / "offsets").glob("[0-9]*"))]  # fmt: skip
    assert logged and all("admitted" in o for o in logged)


# Written by the batch's Spark tasks, or from the driver behind the next batch (`pipeline.behind`).
WRITES = pytest.mark.parametrize(
    "writes", [{}, {"single_task_events": 0, "write_behind": "on"}], ids=["in-spark", "behind"]
)


@WRITES
def test_a_lost_slice_update_is_caught_and_written_again_in_place(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path, writes: dict[str, Any]
) -> None:
    cfg = _cfg(redis_url, tmp_path, spark=writes)
    sent = _produce(r, 10, 40)
    p = FoldQuery(cfg, RedisHandle(redis_url), spark)
    p.writer = LoseOne(redis_url, f"test:lose-one:{tmp_path.name}")
    p.start()
    try:
        assert p.wait_idle(120)
    finally:
        p.stop()
    ledger = Ledger(r, "events", cfg.audit.ledger_shards)
    failed = ledger.failures()
    assert len(failed) == 1 and failed[0]["residual"] != 0 and failed[0]["attempt"] == 1
    batch = failed[0]["batch"]
    assert ledger.get(batch)["ok"] and ledger.get(batch)["attempt"] == 2
    st = _stats(r)
    assert int(st["audit_failed"]) == 1 and int(st["audit_replays"]) == 1
    assert _stored_count(r) == sent == int(st["events_in"])


@WRITES
def test_a_batch_that_stays_unbalanced_fails_and_is_replayed_after_the_restart(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path, writes: dict[str, Any]
) -> None:
    """No in-place replays: the batch fails, is not committed or trimmed, and the restarted
    query replays it from the offset log; the store ends exact. Written behind, the audit fails
    in the writer thread after Spark committed the batch: the fold stops the query, and the
    restart un-commits the batch and runs it again (`pipeline.behind`)."""
    cfg = _cfg(redis_url, tmp_path, audit={"retries": 0}, spark=writes)
    sent = _produce(r, 10, 40)
    p = FoldQuery(cfg, RedisHandle(redis_url), spark)
    p.writer = LoseOne(redis_url, f"test:lose-one:{tmp_path.name}")
    failures: list[int] = []
    runner = threading.Thread(target=p.run_forever, kwargs={"max_backoff_s": 1.0}, daemon=True)
    runner.start()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            f = Ledger(r, "events", 16).failures()
            if f and not failures:
                failures.append(f[0]["batch"])
                # The failed batch was neither committed nor trimmed: its input is still there.
                assert r.xlen("events:0") + r.xlen("events:1") >= 10
            st = _stats(r)
            if failures and int(st.get("events_in", 0)) >= sent:
                break
            time.sleep(0.2)
    finally:
        p.request_stop()
        runner.join(60)
    st = _stats(r)
    assert failures and int(st["audit_failed"]) == 1
    assert int(st["audit_ok"]) == int(st["batches"])
    assert _stored_count(r) == sent == int(st["events_in"])
    key = slice_hash_key("txn_count", "c0")
    assert r.exists(key)
    assert read_mark(p.ckpt) == logged_batches(p.ckpt, "commits")[-1]  # every batch written


@WRITES
def test_events_that_left_the_log_after_the_plan_are_counted_not_waived(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path, writes: dict[str, Any]
) -> None:
    """An entry deleted after its batch was planned (as a Redis failover that lost acknowledged
    writes deletes it): the batch's planned side holds it, a read of the log no longer does.
    The batch balances over what is left, and the difference is counted as removed, in the
    counters, the ledger and the status view, instead of vanishing from the books."""
    src = {"format": "fields", "shards": 1, "max_events_per_batch": 700}
    cfg = _cfg(redis_url, tmp_path, source=src, spark=writes)
    now = int(time.time() * 1000)
    for i in range(2_000):
        r.xadd("events", {"ts": now, "card": f"c{i % 13}", "merchant": "m", "amount": 1.0,
                          "qty": 1})  # fmt: skip
    p = FoldQuery(cfg, RedisHandle(redis_url), spark)
    p.writer = RemoveFirst(redis_url, f"test:remove-first:{tmp_path.name}", "events")
    runner = threading.Thread(target=p.run_forever, kwargs={"max_backoff_s": 1.0}, daemon=True)
    runner.start()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and int(_stats(r).get("events_in", 0)) < 1_999:
            time.sleep(0.2)
    finally:
        p.request_stop()
        runner.join(60)
    st = _stats(r)
    assert int(st["events_removed"]) == 1
    assert int(st["events_admitted"]) == int(st["events_in"]) == 1_999
    # Written in Spark, the next attempt reads the log again, without the entry. Written behind,
    # it writes the rows the batch read before the entry left (the event did happen); the
    # replay after the restart reads the log without it, and its cells are duplicates.
    assert _stored_count(r) == (2_000 if writes else 1_999)
    assert int(st["audit_ok"]) == int(st["batches"]) and int(st["audit_failed"]) >= 1
    records = Ledger(r, "events", cfg.audit.ledger_shards).recent(int(st["batches"]) - 1, 50)
    assert [rec["removed"] for rec in records if rec["removed"]] == [1]
    text = format_status(read_status(r, cfg, int(time.time() * 1000)))
    assert "removed before read" in text and "1 (left the log" in text


def test_a_deposed_leaders_failed_audit_is_not_recorded(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """A leader paused past its lease resumes mid-batch: the new leader trimmed the input it
    had planned, so its audit cannot balance. That failure is the new term's business, not a
    fault of the store: the old leader stops (LeaseLost) before it records it in the shared
    ledger, counts it in `audit_failed`, or reads the trim as events removed."""
    from concurrent.futures import Future

    from sluice.clock import ManualClock
    from sluice.errors import LeaseLost
    from sluice.pipeline.audit import SourceSide
    from sluice.pipeline.lease import Claim, Lease
    from sluice.source.log import Admitted

    p = FoldQuery(_cfg(redis_url, tmp_path), RedisHandle(redis_url), spark)
    clock = ManualClock(1_000_000)
    old, new = (Lease(r, [Claim(p.name, p.ckpt)], 2_000, clock, host="h", pid=pid)
                for pid in (1, 2))  # fmt: skip
    assert old.try_acquire() is None
    clock.advance(2_001)
    assert new.try_acquire() is None  # the old one's lease lapsed while it was paused
    p.lease = old
    side: Future[SourceSide | None] = Future()
    side.set_result(SourceSide(Admitted(0x1234, 900, 900), 1.0, 0))  # not what it wrote
    with pytest.raises(LeaseLost):
        p._audit(7, 1, side, [])
    assert Ledger(r, "events", 16).get(7) is None and "audit_failed" not in _stats(r)
    p.lease = new  # the leader's own failure is recorded
    assert p._audit(7, 1, side, []) is not None and int(_stats(r)["audit_failed"]) == 1


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.text(alphabet=" \t\r\n\x0b\x0cab{}", max_size=40).map(str.encode),
            st.binary(max_size=40),
        ),
        min_size=1,
        max_size=8,
    ),
    st.booleans(),
)
def test_the_audit_counts_events_exactly_as_the_decoder(
    redis_server: Any, payloads: list[bytes], with_d: bool
) -> None:
    """The audit's own count and `entry_event_count` agree on any payload (blank, \\r, \\x0b,
    binary, over the size limit), on entries read back from Redis as the audit reads them."""
    from sluice.source.decode import entry_event_count
    from sluice.source.streams import raw_client, read_range
    from sluice.source.walk import audit_event_count

    client = redis.Redis.from_url(redis_server.url)
    client.delete("fuzz")
    maps = [({b"d": p} if with_d else {b"x": p}) for p in payloads]
    for m in maps:
        client.xadd("fuzz", m)  # type: ignore[arg-type]
    entries = [e for chunk in read_range(raw_client(redis_server.url), "fuzz", "0-0", "+")
               for e in chunk]  # fmt: skip
    counts = [audit_event_count(e[1], 64) for e in entries]
    assert counts == [entry_event_count(m, "jsonl", 64) for m in maps]
    client.close()


def test_the_audit_count_keeps_the_last_value_of_a_repeated_name(redis_server: Any) -> None:
    """A repeated field name: the last value counts, and only it towards the size limit."""
    from sluice.source.decode import entry_event_count
    from sluice.source.streams import raw_client, read_range
    from sluice.source.walk import audit_event_count

    client = redis.Redis.from_url(redis_server.url)
    client.delete("dup")
    big = b'{"a":1}\n' * 8  # 64 bytes: over the limit of 40 only when counted twice
    client.execute_command("XADD", "dup", "*", "d", big, "d", b'{"a":1}\n \n{"a":2}')
    client.execute_command("XADD", "dup", "*", "d", b"x", "d", big)
    entries = [e for chunk in read_range(raw_client(redis_server.url), "dup", "0-0", "+")
               for e in chunk]  # fmt: skip
    counts = [audit_event_count(e[1], 40) for e in entries]
    last = [{b"d": b'{"a":1}\n \n{"a":2}'}, {b"d": big}]
    assert counts == [2, 1] == [entry_event_count(m, "jsonl", 40) for m in last]
    client.close()
