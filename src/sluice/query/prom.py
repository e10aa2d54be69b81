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
    Gauge("sluice_backlog_bytes", "Input bytes not yet committed", registry=reg).set(
        status["backlog"].get("bytes") or 0
    )
    flow = status.get("flow")
    if flow:
        _flow_gauges(reg, flow)
    return generate_latest(reg), CONTENT_TYPE_LATEST


def _flow_gauges(reg: CollectorRegistry, flow: dict[str, Any]) -> None:
    """Per stage: the controller's rate and origin rate, its flag and its backpressure ratio.
    An unlimited rate is exported as +Inf."""
    g = {
        "rate": Gauge("sluice_stage_rate", "Emit rate cap, events/s", ["stage"], registry=reg),
        "origin_rate": Gauge(
            "sluice_stage_origin_rate", "Rate before the first throttle, events/s", ["stage"],
            registry=reg,
        ),
        "measured_rate": Gauge(
            "sluice_stage_measured_rate", "Measured emit rate, events/s", ["stage"], registry=reg
        ),
        "backpressure": Gauge(
            "sluice_stage_backpressure", "1 while the stage is throttled", ["stage"], registry=reg
        ),
        "overloaded": Gauge(
            "sluice_stage_overloaded", "1 while the stage's input is over its high watermark",
            ["stage"], registry=reg,
        ),
        "backpressure_ratio": Gauge(
            "sluice_stage_backpressure_ratio", "Fraction of the last 10 s spent throttled",
            ["stage"], registry=reg,
        ),
    }  # fmt: skip
    for name, st in flow["stages"].items():
        for field, gauge in g.items():
            v = st.get(field)
            if field == "rate" and v is None and st.get("tasks"):
                v = float("inf")
            if v is not None:
                gauge.labels(name).set(float(v))
