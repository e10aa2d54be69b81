"""Pipeline state as seen from Redis (and the log): backlog, counters, rates and freshness.

Everything here reads only, so `sluice status`, the API and the demo line can show it from any
process. The backlog is what the slowest reader of the source has not committed yet: for Redis
Streams the entries left in the streams, for Kafka the consumer lag per partition
(`source.log.Log.level`).
"""

from __future__ import annotations

import time
from typing import Any

import orjson
import redis

from sluice.config import Config
from sluice.flow.levels import QueueLevel, memory_fraction
from sluice.graph import graph_topology, log_spec, reader_name
from sluice.redis.keys import BATCHES_KEY, HEALTH_KEY, STATS_KEY, stats_keys
from sluice.redis.loading import LOADING, is_loading
from sluice.source.log import Backlog, Log, LogUnavailable
from sluice.source.logs import open_log
from sluice.source.options import SourceOptions
from sluice.source.waiting import read_log_state
from sluice.status.consistency import read_consistency
from sluice.status.coverage import metric_history
from sluice.status.flow import flow_status
from sluice.status.ledger import Ledger
from sluice.status.roles import read_roles
from sluice.status.timings import timing_status

UNREACHABLE_MEMO_S = 10.0

_logs: dict[tuple[int, str], Log] = {}
_unreachable: dict[int, tuple[float, LogUnavailable]] = {}  # id(log) -> (until, the error)


def source_log(client: Any, cfg: Config, stream: str | None = None) -> Log:
    """The log of `stream` (the source by default), kept per client and log: a Kafka log holds
    an admin client that is costly to make for every look."""
    graph = graph_topology(cfg) if stream not in (None, cfg.source.stream) else None
    spec = log_spec(cfg) if graph is None else graph.streams[str(stream)].log
    key = (id(client), repr(spec))
    found = _logs.get(key)
    if found is None:
        base = SourceOptions.from_config(cfg, "")
        found = _logs[key] = open_log(SourceOptions(**{**base.__dict__, "log": spec}), client)
    return found


def log_level(
    client: Any, cfg: Config, stream: str | None = None, reader: str | None = None
) -> Backlog:
    """`source_log(...).level(reader)`, except that a log found unreachable is not asked again
    for UNREACHABLE_MEMO_S: each look at a Kafka cluster that is down waits for the request
    timeout (5 s), and the status views look every second or two. Raises LogUnavailable."""
    log_ = source_log(client, cfg, stream)
    memo = _unreachable.get(id(log_))
    if memo is not None and time.monotonic() < memo[0]:
        raise memo[1]
    try:
        b = log_.level(reader)
    except LogUnavailable as e:
        if e.reason == "unreachable":
            _unreachable[id(log_)] = (time.monotonic() + UNREACHABLE_MEMO_S, e)
        raise
    _unreachable.pop(id(log_), None)
    return b


def backlog(client: Any, cfg: Config) -> tuple[int, dict[str, int]]:
    """Input entries not yet committed by the slowest reader, in all and per shard (Kafka:
    per partition). Raises LogUnavailable when the log cannot be read."""
    b = log_level(client, cfg)
    return b.entries, b.shards


def log_status(client: Any, cfg: Config) -> tuple[Backlog | None, dict[str, Any]]:
    """The source log's backlog (None when it cannot be read) and its section of the status:
    its kind, whether it can be read, and for Kafka the topic, group and lag per partition."""
    kind = "redis" if cfg.source.kafka is None else "kafka"
    section: dict[str, Any] = {"kind": kind, "state": "ok"}
    if cfg.source.kafka is not None:
        section.update(topic=cfg.source.kafka.topic, group_id=cfg.source.kafka.group_id,
                       bootstrap=cfg.source.kafka.bootstrap)  # fmt: skip
    waiting = read_log_state(client)
    if waiting is not None and waiting["state"] == "waiting":
        section.update(state="waiting", reason=waiting["reason"], message=waiting["message"],
                       since_ms=waiting["since_ms"])  # fmt: skip
    try:
        b = log_level(client, cfg)
    except LogUnavailable as e:
        section.update(state="waiting", reason=e.reason, message=str(e))
        return None, section
    if kind == "kafka":
        section["lag"] = b.shards
    return b, section


def recent_batches(client: Any, n: int = 60) -> list[dict[str, Any]]:
    return [orjson.loads(b) for b in client.lrange(BATCHES_KEY, 0, n - 1)]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    vs = sorted(values)
    k = min(len(vs) - 1, max(0, round(q * (len(vs) - 1))))
    return vs[k]


def read_status(client: Any, cfg: Config, now_ms: int, window_s: float = 10.0) -> dict[str, Any]:
    """A JSON-ready snapshot: backlog, totals, processed rate and freshness over `window_s`.

    While Redis loads its dataset (a restart) nothing can be read: the snapshot is then
    `loading_status`. Any other Redis error is raised."""
    try:
        return _read_status(client, cfg, now_ms, window_s)
    except (redis.exceptions.ConnectionError, redis.exceptions.ResponseError) as e:
        if not is_loading(e):
            raise
        return loading_status(cfg, str(e))


def loading_status(cfg: Config, message: str) -> dict[str, Any]:
    """The snapshot while Redis loads its dataset: `redis.state` is `loading`, the log and the
    pipeline are waiting (the source and the writer wait for it too), everything else is
    unknown: None, or empty. Same shape as a full snapshot, so every view can show it."""
    unknown: dict[str, Any] = {
        "entries": None, "bytes": None, "bytes_estimated": False, "shards": {},
        "high_watermark": cfg.backpressure.high_watermark,
        "low_watermark": cfg.backpressure.low_watermark,
    }  # fmt: skip
    kind = "redis" if cfg.source.kafka is None else "kafka"
    rates = dict.fromkeys(("input_events_per_s", "admitted_events_per_s",
                           "processed_events_per_s"), 0.0)  # fmt: skip
    return {
        "backlog": unknown,
        "log": {"kind": kind, "state": "waiting", "reason": LOADING, "message": message},
        "processed_events_per_s": 0.0,
        "rates": rates,
        "freshness_ms": {"p50": None, "p99": None},
        "counters": {},
        "last_batch": None,
        "last_batch_age_ms": None,
        "redis": {"state": LOADING, "message": message, "used_memory": None, "maxmemory": None},
        "flow": None,
        "pipeline": {"state": "waiting_for_redis", "consecutive_failures": 0, "restarts": 0,
                     "last_error": message, "heartbeat_age_ms": None, "changed_ms": None},
        "audit": None,
        "stages": {},
        "roles": {},
        "timing": {},
        "consistency": None,
        "coverage": {},
    }  # fmt: skip


def _read_status(client: Any, cfg: Config, now_ms: int, window_s: float) -> dict[str, Any]:
    level, log_section = log_status(client, cfg)
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
    roles = read_roles(client, cfg, now_ms)
    pipeline = pipeline_health(client, now_ms, log_section, roles)
    # A killed driver's admission task keeps its last published rate until it goes stale.
    admitted = 0.0 if pipeline["state"] == "not_running" else _stage_rate(flow, "spark")
    return {
        "backlog": {
            "entries": level.entries if level else None,
            "bytes": level.bytes if level else None,
            "bytes_estimated": bool(level and level.detail.get("bytes_estimated")),
            "high_watermark": cfg.backpressure.high_watermark,
            "low_watermark": cfg.backpressure.low_watermark,
            "shards": level.shards if level else {},
        },
        "log": log_section,
        "processed_events_per_s": processed,
        "rates": {
            # Events per second: sent by producers (the SDK and POST /v1/events, metered by
            # their ingest tasks), admitted into micro-batches, and folded into the store.
            "input_events_per_s": _stage_rate(flow, "ingest"),
            "admitted_events_per_s": admitted,
            "processed_events_per_s": processed,
        },
        "freshness_ms": freshness_of(recent),
        "counters": counters,
        "last_batch": last,
        "last_batch_age_ms": (now_ms - last["done_ms"]) if last else None,
        "redis": {"state": "ok", "used_memory": used, "maxmemory": cap},
        "flow": flow,
        "pipeline": pipeline,
        "audit": audit_status(client, cfg, counters, last),
        "stages": stages_status(client, cfg, now_ms),
        "roles": roles,
        "timing": timing_status(client, now_ms, window_s),
        "consistency": read_consistency(client),
        "coverage": metric_history(client, cfg, now_ms),
    }


def stages_status(client: Any, cfg: Config, now_ms: int) -> dict[str, Any]:
    """Per streaming query of a multi-stage graph (stages, and folds of their streams): its
    counters, the age of its newest batch, and its own input backlog. Empty without stages."""
    if not cfg.stages:
        return {}
    graph = graph_topology(cfg)
    out: dict[str, Any] = {}
    for name, stage in graph.flow.items():
        if stage.queue != "streams":
            continue
        raw = {k.decode(): v.decode() for k, v in client.hgetall(stats_keys(name).stats).items()}
        last = orjson.loads(raw["last_batch"]) if "last_batch" in raw else None
        first = graph.streams[stage.inputs[0]]
        backlog_: dict[str, Any] | None = None
        try:
            entries = size = 0
            for stream in stage.inputs:
                b = log_level(client, cfg, stream, reader_name(name))
                entries, size = entries + b.entries, size + b.bytes
            backlog_ = QueueLevel.against(entries, size, first.backpressure,
                                          reader=reader_name(name)).as_dict()  # fmt: skip
        except LogUnavailable:
            backlog_ = None
        out[name] = {
            "upstreams": list(stage.upstreams),
            "counters": {k: int(v) for k, v in raw.items() if not k.startswith("last_")},
            "last_batch_age_ms": (now_ms - last["done_ms"]) if last else None,
            "backlog": backlog_,
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


def pipeline_health(
    client: Any,
    now_ms: int,
    log_section: dict[str, Any] | None = None,
    roles: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The supervisor's published state; `waiting_for_log` while it runs but its log cannot be
    read (`log_section`). `not_running` when no heartbeat came for HEARTBEAT_STALE_MS, or at
    once, for a pipeline that runs under a lease (`sluice run`; `sluice demo` has none), when
    `roles` (`status.roles.read_roles`) shows no live lease: only the leader writes this
    state, and a killed leader's lease lapses within its ttl (a Spark query's start can hold
    the heartbeat back for seconds; the lease is renewed by a thread of its own)."""
    raw = {k.decode(): v.decode() for k, v in client.hgetall(HEALTH_KEY).items()}
    if not raw:
        return {"state": "not_running", "consecutive_failures": 0, "restarts": 0}
    beat = int(raw.get("heartbeat_ms", 0))
    state = raw.get("state", "unknown")
    leaderless = (
        raw.get("leased") == "1"
        and roles is not None
        and not any(x["live"] for x in roles["leases"].values())
    )
    if state != "stopped" and (now_ms - beat > HEARTBEAT_STALE_MS or leaderless):
        state = "not_running"
    last_error = raw.get("last_error") or None
    if state == "running" and log_section is not None and log_section["state"] == "waiting":
        state, last_error = "waiting_for_log", log_section.get("message")
    return {
        "state": state,
        "consecutive_failures": int(raw.get("consecutive_failures", 0)),
        "restarts": int(raw.get("restarts", 0)),
        "last_error": last_error,
        "heartbeat_age_ms": max(0, now_ms - beat),  # a beat may land after `now_ms` was read
        "changed_ms": int(raw["changed_ms"]) if "changed_ms" in raw else None,
    }


def audit_status(
    client: Any, cfg: Config, counters: dict[str, int], last: dict[str, Any] | None
) -> dict[str, Any]:
    """The audit's totals and its books: events in = aggregated + dead-lettered + expired."""
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
            "events_removed": counters.get("events_removed", 0),
            "events_in": events_in,
            "aggregated": aggregated,
            "dead_lettered": dead - expired,
            "expired": expired,
            "dead_by_reason": by_reason,
            "balanced": events_in == aggregated + dead,
        },
    }
