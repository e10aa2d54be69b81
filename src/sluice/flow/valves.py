"""Where rates act: one valve per emitting stage, and the store's monitor.

- `IngestValve` (the `Producer` SDK and `POST /v1/events`): a token bucket at the task's
  rate, plus a gate that stays shut while the input streams are at or above the high
  watermark. `admit` blocks (or raises `BackpressureError` after `timeout_s`); `try_admit`
  answers at once with how long to wait, for the HTTP 429's `Retry-After`. Events are never
  dropped: a caller that is refused still holds them.
- `AdmissionValve` (the Spark source's `latestOffset`): rate × the time since the previous
  batch was planned (at least one trigger, at most `MAX_INTERVAL_TRIGGERS` of them) → events
  per micro-batch, so a batch that overran its trigger does not lower the admitted rate. It
  also watches its own input queue and signals the ingest tasks, and turns the newest batch
  record into the controllers' batch feedback.
- `StoreMonitor` (the driver, after every batch and every tick): the store's write time, per
  update against its healthy time per update, and its memory against the watermarks; signals
  the Spark task.

Under `controller: none` nothing throttles and no gate shuts. Under `pid`, `aimd` and `fixed`
the law sets Spark's admission; ingest tasks keep only the high-watermark gate. Under
`stepwise` every hop follows seed 000: each task steps its own rate on its downstream's
signals, and the gate is the hard ceiling behind the steps.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson
import redis

from sluice.clock import SYSTEM_CLOCK, Clock
from sluice.config import BackpressureConfig
from sluice.errors import BackpressureError
from sluice.flow.board import Board, task_id
from sluice.flow.controllers import BatchSample, make_controller
from sluice.flow.levels import QueueLevel, UpdateCost, store_level
from sluice.flow.meters import TokenBucket, batch_interval_ms
from sluice.flow.task import QueueWatch, StageTask, notify_upstreams
from sluice.graph import INGEST, FlowStage
from sluice.redis.keys import stats_keys

log = logging.getLogger(__name__)
_seq = itertools.count()

# A micro-batch's budget covers the time since the previous one was planned, up to this many
# trigger intervals: more would let a stalled query admit a burst when it resumes.
MAX_INTERVAL_TRIGGERS = 4
INGEST_STAGE = FlowStage(INGEST, (), "none")
Measure = Callable[[], QueueLevel]  # one look at a stage's input queue (see source.admission)


def spark_task_id(stage: FlowStage) -> str:
    """A Spark stage has one admitting task; its id survives restarts."""
    return f"{stage.name}/{stage.inputs[0]}" if stage.inputs else stage.name


class IngestValve:
    """The ingest task of one producer process. `measure` looks at the input queue (the
    source log's backlog against the watermarks)."""

    def __init__(
        self,
        client: Any,
        bp: BackpressureConfig,
        trigger_ms: int,
        measure: Measure,
        clock: Clock = SYSTEM_CLOCK,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.client = client
        self.bp = bp
        self.measure = measure
        self.clock = clock
        self.sleep = sleep
        self.enabled = bp.controller != "none"
        kind = "stepwise" if bp.controller == "stepwise" else "none"
        controller = make_controller(bp, trigger_ms, clock, None, kind=kind)
        n = next(_seq)
        tid = task_id(INGEST) + (f"/{n}" if n else "")
        self.task = StageTask(Board(client), INGEST_STAGE, controller, clock, bp.tick, tid)
        self.bucket = TokenBucket(clock, controller.rate)
        self.gate_open = True
        self._opened_s = 0.0  # when the gate last opened (monotonic)
        self._since_bytes = 0  # bytes admitted since the input was last measured
        self.level: QueueLevel | None = None
        self._lock = threading.Lock()
        self._publish_failing = False

    def _tick(self) -> None:
        if not self.task.due():
            return
        self.task.poll()
        self.task.review_cap(self.bp.sensitivity)
        self.bucket.set_rate(self.task.controller.rate)
        if self.enabled:
            self.level = self.measure()
            was_open, self.gate_open = self.gate_open, not self.level.overloaded
            self._since_bytes = 0
            self._gate_floor(was_open)
            self.task.queue = self.level.as_dict()
        self.task.extra = {"gate_open": self.gate_open}
        self._publish()

    def _gate_floor(self, was_open: bool) -> None:
        """While the gate holds the producer, and for a meter window after it opens, an overload
        throttles from the rate the producer sent when it shut (`StageTask.measured_rate`)."""
        now = self.clock.monotonic_s()
        if was_open and not self.gate_open:
            # the highest since the gate first shut: a gate that shuts again soon after it
            # opened (a backlog at the high watermark) finds the meter still low
            self.task.rate_floor = max(self.task.rate_floor, self.task.meter.rate())
        if not was_open and self.gate_open:
            self._opened_s = now
        if self.gate_open and now - self._opened_s >= self.task.meter.window_s:
            self.task.rate_floor = 0.0

    def _publish(self) -> None:
        """Publish the task's state, best effort: a Redis at `maxmemory` refuses the HSET, and
        that must not fail the producer's flush (its XADDs are what the caller needs to hear
        about). The state is published again on the next tick; a failure is logged once."""
        try:
            self.task.publish()
        except redis.RedisError as e:
            if not self._publish_failing:
                log.warning("ingest task %s could not publish its state: %s", self.task.id, e)
            self._publish_failing = True
        else:
            if self._publish_failing:
                log.info("ingest task %s publishes its state again", self.task.id)
            self._publish_failing = False

    def _wait_s(self, n: int) -> float:
        if not self.gate_open or self._filled():
            return self.bp.tick / 1000
        return self.bucket.wait_s(n)

    def _filled(self) -> bool:
        """What was admitted since the input was last measured takes it to the high watermark:
        nothing more until the next look. The gate looks once a tick, and without this any
        number of writes (concurrent requests, a producer's catch-up) went through between two
        looks. The first write after a look always may go: one write is the slack."""
        if not self.enabled or self.level is None or self._since_bytes == 0:
            return False
        return self.level.bytes + self._since_bytes >= self.bp.high_watermark

    def try_admit(self, n: int, size_bytes: int = 0) -> float:
        """Admit `n` events (`size_bytes` of them, as written, if known) now and return 0, or
        return the seconds to wait (nothing taken)."""
        with self._lock:
            self._tick()
            wait = self._wait_s(n)
            self.task.hold(wait > 0, by_cap=self._may_probe() and not self._filled())
            if wait <= 0:
                self._take(n)
                self._since_bytes += size_bytes
            return wait

    def _may_probe(self) -> bool:
        """Whether a hold now is the cap's own, to be probed up (see `StageTask.review_cap`).
        Only past the cap's origin (the flag clear), only under `propagation: hop` (under
        `source` the overloaded queue is a far stage's, which this task does not see), and
        only while its input is quiet (at or below the low watermark) with the gate open: a
        probed cap lets a producer's owed events through at the probed rate between two looks
        at the backlog, which from the low watermark is far from the high one. Without it, a
        producer that came to offer more than its cap's origin would be held there for good."""
        quiet = self.gate_open and self.level is not None and self.level.quiet
        hop = self.bp.propagation == "hop"
        return quiet and hop and not self.task.controller.backpressured

    def admit(self, n: int, timeout_s: float | None = None, size_bytes: int = 0) -> None:
        """Block until `n` events may go. Raises BackpressureError after `timeout_s`."""
        start = self.clock.monotonic_s()
        while True:
            wait = self.try_admit(n, size_bytes)
            if wait <= 0:
                return
            waited = self.clock.monotonic_s() - start
            if timeout_s is not None and waited + wait > timeout_s:
                if waited < timeout_s:
                    self.sleep(timeout_s - waited)
                    if self.try_admit(n, size_bytes) <= 0:
                        return
                with self._lock:
                    self.task.ratio.set_throttled(False)
                raise BackpressureError(
                    wait, f"input is backpressured; {n} events not admitted within {timeout_s}s"
                )
            self.sleep(min(wait, self.bp.tick / 1000))

    def _take(self, n: int) -> None:
        self.bucket.take(n)
        self.task.emit(n)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # best effort on the way out
            self.task.close()


class AdmissionValve:
    """The Spark stage's admission: lives in the source reader (on the driver host).
    `measure` looks at the stage's own input queue."""

    def __init__(
        self,
        client: Any,
        bp: BackpressureConfig,
        trigger_ms: int,
        max_batch_events: int | None,
        stage: FlowStage,
        measure: Measure,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.client = client
        self.bp = bp
        self.trigger_ms = trigger_ms
        self.max_batch_events = max_batch_events
        self.clock = clock
        self.stage = stage
        self.stages = {stage.name: stage}
        self.measure = measure
        self.stats_key = stats_keys(stage.name).stats
        controller = make_controller(bp, trigger_ms, clock, max_batch_events)
        board = Board(client)
        tid = spark_task_id(stage)
        previous = board.all_tasks().get(tid)
        if previous is not None:
            controller.restore(previous)
        self.task = StageTask(board, stage, controller, clock, bp.tick, tid)
        self.watch = QueueWatch(bp.sensitivity, clock)
        self._last_token = self._newest_batch_token()
        self._admit_ms: int | None = None
        self._prev_admit_ms: int | None = None
        self._planned_ms: int | None = None  # when the previous batch was planned
        self._limit: int | None = None  # the budget `limit` returned for the batch planned now
        inflight = (previous or {}).get("inflight_ms")
        if inflight is not None and self._last_done_ms() <= int(inflight):
            # The batch admitted before a restart never completed: that is AIMD's BUSY.
            self.task.on_batch(BatchSample(0, 0.0, 0.0, 0.0, ok=False))

    def _newest(self) -> dict[str, Any] | None:
        raw = self.client.hget(self.stats_key, "last_batch")
        return orjson.loads(raw) if raw else None

    def _newest_batch_token(self) -> int | None:
        b = self._newest()
        return None if b is None else int(b["token"])

    def _last_done_ms(self) -> int:
        b = self._newest()
        return 0 if b is None else int(b["done_ms"])

    def limit(self) -> int | None:
        """Called in latestOffset: feed the controller, watch the input, publish, return the
        event budget of the next micro-batch (None = no limit from the controller)."""
        now = self.clock.now_ms()
        self._feedback()
        self.task.poll()
        level = self.measure()
        self.task.queue = level.as_dict()
        verdict = self.watch.update(level)
        notify_upstreams(
            self.task.board, self.stages, self.stage.name, verdict, level, self.task.id, now
        )
        prev, self._planned_ms = self._planned_ms, now
        interval_ms = batch_interval_ms(prev, now, self.trigger_ms, MAX_INTERVAL_TRIGGERS)
        self._limit = self.task.controller.batch_limit(interval_ms)
        return self._limit

    def _cap_binds(self) -> bool:
        """The controller's budget, not the source's static cap, limits this batch."""
        if self._limit is None:
            return False
        return self.max_batch_events is None or self._limit < self.max_batch_events

    def _feedback(self) -> None:
        b = self._newest()
        if b is None or int(b["token"]) == self._last_token:
            return
        self._last_token = int(b["token"])
        admit = self._admit_ms
        if admit is None or int(b["started_ms"]) < admit:
            return  # a batch admitted before this reader existed: no round trip to measure
        sched = 0.0
        if self._prev_admit_ms is not None:
            sched = max(0.0, admit - (self._prev_admit_ms + self.trigger_ms))
        self.task.on_batch(
            BatchSample(
                events=int(b["events"]),
                processing_ms=float(b["done_ms"] - b["started_ms"]),
                scheduling_delay_ms=sched,
                rtt_ms=float(b["done_ms"] - admit),
                ok=True,
            )
        )

    def admitted(self, events: int, held_back: bool) -> None:
        """The batch just planned: `events` admitted; `held_back` if the limit left data."""
        now = self.clock.now_ms()
        if events:
            self._prev_admit_ms, self._admit_ms = self._admit_ms, now
            self.task.emit(events)
        self.task.hold(held_back, by_cap=self._cap_binds())
        self.task.review_cap(self.bp.sensitivity)
        self.task.extra = {
            "inflight_ms": now if events else None,
            "batch_limit": self._limit,
            "held_back": held_back,
        }
        self.task.publish()


class StoreMonitor:
    """The slice store's watch: runs in the driver, fed by each batch's write time and, when
    known, its time per slice update (see `flow.levels`)."""

    def __init__(
        self,
        client: Any,
        bp: BackpressureConfig,
        stage: FlowStage,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.client = client
        self.bp = bp
        self.clock = clock
        self.stage = stage
        self.stages = {stage.name: stage}
        self.board = Board(client)
        self.id = f"{stage.name}/{stage.upstreams[0]}" if stage.upstreams else stage.name
        self.watch = QueueWatch(bp.sensitivity, clock)
        self.write_ms: float | None = None
        self.us_per_update: float | None = None
        self.cost = UpdateCost()
        self.last_observed_s: float | None = None
        self._overloaded = False
        self._changed_ms = clock.now_ms()
        self._lock = threading.Lock()

    def observe(
        self, write_ms: float | None, us_per_update: float | None = None, updates: int = 0
    ) -> None:
        """A batch's write time: that of its slowest partition, and that partition's time per
        slice update over its `updates` (None: judged by the write time alone)."""
        with self._lock:
            self.write_ms = write_ms
            self.us_per_update = us_per_update
            self.last_observed_s = time.monotonic()
        self.tick()
        with self._lock:  # judged against the baseline before, not after, joining it
            self.cost.add(us_per_update, updates)

    def tick(self) -> QueueLevel:
        with self._lock:
            now = self.clock.now_ms()
            seen = self.last_observed_s
            if seen is not None and time.monotonic() - seen > self.bp.sensitivity / 1000:
                self.write_ms = None  # no batch for a while: nothing is waiting on the store
                self.us_per_update = None
            baseline = self.cost.baseline_us() if self.us_per_update is not None else None
            level = store_level(self.client, self.write_ms, self.bp, self.us_per_update, baseline)
            verdict = self.watch.update(level)
            notify_upstreams(self.board, self.stages, self.stage.name, verdict, level, self.id, now)
            changed = level.overloaded != self._overloaded
            if changed:
                self._overloaded = level.overloaded
                self._changed_ms = now
            self.board.publish(
                self.id,
                {
                    "stage": self.stage.name,
                    "task": self.id,
                    "upstreams": list(self.stage.upstreams),
                    "controller": None,
                    "overloaded": level.overloaded,
                    "queue": level.as_dict(),
                    "changed_ms": self._changed_ms,
                    "updated_ms": now,
                },
                changed,
            )
            return level
