"""Bounded reads of Kafka partitions with confluent-kafka (librdkafka), by explicit assignment.

Sluice never reads through a subscribing group consumer: every read is of a span [lo, hi) of
one partition, assigned at `lo`, and stops at `hi`, so a batch that Spark re-runs reads the same
records. Offsets may have gaps (compacted topics, transaction markers), so a read ends when a
record at or past `hi - 1` arrives, or the partition's end is reported at or past `hi`.

Consumers are kept per process and per configuration (Python workers serve many tasks). A read
that cannot go on (the broker is unreachable, the topic is gone) waits and tries again, calling
`on_wait` with a reason, and never gives up on its own: the records of a logged batch are the
batch, and the pipeline shows that it waits (see `source.reader`). Only the broker's own word
ends a wait short: records below the partition's first offset were deleted (retention), and a
partition that now ends before the span does was truncated or created again; either run is
one `lost` record, which the decoder dead-letters (`lost_records`) and the audit counts alike.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from sluice.graph import KafkaSpec
from sluice.source.log import LogUnavailable

log = logging.getLogger(__name__)

CONSUME_BATCH = 10_000
POLL_S = 0.5
STALL_S = 10.0  # no record and no end-of-partition for this long: report the read as waiting
MAX_BACKOFF_S = 10.0

_consumers: dict[tuple[Any, ...], Any] = {}


def new_consumer(spec: KafkaSpec, role: str) -> Any:
    """A consumer for bounded reads (`role` names its group, which it never joins nor commits
    to: librdkafka needs one)."""
    return Consumer(
        spec.client_config(
            **{
                "group.id": f"{spec.group_id}.{role}",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "enable.partition.eof": True,
                "auto.offset.reset": "error",
                "isolation.level": "read_committed",
                "fetch.wait.max.ms": 100,
                "queued.max.messages.kbytes": 16_384,
            }
        )
    )


def consumer_for(spec: KafkaSpec, role: str) -> Any:
    """This process's kept consumer for `role` (see `new_consumer`)."""
    key = (spec.bootstrap, spec.options, spec.group_id, role)
    c = _consumers.get(key)
    if c is None:
        c = _consumers[key] = new_consumer(spec, role)
    return c


def forget_consumers(spec: KafkaSpec | None = None) -> None:
    """Close this process's consumers (of `spec`; all of them with None)."""
    mine = None if spec is None else (spec.bootstrap, spec.options, spec.group_id)
    for key in [k for k in _consumers if mine is None or k[:3] == mine]:
        c = _consumers.pop(key)
        try:
            c.close()
        except Exception:
            log.debug("consumer close failed", exc_info=True)


def topic_partitions(client: Any, spec: KafkaSpec, timeout_s: float) -> list[int]:
    """The partition ids of `spec.topic`, from the metadata `client` (any librdkafka handle)
    lists. Asks for every topic, not the one: a metadata request naming a topic may create it.
    Raises LogUnavailable: `unreachable`, or `no_topic`."""
    try:
        md = client.list_topics(timeout=timeout_s)
    except Exception as e:  # noqa: BLE001 - librdkafka raises KafkaException for all of it
        raise LogUnavailable(
            "unreachable", f"Kafka at {spec.bootstrap} does not answer: {e}"
        ) from None
    topic = md.topics.get(spec.topic)
    if topic is None or topic.error is not None or not topic.partitions:
        why = f" ({topic.error})" if topic is not None and topic.error is not None else ""
        raise LogUnavailable(
            "no_topic",
            f"Kafka topic {spec.topic!r} does not exist at {spec.bootstrap}{why};"
            " create it, or fix `source.kafka.topic`",
        )
    return sorted(topic.partitions)


@dataclass(frozen=True)
class Records:
    """One chunk of a partition's records, in offset order. `lost`: a run of offsets
    [lost[0], lost[1]) that the broker no longer holds (deleted by retention before they were
    read, or past the end of a partition truncated or created again since the batch was
    planned); then the other lists are empty."""

    values: list[bytes | None]
    offsets: list[int]
    timestamps: list[int]
    lost: tuple[int, int] | None = None


def read_span(
    spec: KafkaSpec,
    partition: int,
    lo: int,
    hi: int,
    role: str,
    on_wait: Callable[[str, str], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    stall_s: float = STALL_S,
    consumer: Any = None,
) -> Iterator[Records]:
    """The records of `partition` with lo <= offset < hi, in chunks. Blocks while the broker
    cannot serve them (see the module docstring). `consumer`: one to use instead of this
    process's kept consumer for `role`."""
    if hi <= lo:
        return
    consumer = consumer if consumer is not None else consumer_for(spec, role)
    pos = lo
    backoff = 0.5
    last_progress = time.monotonic()
    consumer.assign([TopicPartition(spec.topic, partition, pos)])
    while pos < hi:
        fatal: Exception | None = None
        try:
            msgs = consumer.consume(min(CONSUME_BATCH, hi - pos), timeout=POLL_S)
        except KafkaException as e:
            msgs, fatal = [], e
        values: list[bytes | None] = []
        offsets: list[int] = []
        stamps: list[int] = []
        trouble: str | None = None if fatal is None else str(fatal)
        done = False
        lost_to: int | None = None
        for m in msgs:
            err = m.error()
            if err is not None:
                code = err.code()
                if code == KafkaError._PARTITION_EOF:
                    if m.offset() >= hi:
                        done = True
                    continue
                if code == KafkaError._AUTO_OFFSET_RESET:
                    lost_to = _gone_to(consumer, spec.topic, partition, pos, hi)
                    if lost_to is not None:
                        break
                trouble = str(err)
                continue
            off = m.offset()
            if off < pos:
                continue
            if off >= hi:
                done = True
                break
            values.append(m.value())
            offsets.append(off)
            stamps.append(m.timestamp()[1])
            pos = off + 1
            if pos >= hi:
                done = True
                break
        if offsets:
            yield Records(values, offsets, stamps)
            last_progress = time.monotonic()
            backoff = 0.5
        if lost_to is not None:
            # Said once, as one record of its own; the read goes on after the lost run.
            yield Records([], [], [], (pos, lost_to))
            pos = lost_to
            consumer.assign([TopicPartition(spec.topic, partition, pos)])
            last_progress = time.monotonic()
            continue
        if done:
            return
        stalled = time.monotonic() - last_progress > stall_s
        if stalled and (gone := _gone_to(consumer, spec.topic, partition, pos, hi)) is not None:
            yield Records([], [], [], (pos, gone))  # the partition ends before them now
            pos = gone
            if pos >= hi:
                return
            consumer.assign([TopicPartition(spec.topic, partition, pos)])
            last_progress = time.monotonic()
            continue
        if trouble is not None or stalled:
            reason = trouble or f"no record of {spec.topic}:{partition} at {pos} for {stall_s}s"
            if on_wait is not None:
                on_wait("unreachable" if trouble else "stalled", reason)
            log.warning(
                "kafka read waits",
                extra={"topic": spec.topic, "partition": partition, "offset": pos,
                       "reason": reason, "retry_in_s": backoff},
            )  # fmt: skip
            sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)
            last_progress = time.monotonic()
            consumer.assign([TopicPartition(spec.topic, partition, pos)])


def _gone_to(consumer: Any, topic: str, partition: int, pos: int, hi: int) -> int | None:
    """Where the run of records from `pos` that the broker no longer holds ends, or None if
    it holds the record at `pos` (or cannot say now). Deleted by retention: up to the
    partition's first offset. Past its end, where offsets never go back but for a partition
    truncated or a topic created again: to `hi`, the whole rest of the span, since offsets a
    new topic reuses are other records (its plan reads the partition again from its start)."""
    try:
        low, high = consumer.get_watermark_offsets(
            TopicPartition(topic, partition), timeout=5, cached=False
        )
    except Exception:  # noqa: BLE001 - unknown: treated as a transient fault by the caller
        return None
    if low < 0 or high < 0:
        return None
    if high < hi:
        return hi
    if low > pos:
        return min(int(low), hi)
    return None
