"""End to end on Kafka: a real broker (tansu), real Spark, real Redis, real HTTP.

- The oracle: 300k seeded events (Zipf keys, late arrivals, malformed records) produced to a
  topic with the Producer SDK, every aggregation checked against DuckDB; once drained, the
  consumer group's committed offsets are the partitions' end offsets and the lag is 0.
- `sluice run` killed with SIGKILL twice under load: nothing lost, nothing counted twice,
  every batch audited.
- A stage that reads the topic and writes a Redis stream that metrics fold.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from confluent_kafka import Consumer, TopicPartition

from sluice.pipeline.fold import FoldQuery
from sluice.pipeline.run import Pipeline
from sluice.query.engine import QueryEngine
from sluice.redis.connection import RedisHandle
from sluice.redis.keys import STATS_KEY
from sluice.source.loadgen import produce_frame
from sluice.source.producer import Producer
from sluice.testing.kafka import TEST_PRODUCER_OPTIONS, KafkaBroker
from tests.conftest import config_data, kafka_config, wait_until
from tests.e2e.test_crash import SteadyProducer, crash_run
from tests.e2e.test_oracle import check_answers, make_events

pytestmark = [pytest.mark.spark, pytest.mark.slow]
SLUICE = [sys.executable, "-m", "sluice.cli"]
MALFORMED = [
    b'{"ts": %d, "card": "card-1", "merchant": "m-1", "amount": "x", "qty": 1}',
    b"not json at all",
    b'["an", "array"]',
    b'{"ts": %d, "merchant": "m-1", "amount": 1.0, "qty": 1}',
]


def _group_offsets(broker: KafkaBroker, topic: str, group: str, parts: int) -> list[int]:
    c = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": group})
    try:
        got = c.committed([TopicPartition(topic, p) for p in range(parts)], timeout=10)
        return [tp.offset for tp in got]
    finally:
        c.close()


def _end_offsets(broker: KafkaBroker, topic: str, parts: int) -> list[int]:
    c = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": "ends"})
    try:
        return [c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                for p in range(parts)]  # fmt: skip
    finally:
        c.close()


def test_random_queries_match_the_reference_on_kafka(
    spark: Any, kafka_broker: KafkaBroker, kafka_topic: str, r: redis.Redis, redis_url: str,
    tmp_path: Path,
) -> None:  # fmt: skip
    cfg = kafka_config(
        redis_url, tmp_path, kafka_broker, kafka_topic, "jsonl",
        source={"max_events_per_batch": 200_000},
    )  # fmt: skip
    now = time.time_ns() // 1_000_000
    events = make_events(now)
    producer = Producer.from_config(cfg, r, flow=False, batch_events=500)
    for start in range(0, len(events), 20_000):
        produce_frame(producer, events.iloc[start : start + 20_000], producer.shard_by)
    raw = kafka_broker.producer()
    bad = b"\n".join(line % now if b"%d" in line else line for line in MALFORMED)
    for _ in range(10):
        raw.produce(kafka_topic, bad, partition=0)
    raw.flush(30)
    fold = FoldQuery(cfg, RedisHandle(redis_url), spark)
    fold.start()
    try:
        assert fold.wait_idle(600), "the pipeline did not drain the topic"
    finally:
        fold.stop()
    status = check_answers(cfg, r, events, now)
    # Kafka's own view: the group committed everything, and Sluice shows no lag.
    assert cfg.source.kafka is not None
    group = cfg.source.kafka.group_id
    ends = _end_offsets(kafka_broker, kafka_topic, 2)
    assert _group_offsets(kafka_broker, kafka_topic, group, 2) == ends
    assert status["log"]["kind"] == "kafka" and status["log"]["state"] == "ok"
    assert status["log"]["lag"] == {"0": 0, "1": 0}
    assert status["counters"]["audit_ok"] == status["counters"]["batches"]


class KafkaProducerThread(SteadyProducer):
    """The steady producer's records, jsonl, on the topic's two partitions."""

    def __init__(self, broker: KafkaBroker, topic: str) -> None:
        super().__init__(None)
        self.producer = broker.producer()
        self.topic = topic

    def send(self, i: int, payload: bytes, n: int) -> bool:
        done: list[Any] = []
        self.producer.produce(
            self.topic, payload, partition=(i // 50) % 2,
            on_delivery=lambda err, _m, done=done: done.append(err),
        )  # fmt: skip
        self.producer.flush(30)
        return done == [None]


def test_repeated_sigkills_under_load_on_kafka_lose_nothing_and_count_nothing_twice(
    kafka_broker: KafkaBroker, kafka_topic: str, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    data = config_data(
        redis_url, tmp_path / "state",
        metrics=[
            {"name": "txn_count", "key": ["card"], "agg": "count", "slice": "10s",
             "retention": "1d"},
            {"name": "qty_sum", "key": ["merchant"], "agg": "sum", "value": "qty",
             "slice": "1m", "retention": "1d"},
        ],
        derived=[],
    )  # fmt: skip
    data["source"].pop("shards")
    data["source"]["kafka"] = {
        "bootstrap": kafka_broker.bootstrap, "topic": kafka_topic,
        "group_id": "sluice-crash", "producer_options": dict(TEST_PRODUCER_OPTIONS),
    }  # fmt: skip
    cfg = tmp_path / "sluice.yaml"
    cfg.write_text(yaml.safe_dump(data))
    producer = KafkaProducerThread(kafka_broker, kafka_topic)
    crash_run(r, cfg, tmp_path / "state" / "checkpoint", random.Random(20261124), producer,
              tmp_path)  # fmt: skip


def test_a_stage_reads_the_topic_and_its_output_is_folded(
    spark: Any, kafka_broker: KafkaBroker, kafka_topic: str, r: redis.Redis, redis_url: str,
    tmp_path: Path,
) -> None:  # fmt: skip
    cfg = kafka_config(
        redis_url, tmp_path, kafka_broker, kafka_topic, "json",
        stages=[{"name": "big", "from": "events", "sql": "SELECT * FROM input WHERE qty >= 50",
                 "to": {"stream": "big", "shards": 2}}],
        metrics=[
            {"name": "txn_count", "key": ["card"], "agg": "count", "slice": "10s",
             "retention": "1d"},
            {"name": "big_count", "key": ["card"], "agg": "count", "slice": "10s",
             "retention": "1d", "from": "big"},
        ],
        derived=[],
    )  # fmt: skip
    now = time.time_ns() // 1_000_000
    with Producer.from_config(cfg, r, flow=False) as producer:
        for i in range(400):
            producer.send({"ts": now, "card": f"c{i % 4}", "merchant": "m", "amount": 1.0,
                           "qty": i % 100})  # fmt: skip
    assert cfg.source.kafka is not None
    group = cfg.source.kafka.group_id
    run = Pipeline(cfg, RedisHandle(redis_url), spark)
    runner = threading.Thread(target=run.run_forever, daemon=True)
    runner.start()
    try:
        wait_until(
            lambda: int(r.hget("sluice:{stats:fold:big}", "events_in") or 0) == 200
            and int(r.hget(STATS_KEY, "events_in") or 0) == 400,
            240, "both folds",
        )  # fmt: skip
        # Two readers of the topic: the group holds the slower one's offsets; both finish.
        ends = _end_offsets(kafka_broker, kafka_topic, 2)
        wait_until(
            lambda: _group_offsets(kafka_broker, kafka_topic, group, 2) == ends,
            30, "the group's offsets to reach the end",
        )  # fmt: skip
    finally:
        run.request_stop()
        runner.join(60)
    engine = QueryEngine(cfg, r)
    for k in range(4):
        big = sum(1 for i in range(400) if i % 4 == k and i % 100 >= 50)
        assert engine.query("txn_count", f"c{k}", "1h", now + 1)["value"] == 100
        assert engine.query("big_count", f"c{k}", "1h", now + 1)["value"] == big
