"""Writing to Kafka through Sluice: the Producer SDK and `POST /v1/events`, on a real broker.

Records are keyed by the first metric's key field, so every event of one key lands in one
partition in the order it was sent; under backpressure (the consumer lag over the high
watermark) the API answers 429 with Retry-After and the SDK blocks, and nothing is lost."""

from __future__ import annotations

import json
import socket
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
import yaml
from click.testing import CliRunner
from confluent_kafka import Consumer, TopicPartition
from fastapi.testclient import TestClient

from sluice.cli import main
from sluice.config import config_from_dict
from sluice.errors import BackpressureError
from sluice.server.app import create_app
from sluice.source.producer import Producer
from sluice.testing.kafka import KafkaBroker
from tests.conftest import config_data, kafka_config

NOW = time.time_ns() // 1_000_000


def _records(broker: KafkaBroker, topic: str, partitions: int = 2) -> list[Any]:
    c = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": "check",
                  "enable.partition.eof": True})  # fmt: skip
    try:
        c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        out, eof = [], set()
        deadline = time.monotonic() + 30
        while len(eof) < partitions and time.monotonic() < deadline:
            for m in c.consume(1000, timeout=0.5):
                if m.error() is None:
                    out.append(m)
                elif m.error().code() == -191:  # _PARTITION_EOF
                    eof.add(m.partition())
        return out
    finally:
        c.close()


def test_the_sdk_writes_one_record_per_event_keyed_so_per_key_order_holds(
    kafka_broker: KafkaBroker, kafka_topic: str, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    cfg = kafka_config(redis_url, tmp_path, kafka_broker, kafka_topic, "json")
    with Producer.from_config(cfg, r, flow=False) as producer:
        for i in range(200):
            # One NaN amount: written as NaN (the non_finite dead letter), keyed all the same;
            # its key was read back with orjson, which refuses NaN, and no flush went through.
            amount = float("nan") if i == 7 else 1.0
            producer.send(
                {"ts": NOW, "card": f"c{i % 9}", "merchant": "m", "amount": amount, "qty": i}
            )
    records = _records(kafka_broker, kafka_topic)
    assert len(records) == 200
    by_key: dict[bytes, list[tuple[int, int]]] = defaultdict(list)
    for m in records:
        ev = json.loads(m.value())
        assert m.key() == ev["card"].encode()
        by_key[m.key()].append((m.partition(), ev["qty"]))
    for key, seen in by_key.items():
        assert len({p for p, _ in seen}) == 1, key  # one partition per key
        assert [q for _, q in seen] == sorted(q for _, q in seen), key  # in send order
    assert int(r.hget("sluice:{stats}", "events_produced")) == 200


def test_a_flush_the_topic_took_is_not_failed_by_redis_so_a_retry_cannot_repeat_it(
    kafka_broker: KafkaBroker, kafka_topic: str, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """The topic took the events, then the input rate's counter could not be written (Redis
    down): the flush succeeds, so nobody sends them again, and the count is added later."""
    cfg = kafka_config(redis_url, tmp_path, kafka_broker, kafka_topic, "json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nothing = s.getsockname()[1]  # a port nothing listens on
    down = redis.Redis(port=nothing, socket_connect_timeout=1)
    producer = Producer.from_config(cfg, down, flow=False)
    for i in range(10):
        producer.send({"ts": NOW, "card": "c1", "merchant": "m", "amount": 1.0, "qty": i})
    assert producer.flush() == 10 and producer.pending() == 0
    assert len(_records(kafka_broker, kafka_topic)) == 10
    producer.client = r  # Redis is back: the next flush adds what was not counted
    producer.send({"ts": NOW, "card": "c1", "merchant": "m", "amount": 1.0, "qty": 10})
    producer.flush()
    assert int(r.hget("sluice:{stats}", "events_produced")) == 11
    assert len(_records(kafka_broker, kafka_topic)) == 11


def test_jsonl_packs_many_events_in_a_record(
    kafka_broker: KafkaBroker, kafka_topic: str, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    cfg = kafka_config(redis_url, tmp_path, kafka_broker, kafka_topic, "jsonl")
    with Producer.from_config(cfg, r, flow=False, batch_events=50) as producer:
        for i in range(300):
            producer.send(
                {"ts": NOW, "card": f"c{i % 9}", "merchant": "m", "amount": 1.0, "qty": i}
            )
    lines = [ln for m in _records(kafka_broker, kafka_topic) for ln in m.value().split(b"\n")]
    assert sorted(orjson.loads(ln)["qty"] for ln in lines) == list(range(300))


def test_post_events_writes_to_the_topic_and_answers_429_while_backpressured(
    kafka_broker: KafkaBroker, kafka_topic: str, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    cfg = kafka_config(
        redis_url, tmp_path, kafka_broker, kafka_topic, "json",
        backpressure={"high_watermark": "2KB", "low_watermark": "1KB", "tick": "50ms"},
    )  # fmt: skip
    body = [{"ts": NOW, "card": f"c{i}", "merchant": "m", "amount": 1.0, "qty": i}
            for i in range(40)]  # fmt: skip
    with TestClient(create_app(cfg, r)) as http:
        assert http.post("/v1/events", json=body).status_code == 202
        assert len(_records(kafka_broker, kafka_topic)) == 40
        # Nothing reads the topic: its lag (about 40 records of ~70 bytes) is over 2 KB.
        time.sleep(0.06)
        resp = http.post("/v1/events", json=body)
        assert resp.status_code == 429, resp.text
        assert int(resp.headers["Retry-After"]) >= 1
        assert resp.json()["error"]["code"] == "backpressure"
    assert len(_records(kafka_broker, kafka_topic)) == 40  # the refused batch was not written
    # The SDK blocks instead, and gives up with BackpressureError after its timeout.
    producer = Producer.from_config(cfg, r, block_timeout_s=0.3)
    producer.send(body[0])
    with pytest.raises(BackpressureError, match=r"not admitted within 0\.3s"):
        producer.flush()
    assert producer.pending() == 1  # kept, not dropped


def test_status_shows_the_lag_per_partition_and_the_group_in_cli_api_and_metrics(
    kafka_broker: KafkaBroker, kafka_topic: str, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    cfg = kafka_config(redis_url, tmp_path, kafka_broker, kafka_topic, "json")
    with Producer.from_config(cfg, r, flow=False) as producer:
        for i in range(7):
            producer.send({"ts": NOW, "card": f"c{i}", "merchant": "m", "amount": 1.0, "qty": i})
    parts = sorted({m.partition() for m in _records(kafka_broker, kafka_topic)})
    data = config_data(redis_url, tmp_path)
    data["source"] = cfg.source.model_dump(by_alias=True, exclude_unset=True)
    path = tmp_path / "sluice.yaml"
    path.write_text(yaml.safe_dump(data))
    assert config_from_dict(data).source.kafka is not None
    out = CliRunner().invoke(main, ["status", "-c", str(path)])
    assert out.exit_code == 0, out.output
    line = next(ln for ln in out.output.splitlines() if ln.startswith("log "))
    assert f"kafka topic {kafka_topic} (group sluice-{kafka_topic})" in line
    assert "lag by partition 0: " in line and "1: " in line
    st = CliRunner().invoke(main, ["status", "-c", str(path), "--json"])
    log = json.loads(st.output)["log"]
    assert log["kind"] == "kafka" and log["state"] == "ok" and sum(log["lag"].values()) == 7
    assert set(parts) <= {int(p) for p in log["lag"]}
    with TestClient(create_app(cfg, r)) as http:
        text = http.get("/metrics").text
    assert f'sluice_kafka_lag_records{{partition="0",topic="{kafka_topic}"}}' in text
    assert "sluice_log_up 1.0" in text
