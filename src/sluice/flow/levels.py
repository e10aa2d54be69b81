"""Queue levels: one measurement of a stage's input queue against its watermarks.

A stream-fed stage's queue is its log's backlog (`source.log.Log.level`); the slice store's is
the slowest partition's write time in the newest batch, judged by the work it did, and Redis
`used_memory` against `maxmemory`.

A batch's write time grows with its size by nature, so a long write alone does not mean the
store is overloaded: a backlog drained in large batches on a healthy Redis writes for seconds.
The write time is therefore also taken per slice update, against the store's healthy time per
update (`UpdateCost`): it counts as over `latency_high` only when each update also took
SLOWDOWN_HIGH times the healthy time, and as under `latency_low` when each took at most
SLOWDOWN_LOW times it.
"""

from __future__ import annotations

from collections import deque
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


SLOWDOWN_HIGH = 3.0
SLOWDOWN_LOW = 1.5
# Whatever was measured, a healthy store applies a slice update in less than this (µs): a Redis
# takes a few µs each, so a store slow from its first batch is still seen as slow.
BASELINE_CAP_US = 50.0
BASELINE_MIN_UPDATES = 1_000  # a batch with fewer updates says little about the cost of one
BASELINE_BATCHES = 64


class UpdateCost:
    """The store's healthy time per slice update (µs): the lower quartile of the per-update
    write times of the newest BASELINE_BATCHES batches that wrote at least
    BASELINE_MIN_UPDATES updates, and at most BASELINE_CAP_US. A store slow for longer than
    that window becomes its own baseline, up to the cap."""

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=BASELINE_BATCHES)

    def add(self, us_per_update: float | None, updates: int) -> None:
        if us_per_update is not None and updates >= BASELINE_MIN_UPDATES:
            self.samples.append(us_per_update)

    def baseline_us(self) -> float:
        if not self.samples:
            return BASELINE_CAP_US
        return min(BASELINE_CAP_US, sorted(self.samples)[len(self.samples) // 4])


def store_level(
    client: Any,
    write_ms: float | None,
    bp: BackpressureConfig,
    us_per_update: float | None = None,
    baseline_us: float | None = None,
) -> QueueLevel:
    """The store's level: the slowest partition's write time (`write_ms`), judged per update
    when its time per update and the healthy one are known (see the module docstring), and
    Redis' memory."""
    used, cap = memory_fraction(client)
    frac = used / cap if cap else 0.0
    w = bp.store
    lat = write_ms or 0.0
    slow, fast = lat >= w.latency_high, lat <= w.latency_low
    slowdown = None
    if us_per_update is not None and baseline_us:
        slowdown = us_per_update / baseline_us
        slow = slow and slowdown >= SLOWDOWN_HIGH
        fast = fast or slowdown <= SLOWDOWN_LOW
    return QueueLevel(
        0,
        used,
        overloaded=slow or (cap > 0 and frac >= w.memory_high),
        quiet=fast and (cap == 0 or frac <= w.memory_low),
        detail={
            "write_ms": write_ms,
            "us_per_update": None if us_per_update is None else round(us_per_update, 2),
            "baseline_us_per_update": None if baseline_us is None else round(baseline_us, 2),
            "slowdown": None if slowdown is None else round(slowdown, 2),
            "used_memory": used,
            "maxmemory": cap,
            "memory_fraction": round(frac, 4),
            "latency_high_ms": w.latency_high,
            "latency_low_ms": w.latency_low,
            "memory_high": w.memory_high,
            "memory_low": w.memory_low,
        },
    )
