"""The Python producer SDK: batches events into log entries, sharded by key.

    with Producer.from_config(cfg, client) as p:
        p.send({"ts": 1700000000000, "card": "c1", "merchant": "m1", "amount": 12.5})

The log is the source's: Redis Streams, or the Kafka topic of `source.kafka`.

- Redis Streams. `jsonl` packs up to `batch_events` events into one entry (field `d`:
  newline-separated JSON objects, field `n`: how many), which is what makes high rates cheap;
  `fields` writes one entry per event with the event's fields as entry fields, like a plain
  `XADD`.
- Kafka. `jsonl` packs up to `batch_events` events into one record value; `json` writes one
  record per event, keyed by its `shard_by` value, as any Kafka producer would.

Events with the same `shard_by` value (by default the first key field of the first metric)
always go to the same shard or partition, in the order they were sent, so per-key order holds.
`send` buffers; `flush` (called on close, and when a shard's buffer is full) writes everything
buffered: one pipelined round trip to Redis, or one produce-and-wait to Kafka.

Flow control: with a `valve` (`from_config` attaches one), `flush` first asks it to admit the
events, which blocks while the input is backpressured (seed 000's throttled upstream) and raises
`BackpressureError` after `block_timeout_s`. A refused flush keeps everything buffered, so the
caller can retry; nothing is dropped. The same holds when the write fails: the buffer is kept,
and a retry writes each event once. A write whose reply never came (a timeout, a cut connection,
a Redis paused or killed after it wrote) may still have landed, so a flush cuts each shard's
buffer into numbered frames and appends them with `produce.lua`, which skips a frame this
producer already appended there (its mark per shard, `sluice:produced:...`, expires an hour
after its last write); a failed flush's frames are sent again as they were. Kafka's producer is
idempotent (`enable.idempotence`), so its retries repeat nothing either.

Each flush also adds its event count to the `events_produced` counter in Redis; the dashboard's
input rate is taken from it.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import chain
from types import TracebackType
from typing import TYPE_CHECKING, Any

import orjson
import redis

from sluice.config import Config
from sluice.errors import BadEvent, SluiceError
from sluice.graph import KafkaSpec, log_spec
from sluice.redis.connection import is_cluster
from sluice.redis.keys import STATS_KEY, shard_keys, shard_side_key
from sluice.redis.loading import unwrapped_script_error
from sluice.redis.scripts import PRODUCE, evalsha_on, execute_loading, script_sha
from sluice.source.admission import ingest_valve
from sluice.source.entries import entry_bytes, entry_fields, event_line
from sluice.source.kafka_sink import KafkaSink

if TYPE_CHECKING:
    from sluice.flow.valves import IngestValve

log = logging.getLogger(__name__)

STREAM_FORMATS = ("jsonl", "fields")
KAFKA_FORMATS = ("jsonl", "json")
ENTRY_OVERHEAD = 64  # an entry's bytes besides its events' lines: `d`, `n` and the count
MARK_TTL_S = 3600  # how long a producer's mark (`produce.lua`) outlives its last write


def shard_of(value: Any, shards: int) -> int:
    if shards == 1:
        return 0
    return zlib.crc32(str(value).encode()) % shards


class Producer:
    def __init__(
        self,
        client: Any,
        stream: str = "events",
        shards: int = 1,
        format: str = "jsonl",
        shard_by: str | None = None,
        batch_events: int = 500,
        valve: IngestValve | None = None,
        block_timeout_s: float | None = None,
        hash_tags: bool = False,
        kafka: KafkaSpec | None = None,
        max_entry_bytes: int | None = None,
        mark_ttl_s: int = MARK_TTL_S,
    ) -> None:
        allowed = KAFKA_FORMATS if kafka is not None else STREAM_FORMATS
        if format not in allowed:
            log = "Kafka" if kafka is not None else "Redis Streams"
            raise SluiceError(
                f"`format` must be {' or '.join(map(repr, allowed))} for {log}, got {format!r}"
            )
        if batch_events < 1:
            raise SluiceError(f"`batch_events` must be at least 1, got {batch_events}")
        self.client = client
        self.kafka = KafkaSink(kafka) if kafka is not None else None
        if self.kafka is not None:
            self.keys = [str(p) for p in range(self.kafka.partitions())]
        else:
            self.keys = shard_keys(stream, shards, hash_tags)
        self.format = format
        self.shard_by = shard_by
        self.batch_events = batch_events
        # An entry (a record) the source would dead-letter as `oversize_entry` is never written:
        # lines are packed under it, and an event over it alone is refused (`_written`).
        self.max_payload = None if max_entry_bytes is None else max_entry_bytes - ENTRY_OVERHEAD
        self._buf: list[list[bytes]] = [[] for _ in self.keys]
        self._fields: list[list[dict[str, bytes | str]]] = [[] for _ in self.keys]
        # Per shard, the frames a flush cut its buffer into (number, end in `_buf`, end in
        # `_fields`): sent again as they were after a failed flush, so that `produce.lua`
        # skips the ones that landed unacknowledged.
        self._frames: list[list[tuple[int, int, int]]] = [[] for _ in self.keys]
        self._frame_no = 0
        writer = os.urandom(8).hex()
        self._marks = [shard_side_key("produced", k, writer) for k in self.keys]
        self._marked: set[int] = set()  # the shards whose mark this producer set
        self.mark_ttl_s = mark_ttl_s
        self._rr = 0
        self.sent_events = 0
        self.sent_entries = 0
        self._uncounted = 0  # events in the log not yet in `events_produced` (Redis failed)
        self.valve = valve
        self.block_timeout_s = block_timeout_s

    @classmethod
    def from_config(cls, cfg: Config, client: Any, flow: bool = True, **kw: Any) -> Producer:
        """A producer for `cfg.source` (its streams, or its Kafka topic), sharding by the first
        key field of the first metric, throttled by `cfg.backpressure` unless `flow` is False."""
        kw.setdefault("shard_by", cfg.metrics[0].key[0])
        if flow and "valve" not in kw:
            kw["valve"] = ingest_valve(cfg, client)
        kw.setdefault("hash_tags", bool(cfg.source.hash_tags))
        spec = log_spec(cfg)
        kw.setdefault("kafka", spec if isinstance(spec, KafkaSpec) else None)
        kw.setdefault("max_entry_bytes", cfg.source.max_entry_bytes)
        return cls(client, cfg.source.stream, cfg.source.shards, cfg.source.format, **kw)

    def _shard(self, event: Mapping[str, Any]) -> int:
        if self.shard_by is not None and self.shard_by in event:
            return shard_of(event[self.shard_by], len(self.keys))
        self._rr = (self._rr + 1) % len(self.keys)
        return self._rr

    def send(self, event: Mapping[str, Any]) -> None:
        """Buffer one event, and flush once a shard holds 4 x `batch_events`. Raises BadEvent
        (nothing buffered) if it is not a JSON-serialisable mapping, is over what one log entry
        may hold, or in the `fields` format has no field with a value (a stream entry cannot
        be empty). A flush's error (BackpressureError, a Redis error) is raised with the event
        buffered: call `flush()` again, do not send it again."""
        i = self._buffer(event, self._written(event))  # refused before a shard is chosen
        if self._full(i):
            self.flush()

    def send_all(self, events: Sequence[Mapping[str, Any]]) -> None:
        """`buffer_all`, then a flush as `send` does: a flush's error is raised with every event
        not written buffered."""
        self.buffer_all(events)
        if any(self._full(i) for i in range(len(self.keys))):
            self.flush()

    def buffer_all(self, events: Sequence[Mapping[str, Any]]) -> list[int]:
        """Buffer every event, or none of them: raises BadEvent naming the first one `send`
        would refuse (`event <i>: ...`). Each event is converted once. Returns each event's
        shard; nothing is written."""
        written = []
        for i, event in enumerate(events):
            try:
                written.append(self._written(event))
            except BadEvent as e:
                raise BadEvent(f"event {i}: {e}") from None
        return [self._buffer(event, entry) for event, entry in zip(events, written, strict=True)]

    def _buffer(self, event: Mapping[str, Any], written: dict[str, bytes | str] | bytes) -> int:
        """Buffer one written event; returns its shard."""
        i = self._shard(event)
        if isinstance(written, dict):
            self._fields[i].append(written)
        else:
            self._buf[i].append(written)
        return i

    def _full(self, shard: int) -> bool:
        """The shard holds 4 x `batch_events`: time to flush."""
        return len(self._buf[shard]) + len(self._fields[shard]) >= self.batch_events * 4

    def _written(self, event: Mapping[str, Any]) -> dict[str, bytes | str] | bytes:
        """`event` as the log gets it: a `fields` entry's fields, or a JSON line."""
        if not isinstance(event, Mapping):
            raise BadEvent(f"an event must be a mapping, got {type(event).__name__}")
        written = entry_fields(event) if self.format == "fields" else event_line(event)
        size = len(written) if isinstance(written, bytes) else entry_bytes(written)
        if self.max_payload is not None and size > self.max_payload:
            raise BadEvent(f"the event is {size:,} bytes as written, over what one log entry may"
                           f" hold ({self.max_payload:,}: source.max_entry_bytes less"
                           f" {ENTRY_OVERHEAD} for the entry's own fields)")  # fmt: skip
        return written

    def _entries(self, lines: list[bytes]) -> Iterator[list[bytes]]:
        """`lines` in runs of at most `batch_events`, each under `max_payload` bytes joined."""
        run: list[bytes] = []
        size = 0
        for line in lines:
            grown = size + len(line) + (1 if run else 0)
            if run and (len(run) == self.batch_events or (
                    self.max_payload is not None and grown > self.max_payload)):  # fmt: skip
                yield run
                run, grown = [], len(line)
            run.append(line)
            size = grown
        if run:
            yield run

    def send_many(self, events: Iterable[Mapping[str, Any]]) -> None:
        """`send` each event in turn: on a flush's error, the events up to the one being sent
        are buffered, and the rest are not (`send_all` buffers all of them first)."""
        for e in events:
            self.send(e)

    def send_lines(self, shard: int, lines: Sequence[bytes]) -> None:
        """Buffer already-serialised JSON objects for one shard (the load generator's fast
        path)."""
        if self.format == "fields":
            raise SluiceError("send_lines needs format 'jsonl' or 'json'")
        self._buf[shard].extend(lines)

    def pending(self) -> int:
        """Events buffered and not yet written."""
        return sum(len(b) for b in self._buf) + sum(len(f) for f in self._fields)

    def pending_bytes(self) -> int:
        """The bytes of the events buffered, as they will be written (values only)."""
        lines = sum(len(line) for b in self._buf for line in b)
        return lines + sum(entry_bytes(e) for f in self._fields for e in f)

    def flush(self) -> int:
        """Write everything buffered. Returns events written.

        Blocks while backpressured; raises BackpressureError (keeping the buffer) on timeout,
        and SluiceError or a Redis error (keeping the buffer) when the write fails."""
        if self.valve is not None:
            n = self.pending()
            if n:
                self.valve.admit(n, self.block_timeout_s, self.pending_bytes())
        # A shard's buffer is emptied only once the log has answered for it: after an error the
        # caller still holds every event not known to be written (a retry may repeat what did
        # land unacknowledged: the write the error cut short).
        if self.kafka is not None:
            events, entries = self._flush_kafka(self.kafka)
            self._emptied(range(len(self.keys)), events, entries)
            return events
        if is_cluster(self.client):
            return self._flush_shards()
        events, entries = self._flush_streams()
        self._emptied(range(len(self.keys)), events, entries)
        return events

    def _emptied(self, shards: Iterable[int], events: int, entries: int) -> None:
        for i in shards:
            self._buf[i] = []
            self._fields[i] = []
            self._frames[i] = []
        self.sent_events += events
        self.sent_entries += entries

    def _add_shard(self, pipe: Any, i: int, node: Any = None) -> tuple[int, int]:
        """Queue shard i's frames on `pipe`, in one `produce.lua` call; (events, entries). On a
        cluster, `node` is the shard's master: the call goes there, without the cluster client
        asking a node (maybe one that is down) for the script's keys."""
        if not (self._buf[i] or self._fields[i]):
            return 0, 0
        args: list[Any] = [self.mark_ttl_s]
        self._marked.add(i)
        events = entries = 0
        for no, lines, fields in self._framed(i):
            frame: list[Any] = []
            for part in self._entries(lines):
                frame += [2, "d", b"\n".join(part), "n", len(part)]
                events += len(part)
            frame_entries = len(frame) // 5
            for entry in fields:
                frame += [len(entry), *chain.from_iterable(entry.items())]
            frame_entries += len(fields)
            events += len(fields)
            entries += frame_entries
            args += [no, frame_entries, *frame]
        keys = [self.keys[i], self._marks[i]]
        if node is None:
            evalsha_on(pipe, PRODUCE, keys, args)
        else:
            pipe.execute_command("EVALSHA", script_sha(PRODUCE), 2, *keys, *args,
                                 target_nodes=node)  # fmt: skip
        return events, entries

    def _framed(self, i: int) -> list[tuple[int, list[bytes], list[dict[str, bytes | str]]]]:
        """Shard i's buffer as frames: those an earlier flush cut, as they were, then what was
        buffered since as a new one."""
        frames = self._frames[i]
        lines_end, fields_end = frames[-1][1:] if frames else (0, 0)
        if len(self._buf[i]) > lines_end or len(self._fields[i]) > fields_end:
            self._frame_no += 1
            frames.append((self._frame_no, len(self._buf[i]), len(self._fields[i])))
        out = []
        a = b = 0
        for no, lines_end, fields_end in frames:
            out.append((no, self._buf[i][a:lines_end], self._fields[i][b:fields_end]))
            a, b = lines_end, fields_end
        return out

    def _flush_shards(self) -> int:
        """On a Redis Cluster, one pipeline per master, for the shards it serves, each shard's
        buffer emptied once its master answered: a master that is down fails its own shards
        only, the others are written, and a retry sends the failed ones alone (one pipeline over
        every master would be sent again whole, by redis-py's own retries and by the caller's,
        repeating the shards that were written). Raises the first master's error, if any, once
        every master was tried."""
        by_node: dict[str, list[int]] = {}
        nodes: dict[str, Any] = {}
        for i in sorted(self.pending_shards()):
            node = self.client.get_node_from_key(self.keys[i])
            by_node.setdefault(node.name, []).append(i)
            nodes[node.name] = node
        written = 0
        failed: Exception | None = None
        for name, shards in by_node.items():
            # `produce.lua` loaded on this master only: the cluster's own SCRIPT LOAD goes to
            # every master, and fails while one is down.
            loader = nodes[name].redis_connection or self.client
            counts: list[tuple[int, int]] = []

            def run(name: str = name, shards: list[int] = shards,
                    counts: list[tuple[int, int]] = counts) -> Any:  # fmt: skip
                pipe = self.client.pipeline(transaction=False)
                counts[:] = [self._add_shard(pipe, i, nodes[name]) for i in shards]
                return pipe.execute()

            try:
                execute_loading(loader, run, (PRODUCE,))
            except Exception as e:  # noqa: BLE001 - raised below, once the others are written
                failed = failed or unwrapped_script_error(e, "XADD, in produce.lua")
                continue
            for i, (events, entries) in zip(shards, counts, strict=True):
                self._emptied((i,), events, entries)
                written += events
        if written:
            self._count_produced(written)
        if failed is not None:
            raise failed
        return written

    def pending_shards(self) -> set[int]:
        """The shards that hold events not yet written."""
        return {i for i in range(len(self.keys)) if self._buf[i] or self._fields[i]}

    def _flush_streams(self) -> tuple[int, int]:
        counts = [0, 0]
        counted = [False]  # an attempt that Redis refused for want of the script counted them

        def run() -> Any:
            pipe = self.client.pipeline(transaction=False)
            counts[:] = [0, 0]
            for i in range(len(self.keys)):
                n, e = self._add_shard(pipe, i)
                counts[0], counts[1] = counts[0] + n, counts[1] + e
            if not counts[1]:
                return []
            # For the input rate on the dashboard and in /v1/status history (a rate, not an
            # audit: a flush that failed and is called again may count its events twice).
            if not counted[0]:
                pipe.hincrby(STATS_KEY, "events_produced", counts[0])
            replies = pipe.execute(raise_on_error=False)
            counted[0] = counted[0] or not isinstance(replies[-1], Exception)
            for reply in replies:
                if isinstance(reply, Exception):
                    raise unwrapped_script_error(reply, "XADD, in produce.lua")
            return replies

        execute_loading(self.client, run, (PRODUCE,))
        return counts[0], counts[1]

    def _flush_kafka(self, sink: KafkaSink) -> tuple[int, int]:
        records: list[tuple[int, bytes, bytes | None]] = []  # (partition, value, key)
        events = 0
        for i, lines in enumerate(self._buf):
            if not lines:
                continue
            events += len(lines)
            if self.format == "jsonl":
                records += [(i, b"\n".join(part), None) for part in self._entries(lines)]
            else:
                records += [(i, line, self._key_of(line)) for line in lines]
        if records:
            sink.write(records)
            self._count_produced(events)
        return events, len(records)

    def _count_produced(self, events: int) -> None:
        """Add `events`, which the log holds now, to the input rate's counter. A Redis error
        here is logged and the count kept for the next flush, never raised: a caller told the
        flush failed would send the events to the log again."""
        self._uncounted += events
        try:
            self.client.hincrby(STATS_KEY, "events_produced", self._uncounted)
        except redis.RedisError as e:
            log.warning("events written to the log; their count not yet recorded in Redis",
                        extra={"events": self._uncounted, "error": str(e)})  # fmt: skip
            return
        self._uncounted = 0

    def _key_of(self, line: bytes) -> bytes | None:
        """A `json` record's key: its `shard_by` value, as Kafka tools expect keys to be."""
        if self.shard_by is None:
            return None
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:  # NaN or Infinity (`event_line`), or not JSON at all
            try:
                obj = json.loads(line)
            except ValueError:
                return None  # no key: the record still goes, and is dead-lettered as read
        value = obj.get(self.shard_by) if isinstance(obj, dict) else None
        return None if value is None else str(value).encode()

    def discard(self) -> int:
        """Forget what is buffered and not yet written; returns how many events that was."""
        n = self.pending()
        self._buf = [[] for _ in self.keys]
        self._fields = [[] for _ in self.keys]
        self._frames = [[] for _ in self.keys]
        return n

    def forget_marks(self) -> None:
        """Remove this producer's marks (`produce.lua`), best effort, once nothing it holds
        will be sent again: a producer made per request (`POST /v1/events`) leaves none
        behind to expire."""
        if self.kafka is not None or not self._marked or self.pending():
            return
        try:
            for i in sorted(self._marked):
                self.client.delete(self._marks[i])
        except redis.RedisError:
            log.debug("producer marks left to expire", exc_info=True)
        self._marked.clear()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            if self.valve is not None:
                self.valve.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if t is None:
            self.close()
