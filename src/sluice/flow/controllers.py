"""Rate controllers: how a stage decides how many events to admit per micro-batch.

One interface, five laws. A stage feeds every controller the same three kinds of input and
each law uses only its own; the others are ignored (the call returns False, "no change").

- `Stepwise` ("stepwise"), seed 000, the patent's stage-by-stage backpressure. Inputs:
  `on_overload` (a direct downstream is at its high watermark) and `on_underload` (it stayed at
  its low watermark for `sensitivity`). Overload multiplies the rate by `step` once per episode
  and remembers the rate it started from; each underload divides by `step`, and the flag clears
  only when the rate is back at that origin. A provisional cap (an origin that was measured)
  is probed upward by its owner (`probe`) and lifted once it holds nothing back (`release`).
- `Aimd` ("aimd"), seed 002, a TCP-like send window in events per micro-batch. Input:
  `on_batch`, whose round trip (admission to completion) is the RTT. NORMAL grows the window by
  `increase`, SLOW shrinks it by `decrease`, BUSY (a failed or timed-out batch) multiplies it by
  `busy_factor`.
- `Pid` ("pid"), Spark Streaming's `PIDRateEstimator` (DESIGN §5), verbatim. Input: `on_batch`
  (events, processing time, scheduling delay).
- `Fixed` ("fixed"), a constant cap, and `Unlimited` ("none"), no cap. Inputs: none.

Rates are events/s; `None` means unlimited. `batch_limit()` turns the rate into events per
micro-batch (over the trigger interval, or the interval the caller measured) and never exceeds
`max_batch_events` (the source's static cap) when that is set.
Controllers are not thread-safe: one stage owns one controller and calls it from one thread.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from sluice.clock import Clock
from sluice.config import BackpressureConfig
from sluice.errors import ConfigError

# `* step` then `/ step` (or events/s -> events/batch) does not round-trip exactly in floating
# point (8000 * 0.7 / 0.7 is 8000.000000000001, other values land one ulp under); values this
# close count as equal.
_REL_TOL = 1e-9


@dataclass(frozen=True)
class BatchSample:
    """One completed (or failed) micro-batch, as the admitting stage saw it."""

    events: int  # events in the batch
    processing_ms: float  # time the batch took to process
    scheduling_delay_ms: float  # how late the batch started after its trigger slot
    rtt_ms: float  # admission to completion (AIMD's round trip)
    ok: bool = True  # False: the batch failed or timed out (AIMD's BUSY)


class Controller(ABC):
    """A stage's admission law. Every `on_*` call returns True iff the state changed.

    - `rate`: events/s; None = unlimited. `origin_rate`: the rate before the first throttle
      (None when not throttled or not applicable). `backpressured`: the seed's flag, "this stage
      is holding its input back". `changed_ms`: clock time of the last state change.
    - `snapshot()` is JSON-ready and `restore()` is its inverse, so a restarted process resumes
      its throttle instead of starting unlimited into the same overload. `restore` trusts a
      snapshot of its own kind (written by `snapshot`) and ignores any other kind.
    """

    name: ClassVar[str]
    _persist: ClassVar[tuple[str, ...]] = ()  # attributes `_x` snapshotted under key "x"

    def __init__(
        self, cfg: BackpressureConfig, trigger_ms: int, clock: Clock, max_batch_events: int | None
    ) -> None:
        if trigger_ms <= 0:
            raise ConfigError(f"`trigger_ms` must be positive, got {trigger_ms}")
        if max_batch_events is not None and max_batch_events < 1:
            raise ConfigError(f"`max_batch_events` must be at least 1, got {max_batch_events}")
        self._cfg = cfg
        self._trigger_ms = trigger_ms
        self._clock = clock
        self._max_batch_events = max_batch_events
        self._changed_ms = clock.now_ms()

    @property
    @abstractmethod
    def rate(self) -> float | None: ...

    @property
    def origin_rate(self) -> float | None:
        return None

    @property
    def backpressured(self) -> bool:
        return False

    @property
    def changed_ms(self) -> int:
        return self._changed_ms

    def on_overload(self, measured_rate: float) -> bool:
        """A direct downstream is at/above its high watermark; `measured_rate` is events/s."""
        return False

    def on_underload(self) -> bool:
        """A direct downstream stayed at/below its low watermark for `sensitivity`."""
        return False

    def on_batch(self, sample: BatchSample) -> bool:
        """A micro-batch completed or failed."""
        return False

    def release(self) -> bool:
        """The owner saw the cap hold nothing back for a whole `sensitivity`: a provisional cap
        may go. Only `stepwise` has one."""
        return False

    def probe(self) -> bool:
        """The owner saw a provisional cap hold input back, and no overload, for a whole
        `sensitivity`: the cap may rise."""
        return False

    def batch_limit(self, interval_ms: float | None = None) -> int | None:
        """Events to admit in the next micro-batch (>= 1); None = unlimited.

        Floors the rate's share of `interval_ms` (default: one trigger interval), then caps at
        `max_batch_events`. The caller bounds `interval_ms`: the limit grows with it.
        """
        rate = self.rate
        if rate is None:
            return self._max_batch_events
        span_ms = self._trigger_ms if interval_ms is None else interval_ms
        limit = max(1, math.floor(rate * span_ms / 1000 * (1 + _REL_TOL)))
        return limit if self._max_batch_events is None else min(limit, self._max_batch_events)

    def snapshot(self) -> dict[str, Any]:
        return {
            "controller": self.name,
            "rate": self.rate,
            "origin_rate": self.origin_rate,
            "backpressure": self.backpressured,
            "changed_ms": self._changed_ms,
            **{a[1:]: getattr(self, a) for a in self._persist},
        }

    def restore(self, snap: dict[str, Any]) -> None:
        if snap.get("controller") != self.name:
            return
        for a in self._persist:
            if a[1:] in snap:
                setattr(self, a, snap[a[1:]])
        self._changed_ms = int(snap.get("changed_ms", self._changed_ms))
        self._restored()

    def _restored(self) -> None:  # noqa: B027 - an optional hook, not an abstract one
        """Hook: repair invariants a restored state must keep (e.g. a changed config)."""

    def _touch(self) -> bool:
        self._changed_ms = self._clock.now_ms()
        return True


class Stepwise(Controller):
    """Seed 000: `rate *= step` once per overload episode, `rate /= step` per underload.

    When the rate was unlimited before the first throttle, the origin is the measured rate
    (at least `min_rate`). Clearing the flag returns to that origin, as the seed says; the cap is
    then provisional. Going straight back to unlimited would re-admit the very burst that
    overloaded the downstream, and the stage would cycle. But a measured origin can sit below
    what the downstream now takes, and a cap that holds input back would never be lifted: so
    the owner raises it with `probe()` and lifts it with `release()`. While flagged, a probe is
    one step back, as an underload would be. An overload during a probe throttles from the
    probed cap, which becomes the new origin and stays provisional.
    """

    name = "stepwise"
    _persist = ("_rate", "_origin_rate", "_backpressure", "_origin_measured")
    _rate: float | None = None
    _origin_rate: float | None = None
    _backpressure = False
    _origin_measured = False  # the origin came from a measurement: the cap may be released

    @property
    def rate(self) -> float | None:
        return self._rate

    @property
    def origin_rate(self) -> float | None:
        return self._origin_rate

    @property
    def backpressured(self) -> bool:
        return self._backpressure

    def on_overload(self, measured_rate: float) -> bool:
        if self._backpressure:
            return False  # throttle once per overload episode
        # A throttle from a provisional cap keeps it provisional: it may still be probed/lifted.
        self._origin_measured = self._rate is None or self._origin_measured
        origin = max(measured_rate, self._cfg.min_rate) if self._rate is None else self._rate
        self._origin_rate = origin
        # Never below min_rate, and never *raise* a rate that was already below it.
        self._rate = max(origin * self._cfg.step, min(origin, self._cfg.min_rate))
        self._backpressure = True
        return self._touch()

    def on_underload(self) -> bool:
        if not self._backpressure or self._rate is None or self._origin_rate is None:
            return False
        return self._step_back(self._rate, self._origin_rate)

    def _step_back(self, rate: float, origin: float) -> bool:
        """One step back towards `origin`; the flag clears there."""
        rate = rate / self._cfg.step
        if rate >= origin * (1 - _REL_TOL):
            self._rate = origin
            self._origin_rate, self._backpressure = None, False
        else:
            self._rate = rate
        return self._touch()

    def release(self) -> bool:
        """Lift a provisional cap (an origin that was measured, not set): unlimited again."""
        if self._backpressure or not self._origin_measured or self._rate is None:
            return False
        self._rate, self._origin_measured = None, False
        return self._touch()

    def probe(self) -> bool:
        """Raise a provisional cap by one step (the inverse of a throttle): while flagged, one
        step back towards the origin; past it, a cap that would reach `max_batch_events` per
        trigger is lifted instead."""
        if not self._origin_measured or self._rate is None:
            return False
        if self._backpressure:
            origin = self._origin_rate
            return origin is not None and self._step_back(self._rate, origin)
        rate = self._rate / self._cfg.step
        cap = self._max_batch_events
        if cap is not None and rate * self._trigger_ms / 1000 >= cap * (1 - _REL_TOL):
            self._rate, self._origin_measured = None, False
        else:
            self._rate = rate
        return self._touch()

    def _restored(self) -> None:
        # A flag without both rates could never be undone: treat it as not throttled.
        if None in (self._rate, self._origin_rate):
            self._backpressure = False
        if not self._backpressure:
            self._origin_rate = None
            if self._rate is None:
                self._origin_measured = False


class Aimd(Controller):
    """Seed 002: a send window in events per micro-batch, driven by each batch's round trip.

    `backpressured` is True while the last batch was SLOW or BUSY. A batch with 0 events never
    grows the window (an idle stage must not inflate it) but still shrinks it when SLOW or BUSY.
    """

    name = "aimd"
    _persist = ("_window", "_state")

    def __init__(
        self, cfg: BackpressureConfig, trigger_ms: int, clock: Clock, max_batch_events: int | None
    ) -> None:
        super().__init__(cfg, trigger_ms, clock, max_batch_events)
        a = cfg.aimd
        self._target_rtt_ms = a.target_rtt if a.target_rtt is not None else 2 * trigger_ms
        self._window = self._clamp(a.initial_window)
        self._state = "normal"  # "normal" | "slow" | "busy"

    @property
    def rate(self) -> float:
        return self._window * 1000 / self._trigger_ms

    @property
    def backpressured(self) -> bool:
        return self._state != "normal"

    def batch_limit(self, interval_ms: float | None = None) -> int:
        return self._window  # a window per micro-batch, whatever the interval

    def on_batch(self, sample: BatchSample) -> bool:
        a = self._cfg.aimd
        if not sample.ok or sample.rtt_ms > a.timeout:
            state, window = "busy", math.floor(self._window * a.busy_factor)
        elif sample.rtt_ms <= self._target_rtt_ms:
            state, window = "normal", self._window + (a.increase if sample.events > 0 else 0)
        else:
            state, window = "slow", self._window - a.decrease
        window = self._clamp(window)
        if (state, window) == (self._state, self._window):
            return False
        self._state, self._window = state, window
        return self._touch()

    def _clamp(self, window: int) -> int:
        # The cap is the source's hard limit and wins over `min_window` when they conflict.
        window = max(self._cfg.aimd.min_window, window)
        return window if self._max_batch_events is None else min(window, self._max_batch_events)

    def _restored(self) -> None:
        self._window = self._clamp(int(self._window))  # the bounds may have changed since
        if self._state not in ("normal", "slow", "busy"):
            self._state = "normal"


class Pid(Controller):
    """Spark Streaming's PIDRateEstimator: same state, same skips, same first-run seeding.

    Gains and the floor come from `cfg.pid` (`cfg.min_rate` is not applied, to stay verbatim).
    `backpressured` is True while the rate is set and below the processing rate of the batch
    that set it: the integral term (scheduling delay) is holding admission under what the stage
    just showed it can process, i.e. it is draining a backlog.
    """

    name = "pid"
    _persist = (
        "_rate",
        "_first_run",
        "_latest_time_ms",
        "_latest_rate",
        "_latest_error",
        "_processing_rate",
    )
    # Spark's initial values; the -1s are overwritten by the first run before they matter.
    _rate: float | None = None
    _first_run = True
    _latest_time_ms = -1
    _latest_rate = -1.0
    _latest_error = -1.0
    _processing_rate: float | None = None

    @property
    def rate(self) -> float | None:
        return self._rate

    @property
    def backpressured(self) -> bool:
        pr = self._processing_rate
        return self._rate is not None and pr is not None and self._rate < pr

    def on_batch(self, sample: BatchSample) -> bool:
        """Called once per completed batch; the batch's time is `clock.now_ms()` at the call."""
        time_ms = self._clock.now_ms()
        if time_ms <= self._latest_time_ms or sample.events <= 0 or sample.processing_ms <= 0:
            return False
        p = self._cfg.pid
        delay_since_update_s = (time_ms - self._latest_time_ms) / 1000
        processing_rate = sample.events / sample.processing_ms * 1000
        error = self._latest_rate - processing_rate
        historical_error = sample.scheduling_delay_ms * processing_rate / self._trigger_ms
        d_error = (error - self._latest_error) / delay_since_update_s
        new_rate = max(
            self._latest_rate
            - p.proportional * error
            - p.integral * historical_error
            - p.derivative * d_error,
            p.min_rate,
        )
        self._latest_time_ms, self._processing_rate = time_ms, processing_rate
        if self._first_run:
            self._latest_rate, self._latest_error, self._first_run = processing_rate, 0.0, False
        else:
            self._latest_rate, self._latest_error, self._rate = new_rate, error, new_rate
        return self._touch()


class Fixed(Controller):
    """A constant rate: `cfg.fixed_rate`, else `max_batch_events` per trigger, else unlimited."""

    name = "fixed"

    @property
    def rate(self) -> float | None:
        if self._cfg.fixed_rate is not None:
            return self._cfg.fixed_rate
        if self._max_batch_events is not None:
            return self._max_batch_events * 1000 / self._trigger_ms
        return None


class Unlimited(Controller):
    """No controller: the rate is always unlimited (`batch_limit` still honours the cap)."""

    name = "none"

    @property
    def rate(self) -> None:
        return None


CONTROLLERS: dict[str, type[Controller]] = {
    c.name: c for c in (Stepwise, Aimd, Pid, Fixed, Unlimited)
}


def make_controller(
    cfg: BackpressureConfig,
    trigger_ms: int,
    clock: Clock,
    max_batch_events: int | None,
    kind: str | None = None,
) -> Controller:
    """Build the controller named by `kind`, or by `cfg.controller` when `kind` is None."""
    name = kind if kind is not None else cfg.controller
    cls = CONTROLLERS.get(name)
    if cls is None:
        raise ConfigError(
            f"unknown controller {name!r}; expected one of {', '.join(CONTROLLERS)}",
            "backpressure.controller",
        )
    return cls(cfg, trigger_ms, clock, max_batch_events)
