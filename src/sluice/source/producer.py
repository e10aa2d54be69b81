"""The Python producer SDK: batches events into stream entries, sharded by key.

    with Producer.from_config(cfg, client) as p:
        p.send({"ts": 1700000000000, "card": "c1", "merchant": "m1", "amount": 12.5})

`jsonl` packs up to `batch_events` events into one entry (field `d`: newline-separated JSON
objects, field `n`: how many), which is what makes high rates cheap; `fields` writes one entry
per event with the event's fields as entry fields, like a plain `XADD`. Events with the same
`shard_by` value always go to the same shard. `send` buffers; `flush` (called on close, and
when a shard's buffer is full) writes with one pipelined round trip.

Flow control: with a `valve` (`from_config` attaches one), `flush` first asks it to admit the
events, which blocks while the input is backpressured (seed 000's throttled upstream) and raises
`BackpressureError` after `block_timeout_s`. A refused flush keeps everything buffered, so the
caller can retry; nothing is dropped. The same holds for a Redis error during `flush`: the
buffer is kept, and since a pipeline is not atomic, a retry may repeat entries that were written
before the error (at least once, never lost).

Each flush also adds its event count to the `events_produced` counter in the same round trip;
the dashboard's input rate is taken from it.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import orjson

from sluice.config import Config
from sluice.errors import SluiceError
from sluice.redis.keys import STATS_KEY, shard_keys

if TYPE_CHECKING:
    from sluice.flow.valves import IngestValve


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
    ) -> None:
        if format not in ("jsonl", "fields"):
            raise SluiceError(f"`format` must be 'jsonl' or 'fields', got {format!r}")
        if batch_events < 1:
            raise SluiceError(f"`batch_events` must be at least 1, got {batch_events}")
        self.client = client
        self.keys = shard_keys(stream, shards, hash_tags)
        self.format = format
        self.shard_by = shard_by
        self.batch_events = batch_events
        self._buf: list[list[bytes]] = [[] for _ in self.keys]
        self._fields: list[list[Mapping[str, Any]]] = [[] for _ in self.keys]
        self._rr = 0
        self.sent_events = 0
        self.sent_entries = 0
        self.valve = valve
        self.block_timeout_s = block_timeout_s

    @classmethod
    def from_config(cls, cfg: Config, client: Any, flow: bool = True, **kw: Any) -> Producer:
        """A producer for `cfg.source`, sharding by the first key field of the first metric,
        throttled by `cfg.backpressure` unless `flow` is False."""
        kw.setdefault("shard_by", cfg.metrics[0].key[0])
        if flow and "valve" not in kw:
            from sluice.flow.valves import IngestValve

            kw["valve"] = IngestValve.from_config(cfg, client)
        kw.setdefault("hash_tags", bool(cfg.source.hash_tags))
        return cls(client, cfg.source.stream, cfg.source.shards, cfg.source.format, **kw)

    def _shard(self, event: Mapping[str, Any]) -> int:
        if self.shard_by is not None and self.shard_by in event:
            return shard_of(event[self.shard_by], len(self.keys))
        self._rr = (self._rr + 1) % len(self.keys)
        return self._rr

    def send(self, event: Mapping[str, Any]) -> None:
        """Buffer one event. Raises SluiceError if it is not a JSON-serialisable mapping."""
        if not isinstance(event, Mapping):
            raise SluiceError(f"an event must be a mapping, got {type(event).__name__}")
        i = self._shard(event)
        if self.format == "jsonl":
            try:
                self._buf[i].append(orjson.dumps(event))
            except TypeError as e:
                raise SluiceError(f"event is not JSON-serialisable: {e}") from None
        else:
            self._fields[i].append(event)
        if len(self._buf[i]) + len(self._fields[i]) >= self.batch_events * 4:
            self.flush()

    def send_many(self, events: Iterable[Mapping[str, Any]]) -> None:
        for e in events:
            self.send(e)

    def send_lines(self, shard: int, lines: Sequence[bytes]) -> None:
        """Buffer already-serialised JSON lines for one shard (the load generator's fast path)."""
        if self.format != "jsonl":
            raise SluiceError("send_lines needs format 'jsonl'")
        self._buf[shard].extend(lines)

    def pending(self) -> int:
        """Events buffered and not yet written."""
        return sum(len(b) for b in self._buf) + sum(len(f) for f in self._fields)

    def flush(self) -> int:
        """Write everything buffered in one pipelined round trip. Returns events written.

        Blocks while backpressured; raises BackpressureError (keeping the buffer) on timeout."""
        if self.valve is not None:
            n = self.pending()
            if n:
                self.valve.admit(n, self.block_timeout_s)
        pipe = self.client.pipeline(transaction=False)
        events = entries = 0
        for i, key in enumerate(self.keys):
            lines = self._buf[i]
            for j in range(0, len(lines), self.batch_events):
                part = lines[j : j + self.batch_events]
                pipe.xadd(key, {"d": b"\n".join(part), "n": len(part)})
                entries += 1
                events += len(part)
            for ev in self._fields[i]:
                pipe.xadd(key, {k: _field_value(v) for k, v in ev.items() if v is not None})
                entries += 1
                events += 1
        if entries:
            # For the input rate on the dashboard and in /v1/status history (a rate, not an
            # audit: a retried flush may count its events twice).
            pipe.hincrby(STATS_KEY, "events_produced", events)
            # The buffer is emptied only once Redis has answered: after a connection error the
            # caller still holds every event (a retry may repeat the entries that did land).
            pipe.execute()
        self._buf = [[] for _ in self.keys]
        self._fields = [[] for _ in self.keys]
        self.sent_events += events
        self.sent_entries += entries
        return events

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


def _field_value(v: Any) -> bytes | str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, bytes | str):
        return v
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, int):
        return str(v)
    return orjson.dumps(v)
