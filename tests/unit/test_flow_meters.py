"""The flow's time-driven parts with an injected clock: rate and ratio meters, the token bucket,
the cap watch and the batch interval, and the queue watch that decides overload and underload
(seed 000's steps 3 and 9)."""

from __future__ import annotations

import pytest

from sluice.clock import ManualClock
from sluice.flow.board import OVERLOAD, UNDERLOAD
from sluice.flow.levels import QueueLevel
from sluice.flow.meters import (
    PROBE,
    RELEASE,
    CapWatch,
    RateMeter,
    RatioMeter,
    TokenBucket,
    batch_interval_ms,
)
from sluice.flow.task import QueueWatch


def level(overloaded: bool = False, quiet: bool = False) -> QueueLevel:
    return QueueLevel(0, 0, overloaded=overloaded, quiet=quiet, detail={})


def test_rate_meter_steady_adds() -> None:
    clock = ManualClock()
    m = RateMeter(clock, window_s=2.0)
    for _ in range(20):
        clock.advance(100)
        m.add(500)
    assert m.rate() == pytest.approx(5_000)


def test_rate_meter_young_meter_divides_by_its_age() -> None:
    clock = ManualClock()
    m = RateMeter(clock, window_s=2.0)
    clock.advance(500)
    m.add(1_000)
    assert m.rate() == pytest.approx(2_000)


def test_rate_meter_sparse_lumps_are_lump_over_gap_not_zero() -> None:
    """A Spark batch every 4 s: the rate is the newest batch over the gap since the one before."""
    clock = ManualClock()
    m = RateMeter(clock, window_s=2.0)
    m.add(8_000)
    clock.advance(4_000)
    m.add(8_000)
    clock.advance(1_000)
    assert m.rate() == pytest.approx(8_000 / 5.0)
    clock.advance(3_000)  # 4 s after the newest: as long as the gap before it, not overdue yet
    assert m.rate() == pytest.approx(8_000 / 8.0)


def test_rate_meter_is_zero_once_the_next_lump_is_overdue() -> None:
    """The input stopped: once the newest lump is older than the window and than the gap
    before it, the rate is 0, not the lump over an ever longer gap."""
    clock = ManualClock()
    m = RateMeter(clock, window_s=2.0)
    m.add(8_000)
    clock.advance(1_000)
    m.add(8_000)  # a second apart: the window (2 s) is the longer
    clock.advance(2_001)
    assert m.rate() == 0.0
    clock.advance(30_000)
    assert m.rate() == 0.0
    m.add(100)  # input again
    assert m.rate() > 0
    lone = RateMeter(clock, window_s=2.0)  # one lump 10 s after birth: overdue 10 s after it
    clock.advance(10_000)
    lone.add(4_016)
    clock.advance(9_000)
    assert lone.rate() == pytest.approx(4_016 / 19.0)
    clock.advance(1_001)
    assert lone.rate() == 0.0


def test_ratio_meter_counts_throttled_time_in_its_window() -> None:
    clock = ManualClock()
    ratio = RatioMeter(clock, window_s=10.0)
    clock.advance(10_000)
    ratio.set_throttled(True)
    clock.advance(2_500)
    ratio.set_throttled(False)
    clock.advance(2_500)
    assert ratio.ratio() == pytest.approx(0.25)
    ratio.set_throttled(True)  # an open span counts up to now
    clock.advance(5_000)
    assert ratio.ratio() == pytest.approx(0.75)
    clock.advance(20_000)
    assert ratio.ratio() == pytest.approx(1.0)
    ratio.set_throttled(False)
    clock.advance(10_001)
    assert ratio.ratio() == 0.0


def test_token_bucket_paces_and_lets_a_big_batch_go_into_debt() -> None:
    clock = ManualClock()
    bucket = TokenBucket(clock, rate=1_000, burst_s=0.25)
    assert bucket.wait_s(250) == 0.0
    bucket.take(250)
    assert bucket.wait_s(100) == pytest.approx(0.1)
    clock.advance(100)
    assert bucket.wait_s(100) == 0.0
    # Bigger than the burst: waits for a full bucket, then goes into debt.
    clock.advance(1_000)
    assert bucket.wait_s(2_000) == 0.0
    bucket.take(2_000)
    assert bucket.wait_s(1) == pytest.approx(1.751)


def test_token_bucket_unlimited_and_rate_changes() -> None:
    clock = ManualClock()
    bucket = TokenBucket(clock, rate=None)
    assert bucket.wait_s(10**9) == 0.0
    bucket.take(10**9)
    bucket.set_rate(100.0)
    assert bucket.rate == 100.0
    assert bucket.wait_s(25) == 0.0
    bucket.take(25)
    assert bucket.wait_s(10) == pytest.approx(0.1)
    bucket.set_rate(None)
    assert bucket.wait_s(10**6) == 0.0


def test_queue_watch_overload_at_once_underload_after_a_full_quiet_sensitivity() -> None:
    clock = ManualClock()
    watch = QueueWatch(sensitivity_ms=2_000, clock=clock)
    assert watch.update(level(overloaded=True)) == OVERLOAD
    assert watch.update(level(overloaded=True)) == OVERLOAD  # every look while overloaded
    verdicts = []
    for _ in range(9):  # quiet from t=0 to t=2000, looked at every 250 ms
        verdicts.append(watch.update(level(quiet=True)))
        clock.advance(250)
    assert verdicts == [None] * 8 + [UNDERLOAD]
    # The quiet timer restarts: the next step back needs another full sensitivity.
    verdicts = []
    for _ in range(7):  # t = 2.5 s .. 4 s
        clock.advance(250)
        verdicts.append(watch.update(level(quiet=True)))
    assert verdicts == [None] * 6 + [UNDERLOAD]


def test_queue_watch_between_the_watermarks_resets_the_quiet_timer() -> None:
    clock = ManualClock()
    watch = QueueWatch(sensitivity_ms=1_000, clock=clock)
    watch.update(level(quiet=True))
    clock.advance(900)
    assert watch.update(level()) is None  # neither overloaded nor quiet
    clock.advance(200)
    assert watch.update(level(quiet=True)) is None
    clock.advance(999)
    assert watch.update(level(quiet=True)) is None
    clock.advance(1)
    assert watch.update(level(quiet=True)) == UNDERLOAD


def test_cap_watch_probes_a_cap_that_holds_back_once_per_quiet_sensitivity() -> None:
    clock = ManualClock(10_000)
    watch = CapWatch(clock)
    changed_ms = clock.now_ms()
    verdicts = []
    for _ in range(9):  # held back by the cap at every batch, 250 ms apart
        watch.hold(held_back=True)
        verdicts.append(watch.verdict(changed_ms, sensitivity_ms=2_000))
        clock.advance(250)
    assert verdicts == [None] * 8 + [PROBE]  # only once the last change is a sensitivity old
    changed_ms = clock.now_ms() - 250  # the probe changed the controller
    watch.hold(held_back=True)
    assert watch.verdict(changed_ms, 2_000) is None  # the next probe waits another sensitivity


def test_cap_watch_releases_a_cap_that_held_nothing_back_for_a_sensitivity() -> None:
    clock = ManualClock(10_000)
    watch = CapWatch(clock)
    changed_ms = clock.now_ms()
    clock.advance(1_000)
    watch.hold(held_back=True)
    assert watch.verdict(changed_ms, 2_000) is None  # the change is only 1 s old
    clock.advance(1_500)
    watch.hold(held_back=False)  # the change is 2.5 s old, the last hold 1.5 s
    assert watch.verdict(changed_ms, 2_000) is None  # neither capped lately nor quiet long
    clock.advance(500)
    assert watch.verdict(changed_ms, 2_000) == RELEASE


def test_cap_watch_ignores_holds_the_cap_did_not_cause() -> None:
    clock = ManualClock(10_000)
    watch = CapWatch(clock)
    clock.advance(3_000)
    watch.hold(held_back=True, by_cap=False)  # a shut gate or the static cap
    assert watch.verdict(0, 2_000) is None  # no probe, and no release either: it held back
    clock.advance(2_000)
    assert watch.verdict(0, 2_000) == RELEASE


def test_batch_interval_is_the_time_since_the_previous_batch_within_bounds() -> None:
    assert batch_interval_ms(None, 5_000, trigger_ms=500, max_triggers=4) == 500  # first batch
    assert batch_interval_ms(4_000, 5_300, 500, 4) == 1_300  # a batch that overran its trigger
    assert batch_interval_ms(4_900, 5_000, 500, 4) == 500  # never under one trigger
    assert batch_interval_ms(0, 60_000, 500, 4) == 2_000  # a stall earns at most 4 triggers


def test_cap_watch_waits_a_sensitivity_after_the_last_overload() -> None:
    clock = ManualClock(10_000)
    watch = CapWatch(clock)
    changed_ms = clock.now_ms()
    clock.advance(1_500)
    watch.overload()  # heard while flagged: the controller did not change
    clock.advance(1_000)
    watch.hold(held_back=True)
    assert watch.verdict(changed_ms, 2_000) is None  # the overload is only 1 s old
    clock.advance(1_000)
    watch.hold(held_back=True)
    assert watch.verdict(changed_ms, 2_000) == PROBE
