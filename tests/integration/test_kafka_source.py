"""The Kafka log under a real streaming query: a real broker (tansu), real Spark, real Redis.

Bad records are dead-lettered with their topic, partition and offset while their neighbours
are folded; a broker that cannot be reached, or a topic that does not exist, keeps the pipeline
waiting (shown in status) instead of failing it; partitions that appear are read from their
start."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from pyspark.sql.streaming.datasource import ReadMaxRows

from sluice.pipeline.fold import FoldQuery
from sluice.query.engine import QueryEngine
from sluice.redis.connection import RedisHandle
from sluice.redis.keys import STATS_KEY
from sluice.source.options import SourceOptions
from sluice.source.reader import FORMAT, LogStreamReader
from sluice.status.snapshot import read_status
from sluice.testing.kafka import KafkaBroker
from tests.conftest import free_port, kafka_config, wait_until

pytestmark = pytest.mark.spark
NOW = time.time_ns() // 1_000_000


def _event(i: int, card: str | None = None) -> dict[str, Any]:
    return {"ts": NOW + i, "card": card or f"c{i % 7}", "merchant": "m", "amount": 0.5, "qty": i}


def test_a_streaming_query_reads_a_topic_within_the_admission_limit(
    spark: Any, kafka_broker: KafkaBroker, kafka_topic: str, redis_url: str, tmp_path: Path
) -> None:
    cfg = kafka_config(
        redis_url, tmp_path, kafka_broker, kafka_topic, "json",
        source={"max_events_per_batch": 300},
    )  # fmt: skip
    producer = kafka_broker.producer()
    for i in range(1200):
        producer.produce(kafka_topic, orjson.dumps(_event(i)), partition=i % 2)
    producer.flush(30)
    opts = SourceOptions.from_config(cfg, redis_url)
    q = (
        spark.readStream.format(FORMAT)
        .options(**opts.to_spark())
        .load()
        .writeStream.format("memory")
        .queryName("kafka_json")
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(processingTime="100 milliseconds")
        .start()
    )
    try:
        wait_until(lambda: spark.table("kafka_json").count() >= 1200, 120, "1200 rows")
        q.processAllAvailable()
        rows = spark.table("kafka_json").select("qty", "_err", "_ems").collect()
        sizes = [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]
    finally:
        q.stop()
    assert sorted(x["qty"] for x in rows) == list(range(1200))
    assert all(x["_err"] is None and x["_ems"] > 0 for x in rows)
    assert len(sizes) >= 4 and max(sizes) <= 300


def test_bad_records_are_dead_lettered_with_their_position_and_neighbours_go_on(
    spark: Any,
    kafka_broker: KafkaBroker,
    kafka_topic: str,
    r: redis.Redis,
    redis_url: str,
    tmp_path: Path,
) -> None:
    cfg = kafka_config(
        redis_url, tmp_path, kafka_broker, kafka_topic, "json",
        source={"max_entry_bytes": "1KB"},
    )  # fmt: skip
    bad = [
        b"not json at all",
        orjson.dumps({"ts": NOW, "merchant": "m", "amount": 1.0, "qty": 1}),  # no card
        orjson.dumps({**_event(0), "amount": "lots"}),
        None,  # a tombstone
        orjson.dumps({**_event(0), "merchant": "m" * 2000}),  # over max_entry_bytes
        b'{\n  "ts": %d, "card": "c1", "merchant": "m",\n  "amount": 2.0, "qty": 1\n}' % NOW,
    ]
    producer = kafka_broker.producer()
    for i, value in enumerate(bad):
        producer.produce(kafka_topic, orjson.dumps(_event(i, "c1")), partition=0)
        producer.produce(kafka_topic, value, key=b"k", partition=0)
    producer.flush(30)
    fold = FoldQuery(cfg, RedisHandle(redis_url), spark)
    fold.start()
    try:
        assert fold.wait_idle(120)
    finally:
        fold.stop()
    dead = [{k.decode(): v.decode() for k, v in f.items()}
            for _, f in r.xrange(cfg.source.dead_letter_stream)]  # fmt: skip
    got = sorted((d["reason"], d["field"]) for d in dead)
    assert got == sorted(
        [("bad_json", ""), ("missing_field", "card"), ("bad_type", "amount"),
         ("null_value", ""), ("oversize_entry", "")]
    )  # fmt: skip
    # Each names its record: topic, partition and offset (bad records sit at odd offsets).
    offsets = sorted(int(d["id"].rpartition("@")[2]) for d in dead)
    assert offsets == [1, 3, 5, 7, 9]
    assert all(d["id"].startswith(f"{kafka_topic}:0@") for d in dead)
    # The good records around them, and the pretty-printed one, were folded.
    assert QueryEngine(cfg, r).query("txn_count", "c1", "1h", NOW + 3_600_000)["value"] == 7
    stats = {k.decode(): int(v) for k, v in r.hgetall(STATS_KEY).items() if v.isdigit()}
    assert stats["events_in"] == 12 and stats["dead_letters"] == 5
    assert stats["audit_ok"] == stats["batches"]
    from sluice.status.dead_letters import read_dead_letters

    items = read_dead_letters(r, cfg, 10)["items"]
    assert sorted(it["offset"] for it in items) == [1, 3, 5, 7, 9]
    assert all(it["topic"] == kafka_topic and it["partition"] == 0 for it in items)


def test_start_latest_counts_only_what_came_after_and_every_audit_balances(
    spark: Any,
    kafka_broker: KafkaBroker,
    kafka_topic: str,
    r: redis.Redis,
    redis_url: str,
    tmp_path: Path,
) -> None:
    """`start: latest` on a topic that already holds records: the first batch begins at the
    topic's end, and so does its audit (its source side read from offset 0 before, so batch 0
    never balanced and the pipeline restarted for good)."""
    cfg = kafka_config(redis_url, tmp_path, kafka_broker, kafka_topic, "json",
                       source={"kafka": {"start": "latest"}})  # fmt: skip
    producer = kafka_broker.producer()
    for i in range(60):
        producer.produce(kafka_topic, orjson.dumps(_event(i, "old")), partition=i % 2)
    producer.flush(30)
    fold = FoldQuery(cfg, RedisHandle(redis_url), spark)
    fold.start()
    try:
        assert fold.wait_idle(120)
        for i in range(40):
            producer.produce(kafka_topic, orjson.dumps(_event(i, "new")), partition=i % 2)
        producer.flush(30)
        wait_until(lambda: int(r.hget(STATS_KEY, "events_in") or 0) >= 40, 120, "40 events")
        assert fold.wait_idle(120)
    finally:
        fold.stop()
    engine = QueryEngine(cfg, r)
    assert engine.query("txn_count", "new", "1h", NOW + 3_600_000)["value"] == 40
    assert engine.query("txn_count", "old", "1h", NOW + 3_600_000)["value"] in (0, None)
    stats = {k.decode(): int(v) for k, v in r.hgetall(STATS_KEY).items() if v.isdigit()}
    assert stats["events_in"] == stats["events_admitted"] == 40
    assert stats["audit_ok"] == stats["batches"] and "audit_failed" not in stats


def test_a_span_past_the_partitions_end_is_read_as_lost_not_waited_for(
    kafka_broker: KafkaBroker, kafka_topic: str, redis_url: str, tmp_path: Path
) -> None:
    """A batch planned over records that are gone since (the topic created again, the partition
    truncated): once its read stalls on a partition that ends before the span, the rest is one
    lost run, which the decoder dead-letters. It used to wait for them for ever."""
    from sluice.source.kafka_records import read_span

    cfg = kafka_config(redis_url, tmp_path, kafka_broker, kafka_topic, "json")
    spec = SourceOptions.from_config(cfg, redis_url).log
    producer = kafka_broker.producer()
    for i in range(5):
        producer.produce(kafka_topic, orjson.dumps(_event(i)), partition=0)
    producer.flush(30)

    def read(lo: int, hi: int) -> list[Any]:
        out: list[Any] = []
        for recs in read_span(spec, 0, lo, hi, "test", stall_s=0.5, sleep=lambda _: None):
            out += [("lost", recs.lost)] if recs.lost else recs.offsets
        return out

    assert read(3, 9) == [3, 4, ("lost", (5, 9))]
    assert read(7, 9) == [("lost", (7, 9))]
    assert read(0, 5) == [0, 1, 2, 3, 4]  # a span the partition holds is read whole


def test_an_unreachable_broker_keeps_the_pipeline_waiting_and_it_goes_on_when_it_is_back(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    port = free_port()
    broker = KafkaBroker(tmp_path / "broker.log", port=port)
    cfg = kafka_config(redis_url, tmp_path, broker, "later", "json")
    fold = FoldQuery(cfg, RedisHandle(redis_url), spark)
    runner = __import__("threading").Thread(target=fold.run_forever, daemon=True)
    runner.start()
    try:
        # Nothing listens: the source waits, and status says so; the query does not fail.
        wait_until(lambda: read_status(r, cfg, NOW)["log"]["state"] == "waiting", 90, "waiting")
        t0 = time.monotonic()
        st = read_status(r, cfg, time.time_ns() // 1_000_000)
        assert read_status(r, cfg, NOW)["log"]["reason"] == "unreachable"
        # Each look at the broker waits 5 s for it; the status views do not ask it again
        # for 10 s after it failed, so these two looks did not wait at all.
        assert time.monotonic() - t0 < 5.0
        assert st["log"]["reason"] == "unreachable"
        assert st["pipeline"]["state"] in ("waiting_for_log", "starting")
        time.sleep(2)
        assert int(r.hget("sluice:{stats}:health", "restarts") or 0) == 0
        # The broker comes up, but the topic does not exist yet: still waiting, for the topic.
        broker.start()
        wait_until(
            lambda: read_status(r, cfg, NOW)["log"].get("reason") == "no_topic", 60, "no_topic"
        )
        broker.create_topic("later", partitions=2)
        producer = broker.producer()
        for i in range(50):
            producer.produce("later", orjson.dumps(_event(i)), partition=i % 2)
        producer.flush(30)
        wait_until(lambda: int(r.hget(STATS_KEY, "events_in") or 0) == 50, 120, "50 events folded")
        wait_until(lambda: read_status(r, cfg, NOW)["log"]["state"] == "ok", 30, "the log ok")
        assert int(r.hget("sluice:{stats}:health", "restarts") or 0) == 0
    finally:
        fold.request_stop()
        runner.join(60)
        broker.stop()


def test_partitions_that_appear_are_read_from_their_start(
    kafka_broker: KafkaBroker, kafka_topic: str, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """This broker cannot add partitions to a topic (no CreatePartitions), so the topic is
    deleted and created again with three: partition 2 is new, and 0 and 1 went back to offset
    0. Both are read from their start, and the batch's offsets say so (`from`)."""
    cfg = kafka_config(redis_url, tmp_path, kafka_broker, kafka_topic, "json")
    reader = LogStreamReader(SourceOptions.from_config(cfg, redis_url))
    producer = kafka_broker.producer()
    for i in range(6):
        producer.produce(kafka_topic, orjson.dumps(_event(i)), partition=i % 2)
    producer.flush(30)
    start = reader.initialOffset()
    first = reader.latestOffset(start, ReadMaxRows(1000))
    assert first["offsets"] == {"0": 3, "1": 3}
    kafka_broker.delete_topic(kafka_topic)
    kafka_broker.create_topic(kafka_topic, partitions=3)
    producer = kafka_broker.producer()  # a new one: the old one knows of two partitions only
    for i in range(6):
        producer.produce(kafka_topic, orjson.dumps(_event(i)), partition=i % 3)
    producer.flush(30)
    time.sleep(5.5)  # the partition list is cached for 5 s
    second = reader.latestOffset(first, ReadMaxRows(1000))
    assert second["offsets"] == {"0": 2, "1": 2, "2": 2}
    assert second["from"] == {"0": 0, "1": 0, "2": 0}
    spans = reader.log.spans(first, second)
    assert sorted((s.shard, s.lo, s.hi) for s in spans) == [("0", 0, 2), ("1", 0, 2), ("2", 0, 2)]
    rows = [row for p in reader.partitions(first, second) for b in reader.read(p)
            for row in b.to_pylist()]  # fmt: skip
    assert len(rows) == 6 and all(row["_err"] is None for row in rows)


def test_a_topic_deleted_while_running_is_waited_for_and_read_again_once_back(
    spark: Any,
    kafka_broker: KafkaBroker,
    kafka_topic: str,
    r: redis.Redis,
    redis_url: str,
    tmp_path: Path,
) -> None:
    """The topic goes away under a running pipeline: status says it waits for the topic, the
    query does not crash-loop, and once the topic is back (created again, offsets from 0) its
    records are read from the start."""
    cfg = kafka_config(redis_url, tmp_path, kafka_broker, kafka_topic, "json")
    fold = FoldQuery(cfg, RedisHandle(redis_url), spark)
    runner = __import__("threading").Thread(target=fold.run_forever, daemon=True)
    producer = kafka_broker.producer()
    for i in range(20):
        producer.produce(kafka_topic, orjson.dumps(_event(i)), partition=i % 2)
    producer.flush(30)
    runner.start()
    try:
        wait_until(lambda: int(r.hget(STATS_KEY, "events_in") or 0) == 20, 120, "20 events")
        kafka_broker.delete_topic(kafka_topic)
        wait_until(
            lambda: read_status(r, cfg, NOW)["log"].get("reason") == "no_topic", 60, "no_topic"
        )
        assert read_status(r, cfg, time.time_ns() // 1_000_000)["pipeline"]["state"] in (
            "waiting_for_log", "restarting", "running"
        )  # fmt: skip
        kafka_broker.create_topic(kafka_topic, partitions=2)
        producer = kafka_broker.producer()
        for i in range(10):
            producer.produce(kafka_topic, orjson.dumps(_event(i)), partition=i % 2)
        producer.flush(30)
        wait_until(lambda: int(r.hget(STATS_KEY, "events_in") or 0) == 30, 180, "10 more")
        wait_until(lambda: read_status(r, cfg, NOW)["log"]["state"] == "ok", 30, "the log ok")
        restarts = int(r.hget("sluice:{stats}:health", "restarts") or 0)
        assert restarts <= 2, f"{restarts} restarts: a crash loop"
    finally:
        fold.request_stop()
        runner.join(60)
