"""The per-batch time breakdown, as the status views show it (written by `pipeline.timing`).

Each entry is one committed batch: `{batch, events, total_ms, done_ms, phases: {phase: ms}}`
with the phases of `PHASES`, in the order a batch goes through them.
"""

from __future__ import annotations

import statistics
from typing import Any

import orjson

from sluice.redis.keys import timings_key

SPARK_PHASES = ("latestOffset", "queryPlanning", "walCommit", "commitOffsets")
SLUICE_PHASES = ("analyze", "decode", "fold", "wait", "write", "audit", "record", "lease")
# The order of a batch's phases (stacked bottom to top in the dashboard's chart).
PHASES = (*SPARK_PHASES[:3], *SLUICE_PHASES, "commitOffsets", "other")


def read_timings(client: Any, stage: str = "spark", n: int = 60) -> list[dict[str, Any]]:
    """The newest `n` entries, oldest first."""
    return [orjson.loads(x) for x in reversed(client.lrange(timings_key(stage), 0, n - 1))]


def summarize(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over `entries`: per phase and of the whole batch, and the events per batch."""
    if not entries:
        return {"batches": 0, "total_ms": None, "events": None, "phases_ms": {}}
    return {
        "batches": len(entries),
        "total_ms": statistics.median(e["total_ms"] for e in entries),
        "events": statistics.median(e["events"] for e in entries),
        "phases_ms": {
            p: round(statistics.median(e["phases"].get(p, 0.0) for e in entries), 1) for p in PHASES
        },
    }


def timing_status(client: Any, now_ms: int, window_s: float = 10.0) -> dict[str, Any]:
    """`{"phases": [...], "recent": {median over the batches done in the last window_s},
    "batches": [[done_ms, events, [ms per phase]], ...]}` (the newest 60, for the chart)."""
    entries = read_timings(client)
    horizon = now_ms - window_s * 1000
    recent = [e for e in entries if (e.get("done_ms") or 0) >= horizon]
    rows = [
        [e.get("done_ms"), e["events"], [e["phases"].get(p, 0.0) for p in PHASES]] for e in entries
    ]
    return {"phases": list(PHASES), "recent": summarize(recent), "batches": rows}
