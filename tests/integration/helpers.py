"""Helpers for tests that drive the real plan and writer without a streaming query."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import orjson
import pyarrow as pa
import redis

from sluice.config import BackpressureConfig, Config
from sluice.flow.levels import QueueLevel
from sluice.graph import StreamsSpec
from sluice.source.admission import log_measure
from sluice.source.decode import output_schema
from sluice.source.ids import event_ids
from sluice.source.options import SourceOptions
from sluice.source.streams import RedisStreamsLog


def decoded_table(cfg: Config, events: Sequence[dict[str, Any]], ref_ms: int) -> pa.Table:
    """Events as the source would decode them: schema fields plus the meta columns.

    An event may carry `_err` (a dead-letter reason) and `_ems` (its entry time).
    """
    opts = SourceOptions.from_config(cfg, "redis://unused")
    schema = output_schema(opts)
    cols: dict[str, list[Any]] = {f.name: [] for f in schema}
    for i, ev in enumerate(events):
        for name, _, _ in opts.fields:
            cols[name].append(ev.get(name))
        ems = ev.get("_ems", ev.get("ts", ref_ms))
        cols["_ts"].append(ev.get("ts", ems))
        cols["_ems"].append(ems)
        cols["_ref"].append(ref_ms)
        cols["_err"].append(ev.get("_err"))
        cols["_field"].append(ev.get("_field"))
        cols["_eid"].append(f"{ems}-{i}" if ev.get("_err") else None)
        cols["_idx"].append(0)
        cols["_raw"].append("{}" if ev.get("_err") else None)
        cols["_e"].append(int(event_ids([ems], [i], [0], "events:0")[0]))
    return pa.Table.from_pydict(cols, schema=schema)


_BY_CARD = {"key": ["card"], "slice": "10s", "retention": "1d"}
# Metrics whose `value` can fail or not be finite: a division by zero (qty 0), a NaN (a negative
# amount), an infinity (an amount of 18 or more); beside a plain count.
EXPRESSION_METRICS = [
    {"name": "txn_count", "agg": "count", **_BY_CARD},
    {"name": "per_unit", "agg": "sum", "value": "amount / qty", **_BY_CARD},
    {"name": "root", "agg": "sum", "value": "sqrt(amount)", **_BY_CARD},
    {"name": "big", "agg": "max", "value": "amount * 1e307", **_BY_CARD},
]


def slice_snapshot(client: redis.Redis) -> dict[bytes, Any]:
    """Every slice hash (its fields) and slice HyperLogLog (its bytes), for comparisons."""
    out: dict[bytes, Any] = {k: client.hgetall(k) for k in client.scan_iter(match="sluice:s:*")}
    out.update({k: client.get(k) for k in client.scan_iter(match="sluice:h:*")})
    return dict(sorted(out.items()))


def stream_level(
    client: Any, streams: Sequence[str], bp: BackpressureConfig, reader: str | None = None
) -> QueueLevel:
    """The backlog of Redis streams `streams` (of `reader`, or the slowest reader), judged by
    `bp`: what the valves measure."""
    opts = SourceOptions(
        url="",
        log=StreamsSpec(tuple(streams)),
        format="jsonl",
        fields=(),
        time_field=None,
        max_events_per_batch=None,
        max_string_bytes=4096,
    )
    return log_measure(RedisStreamsLog(opts, client), bp, reader)()


def same_plan(log: RedisStreamsLog, start: dict[str, str], budget: int) -> Any:
    """Plan with `log` (which may hold entries walked ahead, or read past an earlier plan's
    end) and with a fresh log of the same options that walks everything itself: the two plans
    must agree in every field."""
    if log._ahead_walk is not None:
        log._ahead_walk.join()  # so that the fresh log's walk sees the same stream
    fresh = RedisStreamsLog(log.opts).plan(start, budget, 0)
    got = log.plan(start, budget, 0)
    assert (got.end, got.entries, got.events, got.more, got.admitted) == (
        fresh.end, fresh.entries, fresh.events, fresh.more, fresh.admitted,
    )  # fmt: skip
    return got


def produce_now(r: Any, n: int, shards: Sequence[str] = ("events:0", "events:1")) -> None:
    """`n` events of the test config, stamped now, over its shards (`cfg.source.shard_keys()`:
    on one Redis `events:0` and `:1`)."""
    now = time.time_ns() // 1_000_000
    for i in range(n):
        ev = {"ts": now, "card": f"c{i % 7}", "merchant": "m", "amount": 1.0, "qty": 1}
        r.xadd(shards[i % len(shards)], {"d": orjson.dumps(ev)})
