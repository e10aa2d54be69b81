"""A checkpoint's positions are in one log (`pipeline.query.check_log`): a Kafka checkpoint
read with another topic is refused, since its offsets would skip the new topic's records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.errors import ConfigError
from sluice.graph import KafkaSpec, StreamsSpec
from sluice.pipeline.query import LOG_FILE, check_log
from sluice.source.reader import START_FILE


def kafka(topic: str) -> KafkaSpec:
    return KafkaSpec(bootstrap="127.0.0.1:9092", topic=topic, group_id="sluice")


def planned(ckpt: Path, batch: int = 0) -> None:
    """As Spark's offset log holds a planned batch."""
    (ckpt / "offsets").mkdir(parents=True, exist_ok=True)
    (ckpt / "offsets" / str(batch)).write_text('v1\n{}\n{"offsets": {"0": 136, "1": 76}}\n')


def test_a_checkpoint_keeps_its_topic_and_is_refused_another_once_it_planned(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "checkpoint"
    check_log(ckpt, kafka("payments"))
    assert json.loads((ckpt / LOG_FILE).read_text()) == {"kafka_topic": "payments"}
    planned(ckpt)
    check_log(ckpt, kafka("payments"))  # the same topic: a restart
    with pytest.raises(ConfigError) as e:
        check_log(ckpt, kafka("payments-v2"))
    assert e.value.path == "source.kafka.topic"
    assert "holds offsets in Kafka topic 'payments', not 'payments-v2'" in str(e.value)
    assert "a state_dir of its own" in str(e.value)
    assert json.loads((ckpt / LOG_FILE).read_text()) == {"kafka_topic": "payments"}


def test_a_checkpoint_that_planned_nothing_forgets_the_old_topic_and_its_start(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "checkpoint"
    check_log(ckpt, kafka("nosuch"))
    (ckpt / START_FILE).write_text('{"0": 4100, "1": 3900}')  # `start: latest` in 'nosuch'
    check_log(ckpt, kafka("payments"))
    assert not (ckpt / START_FILE).exists()
    assert json.loads((ckpt / LOG_FILE).read_text()) == {"kafka_topic": "payments"}


def test_a_checkpoint_from_before_the_file_takes_the_config_s_topic(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint"
    planned(ckpt, 7)
    check_log(ckpt, kafka("payments"))
    assert json.loads((ckpt / LOG_FILE).read_text()) == {"kafka_topic": "payments"}


def test_redis_streams_positions_are_per_stream_key_and_need_no_file(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint"
    planned(ckpt)
    check_log(ckpt, StreamsSpec(("events:0", "events:1")))
    assert not (ckpt / LOG_FILE).exists()
