"""Prometheus exposition (the standard text format, written by the official client).

Two sources go into one scrape:

- the pipeline's state, read from Redis at scrape time (`StatusCollector`): rates, backlog,
  freshness, stage flow state, audit books, Redis and supervisor health. These are the same
  numbers in every API worker, so any worker may answer a scrape;
- the request latency histogram, recorded in process by the app (`RequestTimer`). With several
  `sluice serve` workers, each writes its observations to the client's multiprocess directory
  (`PROMETHEUS_MULTIPROC_DIR`, set by `serve`), and a scrape merges them all.

All names start with `sluice_`. Counters that Redis keeps since the start are exported as
counters (`_total`), so `rate()` works on them; the rest are gauges.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import redis
from prometheus_client import CollectorRegistry, Histogram, generate_latest, values
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from sluice.flow.levels import memory_fraction
from sluice.status.consistency import RESULTS

PIPELINE_STATES = ("starting", "running", "restarting", "waiting_for_redis", "waiting_for_log",
                   "failing", "stopped", "not_running")  # fmt: skip
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def exposition(
    status: dict[str, Any] | None,
    redis_health: dict[str, Any],
    freshness: dict[str, Any] | None = None,
    timer: RequestTimer | None = None,
) -> tuple[bytes, str]:
    """The scrape body and its content type. `status` is None when Redis did not answer: the
    scrape then carries `sluice_redis_up 0` and the in-process metrics only."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StatusCollector(status, redis_health, freshness))
    body = generate_latest(reg)
    if timer is not None:
        body += timer.exposition()
    return body, CONTENT_TYPE_LATEST


def _gauge(name: str, doc: str, value: float | None, unit: str = "") -> Iterator[Metric]:
    if value is not None:
        yield GaugeMetricFamily(name, doc, value=float(value), unit=unit)


class StatusCollector(Collector):
    """Metric families from one `read_status` snapshot (see `status.snapshot`)."""

    def __init__(
        self,
        status: dict[str, Any] | None,
        redis_health: dict[str, Any],
        freshness: dict[str, Any] | None,
    ) -> None:
        self.status = status
        self.redis = redis_health
        self.freshness = freshness

    def collect(self) -> Iterator[Metric]:
        yield from self._redis()
        st = self.status
        if st is None:
            return
        yield from self._rates(st)
        yield from self._backlog(st)
        yield from self._freshness(st)
        yield from self._counters(st)
        if st.get("flow"):
            yield from self._flow(st["flow"])
        if st.get("audit"):
            yield from self._audit(st["audit"])
        if st.get("pipeline"):
            yield from self._pipeline(st["pipeline"], st.get("last_batch_age_ms"))
        if st.get("consistency"):
            yield from self._consistency(st["consistency"])
        if st.get("coverage"):
            yield self._coverage(st["coverage"])

    def _redis(self) -> Iterator[Metric]:
        h = self.redis
        yield GaugeMetricFamily("sluice_redis_up", "1 while Redis answers PING", value=h["up"])
        yield from _gauge("sluice_redis_ping_seconds", "Round trip of PING", h.get("ping_s"))
        yield from _gauge(
            "sluice_redis_used_memory_bytes", "Redis used_memory", h.get("used_memory")
        )
        yield from _gauge(
            "sluice_redis_maxmemory_bytes", "Redis maxmemory (0: no limit)", h.get("maxmemory")
        )

    def _rates(self, st: dict[str, Any]) -> Iterator[Metric]:
        rates = st.get("rates") or {}
        yield GaugeMetricFamily(
            "sluice_processed_events_per_second", "Events folded per second (last 10 s)",
            value=st["processed_events_per_s"],
        )  # fmt: skip
        yield from _gauge(
            "sluice_input_events_per_second",
            "Events producers sent per second (metered by their ingest tasks)",
            rates.get("input_events_per_s"),
        )
        yield from _gauge(
            "sluice_admitted_events_per_second",
            "Events admitted into micro-batches per second (the Spark task's meter)",
            rates.get("admitted_events_per_s"),
        )

    def _coverage(self, coverage: dict[str, dict[str, Any]]) -> Metric:
        g = GaugeMetricFamily(
            "sluice_metric_history_missing_seconds",
            "The part of a metric's retention its stored history does not reach (status.coverage)",
            labels=["metric"],
        )
        for name, c in coverage.items():
            g.add_metric([name], c["missing_ms"] / 1000)
        return g

    def _backlog(self, st: dict[str, Any]) -> Iterator[Metric]:
        b = st["backlog"]
        yield from _gauge("sluice_backlog_entries", "Input entries not yet committed", b["entries"])
        yield from _gauge(
            "sluice_backlog_bytes",
            "Input bytes not yet committed (Kafka: estimated from the mean record size)",
            b.get("bytes"),
        )
        yield from _gauge(
            "sluice_backlog_high_watermark_bytes", "The input's high watermark",
            b.get("high_watermark"),
        )  # fmt: skip
        yield from _gauge(
            "sluice_backlog_low_watermark_bytes", "The input's low watermark",
            b.get("low_watermark"),
        )  # fmt: skip
        log = st.get("log") or {}
        yield GaugeMetricFamily(
            "sluice_log_up", "1 while the source log can be read (0: waiting for it)",
            value=1 if log.get("state", "ok") == "ok" else 0,
        )  # fmt: skip
        if "lag" in log:
            lag = GaugeMetricFamily(
                "sluice_kafka_lag_records",
                "Records of the Kafka topic not yet committed by Sluice's slowest reader",
                labels=["topic", "partition"],
            )
            for partition, n in sorted(log["lag"].items(), key=lambda kv: int(kv[0])):
                lag.add_metric([log.get("topic", ""), str(partition)], n)
            yield lag

    def _freshness(self, st: dict[str, Any]) -> Iterator[Metric]:
        fresh = GaugeMetricFamily(
            "sluice_freshness_ms",
            "Produce-to-queryable delay of recent batches",
            labels=["quantile"],
        )
        for q, v in st["freshness_ms"].items():
            if v is not None:
                fresh.add_metric([q], v)
        yield fresh
        h = self.freshness
        if h is not None:
            yield HistogramMetricFamily(
                "sluice_freshness_seconds",
                "Per committed batch: how long its oldest entry waited to become queryable",
                buckets=[(_le(b), n) for b, n in h["buckets"]],
                sum_value=h["sum_s"],
            )

    def _counters(self, st: dict[str, Any]) -> Iterator[Metric]:
        c = st["counters"]
        events = GaugeMetricFamily("sluice_events", "Pipeline event counters", labels=["counter"])
        for name, v in c.items():
            events.add_metric([name], v)
        yield events
        for name, field, doc in (
            ("sluice_events_produced", "events_produced", "Events sent by producers"),
            ("sluice_events_admitted", "events_admitted", "Events in committed batches"),
            (
                "sluice_events_removed",
                "events_removed",
                "Events that left the log between their batch's plan and its read",
            ),
            ("sluice_events_in", "events_in", "Events decoded"),
            ("sluice_events_aggregated", "events_aggregated", "Events folded into slices"),
            ("sluice_batches", "batches", "Micro-batches committed"),
            ("sluice_slice_updates_applied", "updates_applied", "Slice updates applied"),
        ):
            yield CounterMetricFamily(name, doc, value=c.get(field, 0))
        dead = CounterMetricFamily(
            "sluice_dead_letters", "Dead letters by reason", labels=["reason"]
        )
        for name, v in c.items():
            if name.startswith("dead_") and name != "dead_letters":
                dead.add_metric([name[5:]], v)
        yield dead

    def _flow(self, flow: dict[str, Any]) -> Iterator[Metric]:
        """Per stage: the controller's rate and origin rate, its flag and its backpressure
        ratio. An unlimited rate is exported as +Inf."""
        fams = {
            "rate": GaugeMetricFamily(
                "sluice_stage_rate", "Emit rate cap, events/s", labels=["stage"]
            ),
            "origin_rate": GaugeMetricFamily(
                "sluice_stage_origin_rate", "Rate before the first throttle, events/s",
                labels=["stage"],
            ),
            "measured_rate": GaugeMetricFamily(
                "sluice_stage_measured_rate", "Measured emit rate, events/s", labels=["stage"]
            ),
            "backpressure": GaugeMetricFamily(
                "sluice_stage_backpressure", "1 while the stage is throttled", labels=["stage"]
            ),
            "overloaded": GaugeMetricFamily(
                "sluice_stage_overloaded", "1 while the stage's input is over its high watermark",
                labels=["stage"],
            ),
            "backpressure_ratio": GaugeMetricFamily(
                "sluice_stage_backpressure_ratio", "Fraction of the last 10 s spent throttled",
                labels=["stage"],
            ),
            "tasks": GaugeMetricFamily(
                "sluice_stage_tasks", "Live tasks of the stage", labels=["stage"]
            ),
        }  # fmt: skip
        for name, st in flow["stages"].items():
            for field, fam in fams.items():
                v = st.get(field)
                if field == "rate" and v is None and st.get("tasks"):
                    v = float("inf")
                if v is not None:
                    fam.add_metric([name], float(v))
        yield from fams.values()

    def _audit(self, audit: dict[str, Any]) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "sluice_audit_batches", "Batches whose XORs balanced", value=audit["batches_ok"]
        )
        yield CounterMetricFamily(
            "sluice_audit_failed_attempts", "Batch attempts that did not balance",
            value=audit["failed_attempts"],
        )  # fmt: skip
        yield CounterMetricFamily(
            "sluice_audit_replays", "In-place replays of unbalanced batches", value=audit["replays"]
        )
        b = audit["books"]
        yield GaugeMetricFamily(
            "sluice_audit_balanced", "1 while events in = aggregated + dead-lettered + expired",
            value=int(b["balanced"]),
        )  # fmt: skip
        books = CounterMetricFamily(
            "sluice_audit_events", "The books: events admitted, in, aggregated, dead-lettered,"
            " expired", labels=["book"],
        )  # fmt: skip
        for book in ("events_admitted", "events_in", "aggregated", "dead_lettered", "expired"):
            books.add_metric([book.removeprefix("events_")], b[book])
        yield books

    def _pipeline(self, p: dict[str, Any], last_batch_age_ms: float | None) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "sluice_pipeline_state", "The supervisor's state (1 for the current one)",
            labels=["state"],
        )  # fmt: skip
        states = (
            PIPELINE_STATES if p["state"] in PIPELINE_STATES else (*PIPELINE_STATES, p["state"])
        )
        for s in states:
            state.add_metric([s], int(s == p["state"]))
        yield state
        yield GaugeMetricFamily(
            "sluice_pipeline_up",
            "1 while the streaming query runs",
            value=int(p["state"] == "running"),
        )
        yield CounterMetricFamily(
            "sluice_pipeline_restarts", "Query restarts by the supervisor", value=p["restarts"]
        )
        yield GaugeMetricFamily(
            "sluice_pipeline_consecutive_failures", "Query failures in a row",
            value=p["consecutive_failures"],
        )  # fmt: skip
        age = p.get("heartbeat_age_ms")
        yield from _gauge(
            "sluice_pipeline_heartbeat_age_seconds", "Time since the supervisor's last heartbeat",
            None if age is None else age / 1000,
        )  # fmt: skip
        yield from _gauge(
            "sluice_last_batch_age_seconds", "Time since the last batch committed",
            None if last_batch_age_ms is None else last_batch_age_ms / 1000,
        )  # fmt: skip

    def _consistency(self, report: dict[str, Any]) -> Iterator[Metric]:
        """The newest `sluice consistency` report: its sampled answers by result, and when it
        ran (alert on `time() - sluice_consistency_report_timestamp_seconds`)."""
        answers = GaugeMetricFamily(
            "sluice_consistency_answers",
            "Sampled answers of the newest consistency report, by how they compared offline",
            labels=["result"],
        )
        for result in RESULTS:
            answers.add_metric([result], float(report.get(result) or 0))
        yield answers
        at_ms = report.get("at_ms")
        yield from _gauge(
            "sluice_consistency_report_timestamp_seconds",
            "When the newest consistency report was made (Unix time)",
            at_ms / 1000 if isinstance(at_ms, int | float) else None,
        )


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def redis_health(client: Any) -> dict[str, Any]:
    """PING round trip and memory; `{"up": 0}` when Redis does not answer. Never raises."""
    try:
        t0 = time.perf_counter()
        client.ping()
        ping_s = time.perf_counter() - t0
        used, cap = memory_fraction(client)
    except (redis.RedisError, redis.exceptions.RedisClusterException):
        return {"up": 0}
    return {"up": 1, "ping_s": ping_s, "used_memory": used, "maxmemory": cap}


class RequestTimer:
    """The request latency histogram, by method and route template (`/v1/metrics/{name}`).

    `observe` costs about a microsecond (a dict lookup and the client's bucket update): the
    label child of each (method, route) is made once and kept. Requests that matched no route
    (a 404 on an unknown path, a 401 before routing) are not recorded, so the label set stays
    bounded by the app's routes.
    """

    def __init__(self) -> None:
        self.multiprocess = bool(os.environ.get(MULTIPROC_ENV))
        if self.multiprocess and not values.ValueClass._multiprocess:
            # The client picks its value class when first imported. A worker forked from a
            # process that imported it before the directory was set (granian forks its
            # workers) holds the in-memory class: take the file-backed one, once.
            values.ValueClass = values.get_value_class()
        # In multiprocess mode the values live in files, not in a registry.
        self.registry = None if self.multiprocess else CollectorRegistry(auto_describe=False)
        self.histogram = Histogram(
            "sluice_http_request_duration_seconds",
            "HTTP request latency by route template, from the request to the response's end",
            ["method", "route"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self._children: dict[tuple[str, str], Any] = {}

    def observe(self, method: str, route: str, seconds: float) -> None:
        child = self._children.get((method, route))
        if child is None:
            child = self._children[(method, route)] = self.histogram.labels(method, route)
        child.observe(seconds)

    def exposition(self) -> bytes:
        if self.multiprocess:
            from prometheus_client import multiprocess

            reg = CollectorRegistry(auto_describe=False)
            multiprocess.MultiProcessCollector(reg)
            return generate_latest(reg)
        assert self.registry is not None
        return generate_latest(self.registry)
