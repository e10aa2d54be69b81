"""The Kafka log: the partitions of one topic are the shards, positions are offsets.

A position is the offset of the next record, so a span [lo, hi) holds the records with
lo <= offset < hi (offsets may have gaps: compaction, transaction markers). End offsets are the
last stable offsets (read_committed), so an open transaction's records wait until it commits.

- Partitions are read from the topic's metadata (refreshed every `METADATA_TTL_S`); one that
  appears while the pipeline runs is read from its earliest offset. When a partition's end
  falls behind the position Sluice holds (the topic was deleted and created again), it is read
  again from its earliest offset, and a warning says so. Both are logged in the batch's offsets
  (`"from"`), so a re-run reads the same records.
- Budgets count events: a `json` record is one; `jsonl` records are read on the driver to count
  their lines (`values.record_event_count`), as the Redis log's planner counts its entries'.
- The audit's source side: a `jsonl` plan computes it from the records it reads to count the
  budget, and logs it with the offsets (`Log.planned_source`); otherwise (`json`, or a batch
  without a budget) the audit reads the batch's spans again, on the driver, with its own
  consumer. Either read is the planner's or the audit's own, not the batch's.
- After a batch commits, this reader's positions are kept in Redis (`sluice:rd:{kafka:...}`,
  per partition), and the smallest over the topic's readers is committed to `group_id`: Kafka's
  own lag tools (kafka-consumer-groups, Burrow, exporters) then show Sluice as a consumer. The
  commits run on a thread of their own, retried with a backoff, and each checks the smallest
  again after it lands (`source.kafka_commits`): a batch never waits on the coordinator.
- Kafka does not report a lag in bytes, so the backlog's bytes are the lag in records times the
  mean record size Sluice has read (`bytes_estimated`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
from confluent_kafka import Consumer, IsolationLevel, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from sluice.graph import KafkaSpec
from sluice.redis.connection import client_for
from sluice.redis.keys import shard_side_key
from sluice.redis.scripts import RELEASE_OFFSET, evalsha_on, execute_loading
from sluice.source.decode import Decoder
from sluice.source.ids import event_ids, xor_all
from sluice.source.kafka_commits import COMMIT_TIMEOUT_S, Committer
from sluice.source.kafka_records import (
    Records,
    forget_consumers,
    new_consumer,
    read_span,
    topic_partitions,
)
from sluice.source.log import (
    Admitted,
    Backlog,
    Log,
    LogUnavailable,
    Plan,
    Position,
    Span,
    spread_budget,
)
from sluice.source.options import SourceOptions
from sluice.source.values import record_event_count

log = logging.getLogger(__name__)

METADATA_TTL_S = 5.0
REQUEST_TIMEOUT_S = 5.0
SAMPLE_RECORDS = 32
RECORD_BYTES_TTL_S = 30.0


def shard_name(topic: str, partition: str | int) -> str:
    """A partition's name in event ids and reader keys: `<topic>:<partition>`."""
    return f"{topic}:{partition}"


def reader_hash(topic: str, partition: str | int) -> str:
    """The Redis hash of one partition's reader positions (reader name -> offset)."""
    return shard_side_key("rd", f"kafka:{shard_name(topic, partition)}")


class KafkaLog(Log):
    OFFSETS_FIELD = "offsets"
    kind = "kafka"
    origin: ClassVar[Any] = 0

    def __init__(
        self, opts: SourceOptions, client: Any = None, commit_timeout_s: float = COMMIT_TIMEOUT_S
    ) -> None:
        if not isinstance(opts.log, KafkaSpec):
            raise TypeError("KafkaLog needs a KafkaSpec")
        self.opts = opts
        self.spec: KafkaSpec = opts.log
        self.commit_timeout_s = commit_timeout_s
        self._admin: Any = None
        self._lookup: Any = None  # reads the group's offsets; never commits
        self._commits: Committer | None = None
        self._redis: Any = client
        self._parts: tuple[float, list[int]] | None = None
        self._released: set[str] = set()  # the partitions this reader released, for the commits
        self._record_bytes: tuple[float, float] | None = None  # (mean bytes, when measured)

    def __getstate__(self) -> dict[str, Any]:
        """Plain options only: clients and threads are made anew where the log is unpickled."""
        return {**self.__dict__, "_admin": None, "_lookup": None, "_commits": None, "_redis": None}

    @staticmethod
    def before(a: Position, b: Position) -> bool:
        return int(a) < int(b)

    # -- clients ------------------------------------------------------------------------------

    def _admin_client(self) -> Any:
        if self._admin is None:
            self._admin = AdminClient(self.spec.client_config())
        return self._admin

    def _client(self) -> Any:
        if self._redis is None:
            self._redis = client_for(self.opts.url, timeout_s=30, connect_timeout_s=10)
        return self._redis

    def partitions(self) -> list[int]:
        """The topic's partition ids (cached for METADATA_TTL_S). Raises LogUnavailable."""
        now = time.monotonic()
        if self._parts is not None and now - self._parts[0] < METADATA_TTL_S:
            return self._parts[1]
        try:
            parts = topic_partitions(self._admin_client(), self.spec, REQUEST_TIMEOUT_S)
        except LogUnavailable as e:
            if e.reason == "no_topic":
                # Kept consumers know the topic: let them go before it may be created again.
                forget_consumers(self.spec)
            raise
        self._parts = (now, parts)
        return parts

    def offsets(self, parts: list[int], which: str) -> dict[int, int]:
        """The earliest or latest (last stable) offset of each partition. Raises
        LogUnavailable."""
        if not parts:
            return {}
        want = OffsetSpec.latest() if which == "latest" else OffsetSpec.earliest()
        req = {TopicPartition(self.spec.topic, p): want for p in parts}
        try:
            futures = self._admin_client().list_offsets(
                req,
                isolation_level=IsolationLevel.READ_COMMITTED,
                request_timeout=REQUEST_TIMEOUT_S,
            )
            return {tp.partition: int(f.result().offset) for tp, f in futures.items()}
        except Exception as e:  # noqa: BLE001 - librdkafka raises KafkaException for all of it
            self._parts = None  # the partitions may have changed: look again next time
            raise LogUnavailable(
                "unreachable", f"Kafka offsets of {self.spec.topic!r} not available: {e}"
            ) from None

    # -- planning ---------------------------------------------------------------------------

    def start_positions(self) -> dict[str, Position]:
        parts = self.partitions()
        return {str(p): o for p, o in self.offsets(parts, self.spec.start).items()}

    def plan(self, start: Mapping[str, Position], budget: int | None, ref_ms: int) -> Plan:
        parts = self.partitions()
        ends = self.offsets(parts, "latest")
        fresh = [p for p in parts if str(p) not in start or ends[p] < int(start[str(p)])]
        lows = self.offsets(fresh, "earliest")
        lo: dict[str, int] = {s: int(v) for s, v in start.items()}
        first: dict[str, int] = {}
        if any(str(p) in start for p in fresh):
            forget_consumers(self.spec)  # the topic was created again (see `partitions`)
        for p in fresh:
            s = str(p)
            if s in start:
                log.warning(
                    "kafka offsets went back; reading the partition again from its start",
                    extra={"topic": self.spec.topic, "partition": p, "held": start[s],
                           "end": ends[p], "from": lows[p]},
                )  # fmt: skip
            lo[s] = first[s] = lows[p]
        hi = {str(p): max(ends[p], lo[str(p)]) for p in parts}
        end = {**lo, **hi}  # a partition missing from the metadata keeps its position
        if budget is None:
            return Plan(end, first, None, 0, False, ref_ms)
        cur = dict(lo)
        read: dict[str, Admitted] = {}

        def take(shard: str, share: int, first_round: bool) -> tuple[int, bool]:
            n, pos, more, got = self._take(shard, cur[shard], hi[shard], share, first_round)
            cur[shard] = pos
            was = read.get(shard, Admitted(0, 0, 0))
            read[shard] = Admitted(was.xor ^ got.xor, was.events + got.events,
                                   was.entries + got.entries)  # fmt: skip
            return n, more

        events, wanting = spread_budget(budget, list(hi), take)
        entries = {s: cur[s] - lo[s] for s in hi}
        admitted = None
        if self.opts.format == "jsonl":  # what the takes read: [lo, hi, xor, events, records]
            admitted = {s: [lo[s], cur[s], f"{a.xor:016x}", a.events, a.entries]
                        for s, a in read.items() if a.events}  # fmt: skip
        return Plan({**lo, **cur}, first, entries, events, bool(wanting), ref_ms, admitted)

    def _take(
        self, shard: str, pos: int, hi: int, share: int, force_first: bool
    ) -> tuple[int, int, bool, Admitted]:
        """Advance one partition from `pos` by at most `share` events: (events, new position,
        whether records are left, the audit's source side of the records taken)."""
        none = Admitted(0, 0, 0)
        if pos >= hi:
            return 0, pos, False, none
        if self.opts.format == "json":  # one event per record; gaps only lower the count
            n = min(share, hi - pos)
            return n, pos + n, pos + n < hi, none
        events = acc = records = 0
        salt = shard_name(self.spec.topic, shard)
        for recs in read_span(self.spec, int(shard), pos, hi, "planner"):
            if recs.lost is not None:
                events, pos = events + 1, recs.lost[1]
                acc ^= xor_all(event_ids([recs.lost[0]], [0], [0], salt))
                continue
            self._observe_sizes(recs)
            counts: list[int] = []
            stop = False
            for value, off in zip(recs.values, recs.offsets, strict=True):
                n = record_event_count(value, "jsonl", self.opts.max_entry_bytes)
                if events + n > share and (events > 0 or not force_first):
                    stop = True
                    break
                counts.append(n)
                events += n
                pos = off + 1
            acc ^= _records_xor(recs.offsets[: len(counts)], counts, salt)
            records += len(counts)
            if stop:
                return events, pos, True, Admitted(acc, events, records)
            if events >= share:
                break
        return events, pos, pos < hi, Admitted(acc, events, records)

    def split(self, span: Span, entries: int | None, parts: int) -> list[Span]:
        lo, hi = int(span.lo), int(span.hi)
        k = max(1, min(parts, hi - lo))
        cuts = [lo + (hi - lo) * i // k for i in range(k + 1)]
        return [Span(span.shard, a, b) for a, b in itertools.pairwise(cuts) if b > a]

    def count_entries(self, span: Span) -> int:
        return max(0, int(span.hi) - int(span.lo))

    # -- the audit's source side --------------------------------------------------------------

    def admitted(self, spans: list[Span]) -> Admitted:
        """Reads with a consumer of its own, closed when done: this runs in the driver's main
        process, which an idle consumer of a topic deleted meanwhile could take down (seen with
        librdkafka against the test broker)."""
        consumer = new_consumer(self.spec, "audit")
        try:
            return self._admitted(spans, consumer)
        finally:
            consumer.close()

    def _admitted(self, spans: list[Span], consumer: Any) -> Admitted:
        acc = events = entries = 0
        fmt = self.opts.format
        for span in spans:
            salt = shard_name(self.spec.topic, span.shard)
            lo, hi = int(span.lo), int(span.hi)
            for recs in read_span(self.spec, int(span.shard), lo, hi, "audit", consumer=consumer):
                if recs.lost is not None:
                    acc ^= xor_all(event_ids([recs.lost[0]], [0], [0], salt))
                    events += 1
                    continue
                self._observe_sizes(recs)
                counts = [record_event_count(v, fmt, self.opts.max_entry_bytes)
                          for v in recs.values]  # fmt: skip
                acc ^= _records_xor(recs.offsets, counts, salt)
                events += sum(counts)
                entries += len(recs.offsets)
        return Admitted(acc, events, entries)

    # -- backlog ------------------------------------------------------------------------------

    def positions(self, parts: list[int]) -> list[dict[str, int]]:
        """Every reader's committed offset, per partition (from Redis)."""
        pipe = self._client().pipeline(transaction=False)
        for p in parts:
            pipe.hgetall(reader_hash(self.spec.topic, p))
        return [{k.decode(): int(v) for k, v in rd.items()} for rd in pipe.execute()]

    def level(self, reader: str | None = None) -> Backlog:
        """The lag per partition: the end offset less the reader's committed offset (the
        slowest reader's without `reader`; before any commit, the group's committed offset, or
        the partition's start). Bytes are estimated (see the module docstring)."""
        parts = self.partitions()
        ends = self.offsets(parts, "latest")
        held = self.positions(parts)
        missing = [p for p, rd in zip(parts, held, strict=True) if not rd or (
            reader is not None and reader not in rd)]  # fmt: skip
        fallback = self._group_offsets(missing) if missing else {}
        lag: dict[str, int] = {}
        for p, rd in zip(parts, held, strict=True):
            if reader is not None and reader in rd:
                pos = rd[reader]
            elif reader is None and rd:
                pos = min(rd.values())
            else:
                pos = fallback.get(p, 0)
            lag[str(p)] = max(0, ends[p] - pos)
        total = sum(lag.values())
        size = round(total * self.record_bytes(parts, ends, lag)) if total else 0
        detail: dict[str, Any] = {"bytes_estimated": True, "topic": self.spec.topic}
        if reader is not None:
            detail["reader"] = reader
        return Backlog(total, size, lag, detail)

    def _group_offsets(self, parts: list[int]) -> dict[int, int]:
        """The group's committed offsets, else each partition's earliest offset."""
        out: dict[int, int] = {}
        try:
            got = self._lookup_client().committed(
                [TopicPartition(self.spec.topic, p) for p in parts], timeout=REQUEST_TIMEOUT_S
            )
            out = {tp.partition: int(tp.offset) for tp in got if tp.offset >= 0}
        except Exception:
            log.debug("group offsets not available", exc_info=True)
        rest = [p for p in parts if p not in out]
        if rest:
            out.update(self.offsets(rest, "earliest"))
        return out

    def record_bytes(self, parts: list[int], ends: dict[int, int], lag: dict[str, int]) -> float:
        """The mean record size: measured from what this process read, or sampled from the end
        of the partition with the largest lag (kept for RECORD_BYTES_TTL_S)."""
        known = self._record_bytes
        if known is not None and time.monotonic() - known[1] < RECORD_BYTES_TTL_S:
            return known[0]
        p = max(parts, key=lambda q: lag[str(q)])
        lo = max(0, ends[p] - SAMPLE_RECORDS)
        sizes: list[int] = []
        # A consumer of its own, closed at once: one kept idle would keep the topic's metadata
        # cached, and librdkafka can crash refreshing it after the topic is created again.
        consumer = new_consumer(self.spec, "sampler")
        try:
            sample = read_span(self.spec, p, lo, ends[p], "sampler", sleep=_no_wait,
                               stall_s=2.0, consumer=consumer)  # fmt: skip
            for recs in sample:
                sizes += [len(v or b"") for v in recs.values]
                break
        except Exception:
            log.debug("record size sample failed", exc_info=True)
        finally:
            consumer.close()
        if sizes:
            self._record_bytes = (sum(sizes) / len(sizes), time.monotonic())
        return self._record_bytes[0] if self._record_bytes else 0.0

    def _observe_sizes(self, recs: Records) -> None:
        if recs.values:
            mean = sum(len(v or b"") for v in recs.values) / len(recs.values)
            self._record_bytes = (mean, time.monotonic())

    # -- housekeeping -------------------------------------------------------------------------

    def _lookup_client(self) -> Any:
        if self._lookup is None:
            self._lookup = Consumer(
                self.spec.client_config(
                    **{"group.id": self.spec.group_id, "enable.auto.commit": False}
                )
            )
        return self._lookup

    def release(self, end: Mapping[str, Position], reset: Sequence[str] = ()) -> None:
        """Keep this reader's offsets in Redis, and have the smallest over the topic's readers,
        per partition, committed to `group_id` by the commit thread (`source.kafka_commits`).
        Offsets only move forward, but in the `reset` partitions (created again: their lag
        and the group's offsets would otherwise stay past the new end).
        Returns once Redis holds them; the commit never holds up the caller, and a failed one
        is tried again in the background: the offsets only say how far Sluice got, they never
        decide what it reads. Raises what the Redis client raises."""
        if not end:
            return
        self._released |= set(end)
        low = self._floors(end, reset)
        if self._commits is None:
            self._commits = Committer(self.spec, self._floor_now, self.commit_timeout_s)
        self._commits.offer(low, {int(s) for s in reset})

    def _floor_now(self) -> dict[int, int]:
        """The smallest offset over the readers of each partition this reader released, where
        every reader has one; reads only (the commit thread's: writing this reader's offsets
        from there could undo a reset that `release` made meanwhile)."""
        shards = sorted(self._released, key=int)
        pipe = self._client().pipeline(transaction=False)
        for s in shards:
            pipe.hmget(reader_hash(self.spec.topic, s), self.opts.readers_of(s))
        got = pipe.execute()
        return {int(s): min(int(v) for v in vals) for s, vals in zip(shards, got, strict=True)
                if vals and all(v is not None for v in vals)}  # fmt: skip

    def _floors(self, end: Mapping[str, Position], reset: Sequence[str] = ()) -> dict[int, int]:
        """Record this reader's offsets `end` (they only move forward, but in `reset`), and
        return the smallest offset over the readers of each partition that every reader has
        released."""
        client = self._client()
        shards = sorted(end, key=int)

        def run() -> Any:
            pipe = client.pipeline(transaction=False)
            for s in shards:
                names = self.opts.readers_of(s)
                evalsha_on(
                    pipe, RELEASE_OFFSET, [reader_hash(self.spec.topic, s)],
                    [self.opts.reader, int(end[s]), int(s in reset), *names],
                )  # fmt: skip
            return pipe.execute()

        mins = execute_loading(client, run, (RELEASE_OFFSET,))
        return {int(s): int(low) for s, low in zip(shards, mins, strict=True)
                if low is not None}  # fmt: skip

    # -- executor side ------------------------------------------------------------------------

    def read(
        self, span: Span, ref_ms: int, on_wait: Callable[[str, str], None] | None = None
    ) -> Iterator[pa.RecordBatch]:
        p = int(span.shard)
        decoder = Decoder(self.opts, ref_ms, shard_name(self.spec.topic, p))
        for recs in read_span(self.spec, p, int(span.lo), int(span.hi), "reader", on_wait):
            if recs.lost is not None:
                yield decoder.lost(recs.lost, self.spec.topic, p)
            else:
                yield from decoder.decode_records(
                    recs.values, recs.offsets, recs.timestamps, self.spec.topic, p
                )

    def close(self) -> None:
        """Stop the commit thread (a due commit still goes, within `kafka_commits.CLOSE_WAIT_S`)
        and close the clients."""
        forget_consumers(self.spec)
        if self._commits is not None:
            self._commits.close()
        if self._lookup is not None:
            try:
                self._lookup.close()
            except Exception:
                log.debug("group lookup close failed", exc_info=True)
        self._commits = self._lookup = self._admin = None


def _records_xor(offsets: Any, counts: list[int], salt: str) -> int:
    """The XOR of the event ids of records at `offsets` holding `counts` events each."""
    per = np.asarray(counts, dtype=np.int64)
    n = int(per.sum())
    if not n:
        return 0
    starts = np.cumsum(per) - per
    idx = np.arange(n, dtype=np.int64) - np.repeat(starts, per)
    offs = np.repeat(np.asarray(offsets[: len(per)], dtype=np.int64), per)
    return xor_all(event_ids(offs, np.zeros(n, dtype=np.uint64), idx, salt))


def _no_wait(_: float) -> None:
    raise LogUnavailable("unreachable", "the sample read would have to wait")
