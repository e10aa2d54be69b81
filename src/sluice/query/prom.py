"""Prometheus exposition of the pipeline status (standard text format, official client)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST


def exposition(status: dict[str, Any]) -> tuple[bytes, str]:
    reg = CollectorRegistry()
    Gauge("sluice_backlog_entries", "Input entries not yet committed", registry=reg).set(
        status["backlog"]["entries"]
    )
    Gauge("sluice_processed_events_per_second", "Events folded per second", registry=reg).set(
        status["processed_events_per_s"]
    )
    fresh = Gauge(
        "sluice_freshness_ms", "Produce-to-queryable delay of recent batches", ["quantile"],
        registry=reg,
    )  # fmt: skip
    for q, v in status["freshness_ms"].items():
        if v is not None:
            fresh.labels(q).set(v)
    counters = Gauge("sluice_events", "Pipeline event counters", ["counter"], registry=reg)
    for name, v in status["counters"].items():
        counters.labels(name).set(v)
    return generate_latest(reg), CONTENT_TYPE_LATEST
