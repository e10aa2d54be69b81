"""The Redis Streams source: offsets, admission limits, deterministic replay, both formats,
partition splitting and dead-lettering. Real Redis; the streaming tests run a real Spark query."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pytest
import redis
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

from sluice.config import config_from_dict
from sluice.pipeline.fold import FoldQuery
from sluice.query.engine import QueryEngine
from sluice.redis.connection import RedisHandle
from sluice.redis.embedded import EmbeddedRedis
from sluice.source.options import SourceOptions
from sluice.source.producer import Producer
from sluice.source.reader import FORMAT, START_FILE, LogStreamReader
from tests.conftest import config_data, free_port, make_config

NOW = time.time_ns() // 1_000_000


def _reader(cfg: Any, url: str, **kw: Any) -> LogStreamReader:
    opts = dataclasses.replace(SourceOptions.from_config(cfg, url), **kw)
    return LogStreamReader(opts)


def _read_all(reader: LogStreamReader, start: dict[str, Any], end: dict[str, Any]) -> pa.Table:
    batches = [b for p in reader.partitions(start, end) for b in reader.read(p)]
    return pa.Table.from_batches(batches) if batches else pa.table({})


def _jsonl_entries(r: redis.Redis, stream: str, n_entries: int, per_entry: int, t0: int) -> None:
    for e in range(n_entries):
        lines = [
            orjson.dumps({"ts": t0 + e, "card": f"c{i}", "merchant": "m", "amount": 1.0, "qty": i})
            for i in range(per_entry)
        ]
        r.xadd(stream, {"d": b"\n".join(lines), "n": per_entry})


def test_offsets_and_event_budget(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    cfg = make_config(redis_url, tmp_path)
    reader = _reader(cfg, redis_url)
    start = reader.initialOffset()
    assert start["ids"] == {"events:0": "0-0", "events:1": "0-0"}
    assert reader.latestOffset(start, ReadAllAvailable()) is start  # nothing yet
    for shard in ("events:0", "events:1"):
        _jsonl_entries(r, shard, 10, 100, NOW)
    # 250 events over 2 shards = 125 each: one 100-event entry fits, the second would not.
    end = reader.latestOffset(start, ReadMaxRows(250))
    assert _read_all(reader, start, end).num_rows == 200
    # The first entry is admitted even when it alone is over the budget (no stall).
    small = reader.latestOffset(start, ReadMaxRows(2))
    assert _read_all(reader, start, small).num_rows == 200
    everything = reader.latestOffset(start, ReadAllAvailable())
    assert _read_all(reader, start, everything).num_rows == 2000
    following = reader.latestOffset(end, ReadMaxRows(1000))
    assert _read_all(reader, end, following).num_rows == 1000
    assert reader.getDefaultReadLimit() == ReadMaxRows(cfg.source.max_events_per_batch)


def test_replay_of_a_range_is_deterministic(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    cfg = make_config(redis_url, tmp_path)
    reader = _reader(cfg, redis_url, partition_events=1)
    _jsonl_entries(r, "events:0", 50, 20, NOW)
    start = reader.initialOffset()
    end = reader.latestOffset(start, ReadAllAvailable())
    first = _read_all(reader, start, end)
    _jsonl_entries(r, "events:0", 30, 20, NOW + 100)  # new data beyond `end`
    again = _read_all(reader, start, end)
    assert first.num_rows == 1000
    assert first.equals(again)


def test_large_ranges_split_into_parallel_partitions(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    cfg = make_config(redis_url, tmp_path, source={"shards": 1, "format": "fields"})
    reader = _reader(cfg, redis_url, partition_events=100, max_partitions_per_shard=4)
    producer = Producer(r, "events", 1, "fields")
    for i in range(2000):
        producer.send({"ts": NOW, "card": f"c{i}", "merchant": "m", "amount": 1.0, "qty": i})
        if i % 100 == 0:
            producer.flush()
            time.sleep(0.002)  # spread entry ids over several milliseconds
    producer.flush()
    start = reader.initialOffset()
    end = reader.latestOffset(start, ReadAllAvailable())
    parts = reader.partitions(start, end)
    assert len(parts) == 4
    table = _read_all(reader, start, end)
    assert sorted(table.column("qty").to_pylist()) == list(range(2000))


def test_a_producer_packs_entries_under_the_entry_limit_and_refuses_an_event_over_it(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """Events the producer accepted are never written as one entry over `max_entry_bytes`,
    which the source would dead-letter whole as `oversize_entry` (45 events of 200 KB posted
    at once were lost so, after a 202). An event over the limit alone is refused at `send`."""
    from sluice.errors import BadEvent

    cfg = make_config(redis_url, tmp_path, source={"shards": 1, "max_entry_bytes": "4KB"})
    producer = Producer.from_config(cfg, r, flow=False)
    pad = "p" * 900
    events = [{"ts": NOW, "card": f"c{i}", "merchant": "m", "amount": 1.0, "qty": 1, "pad": pad}
              for i in range(20)]  # fmt: skip
    producer.send_all(events)
    assert producer.flush() == 20
    entries = r.xrange("events")
    assert len(entries) > 1 and sum(int(f[b"n"]) for _, f in entries) == 20
    assert all(sum(len(k) + len(v) for k, v in f.items()) <= 4000 for _, f in entries)
    reader = _reader(cfg, redis_url)
    start = reader.initialOffset()
    rows = _read_all(reader, start, reader.latestOffset(start, ReadAllAvailable())).to_pylist()
    assert len(rows) == 20 and {row["_err"] for row in rows} == {None}, rows[0]
    with pytest.raises(BadEvent, match="over what one log entry may hold"):
        producer.send({**events[0], "pad": "p" * 5000})
    assert producer.pending() == 0
    # `fields`: the size is the UTF-8 bytes the source counts, not characters
    fields = make_config(redis_url, tmp_path / "f", source={"shards": 1, "format": "fields",
                                                            "max_entry_bytes": "4KB"})  # fmt: skip
    with pytest.raises(BadEvent, match="over what one log entry may hold"):
        Producer.from_config(fields, r, flow=False).send({**events[0], "pad": "é" * 2500})


def test_plain_xadd_in_fields_format(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    cfg = make_config(redis_url, tmp_path, source={"shards": 1, "format": "fields"})
    reader = _reader(cfg, redis_url)
    r.xadd("events", {"ts": NOW, "card": "c1", "merchant": "m1", "amount": "12.5", "qty": 3})
    r.xadd("events", {"card": "c2", "merchant": "m1", "amount": "1", "qty": "4", "extra": "x"})
    r.xadd("events", {"ts": "soon", "card": "c3", "merchant": "m1", "amount": "1", "qty": 1})
    start = reader.initialOffset()
    t = _read_all(reader, start, reader.latestOffset(start, ReadAllAvailable())).to_pylist()
    assert [(x["card"], x["amount"], x["qty"], x["_err"]) for x in t[:2]] == [
        ("c1", 12.5, 3, None),
        ("c2", 1.0, 4, None),
    ]
    assert t[0]["_ts"] == NOW
    assert t[1]["_ts"] == t[1]["_ems"]  # no time field: the entry id's time
    assert (t[2]["_err"], t[2]["_field"]) == ("bad_type", "ts")
    assert t[2]["_eid"] and "soon" in t[2]["_raw"]


def test_commit_trims_only_up_to_the_committed_id(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    cfg = make_config(redis_url, tmp_path, source={"shards": 1})
    reader = _reader(cfg, redis_url)
    _jsonl_entries(r, "events", 10, 5, NOW)
    start = reader.initialOffset()
    end = reader.latestOffset(start, ReadMaxRows(20))  # 4 entries
    _jsonl_entries(r, "events", 3, 5, NOW)
    reader.commit(end)
    assert r.xlen("events") == 10 - 4 + 1 + 3  # the committed id itself stays
    assert _read_all(reader, end, reader.latestOffset(end, ReadAllAvailable())).num_rows == 45


@pytest.mark.spark
@pytest.mark.parametrize("fmt", ["jsonl", "fields"])
def test_streaming_query_reads_every_event_within_the_admission_limit(
    fmt: str, spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    cfg = make_config(redis_url, tmp_path, source={"format": fmt, "max_events_per_batch": 300})
    opts = SourceOptions.from_config(cfg, redis_url)
    producer = Producer.from_config(cfg, r, batch_events=50)
    for i in range(1500):
        producer.send(
            {"ts": NOW + i, "card": f"c{i % 7}", "merchant": "m", "amount": 0.5, "qty": i}
        )
    producer.flush()
    name = f"source_{fmt}"
    q = (
        spark.readStream.format(FORMAT)
        .options(**opts.to_spark())
        .load()
        .writeStream.format("memory")
        .queryName(name)
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(processingTime="100 milliseconds")
        .start()
    )
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if spark.table(name).count() >= 1500:
                break
            time.sleep(0.2)
        q.processAllAvailable()
        rows = spark.table(name).select("qty", "_err").collect()
        sizes = [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]
    finally:
        q.stop()
    assert sorted(x["qty"] for x in rows) == list(range(1500))
    assert all(x["_err"] is None for x in rows)
    assert len(sizes) >= 5 and max(sizes) <= 300


@pytest.mark.spark
def test_malformed_entries_are_dead_lettered_and_the_batch_goes_on(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    cfg = make_config(redis_url, tmp_path, source={"shards": 1, "format": "jsonl"})
    good = [orjson.dumps({"ts": NOW, "card": "c1", "merchant": "m1", "amount": 2.0, "qty": 1})] * 3
    r.xadd("events", {"d": b"\n".join(good), "n": 3})
    r.xadd("events", {"d": b'{"ts": 1, "card": "c1"}\nnot json\n[1,2]', "n": 3})
    r.xadd(
        "events",
        {"d": b'{"ts":' + str(NOW).encode() + b',"card":"\xff","merchant":"m","amount":1,"qty":1}'},
    )
    r.xadd("events", {"other": "x"})
    r.xadd(
        "events",
        {
            "d": orjson.dumps(
                {"ts": NOW, "card": "c1", "merchant": "m1", "amount": "lots", "qty": 1}
            )
        },
    )
    pipeline = FoldQuery(cfg, RedisHandle(redis_url), spark)
    pipeline.start()
    try:
        assert pipeline.wait_idle(120)
    finally:
        pipeline.stop()
    dead = r.xrange(cfg.source.dead_letter_stream)
    got = sorted((f[b"reason"].decode(), f[b"field"].decode()) for _, f in dead)
    assert got == sorted(
        [
            ("missing_field", "merchant"),
            ("bad_json", ""),
            ("not_object", ""),
            ("invalid_utf8", ""),
            ("missing_field", "d"),
            ("bad_type", "amount"),
        ]
    )
    assert all(f[b"id"] and f[b"raw"] for _, f in dead)
    assert QueryEngine(cfg, r).query("txn_count", "c1", "1m", NOW)["value"] == 3
    assert r.xlen("events") == 1  # trimmed up to the committed entry


def test_flow_control_falls_back_to_the_static_limit_while_redis_refuses_writes_and_recovers(
    r: redis.Redis,
    redis_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """At `maxmemory` (noeviction) the admission valve cannot publish its state: batches are then
    sized by the static limit, never stopped, and the valve is used again once Redis recovers."""
    import sluice.source.admission as admission_mod

    monkeypatch.setattr(admission_mod, "FLOW_RETRY_S", 0.3)
    cfg = make_config(
        redis_url, tmp_path, source={"max_events_per_batch": 10_000},
        backpressure={"controller": "fixed", "fixed_rate": 1000},
    )  # fmt: skip
    reader = _reader(cfg, redis_url)
    start = reader.initialOffset()
    for shard in ("events:0", "events:1"):
        _jsonl_entries(r, shard, 10, 100, NOW)

    def admitted(end: dict[str, Any]) -> int:
        return sum(end.get("entries", {}).values()) * 100

    old = r.config_get("maxmemory*")
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", 1)
    try:
        # The budget comes from the valve (1000/s over one trigger); publishing it fails.
        first = reader.latestOffset(start, ReadMaxRows(10_000))
        assert admitted(first) == 200 and reader.admission._errors == 1
        # Meanwhile the static limit applies: the rest of the input in one batch.
        rest = reader.latestOffset(start, ReadMaxRows(10_000))
        assert admitted(rest) == 2000
    finally:
        r.config_set("maxmemory", old["maxmemory"])
        r.config_set("maxmemory-policy", old["maxmemory-policy"])
    time.sleep(0.4)
    again = reader.latestOffset(start, ReadMaxRows(10_000))
    assert 0 < admitted(again) < 2000  # the fixed rate's share of a trigger, again
    assert reader.admission._errors == 0
    messages = [m for m in caplog.messages if m.startswith("flow control")]
    assert messages == [
        "flow control failed; admitting with the static limit until it recovers",
        "flow control recovered",
    ]
    failed = next(x for x in caplog.records if x.getMessage().startswith("flow control failed"))
    assert failed.exc_info is not None  # not an outage: the traceback says where it failed


def test_flow_control_says_in_one_line_that_redis_is_down(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every part of the pipeline reports a Redis outage; the admission valve's first failure
    in it is one warning with the error, not a traceback (which a process Spark started would
    print bare, with no time to place it by)."""
    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        reader = _reader(make_config(server.url, tmp_path / "state"), server.url)
        assert reader.admission is not None
        reader.admission.budget()  # the valve is built, on a live Redis
    finally:
        server.stop()
    with caplog.at_level(logging.DEBUG, logger="sluice"):
        assert reader.admission.budget() is None  # the static limit applies meanwhile
    [rec] = [x for x in caplog.records if x.getMessage().startswith("flow control")]
    assert rec.levelname == "WARNING" and rec.exc_info is None
    assert "connect" in rec.__dict__["error"].lower(), rec.__dict__["error"]
    assert reader.admission._errors == 1


def test_start_positions_are_kept_beside_the_checkpoint(redis_url: str, tmp_path: Path) -> None:
    """A re-run first batch starts where the first attempt did, even if the log's start moved:
    the first answer is kept under the checkpoint, written whole, and read back from there."""
    cfg = make_config(redis_url, tmp_path)
    ckpt = tmp_path / "ckpt"
    first = _reader(cfg, redis_url, checkpoint=str(ckpt)).initialOffset()
    assert orjson.loads((ckpt / START_FILE).read_bytes()) == first["ids"]
    assert sorted(p.name for p in ckpt.iterdir()) == [START_FILE]  # no temporary file left
    moved = {"events:0": "5-0", "events:1": "7-0"}  # as if the log's start had moved since
    (ckpt / START_FILE).write_bytes(orjson.dumps(moved))
    assert _reader(cfg, redis_url, checkpoint=str(ckpt)).initialOffset()["ids"] == moved


def test_flow_control_says_in_one_line_that_the_kafka_log_is_out_of_reach(
    redis_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A broker out of reach is reported by the log's state (`waiting_for_log`, its reason);
    the admission valve's failure to measure the log meanwhile is one warning, not a
    traceback."""
    data = config_data(redis_url, tmp_path)
    source = {k: v for k, v in data["source"].items() if k != "shards"}
    nobody = f"127.0.0.1:{free_port()}"  # no broker listens there
    data["source"] = {**source, "kafka": {"bootstrap": nobody, "topic": "payments",
                                          "group_id": "sluice-payments"}}  # fmt: skip
    reader = _reader(config_from_dict(data), redis_url)
    assert reader.admission is not None
    with caplog.at_level(logging.DEBUG, logger="sluice"):
        assert reader.admission.budget() is None  # the static limit applies meanwhile
    [rec] = [x for x in caplog.records if x.getMessage().startswith("flow control")]
    assert rec.levelname == "WARNING" and rec.exc_info is None
    assert f"Kafka at {nobody} does not answer" in rec.__dict__["error"], rec.__dict__["error"]
