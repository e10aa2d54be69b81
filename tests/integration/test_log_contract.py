"""The log contract (`sluice.source.log.Log`), one suite for both logs: Redis Streams on a real
redis-server, and Kafka on a real broker. Every test runs against each.

The contract: spans between positions read exactly their entries, the same ones on every read;
a budget is counted in events; the audit's count and XOR match what the reads decode; the
backlog shrinks as a reader releases; release keeps the slowest reader's position (Redis
trims to it, Kafka commits it to the consumer group)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pyarrow as pa
import pytest
import redis

from sluice.graph import KafkaSpec, StreamsSpec
from sluice.source.ids import xor_all
from sluice.source.log import Log, Span
from sluice.source.logs import open_log
from sluice.source.options import SourceOptions
from sluice.testing.kafka import KafkaBroker
from tests.conftest import wait_until

FIELDS = (("ts", "long", True), ("card", "string", False), ("amount", "double", False))


@dataclass
class Harness:
    """One log with two shards, and a way to append `jsonl` entries to a shard."""

    kind: str
    url: str
    spec: StreamsSpec | KafkaSpec
    client: redis.Redis
    broker: KafkaBroker | None = None
    counter: Iterator[int] = field(default_factory=lambda: itertools.count())
    _producer: Any = None
    opened: list[Log] = field(default_factory=list)  # closed after the test: no commit thread
    # of a Kafka log outlives it (one retrying against a closed Redis logged warnings later)

    def options(self, reader: str = "", readers: tuple[str, ...] = ("",)) -> SourceOptions:
        return SourceOptions(
            url=self.url,
            log=self.spec,
            format="jsonl",
            fields=FIELDS,
            time_field="ts",
            max_events_per_batch=None,
            max_string_bytes=256,
            reader=reader,
            readers={"*": readers},
        )

    def log(self, reader: str = "", readers: tuple[str, ...] = ("",)) -> Log:
        log = open_log(self.options(reader, readers), self.client)
        self.opened.append(log)
        return log

    @property
    def shards(self) -> tuple[str, str]:
        return ("c:0", "c:1") if self.kind == "redis" else ("0", "1")

    def append(self, shard: int, events: int, bad: bool = False) -> None:
        """One entry of `events` events on shard `shard` (one bad line among them if `bad`)."""
        lines = [
            orjson.dumps({"ts": 1_700_000_000_000 + n, "card": f"c{n % 7}", "amount": 1.5})
            for n in itertools.islice(self.counter, events)
        ]
        if bad:
            lines[0] = b"{not json"
        payload = b"\n".join(lines)
        if isinstance(self.spec, StreamsSpec):
            self.client.xadd(self.spec.shards[shard], {"d": payload, "n": events})
        else:
            assert self.broker is not None
            if self._producer is None:
                self._producer = self.broker.producer()
            self._producer.produce(self.spec.topic, payload, partition=shard)
            self._producer.flush(10)


@pytest.fixture(params=["redis", "kafka"])
def h(request: pytest.FixtureRequest, r: redis.Redis, redis_url: str) -> Iterator[Harness]:
    if request.param == "redis":
        harness = Harness("redis", redis_url, StreamsSpec(("c:0", "c:1")), r)
    else:
        broker: KafkaBroker = request.getfixturevalue("kafka_broker")
        topic = request.getfixturevalue("kafka_topic")
        spec = KafkaSpec(broker.bootstrap, topic, "sluice-contract")
        harness = Harness("kafka", redis_url, spec, r, broker)
    yield harness
    for log in harness.opened:
        log.close()


def read(log: Log, spans: list[Span]) -> pa.Table:
    batches = [b for s in spans for b in log.read(s, 0)]
    return pa.Table.from_batches(batches) if batches else pa.table({"_e": [], "_err": []})


def offsets(log: Log, start: dict[str, Any], plan_end: dict[str, Any], first: Any) -> Any:
    """The offset dicts the Spark source logs, for `log.spans`."""
    end = {log.OFFSETS_FIELD: plan_end}
    if first:
        end["from"] = first
    return ({log.OFFSETS_FIELD: start} if start else {}), end


def test_a_span_reads_exactly_its_entries_and_the_same_ones_again(h: Harness) -> None:
    log = h.log()
    start = log.start_positions()
    for i in range(6):
        h.append(i % 2, 10)
    plan = log.plan(start, None, 0)
    a, b = offsets(log, start, plan.end, plan.first)
    spans = log.spans(a, b)
    first = read(log, spans)
    assert first.num_rows == 60 and first.column("_err").null_count == 60
    h.append(0, 10)  # beyond the span: not read
    assert read(log, spans).equals(first)
    # The next plan starts where this one ended: nothing twice, nothing missed.
    nxt = log.plan(plan.end, None, 0)
    a2, b2 = offsets(log, plan.end, nxt.end, nxt.first)
    assert read(log, log.spans(a2, b2)).num_rows == 10


def test_a_span_splits_into_parts_that_cover_it(h: Harness) -> None:
    log = h.log()
    start = log.start_positions()
    for _ in range(8):
        h.append(0, 3)
    plan = log.plan(start, None, 0)
    (span,) = log.spans(*offsets(log, start, plan.end, plan.first))
    parts = log.split(span, 8, 4)
    assert 1 <= len(parts) <= 4
    whole = read(log, [span]).column("_e").to_pylist()
    assert [e for p in parts for e in read(log, [p]).column("_e").to_pylist()] == whole


def test_a_budget_counts_events_and_the_first_entry_always_goes(h: Harness) -> None:
    log = h.log()
    start = log.start_positions()
    for _ in range(5):
        h.append(0, 20)
        h.append(1, 20)
    plan = log.plan(start, 50, 0)  # 25 a shard: one 20-event entry each, the next would not fit
    assert plan.more and plan.events == 40
    assert read(log, log.spans(*offsets(log, start, plan.end, plan.first))).num_rows == 40
    tiny = log.plan(start, 2, 0)  # smaller than an entry: one entry per shard still goes
    assert tiny.events == 40
    rest = log.plan(plan.end, 10_000, 0)
    assert not rest.more and rest.events == 160


def test_the_audit_counts_and_xors_what_the_reads_decode(h: Harness) -> None:
    log = h.log()
    start = log.start_positions()
    for i in range(6):
        h.append(i % 2, 7, bad=(i == 3))
    plan = log.plan(start, None, 0)
    spans = log.spans(*offsets(log, start, plan.end, plan.first))
    decoded = read(log, spans)
    admitted = log.admitted(spans)
    assert (admitted.events, admitted.entries) == (42, 6)
    assert admitted.xor == xor_all(decoded.column("_e").to_pylist())
    assert decoded.column("_err").to_pylist().count("bad_json") == 1


def test_a_budgeted_plan_logs_the_audits_source_side(h: Harness) -> None:
    """A plan that reads entries to count a budget logs the audit's source side of exactly what
    it admitted, the same as reading the spans again, and only for those spans."""
    log = h.log()
    start = log.start_positions()
    for i in range(8):
        h.append(i % 2, 5 + i, bad=(i == 4))
    plan = log.plan(start, 30, 0)  # 15 a shard: not every entry fits
    assert plan.more and plan.admitted is not None
    start_offsets, end = offsets(log, start, plan.end, plan.first)
    end["admitted"] = plan.admitted
    spans = log.spans(start_offsets, end)
    planned = log.planned_source(spans, end)
    assert planned is not None and planned == log.admitted(spans)
    assert planned.xor == xor_all(read(log, spans).column("_e").to_pylist())
    assert planned.events == plan.events
    later = log.plan(plan.end, 10_000, 0)
    more_offsets, more_end = offsets(log, plan.end, later.end, later.first)
    assert log.planned_source(log.spans(more_offsets, more_end), end) is None  # not its spans


def test_the_backlog_shrinks_as_readers_release_and_the_slowest_holds_it(h: Harness) -> None:
    slow = h.log("slow", ("slow", "fast"))
    fast = h.log("fast", ("slow", "fast"))
    start = slow.start_positions()
    for _ in range(4):
        h.append(0, 5)
        h.append(1, 5)
    first = slow.plan(start, 10, 0)  # one entry a shard
    everything = slow.plan(start, None, 0)
    fast.release(everything.end)
    slow.release(first.end)
    assert fast.level("fast").entries == 0 and fast.level("fast").bytes == 0
    assert slow.level("slow").entries == 6  # 3 entries a shard after the first
    assert slow.level().entries == 6 and slow.level().bytes > 0  # the slowest reader's
    slow.release(everything.end)
    assert slow.level().entries == 0
    assert slow.level().bytes == 0  # not the committed entry the stream keeps
    assert slow.level().shards == dict.fromkeys(h.shards, 0)
    if h.kind == "redis":  # trimmed to the slowest reader's committed entry, which stays
        assert [h.client.xlen(s) for s in h.shards] == [1, 1]
    else:  # the group's committed offsets are the slowest reader's
        assert isinstance(h.spec, KafkaSpec)
        want = [everything.end["0"], everything.end["1"]]  # committed by a thread: poll
        wait_until(lambda: _group_offsets(h.spec) == want, 30, "the group's offsets")


def _group_offsets(spec: KafkaSpec) -> list[int]:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": spec.bootstrap, "group.id": spec.group_id})
    try:
        return [tp.offset for tp in c.committed(
            [TopicPartition(spec.topic, p) for p in (0, 1)], timeout=10)]  # fmt: skip
    finally:
        c.close()


def test_release_never_moves_a_position_back(h: Harness) -> None:
    log = h.log()
    start = log.start_positions()
    for _ in range(3):
        h.append(0, 2)
    plan = log.plan(start, None, 0)
    log.release(plan.end)
    log.release(start)  # an older commit, replayed after a restart
    assert log.level().entries == 0
