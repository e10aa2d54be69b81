"""The pipeline as a chain of stages, and how each stage measures its input queue.

    ingest ──(input streams)──▶ spark ──(slice store)──▶ (queries)

A stage is a set of tasks (each producer process or API worker is one `ingest` task; the source
reader is the one `spark` task). A stage watches its *own* input queue and signals only its
direct upstream stages (seed 000). The topology is data, so longer chains (stage → stream →
stage) add entries here rather than code paths.

Queue levels:
- a stream-fed stage: the entries and bytes of its input streams that are not yet committed
  (the input is trimmed at the committed id, so the stream itself is the queue; with several
  readers it is trimmed at the slowest one's, and a faster one's queue is estimated);
- the store: the slowest partition's write time in the newest batch, and Redis `used_memory`
  against `maxmemory`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.config import BackpressureConfig, Config
from sluice.redis.keys import shard_side_key
from sluice.source.ids import parse_id

INGEST = "ingest"
SPARK = "spark"
STORE = "store"


@dataclass(frozen=True)
class Stage:
    name: str
    upstreams: tuple[str, ...]
    queue: str  # "streams" | "store" | "none"
    streams: tuple[str, ...] = ()


def topology(input_streams: tuple[str, ...]) -> dict[str, Stage]:
    """Stages by name, in flow order."""
    return {
        INGEST: Stage(INGEST, (), "none"),
        SPARK: Stage(SPARK, (INGEST,), "streams", input_streams),
        STORE: Stage(STORE, (SPARK,), "store"),
    }


def config_topology(cfg: Config) -> dict[str, Stage]:
    """Every flow stage of `cfg`, with its `stages:` (see `pipeline.graph.flow_topology`)."""
    from sluice.pipeline.graph import graph_topology

    return graph_topology(cfg).flow


def downstream_of(stages: dict[str, Stage], name: str) -> list[Stage]:
    return [s for s in stages.values() if name in s.upstreams]


@dataclass(frozen=True)
class QueueLevel:
    """One measurement of a stage's input queue, and where it sits against its watermarks."""

    entries: int
    bytes: int
    overloaded: bool
    quiet: bool
    detail: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {
            "entries": self.entries,
            "bytes": self.bytes,
            "overloaded": self.overloaded,
            "quiet": self.quiet,
            **self.detail,
        }


def stream_level(
    client: Any, streams: tuple[str, ...], bp: BackpressureConfig, reader: str | None = None
) -> QueueLevel:
    """Entries and bytes held in `streams` (one pipelined round trip).

    With `reader`, that reader's own backlog. A shard is trimmed up to its slowest reader (see
    release.lua), so for the slowest one the stream is exact; for a faster one the part after
    its committed id is an estimate by entry-id time (`backlog_share`), exact only if entries
    arrived uniformly over time. That reads each shard's first and last entry, payload
    included. A reader that has not committed yet counts the whole stream.
    """
    pipe = client.pipeline(transaction=False)
    for s in streams:
        pipe.xlen(s)
        # SAMPLES 0: every node of the stream. The default (5 sampled nodes) was measured off by
        # 0.4x to 2.7x on backlogs of large jsonl entries; all nodes cost microseconds each.
        pipe.execute_command("MEMORY", "USAGE", s, "SAMPLES", 0)
        if reader is not None:
            pipe.hget(shard_side_key("rd", s), reader)
            pipe.execute_command("XRANGE", s, "-", "+", "COUNT", 1)
            pipe.execute_command("XREVRANGE", s, "+", "-", "COUNT", 1)
    res = pipe.execute()
    step = 2 if reader is None else 5
    entries = size = 0
    for i in range(0, len(res), step):
        share = 1.0
        if reader is not None:
            share = backlog_share(res[i + 2], _entry_id(res[i + 3]), _entry_id(res[i + 4]))
        entries += round(int(res[i]) * share)
        size += round(int(res[i + 1] or 0) * share)
    detail: dict[str, Any] = {
        "high_watermark": bp.high_watermark,
        "low_watermark": bp.low_watermark,
    }
    if reader is not None:
        detail["reader"] = reader
    return QueueLevel(
        entries,
        size,
        overloaded=size >= bp.high_watermark,
        quiet=size <= bp.low_watermark,
        detail=detail,
    )


def backlog_share(
    offset_id: str | bytes | None, first_id: str | bytes | None, last_id: str | bytes | None
) -> float:
    """The fraction of a stream after `offset_id`, by entry time: the share of the span from
    the first to the last entry's ms that lies after the offset. 1 with no offset (nothing
    committed) or when all entries share one ms; 0 when the stream is empty or the offset is at
    or past its last entry."""
    if first_id is None or last_id is None:
        return 0.0
    if offset_id is None:
        return 1.0
    offset, first, last = parse_id(offset_id), parse_id(first_id), parse_id(last_id)
    if offset >= last:
        return 0.0
    if last[0] == first[0]:
        return 1.0
    share = (last[0] - max(offset[0], first[0])) / (last[0] - first[0])
    return min(1.0, max(0.0, share))


def _entry_id(reply: Any) -> Any:
    """The id of the one entry of an XRANGE/XREVRANGE ... COUNT 1 reply, parsed or raw."""
    return reply[0][0] if reply else None


def memory_fraction(client: Any) -> tuple[int, int]:
    """(used_memory, maxmemory) in bytes; maxmemory 0 means no limit is set. On a cluster,
    those of the master nearest its limit (the most used one when none has a limit): the store
    is as full as its fullest node."""
    from sluice.redis.cluster import node_clients

    best: tuple[float, int, int] | None = None
    for node in node_clients(client):
        info = node.info("memory")
        used, cap = int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))
        rank = (used / cap if cap else 0.0, used, cap)
        if best is None or rank > best:
            best = rank
    assert best is not None
    return best[1], best[2]


def store_level(client: Any, write_ms: float | None, bp: BackpressureConfig) -> QueueLevel:
    used, cap = memory_fraction(client)
    frac = used / cap if cap else 0.0
    w = bp.store
    lat = write_ms or 0.0
    return QueueLevel(
        0,
        used,
        overloaded=lat >= w.latency_high or (cap > 0 and frac >= w.memory_high),
        quiet=lat <= w.latency_low and (cap == 0 or frac <= w.memory_low),
        detail={
            "write_ms": write_ms,
            "used_memory": used,
            "maxmemory": cap,
            "memory_fraction": round(frac, 4),
            "latency_high_ms": w.latency_high,
            "latency_low_ms": w.latency_low,
            "memory_high": w.memory_high,
            "memory_low": w.memory_low,
        },
    )
