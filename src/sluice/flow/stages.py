"""The pipeline as a chain of stages, and how each stage measures its input queue.

    ingest ──(input streams)──▶ spark ──(slice store)──▶ (queries)

A stage is a set of tasks (each producer process or API worker is one `ingest` task; the source
reader is the one `spark` task). A stage watches its *own* input queue and signals only its
direct upstream stages (seed 000). The topology is data, so longer chains (stage → stream →
stage) add entries here rather than code paths.

Queue levels:
- a stream-fed stage: the entries and bytes of its input streams that are not yet committed
  (the input is trimmed at the committed id, so the stream itself is the queue);
- the store: the slowest partition's write time in the newest batch, and Redis `used_memory`
  against `maxmemory`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.config import BackpressureConfig, Config

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
    return topology(tuple(cfg.source.shard_keys()))


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


def stream_level(client: Any, streams: tuple[str, ...], bp: BackpressureConfig) -> QueueLevel:
    """Entries and bytes held in `streams` (one pipelined round trip)."""
    pipe = client.pipeline(transaction=False)
    for s in streams:
        pipe.xlen(s)
        # SAMPLES 0: every node of the stream. The default (5 sampled nodes) was measured off by
        # 0.4x to 2.7x on backlogs of large jsonl entries; all nodes cost microseconds each.
        pipe.execute_command("MEMORY", "USAGE", s, "SAMPLES", 0)
    res = pipe.execute()
    entries = sum(int(res[i]) for i in range(0, len(res), 2))
    size = sum(int(res[i] or 0) for i in range(1, len(res), 2))
    return QueueLevel(
        entries,
        size,
        overloaded=size >= bp.high_watermark,
        quiet=size <= bp.low_watermark,
        detail={"high_watermark": bp.high_watermark, "low_watermark": bp.low_watermark},
    )


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
