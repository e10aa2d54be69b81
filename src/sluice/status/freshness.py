"""The freshness histogram: how long events wait between Redis accepting them and being
queryable, one observation per committed batch.

The observation is the wait of the batch's *oldest* entry (`done_ms − min_ems`, entry-id times,
so an event whose own timestamp is late does not count as stale). It bounds the wait of every
event in the batch. The histogram lives in Redis (`sluice:{stats}:freshness`) and is added to
by the same script that records the batch, so a re-run batch is not observed twice, and every
API worker exports the same numbers. Fields: `le_<ms>` (count in that bucket, not cumulative),
`count`, `sum_ms`.
"""

from __future__ import annotations

from typing import Any

from sluice.redis.keys import FRESHNESS_KEY

# Upper bounds, ms. The last bucket (+Inf) is `count` minus the others.
BUCKETS_MS = (50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000, 300_000)


def observation(rec: dict[str, Any]) -> int | None:
    """The batch's freshness in ms, or None for a batch without entries."""
    if rec.get("min_ems") is None:
        return None
    return max(0, int(rec["done_ms"]) - int(rec["min_ems"]))


def increments(wait_ms: int) -> list[Any]:
    """(field, increment) pairs for one observation, flat, for `record_batch.lua`."""
    out: list[Any] = ["count", 1, "sum_ms", wait_ms]
    bound = next((b for b in BUCKETS_MS if wait_ms <= b), None)
    if bound is not None:
        out += [f"le_{bound}", 1]
    return out


def read_histogram(client: Any) -> dict[str, Any]:
    """`{"buckets": [(upper bound in s, cumulative count), …, (inf, count)], "count", "sum_s"}`."""
    raw = {k.decode(): int(v) for k, v in client.hgetall(FRESHNESS_KEY).items()}
    count = raw.get("count", 0)
    buckets: list[tuple[float, int]] = []
    running = 0
    for b in BUCKETS_MS:
        running += raw.get(f"le_{b}", 0)
        buckets.append((b / 1000, running))
    buckets.append((float("inf"), count))
    return {"buckets": buckets, "count": count, "sum_s": raw.get("sum_ms", 0) / 1000}
