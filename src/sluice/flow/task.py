"""Seed 000's two roles, for one task.

- As a **downstream**, `QueueWatch` turns queue measurements into verdicts: *overloaded* at or
  above the high watermark; *underloaded* once the queue has stayed at or below the low
  watermark for a full `sensitivity` (then the quiet timer restarts, so each further step back
  needs another full quiet period). `notify_upstreams` sends the verdict to each task of each
  direct upstream stage whose published state says it can act on it: overload to tasks not
  yet backpressured, and to flagged tasks with a provisional origin (their controller does not
  step again, but they must know the overload goes on before they probe); underload only to
  flagged tasks.
- As an **upstream**, `StageTask` reads the signals addressed to it, lets its controller act on
  them, meters its own emit rate and backpressure ratio, and publishes its state. Its owner
  reports each admission decision (`hold`) and, once per tick or batch, has it review a
  provisional cap (`review_cap`): lift it, or probe it upward.

Underload goes only to flagged tasks. A task with a provisional origin does not need it: it
probes on the absence of overload, which also covers a downstream that sits between its
watermarks and so never reports underload.
"""

from __future__ import annotations

from typing import Any

import redis

from sluice.clock import Clock
from sluice.flow.board import OVERLOAD, UNDERLOAD, Board, task_id
from sluice.flow.controllers import BatchSample, Controller
from sluice.flow.levels import QueueLevel
from sluice.flow.meters import PROBE, RELEASE, CapWatch, RateMeter, RatioMeter
from sluice.graph import FlowStage

SIGNAL_DRIVEN = ("stepwise",)
# A signal older than this when read is ignored: a live overload is sent again every tick or
# batch, and a task that did not read for long (an idle `sluice serve` worker, which reads only
# when a request comes) would otherwise act on minutes-old news.
STALE_SIGNAL_MS = 10_000


class QueueWatch:
    def __init__(self, sensitivity_ms: int, clock: Clock) -> None:
        self.sensitivity_ms = sensitivity_ms
        self.clock = clock
        self._quiet_since: int | None = None

    def update(self, level: QueueLevel) -> str | None:
        now = self.clock.now_ms()
        if level.overloaded:
            self._quiet_since = None
            return OVERLOAD
        if not level.quiet:
            self._quiet_since = None
            return None
        if self._quiet_since is None:
            self._quiet_since = now
        if now - self._quiet_since >= self.sensitivity_ms:
            self._quiet_since = now
            return UNDERLOAD
        return None


def notify_upstreams(
    board: Board,
    stages: dict[str, FlowStage],
    stage: str,
    verdict: str | None,
    level: QueueLevel,
    sender: str,
    now_ms: int,
) -> int:
    """Send `verdict` to the tasks of `stage`'s direct upstreams that need it (see above)."""
    if verdict is None:
        return 0
    sent = 0
    for up in stages[stage].upstreams:
        for tid, st in board.tasks(now_ms, up).items():
            if not st.get("listens"):
                continue
            flagged = bool(st.get("backpressure"))
            probing = bool(st.get("origin_measured"))
            if (verdict == OVERLOAD and (probing or not flagged)) or (
                verdict == UNDERLOAD and flagged
            ):
                board.send(tid, verdict, sender, level.bytes, now_ms)
                sent += 1
    return sent


class StageTask:
    """One task of an emitting stage: its controller, its meters and its published state."""

    def __init__(
        self,
        board: Board,
        stage: FlowStage,
        controller: Controller,
        clock: Clock,
        tick_ms: int,
        task: str | None = None,
    ) -> None:
        self.board = board
        self.stage = stage
        self.controller = controller
        self.clock = clock
        self.tick_ms = tick_ms
        self.id = task or task_id(stage.name)
        self.meter = RateMeter(clock)
        self.ratio = RatioMeter(clock)
        self.emitted_total = 0  # events emitted since this task started: rates by difference
        self.queue: dict[str, Any] | None = None
        self.extra: dict[str, Any] = {}
        try:
            self._cursor = board.signals_tail()
        except redis.RedisError:  # Redis down: a producer is still made, and buffers; signals
            self._cursor = f"{clock.now_ms()}-0"  # are read from about now (ids are times)
        self._next_tick = 0.0
        self._changed = True
        self.cap_watch = CapWatch(clock)
        self.signals_seen = 0
        self.rate_floor = 0.0  # set by the owner: see `measured_rate`

    @property
    def listens(self) -> bool:
        return self.controller.name in SIGNAL_DRIVEN

    def due(self) -> bool:
        return self.clock.monotonic_s() >= self._next_tick

    def poll(self) -> bool:
        """Act on the signals addressed to this task; returns True if the state changed."""
        self._next_tick = self.clock.monotonic_s() + self.tick_ms / 1000
        signals, self._cursor = self.board.receive(self.id, self._cursor)
        changed = False
        now = self.clock.now_ms()
        for sig in signals:
            if now - sig.at_ms > STALE_SIGNAL_MS:
                continue
            self.signals_seen += 1
            if sig.kind == OVERLOAD:
                self.cap_watch.overload()
                changed |= self.controller.on_overload(self.measured_rate())
            elif sig.kind == UNDERLOAD:
                changed |= self.controller.on_underload()
        self._changed |= changed
        return changed

    def emit(self, n: int) -> None:
        """`n` events left this task: metered, and counted in `emitted_total`."""
        self.meter.add(n)
        self.emitted_total += n

    def measured_rate(self) -> float:
        """The rate an overload throttles from, when no cap was set: the emit rate, or the
        owner's `rate_floor` if higher (an ingest task's rate when its gate shut: a producer
        the gate held for longer than the meter's window emits nothing meanwhile, and
        throttling from 0, so `min_rate`, would hold it far below what it sent before)."""
        return max(self.meter.rate(), self.rate_floor)

    def hold(self, held_back: bool, by_cap: bool = True) -> None:
        """Record one admission decision (see `CapWatch.hold`); meters the backpressure ratio."""
        self.ratio.set_throttled(held_back)
        self.cap_watch.hold(held_back, by_cap)

    def review_cap(self, sensitivity_ms: int) -> None:
        """Probe or lift a provisional cap as `CapWatch` says; called once per tick or batch,
        after `hold`. Other caps and other controllers ignore both."""
        verdict = self.cap_watch.verdict(self.controller.changed_ms, sensitivity_ms)
        if verdict == PROBE:
            self._changed |= self.controller.probe()
        elif verdict == RELEASE:
            self._changed |= self.controller.release()

    def on_batch(self, sample: BatchSample) -> None:
        self._changed |= self.controller.on_batch(sample)

    def state(self) -> dict[str, Any]:
        snap = self.controller.snapshot()
        return {
            **snap,
            "stage": self.stage.name,
            "task": self.id,
            "upstreams": list(self.stage.upstreams),
            "listens": self.listens,
            "measured_rate": round(self.meter.rate(), 1),
            "emitted_total": self.emitted_total,
            "backpressure_ratio": round(self.ratio.ratio(), 4),
            "queue": self.queue,
            "updated_ms": self.clock.now_ms(),
            **self.extra,
        }

    def publish(self) -> dict[str, Any]:
        st = self.state()
        self.board.publish(self.id, st, self._changed)
        self._changed = False
        return st

    def close(self) -> None:
        self.board.forget(self.id)
