"""Admission control as the source sees it, and the valves' view of the log.

- `Admission`: the reading stage's admission control inside the Spark source. The reader
  builds it in `__init__` from its plain options; the `AdmissionValve` (which holds clients) is
  made on the driver at first use. It never stops the input: when the valve fails (Redis at
  maxmemory refuses its state writes, say), the static limit applies until the valve works
  again, tried every FLOW_RETRY_S and logged once per streak.
- `log_measure`: one look at a log's backlog, judged against a stage's watermarks; the
  valves' `measure`.
- `ingest_valve`: the ingest task of a producer process (the SDK, `POST /v1/events`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis

from sluice.clock import SYSTEM_CLOCK, Clock
from sluice.config import BackpressureConfig, Config
from sluice.flow.levels import QueueLevel
from sluice.flow.valves import AdmissionValve, IngestValve
from sluice.graph import FlowStage
from sluice.redis.connection import client_for
from sluice.source.log import Log, LogUnavailable
from sluice.source.logs import open_log
from sluice.source.options import SourceOptions

log = logging.getLogger(__name__)

FLOW_RETRY_S = 5.0  # a failed flow valve is tried again after this long


def log_measure(
    source_log: Log, bp: BackpressureConfig, reader: str | None = None
) -> Callable[[], QueueLevel]:
    """A valve's `measure`: the log's backlog (of `reader`, or the slowest reader) against
    `bp`'s watermarks."""

    def measure() -> QueueLevel:
        b = source_log.level(reader)
        return QueueLevel.against(b.entries, b.bytes, bp, shards=b.shards, **b.detail)

    return measure


def ingest_valve(cfg: Config, client: Any, clock: Clock = SYSTEM_CLOCK) -> IngestValve:
    """The ingest task of one producer process, watching the source log."""
    source_log = open_log(SourceOptions.from_config(cfg, ""), client)
    measure = log_measure(source_log, cfg.backpressure)
    return IngestValve(client, cfg.backpressure, cfg.spark.trigger, measure, clock)


class Admission:
    """The reader's admission collaborator. Plain (picklable) until `budget` first runs."""

    def __init__(self, opts: SourceOptions, source_log: Log, clock: Clock = SYSTEM_CLOCK) -> None:
        if opts.flow is None:
            raise ValueError("Admission needs flow options")
        self.opts = opts
        self.flow = opts.flow
        self.log = source_log
        self.clock = clock
        self._valve: AdmissionValve | None = None
        self._errors = 0  # failures in a row; the static limit applies meanwhile
        self._retry_at = 0.0  # monotonic time before which the valve is not tried again

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_valve": None}

    def _make_valve(self) -> AdmissionValve:
        flow = self.flow
        stage = FlowStage(flow.stage, flow.upstreams, "streams", flow.inputs)
        reader = self.opts.reader if flow.own_level else None
        return AdmissionValve(
            client_for(self.opts.url, timeout_s=30, connect_timeout_s=10),
            flow.backpressure,
            flow.trigger_ms,
            self.opts.max_events_per_batch,
            stage,
            log_measure(self.log, flow.backpressure, reader),
            self.clock,
        )

    def budget(self) -> int | None:
        """The controller's event budget for the next batch; None when it sets none (or the
        valve is failing)."""
        if time.monotonic() < self._retry_at:
            return None
        try:
            if self._valve is None:
                self._valve = self._make_valve()
            limit = self._valve.limit()
        except Exception as e:  # noqa: BLE001 - logged in _failed; never stops the input
            self._failed(e)
            return None
        if self._errors:
            log.warning("flow control recovered", extra={"failures": self._errors})
            self._errors = 0
        return limit

    def admitted(self, events: int, held_back: bool) -> None:
        """The batch just planned: `events` admitted; `held_back` if the limit left data."""
        if self._valve is None or time.monotonic() < self._retry_at:
            return
        try:
            self._valve.admitted(events, held_back)
        except Exception as e:  # noqa: BLE001 - logged in _failed; never stops the input
            self._failed(e)

    def _failed(self, e: Exception) -> None:
        """Log the first failure of a run of them: one line when Redis or the log is out of
        reach (an outage the rest of the pipeline reports too: the log's state says
        `waiting_for_log` with its reason), with the traceback otherwise."""
        if self._errors == 0:
            what = "flow control failed; admitting with the static limit until it recovers"
            if isinstance(e, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError
                          | LogUnavailable):  # fmt: skip
                log.warning(what, extra={"error": str(e) or type(e).__name__})
            else:
                log.exception(what)
        self._errors += 1
        self._retry_at = time.monotonic() + FLOW_RETRY_S
