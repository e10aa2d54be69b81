"""The Spark streaming source over Redis Streams (`spark.readStream.format("redis-streams")`).

Offsets are `{"ids": {shard_key: last_entry_id}, "ref": ms}`; a batch reads, per shard, the
entries with start_id < id <= end_id. Spark logs a batch's end offset before running it, so a
re-run after a crash reads exactly the same entries (entries are trimmed only after commit).
Several queries may read the same shards, each with its own offsets (`SourceOptions.reader`);
a shard is then trimmed only up to the slowest of them.

Admission control: `latestOffset(start, limit)` honours `ReadMaxRows(n)` with n counted in
*events* (for `jsonl`, an entry holds many). The budget is split evenly over the shards, and
counted server-side by a Lua script, so only the end ids travel to the driver.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows

from sluice.source.decode import Decoder, spark_schema_ddl
from sluice.source.ids import ZERO_ID, id_ms, parse_id, split_range
from sluice.source.options import SourceOptions

FORMAT = "redis-streams"
log = logging.getLogger(__name__)
FLOW_RETRY_S = 5.0  # a failed flow valve is tried again after this long
XRANGE_COUNT = 2000

_clients: dict[str, Any] = {}


def _unparsed(reply: Any, **kw: Any) -> Any:
    return reply


def raw_client(url: str) -> Any:
    """A per-process client whose XRANGE replies are left unparsed (nested lists of bytes).

    Python workers are reused across tasks, so the client (and its pool) is kept per URL. On a
    cluster the replies are parsed by the client of the node that served them, so the callback
    is set on each node's client; `read_range` copes with a node added later (a failover).
    """
    client = _clients.get(url)
    if client is None:
        from sluice.redis.cluster import node_clients
        from sluice.redis.connection import client_for

        client = client_for(url, timeout_s=30, connect_timeout_s=10)
        for c in {id(n): n for n in [client, *node_clients(client)]}.values():
            c.set_response_callback("XRANGE", _unparsed)
            c.set_response_callback("XREVRANGE", _unparsed)
        _clients[url] = client
    return client


def _raw_entries(chunk: Any) -> Any:
    """Entries as XRANGE sends them, [[id, [k, v, ...]], ...], also from a client that parsed
    them into (id, {k: v}) pairs (a cluster node whose client was made after `raw_client`)."""
    if chunk and isinstance(chunk[0], tuple):
        return [[eid, [x for kv in fields.items() for x in kv]] for eid, fields in chunk]
    return chunk


def _flow_stage(flow: dict[str, Any], shards: Sequence[str]) -> Any:
    """The flow stage named in the valve's options (`[name, upstreams]`); None: the default."""
    if "stage" not in flow:
        return None
    from sluice.flow.stages import Stage

    name, upstreams = flow["stage"]
    return Stage(name, tuple(upstreams), "streams", tuple(shards))


class ShardRange(InputPartition):
    """Entries (lo, hi] of one shard. Plain values only: it is pickled to the executors."""

    def __init__(self, shard: str, lo: str, hi: str, ref_ms: int) -> None:
        super().__init__((shard, lo, hi, ref_ms))
        self.shard = shard
        self.lo = lo
        self.hi = hi
        self.ref_ms = ref_ms


def read_range(client: Any, shard: str, lo: str, hi: str) -> Iterator[list[Any]]:
    """Yield raw XRANGE chunks covering (lo, hi]."""
    cursor = lo
    while True:
        chunk = _raw_entries(
            client.execute_command("XRANGE", shard, f"({cursor}", hi, "COUNT", XRANGE_COUNT)
        )
        if not chunk:
            return
        yield chunk
        if len(chunk) < XRANGE_COUNT:
            return
        last = chunk[-1][0]
        cursor = last.decode() if isinstance(last, bytes) else str(last)


class RedisStreamReader(DataSourceStreamReader):
    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        self._released: dict[str, Any] | None = None
        self._valve: Any = None
        self._valve_errors = 0  # failures in a row; the static limit applies meanwhile
        self._valve_retry_at = 0.0  # monotonic time before which the valve is not tried again

    # -- driver side ------------------------------------------------------------------------

    def _client(self) -> Any:
        return raw_client(self.opts.url)

    def initialOffset(self) -> dict[str, Any]:
        return {"ids": {s: ZERO_ID for s in self.opts.shards}, "ref": 0}

    def getDefaultReadLimit(self) -> ReadLimit:
        n = self.opts.max_events_per_batch
        return ReadAllAvailable() if n is None else ReadMaxRows(n)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        # Spark asks for the next batch only after the batch ending at `start` is in its commit
        # log (a batch re-run after a crash is re-planned from the offset log, not from here), so
        # everything up to `start` is done: record it and let the input go, even when no new
        # data arrives to trigger `commit()`.
        self._release(start)
        ids = dict(start["ids"])
        for s in self.opts.shards:
            ids.setdefault(s, ZERO_ID)
        budget = getattr(limit, "max_rows", None) if isinstance(limit, ReadMaxRows) else None
        cap = self._flow_limit()
        if cap is not None:
            budget = cap if budget is None else min(int(budget), cap)
        client = self._client()
        new_ids = dict(ids)
        events, held_back = 0, False
        if budget is None:
            pipe = client.pipeline(transaction=False)
            for s in self.opts.shards:
                pipe.execute_command("XREVRANGE", s, "+", "-", "COUNT", 1)
            for s, last in zip(self.opts.shards, pipe.execute(), strict=True):
                if last:
                    last_id = last[0][0].decode()
                    if parse_id(last_id) > parse_id(ids[s]):
                        new_ids[s] = last_id
        else:
            new_ids, entries, events, held_back = self._advance(client, ids, int(budget))
        self._flow_admitted(events, held_back)
        if new_ids == ids:
            return start
        out: dict[str, Any] = {"ids": new_ids, "ref": max(id_ms(v) for v in new_ids.values())}
        if budget is not None:
            out["entries"] = entries  # sizes the partitions of this batch
        return out

    # -- flow control (see sluice.flow.valves) ------------------------------------------------

    def _flow_limit(self) -> int | None:
        """The controller's event budget for the next batch; None when it sets none."""
        if self.opts.flow is None or time.monotonic() < self._valve_retry_at:
            return None
        try:
            if self._valve is None:
                from sluice.config import BackpressureConfig
                from sluice.flow.valves import AdmissionValve

                flow = json.loads(self.opts.flow)
                self._valve = AdmissionValve(
                    self._client(),
                    BackpressureConfig.model_validate(flow["backpressure"]),
                    tuple(self.opts.shards),
                    int(flow["trigger_ms"]),
                    self.opts.max_events_per_batch,
                    stage=_flow_stage(flow, self.opts.shards),
                    reader=flow.get("reader"),
                )
            limit: int | None = self._valve.limit()
        except Exception:  # noqa: BLE001 - logged in _flow_failed; never stops the input
            self._flow_failed()
            return None
        self._flow_ok()
        return limit

    def _flow_admitted(self, events: int, held_back: bool) -> None:
        if self._valve is None or time.monotonic() < self._valve_retry_at:
            return
        try:
            self._valve.admitted(events, held_back)
        except Exception:  # noqa: BLE001 - logged in _flow_failed; never stops the input
            self._flow_failed()

    def _flow_failed(self) -> None:
        """Flow control must never stop the input: the static limit applies until the valve
        works again (e.g. Redis at maxmemory refuses its state writes), retried every
        FLOW_RETRY_S. Logged once per streak."""
        if self._valve_errors == 0:
            log.exception("flow control failed; admitting with the static limit until it recovers")
        self._valve_errors += 1
        self._valve_retry_at = time.monotonic() + FLOW_RETRY_S

    def _flow_ok(self) -> None:
        if self._valve_errors:
            log.warning("flow control recovered", extra={"failures": self._valve_errors})
            self._valve_errors = 0

    def _advance(
        self, client: Any, ids: dict[str, str], budget: int
    ) -> tuple[dict[str, str], dict[str, int], int, bool]:
        """Spread `budget` events over the shards: evenly first, then what a shard with little
        backlog left unused goes to the shards that still have more (keys are rarely even).
        Returns the new ids, entries per shard, events admitted, and whether any were left."""
        script = self._advance_script(client)
        new_ids = dict(ids)
        entries = dict.fromkeys(self.opts.shards, 0)
        wanting = list(self.opts.shards)
        left = budget
        for round_ in range(3):
            if left <= 0 or not wanting:
                break
            share = max(1, left // len(wanting))
            still = []
            for s in wanting:
                end, n_entries, n_events, more = script(
                    # Only the first round may overshoot, by one entry per shard, for progress.
                    keys=[s],
                    args=[new_ids[s], share, self.opts.format, int(round_ == 0)],
                )
                end = end.decode() if isinstance(end, bytes) else str(end)
                if parse_id(end) > parse_id(new_ids[s]):
                    new_ids[s] = end
                entries[s] += int(n_entries)
                left -= int(n_events)
                if int(more):
                    still.append(s)
            wanting = still
        return new_ids, entries, budget - left, bool(wanting)

    def _advance_script(self, client: Any) -> Any:
        from sluice.redis.scripts import ADVANCE, script_source

        return client.register_script(script_source(ADVANCE))

    def reportLatestOffset(self) -> dict[str, Any] | None:
        return None

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        parts: list[InputPartition] = []
        ref = int(end.get("ref", 0))
        for shard, hi in end["ids"].items():
            lo = start["ids"].get(shard, ZERO_ID)
            if parse_id(hi) <= parse_id(lo):
                continue
            n = end.get("entries", {}).get(shard)
            if n is None:
                n = self._estimate_entries(shard, lo, hi)
            k = min(self.opts.max_partitions_per_shard, max(1, math.ceil(n / self._per_part())))
            parts.extend(ShardRange(shard, a, b, ref) for a, b in split_range(lo, hi, k))
        return parts

    def _per_part(self) -> int:
        # `partition_events` is in events; a jsonl entry carries many, so count entries lower.
        return self.opts.partition_events if self.opts.format == "fields" else 500

    def _estimate_entries(self, shard: str, lo: str, hi: str) -> int:
        """An upper bound on the entries in (lo, hi]: the stream length (trimmed after commit)."""
        try:
            return int(self._client().xlen(shard))
        except Exception:  # noqa: BLE001 - an estimate only; one partition is always correct
            return 0

    def commit(self, end: dict[str, Any]) -> None:
        """Spark finished every batch up to `end`: the input before it may go."""
        self._release(end)

    def _release(self, end: dict[str, Any]) -> None:
        """Record this reader's committed ids and trim each shard up to the slowest reader of
        it (see release.lua; idempotent). The default reader also publishes its ids for the
        status views."""
        from sluice.redis.keys import OFFSETS_KEY, shard_side_key
        from sluice.redis.scripts import RELEASE, evalsha_on, execute_loading

        if end == self._released:
            return
        client = self._client()
        released = {s: last for s, last in end["ids"].items() if last != ZERO_ID}

        def run() -> Any:
            pipe = client.pipeline(transaction=False)
            for shard, last in released.items():
                keys = [shard, shard_side_key("rd", shard)]
                names = self.opts.readers_of(shard)
                evalsha_on(pipe, RELEASE, keys, [self.opts.reader, last, *names])
                if self.opts.reader == "":
                    pipe.hset(OFFSETS_KEY, shard, last)
            return pipe.execute()

        if released:
            execute_loading(client, run, (RELEASE,))
        self._released = end

    def stop(self) -> None:
        _clients.pop(self.opts.url, None)

    # -- executor side ----------------------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        shard, lo, hi, ref_ms = partition.value
        decoder = Decoder(self.opts, ref_ms, shard)
        client = raw_client(self.opts.url)
        for chunk in read_range(client, shard, lo, hi):
            yield from decoder.decode(chunk)


class RedisStreamDataSource(DataSource):
    """`spark.readStream.format("redis-streams").options(**SourceOptions(...).to_spark())`."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        return spark_schema_ddl(SourceOptions.from_spark(self.options))

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        return RedisStreamReader(SourceOptions.from_spark(self.options))
