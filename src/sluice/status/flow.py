"""The flow picture for `GET /v1/status` and `sluice status`: each stage's tasks, their current
and origin rates, backpressure flags and ratios, queue levels, and the recent state timeline."""

from __future__ import annotations

from typing import Any

from sluice.config import Config
from sluice.flow.board import STALE_MS, Board
from sluice.graph import graph_topology


def flow_status(client: Any, cfg: Config, now_ms: int, timeline: int = 50) -> dict[str, Any]:
    board = Board(client)
    tasks = board.all_tasks()
    stages: dict[str, Any] = {}
    for name, stage in graph_topology(cfg).flow.items():
        mine = [t for t in tasks.values() if t.get("stage") == name]
        live = [t for t in mine if now_ms - int(t.get("updated_ms", 0)) <= STALE_MS]
        rates = [t.get("rate") for t in live]
        origins = [t.get("origin_rate") for t in live if t.get("origin_rate") is not None]
        stages[name] = {
            "upstreams": list(stage.upstreams),
            "tasks": len(live),
            "backpressure": any(bool(t.get("backpressure")) for t in live),
            "overloaded": any(bool((t.get("queue") or {}).get("overloaded")) for t in live)
            or any(bool(t.get("overloaded")) for t in live),
            # None = at least one task is unlimited, so the stage as a whole has no cap.
            "rate": None if not live or any(r is None for r in rates) else sum(rates),
            "origin_rate": sum(origins) if origins else None,
            "measured_rate": sum(float(t.get("measured_rate") or 0.0) for t in live),
            "emitted_total": sum(int(t.get("emitted_total") or 0) for t in live),
            "backpressure_ratio": max(
                (float(t.get("backpressure_ratio") or 0.0) for t in live), default=0.0
            ),
            "queue": next((t["queue"] for t in live if t.get("queue")), None),
            "changed_ms": max((int(t.get("changed_ms") or 0) for t in live), default=None),
            "task_states": live,
        }
    return {
        "controller": cfg.backpressure.controller,
        "high_watermark": cfg.backpressure.high_watermark,
        "low_watermark": cfg.backpressure.low_watermark,
        "stages": stages,
        "timeline": board.timeline(timeline) if timeline > 0 else [],
    }
