"""Pipeline state as seen from Redis: backlog, counters, rates and freshness.

Everything here reads Redis only, so `sluice status`, the API and the demo line can show it from
any process. The backlog is the number of input entries not yet committed: the input is trimmed
at the last committed id (which itself stays, as the resume point), so it is the stream length,
less one when the first entry is that resume point.
"""

from __future__ import annotations

from typing import Any

import orjson

from sluice.config import Config
from sluice.flow.stages import memory_fraction, stream_level
from sluice.flow.status import flow_status
from sluice.redis.keys import (
    BATCHES_KEY,
    HEALTH_KEY,
    OFFSETS_KEY,
    STATS_KEY,
    shard_side_key,
    stats_keys,
)


def backlog(client: Any, cfg: Config) -> tuple[int, dict[str, int]]:
    """Input entries not yet committed by the slowest reader, in all and per shard."""
    shards = cfg.source.shard_keys()
    pipe = client.pipeline(transaction=False)
    for s in shards:
        pipe.xlen(s)
        pipe.execute_command("XRANGE", s, "-", "+", "COUNT", 1)
        pipe.hvals(shard_side_key("rd", s))  # every reader's committed id
    pipe.hgetall(OFFSETS_KEY)  # the default reader's, as written before readers had names
    res = pipe.execute()
    legacy = {k.decode(): v.decode() for k, v in res[-1].items()}
    per: dict[str, int] = {}
    for i, s in enumerate(shards):
        length, first, ids = int(res[3 * i]), res[3 * i + 1], res[3 * i + 2]
        first_id = _first_id(first)
        committed = {v.decode() for v in ids} | ({legacy[s]} if s in legacy else set())
        per[s] = max(0, length - (1 if first_id is not None and first_id in committed else 0))
    return sum(per.values()), per


def _first_id(reply: Any) -> str | None:
    if not reply:
        return None
    entry = reply[0]
    eid = entry[0]
    return eid.decode() if isinstance(eid, bytes) else str(eid)


def recent_batches(client: Any, n: int = 60) -> list[dict[str, Any]]:
    return [orjson.loads(b) for b in client.lrange(BATCHES_KEY, 0, n - 1)]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    vs = sorted(values)
    k = min(len(vs) - 1, max(0, round(q * (len(vs) - 1))))
    return vs[k]


def read_status(client: Any, cfg: Config, now_ms: int, window_s: float = 10.0) -> dict[str, Any]:
    """A JSON-ready snapshot: backlog, totals, processed rate and freshness over `window_s`."""
    total, per_shard = backlog(client, cfg)
    level = stream_level(client, tuple(cfg.source.shard_keys()), cfg.backpressure)
    raw = client.hgetall(STATS_KEY)
    stats = {k.decode(): v.decode() for k, v in raw.items()}
    counters = {k: int(v) for k, v in stats.items() if k not in ("last_token", "last_batch")}
    batches = recent_batches(client)
    horizon = now_ms - int(window_s * 1000)
    recent = [b for b in batches if b["done_ms"] >= horizon]
    events = sum(b["events"] for b in recent)
    span_s = window_s
    if recent:
        span_s = max(0.5, min(window_s, (now_ms - min(b["started_ms"] for b in recent)) / 1000))
    last = orjson.loads(stats["last_batch"]) if "last_batch" in stats else None
    flow = flow_status(client, cfg, now_ms)
    processed = events / span_s if recent else 0.0
    used, cap = memory_fraction(client)
    return {
        "backlog": {
            "entries": total,
            "bytes": level.bytes,
            "high_watermark": cfg.backpressure.high_watermark,
            "low_watermark": cfg.backpressure.low_watermark,
            "shards": per_shard,
        },
        "processed_events_per_s": processed,
        "rates": {
            # Events per second: sent by producers (the SDK and POST /v1/events, metered by
            # their ingest tasks), admitted into micro-batches, and folded into the store.
            "input_events_per_s": _stage_rate(flow, "ingest"),
            "admitted_events_per_s": _stage_rate(flow, "spark"),
            "processed_events_per_s": processed,
        },
        "freshness_ms": freshness_of(recent),
        "counters": counters,
        "last_batch": last,
        "last_batch_age_ms": (now_ms - last["done_ms"]) if last else None,
        "redis": {"used_memory": used, "maxmemory": cap},
        "flow": flow,
        "pipeline": pipeline_health(client, now_ms),
        "audit": audit_status(client, cfg, counters, last),
        "stages": stages_status(client, cfg, now_ms),
    }


def stages_status(client: Any, cfg: Config, now_ms: int) -> dict[str, Any]:
    """Per streaming query of a multi-stage graph (stages, and folds of their streams): its
    counters, the age of its newest batch, and its own input backlog. Empty without stages."""
    if not cfg.stages:
        return {}
    from sluice.pipeline.graph import graph_topology, reader_name

    graph = graph_topology(cfg)
    by_shard = {k: spec for spec in graph.streams.values() for k in spec.shards}
    out: dict[str, Any] = {}
    for name, stage in graph.flow.items():
        if stage.queue != "streams":
            continue
        raw = {k.decode(): v.decode() for k, v in client.hgetall(stats_keys(name).stats).items()}
        last = orjson.loads(raw["last_batch"]) if "last_batch" in raw else None
        bp = by_shard[stage.streams[0]].backpressure
        level = stream_level(client, stage.streams, bp, reader_name(name))
        out[name] = {
            "upstreams": list(stage.upstreams),
            "counters": {k: int(v) for k, v in raw.items() if not k.startswith("last_")},
            "last_batch_age_ms": (now_ms - last["done_ms"]) if last else None,
            "backlog": level.as_dict(),
        }
    return out


def freshness_of(batches: list[dict[str, Any]]) -> dict[str, float | None]:
    """p50, p99 and max of how long the batches' events waited to become queryable: p50 over
    the oldest and newest entry of each batch, p99 and max over the oldest."""
    oldest = [b["done_ms"] - b["min_ems"] for b in batches if b.get("min_ems") is not None]
    newest = [b["done_ms"] - b["max_ems"] for b in batches if b.get("max_ems") is not None]
    return {
        "p50": _percentile(newest + oldest, 0.5),
        "p99": _percentile(oldest, 0.99),
        "max": max(oldest) if oldest else None,
    }


def _stage_rate(flow: dict[str, Any], stage: str) -> float:
    st = flow["stages"].get(stage)
    return float(st["measured_rate"]) if st else 0.0


HEARTBEAT_STALE_MS = 10_000


def pipeline_health(client: Any, now_ms: int) -> dict[str, Any]:
    """The supervisor's published state; `not_running` when no heartbeat came for a while."""
    raw = {k.decode(): v.decode() for k, v in client.hgetall(HEALTH_KEY).items()}
    if not raw:
        return {"state": "not_running", "consecutive_failures": 0, "restarts": 0}
    beat = int(raw.get("heartbeat_ms", 0))
    state = raw.get("state", "unknown")
    if now_ms - beat > HEARTBEAT_STALE_MS and state != "stopped":
        state = "not_running"
    return {
        "state": state,
        "consecutive_failures": int(raw.get("consecutive_failures", 0)),
        "restarts": int(raw.get("restarts", 0)),
        "last_error": raw.get("last_error") or None,
        "heartbeat_age_ms": now_ms - beat,
        "changed_ms": int(raw["changed_ms"]) if "changed_ms" in raw else None,
    }


def audit_status(
    client: Any, cfg: Config, counters: dict[str, int], last: dict[str, Any] | None
) -> dict[str, Any]:
    """The audit's totals and its books: events in = aggregated + dead-lettered + expired."""
    from sluice.pipeline.audit import Ledger

    ledger = Ledger(client, cfg.source.stream, cfg.audit.ledger_shards)
    recent = ledger.recent(int(last["batch"]), 10) if last else []
    dead = counters.get("dead_letters", 0)
    expired = counters.get("dead_expired", 0)
    by_reason = {
        k[5:]: v for k, v in counters.items() if k.startswith("dead_") and k != "dead_letters"
    }
    events_in = counters.get("events_in", 0)
    aggregated = counters.get("events_aggregated", 0)
    return {
        "enabled": cfg.audit.enabled,
        "batches_ok": counters.get("audit_ok", 0),
        "failed_attempts": counters.get("audit_failed", 0),
        "replays": counters.get("audit_replays", 0),
        "all_complete": bool(recent) and all(r["ok"] for r in recent),
        "recent": recent,
        "failures": ledger.failures(5),
        "books": {
            "events_admitted": counters.get("events_admitted", 0),
            "events_in": events_in,
            "aggregated": aggregated,
            "dead_lettered": dead - expired,
            "expired": expired,
            "dead_by_reason": by_reason,
            "balanced": events_in == aggregated + dead,
        },
    }
