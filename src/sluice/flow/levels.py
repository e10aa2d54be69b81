"""Queue levels: one measurement of a stage's input queue against its watermarks.

A stream-fed stage's queue is its log's backlog (`source.log.Log.level`); the slice store's is
the slowest partition's write time in the newest batch, and Redis `used_memory` against
`maxmemory`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.config import BackpressureConfig


@dataclass(frozen=True)
class QueueLevel:
    """One measurement of a stage's input queue, and where it sits against its watermarks."""

    entries: int
    bytes: int
    overloaded: bool
    quiet: bool
    detail: dict[str, Any]

    @classmethod
    def against(
        cls, entries: int, size_bytes: int, bp: BackpressureConfig, **detail: Any
    ) -> QueueLevel:
        """A backlog of `entries` and `size_bytes` judged by `bp`'s byte watermarks."""
        return cls(
            entries,
            size_bytes,
            overloaded=size_bytes >= bp.high_watermark,
            quiet=size_bytes <= bp.low_watermark,
            detail={
                "high_watermark": bp.high_watermark,
                "low_watermark": bp.low_watermark,
                **detail,
            },
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "entries": self.entries,
            "bytes": self.bytes,
            "overloaded": self.overloaded,
            "quiet": self.quiet,
            **self.detail,
        }


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
