"""Small time-driven meters a stage task keeps: its emit rate, its backpressure ratio, the
token bucket that enforces its rate, and the watch that says when a provisional cap may be
probed or lifted. Every one takes an injected clock.
"""

from __future__ import annotations

import math
from collections import deque

from sluice.clock import Clock


class RateMeter:
    """Events per second over the last `window_s`, from counts added as they happen.

    The two newest additions are always kept, so a task that emits in sparse lumps (a Spark
    batch every few seconds) still measures lump / gap rather than 0. Once the newest lump is
    older than both the window and the gap before it (the next one is overdue: the input has
    stopped), the rate is 0, not a lump over an ever longer gap.
    """

    def __init__(self, clock: Clock, window_s: float = 2.0) -> None:
        self.clock = clock
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._born = clock.monotonic_s()

    def add(self, n: int) -> None:
        now = self.clock.monotonic_s()
        self._events.append((now, n))
        self._expire(now)

    def _expire(self, now: float) -> None:
        while len(self._events) > 2 and self._events[0][0] < now - self.window_s:
            self._events.popleft()

    def rate(self) -> float:
        now = self.clock.monotonic_s()
        self._expire(now)
        recent = sum(1 for t, _ in self._events if t >= now - self.window_s)
        if recent < 2 and self._events and now - self._born >= self.window_s:
            # Sparse: the newest lump over the gap since the one before it (or since birth).
            t_prev = self._events[0][0] if len(self._events) == 2 else self._born
            t_last = self._events[-1][0]
            if now - t_last > max(self.window_s, t_last - t_prev):
                return 0.0
            return self._events[-1][1] / max(now - t_prev, 1e-3)
        in_window = sum(n for t, n in self._events if t >= now - self.window_s)
        # A meter younger than its window divides by its age, not by the full window.
        span = min(self.window_s, max(now - self._born, 1e-3))
        return in_window / span


class RatioMeter:
    """The fraction of the last `window_s` a task spent throttled (Flink's
    `backPressuredTimeMsPerSecond` / 1000). Feed it throttled intervals as they end, or mark the
    task throttled/free and let the meter account the time in between."""

    def __init__(self, clock: Clock, window_s: float = 10.0) -> None:
        self.clock = clock
        self.window_s = window_s
        self._spans: deque[tuple[float, float]] = deque()  # (start, end) of throttled time
        self._since: float | None = None
        self._born = clock.monotonic_s()

    def set_throttled(self, throttled: bool) -> None:
        now = self.clock.monotonic_s()
        if throttled and self._since is None:
            self._since = now
        elif not throttled and self._since is not None:
            self.add_span(self._since, now)
            self._since = None

    def add_span(self, start_s: float, end_s: float) -> None:
        if end_s > start_s:
            self._spans.append((start_s, end_s))

    def ratio(self) -> float:
        now = self.clock.monotonic_s()
        lo = now - self.window_s
        while self._spans and self._spans[0][1] < lo:
            self._spans.popleft()
        spans = list(self._spans)
        if self._since is not None:
            spans.append((self._since, now))
        busy = sum(min(e, now) - max(s, lo) for s, e in spans if e > lo)
        span = min(self.window_s, max(now - self._born, 1e-3))
        return max(0.0, min(1.0, busy / span))


PROBE = "probe"
RELEASE = "release"


class CapWatch:
    """When a provisional cap should rise (`PROBE`) or go (`RELEASE`), from the owner's
    admission decisions.

    `hold` records each decision and `overload` each overload signal. `verdict` is asked once
    per tick or batch with the clock time of the controller's last change, and answers only
    once that change and the last overload are both `sensitivity_ms` old: `PROBE` if the cap
    held input back since the previous `verdict`, `RELEASE` if nothing at all was held back for
    `sensitivity_ms`, else None.
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._held_ms = clock.now_ms()  # when input was last left behind, by anything
        self._capped = False  # the cap left input behind since the previous verdict
        self._overload_ms: int | None = None  # when the last overload signal arrived

    def hold(self, held_back: bool, by_cap: bool = True) -> None:
        """`held_back`: input was left behind; `by_cap`: the controller's cap did it (not a
        gate or a static limit, which raising the cap would not open)."""
        if held_back:
            self._held_ms = self.clock.now_ms()
            self._capped |= by_cap

    def overload(self) -> None:
        """A direct downstream reported overload (whether or not the controller acted on it)."""
        self._overload_ms = self.clock.now_ms()

    def verdict(self, changed_ms: int, sensitivity_ms: int) -> str | None:
        now = self.clock.now_ms()
        capped, self._capped = self._capped, False
        if now - max(changed_ms, self._overload_ms or changed_ms) < sensitivity_ms:
            return None
        if capped:
            return PROBE
        if now - self._held_ms >= sensitivity_ms:
            return RELEASE
        return None


def batch_interval_ms(prev_ms: int | None, now_ms: int, trigger_ms: int, max_triggers: int) -> int:
    """The time a micro-batch's budget covers: since the previous batch was planned, so that a
    batch that overran its trigger does not lower the admitted rate. At least one trigger (Spark
    plans no faster; also the first batch) and at most `max_triggers` of them (a stalled query
    earns no credit for a burst when it resumes)."""
    if prev_ms is None:
        return trigger_ms
    return min(max(now_ms - prev_ms, trigger_ms), max_triggers * trigger_ms)


class TokenBucket:
    """Admits events at `rate` per second with a burst of one `burst_s` worth of tokens.

    `rate=None` admits everything. `wait_s(n)` says how long until `n` events may go (0 = now),
    without taking anything; `take(n)` takes them, possibly into debt, so a caller that must send
    a batch bigger than the burst is delayed in proportion instead of refused forever.
    """

    def __init__(self, clock: Clock, rate: float | None = None, burst_s: float = 0.25) -> None:
        self.clock = clock
        self.burst_s = burst_s
        self._rate = rate
        self._tokens = self._cap()
        self._at = clock.monotonic_s()

    def _cap(self) -> float:
        return math.inf if self._rate is None else max(1.0, self._rate * self.burst_s)

    @property
    def rate(self) -> float | None:
        return self._rate

    def set_rate(self, rate: float | None) -> None:
        self._refill()
        self._rate = rate
        self._tokens = min(self._tokens, self._cap()) if rate is not None else math.inf

    def _refill(self) -> None:
        now = self.clock.monotonic_s()
        if self._rate is None:
            self._tokens = math.inf
        else:
            if math.isinf(self._tokens):
                self._tokens = self._cap()
            self._tokens = min(self._cap(), self._tokens + (now - self._at) * self._rate)
        self._at = now

    def wait_s(self, n: int) -> float:
        self._refill()
        if self._rate is None or self._tokens >= min(n, self._cap()):
            return 0.0
        return (min(n, self._cap()) - self._tokens) / self._rate

    def take(self, n: int) -> None:
        self._refill()
        if self._rate is not None:
            self._tokens -= n
