"""sluice.flow.controllers: the five rate laws, driven by a manual clock."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sluice.clock import ManualClock
from sluice.config import AimdConfig, BackpressureConfig, PidConfig
from sluice.errors import ConfigError
from sluice.flow.controllers import (
    CONTROLLERS,
    Aimd,
    BatchSample,
    Controller,
    Fixed,
    Pid,
    Stepwise,
    Unlimited,
    make_controller,
)

TRIGGER_MS = 500


def stepwise(clock: ManualClock, rate: float | None = None, **cfg: Any) -> Stepwise:
    """A stepwise controller, optionally resumed at a finite unthrottled `rate`."""
    c = Stepwise(BackpressureConfig(**cfg), TRIGGER_MS, clock, None)
    if rate is not None:
        c.restore({"controller": "stepwise", "rate": rate, "backpressure": False})
    return c


def batch(rtt_ms: float, events: int = 1_000, ok: bool = True) -> BatchSample:
    return BatchSample(
        events=events, processing_ms=100.0, scheduling_delay_ms=0.0, rtt_ms=rtt_ms, ok=ok
    )


def roundtrip(c: Controller) -> dict[str, Any]:
    """The snapshot as it comes back from JSON (what a restarted process reads)."""
    snap: dict[str, Any] = json.loads(json.dumps(c.snapshot()))
    return snap


# --- stepwise (seed 000) ---------------------------------------------------------------------


def test_stepwise_seed_sequence_from_unlimited() -> None:
    clock = ManualClock(1_000)
    c = stepwise(clock)
    assert (c.rate, c.origin_rate, c.backpressured, c.batch_limit()) == (None, None, False, None)

    clock.advance(250)
    assert c.on_overload(10_000) is True
    assert (c.rate, c.origin_rate, c.backpressured) == (5_000, 10_000, True)
    assert c.changed_ms == 1_250
    assert c.batch_limit() == 2_500  # 5000 events/s over a 500 ms trigger

    clock.advance(250)
    assert c.on_overload(20_000) is False  # one throttle per overload episode
    assert (c.rate, c.origin_rate, c.changed_ms) == (5_000, 10_000, 1_250)

    clock.advance(2_000)
    assert c.on_underload() is True
    # Back at the measured origin: the flag clears, and the origin stays as a provisional cap.
    assert (c.rate, c.origin_rate, c.backpressured) == (10_000, None, False)
    assert c.changed_ms == 3_500
    assert c.on_underload() is False
    clock.advance(2_000)
    assert c.release() is True  # the owner saw the cap hold nothing back: unlimited again
    assert (c.rate, c.changed_ms) == (None, 5_500)
    assert c.release() is False


def test_stepwise_release_lifts_only_a_measured_cap_and_never_while_throttled() -> None:
    c = stepwise(ManualClock(), rate=8_000)
    assert c.release() is False  # a configured rate is not provisional
    c.on_overload(1)
    assert c.release() is False and c.rate == 4_000
    m = stepwise(ManualClock())
    m.on_overload(6_000)
    assert m.release() is False and m.backpressured  # throttled: nothing to lift


def test_stepwise_probe_raises_a_provisional_cap_one_step_at_a_time() -> None:
    clock = ManualClock(1_000)
    c = stepwise(clock)
    c.on_overload(10_000)
    assert c.probe() is True  # while flagged: one step back, as an underload would be
    assert (c.rate, c.backpressured) == (10_000, False)  # at the measured origin, provisional

    clock.advance(2_000)
    assert c.probe() is True  # the inverse of a throttle: rate / step
    assert (c.rate, c.origin_rate, c.backpressured, c.changed_ms) == (20_000, None, False, 3_000)
    assert c.probe() is True
    assert c.rate == 40_000
    assert c.release() is True and c.rate is None  # it stopped holding input back
    assert c.probe() is False  # unlimited: nothing to raise


def test_stepwise_overload_during_a_probe_sets_a_new_provisional_origin() -> None:
    c = stepwise(ManualClock())
    c.on_overload(10_000)
    c.on_underload()
    c.probe()
    assert c.rate == 20_000
    assert c.on_overload(123) is True  # from the probed cap, not from the measurement
    assert (c.rate, c.origin_rate, c.backpressured) == (10_000, 20_000, True)
    assert c.on_overload(123) is False  # still one throttle per episode
    assert c.on_underload() is True
    assert (c.rate, c.backpressured) == (20_000, False)
    assert c.probe() is True and c.rate == 40_000  # still provisional: it may rise again
    assert roundtrip(c)["origin_measured"] is True


def test_stepwise_probe_never_raises_a_configured_rate() -> None:
    c = stepwise(ManualClock(), rate=8_000)
    assert c.probe() is False
    c.on_overload(0)
    assert c.probe() is False  # flagged: only an underload steps back, as in the seed
    c.on_underload()
    assert (c.rate, c.backpressured) == (8_000, False)
    assert c.probe() is False and c.rate == 8_000


def test_stepwise_probe_lifts_a_cap_that_reaches_the_static_cap() -> None:
    c = Stepwise(BackpressureConfig(), TRIGGER_MS, ManualClock(), max_batch_events=15_000)
    c.on_overload(12_000)
    c.on_underload()
    assert c.batch_limit() == 6_000  # 12,000 events/s over a 500 ms trigger
    assert c.probe() is True  # 24,000/s: 12,000 per trigger, still under the 15,000 cap
    assert (c.rate, c.batch_limit()) == (24_000, 12_000)
    assert c.probe() is True  # 48,000/s, 24,000 per trigger: the static cap binds first
    assert (c.rate, c.batch_limit()) == (None, 15_000)


def test_batch_limit_covers_the_interval_it_is_given() -> None:
    c = Stepwise(BackpressureConfig(), TRIGGER_MS, ManualClock(), max_batch_events=10_000)
    c.on_overload(10_000)  # 5,000 events/s
    assert c.batch_limit() == 2_500  # one 500 ms trigger
    assert c.batch_limit(1_500.0) == 7_500  # a batch planned 1.5 s after the previous one
    assert c.batch_limit(4_000.0) == 10_000  # still under the static cap
    assert (
        Fixed(BackpressureConfig(fixed_rate=1_000), TRIGGER_MS, ManualClock(), None).batch_limit(
            2_000.0
        )
        == 2_000
    )
    assert aimd().batch_limit(2_000.0) == 10_000  # a window per batch, whatever the interval


def test_stepwise_finite_rate_keeps_its_own_origin() -> None:
    c = stepwise(ManualClock(), rate=8_000)
    assert c.on_overload(123) is True  # the measurement is not used when the rate is finite
    assert (c.rate, c.origin_rate, c.backpressured) == (4_000, 8_000, True)
    assert c.on_underload() is True
    assert (c.rate, c.origin_rate, c.backpressured) == (8_000, None, False)

    # A second episode records its origin afresh, from the rate at that throttle.
    assert c.on_overload(999_999) is True
    assert (c.rate, c.origin_rate) == (4_000, 8_000)


def test_stepwise_flag_clears_only_back_at_origin() -> None:
    c = stepwise(ManualClock())
    c.restore({"controller": "stepwise", "rate": 2_000, "origin_rate": 8_000, "backpressure": True})
    assert c.on_overload(50_000) is False  # already backpressured: no further step down

    assert c.on_underload() is True
    assert (c.rate, c.origin_rate, c.backpressured) == (4_000, 8_000, True)
    assert c.on_underload() is True
    assert (c.rate, c.origin_rate, c.backpressured) == (8_000, None, False)
    assert c.on_underload() is False
    assert c.rate == 8_000


@pytest.mark.parametrize(
    ("step", "rate"),
    [
        (0.3, 1_000.0),
        (0.7, 8_000.0),  # 8000 * 0.7 / 0.7 == 8000.000000000001: an overshoot
        (0.9, 893_327.7108533793),  # * 0.9 / 0.9 comes back one ulp *under* the origin
    ],
)
def test_stepwise_snaps_to_origin_despite_float_round_trip(step: float, rate: float) -> None:
    c = stepwise(ManualClock(), rate=rate, step=step)
    c.on_overload(0)
    assert c.backpressured
    assert c.on_underload() is True
    assert c.rate == rate  # exactly, not a float neighbour
    assert not c.backpressured


def test_stepwise_never_below_min_rate() -> None:
    c = stepwise(ManualClock(), min_rate=100.0)
    c.on_overload(150)
    assert (c.rate, c.origin_rate) == (100, 150)  # 75 would be under the floor
    assert c.on_underload() is True
    assert (c.rate, c.backpressured) == (150, False)
    assert c.release() is True and c.rate is None

    c.on_overload(20)  # a measurement under the floor: the origin is the floor
    assert (c.rate, c.origin_rate) == (100, 100)

    low = stepwise(ManualClock(), rate=50)  # a throttle never raises a rate already below it
    low.on_overload(0)
    assert (low.rate, low.backpressured) == (50, True)


def test_stepwise_batch_limit_honours_the_cap() -> None:
    c = Stepwise(BackpressureConfig(), TRIGGER_MS, ManualClock(), max_batch_events=1_000)
    assert c.batch_limit() == 1_000  # unlimited rate: the static cap
    c.on_overload(10_000)
    assert c.batch_limit() == 1_000  # 5000/s is 2500 per trigger, still over the cap
    c.on_overload(0)
    c.restore({"controller": "stepwise", "rate": 1.0, "origin_rate": 2.0, "backpressure": True})
    assert c.batch_limit() == 1  # never 0


def test_stepwise_snapshot_restore_round_trip() -> None:
    clock = ManualClock(7_000)
    c = stepwise(clock)
    c.on_overload(10_000)
    snap = roundtrip(c)
    assert snap["controller"] == "stepwise"
    assert (snap["rate"], snap["origin_rate"], snap["backpressure"]) == (5_000, 10_000, True)
    assert snap["changed_ms"] == 7_000

    resumed = stepwise(ManualClock(99_000))
    resumed.restore(snap)
    assert resumed.snapshot() == c.snapshot()
    assert resumed.changed_ms == 7_000
    resumed.on_underload()
    assert resumed.rate == 10_000
    assert resumed.release() is True  # the measured origin survives the restart as provisional
    assert resumed.rate is None


def test_stepwise_ignores_batches_and_foreign_snapshots() -> None:
    c = stepwise(ManualClock(), rate=8_000)
    assert c.on_batch(batch(rtt_ms=1e9, ok=False)) is False
    c.restore({"controller": "aimd", "rate": 1.0, "window": 5, "backpressure": True})
    assert (c.rate, c.backpressured) == (8_000, False)


# --- aimd (seed 002) -------------------------------------------------------------------------

AIMD = AimdConfig(
    initial_window=10_000,
    increase=1_000,
    decrease=2_000,
    busy_factor=0.5,
    min_window=1_000,
    timeout=5_000,
)


def aimd(clock: ManualClock | None = None, cap: int | None = None, **kw: Any) -> Aimd:
    cfg = BackpressureConfig(aimd=AIMD.model_copy(update=kw))
    return Aimd(cfg, TRIGGER_MS, clock or ManualClock(), cap)


def test_aimd_normal_slow_busy() -> None:
    clock = ManualClock()
    c = aimd(clock)  # target RTT defaults to 2 x trigger = 1000 ms
    assert (c.batch_limit(), c.rate, c.backpressured) == (10_000, 20_000, False)

    clock.advance(500)
    assert c.on_batch(batch(rtt_ms=1_000)) is True  # at the target: NORMAL
    assert (c.batch_limit(), c.snapshot()["state"], c.changed_ms) == (11_000, "normal", 500)

    assert c.on_batch(batch(rtt_ms=1_001)) is True  # SLOW: linear decrease
    assert (c.batch_limit(), c.snapshot()["state"], c.backpressured) == (9_000, "slow", True)

    assert c.on_batch(batch(rtt_ms=10, ok=False)) is True  # a failed batch is BUSY
    assert (c.batch_limit(), c.snapshot()["state"]) == (4_500, "busy")
    assert c.on_batch(batch(rtt_ms=5_001)) is True  # slower than the timeout is BUSY too
    assert c.batch_limit() == 2_250
    assert c.on_batch(batch(rtt_ms=5_000)) is True  # at the timeout: only SLOW
    assert (c.batch_limit(), c.snapshot()["state"]) == (1_000, "slow")  # clamped to min_window

    assert c.on_batch(batch(rtt_ms=0)) is True
    assert (c.batch_limit(), c.backpressured) == (2_000, False)
    assert c.rate == c.batch_limit() * 1000 / TRIGGER_MS


def test_aimd_clamps() -> None:
    c = aimd(cap=12_000, initial_window=20_000)
    assert c.batch_limit() == 12_000  # the initial window is clamped to the cap
    assert c.on_batch(batch(rtt_ms=0)) is False  # already NORMAL at the cap: no change
    assert c.batch_limit() == 12_000

    low = aimd(initial_window=1_500)
    assert low.on_batch(batch(rtt_ms=0, ok=False)) is True
    assert low.batch_limit() == 1_000  # 750 is under min_window
    assert low.on_batch(batch(rtt_ms=0, ok=False)) is False  # still BUSY at the floor

    tiny = aimd(cap=500)  # the source's cap wins over min_window
    assert tiny.batch_limit() == 500
    assert tiny.on_batch(batch(rtt_ms=0, ok=False)) is True  # BUSY, but nowhere lower to go
    assert tiny.batch_limit() == 500


def test_aimd_idle_batches_do_not_grow_the_window() -> None:
    c = aimd()
    assert c.on_batch(batch(rtt_ms=0, events=0)) is False
    assert c.batch_limit() == 10_000
    assert c.on_batch(batch(rtt_ms=2_000, events=0)) is True  # but SLOW still shrinks it
    assert c.batch_limit() == 8_000
    assert c.on_batch(batch(rtt_ms=0, events=0)) is True  # back to NORMAL, window unchanged
    assert (c.batch_limit(), c.backpressured) == (8_000, False)


def test_aimd_explicit_target_and_ignored_inputs() -> None:
    c = aimd(target_rtt=3_000)
    assert c.on_batch(batch(rtt_ms=2_500)) is True
    assert c.batch_limit() == 11_000
    assert c.on_overload(1e9) is False
    assert c.on_underload() is False
    assert c.batch_limit() == 11_000


def test_aimd_snapshot_restore() -> None:
    c = aimd()
    c.on_batch(batch(rtt_ms=2_000))
    snap = roundtrip(c)
    assert (snap["window"], snap["state"], snap["backpressure"]) == (8_000, "slow", True)
    assert snap["rate"] == 16_000

    resumed = aimd()
    resumed.restore(snap)
    assert resumed.snapshot() == c.snapshot()
    smaller = aimd(cap=5_000)  # the cap shrank across the restart: the window follows it
    smaller.restore(snap)
    assert smaller.batch_limit() == 5_000


# --- pid (Spark's PIDRateEstimator) ----------------------------------------------------------


def pid_reference(
    samples: list[tuple[int, int, float, float]], batch_ms: int, p: PidConfig
) -> list[float | None]:
    """PIDRateEstimator.compute, transcribed: (time_ms, n, processing_ms, scheduling_ms) -> rate."""
    first, latest_time, latest_rate, latest_error = True, -1, -1.0, -1.0
    out: list[float | None] = []
    for time_ms, n, proc, sched in samples:
        if not (time_ms > latest_time and n > 0 and proc > 0):
            out.append(None)
            continue
        since_s = (time_ms - latest_time) / 1000
        rate = n / proc * 1000
        error = latest_rate - rate
        hist = sched * rate / batch_ms
        d_error = (error - latest_error) / since_s
        new = max(
            latest_rate - p.proportional * error - p.integral * hist - p.derivative * d_error,
            p.min_rate,
        )
        latest_time = time_ms
        if first:
            first, latest_rate, latest_error = False, rate, 0.0
            out.append(None)
        else:
            latest_rate, latest_error = new, error
            out.append(new)
    return out


def drive(c: Pid, clock: ManualClock, samples: list[tuple[int, int, float, float]]) -> list[Any]:
    rates: list[Any] = []
    for time_ms, n, proc, sched in samples:
        clock.advance(time_ms - clock.now_ms())
        c.on_batch(BatchSample(n, proc, sched, rtt_ms=proc + sched))
        rates.append(c.rate)
    return rates


def test_pid_by_hand() -> None:
    clock = ManualClock()
    c = Pid(BackpressureConfig(), 1_000, clock, None)  # Kp 1, Ki 0.2, Kd 0, floor 100
    clock.advance(1_000)
    assert c.on_batch(BatchSample(1_000, 500.0, 0.0, 500.0)) is True
    assert (c.rate, c.backpressured) == (None, False)  # the first batch only seeds 2000/s

    clock.advance(1_000)
    assert c.on_batch(BatchSample(1_000, 1_000.0, 500.0, 1_500.0)) is True
    # processing 1000/s; error 2000 - 1000; historical 500 * 1000 / 1000
    assert c.rate == pytest.approx(2_000 - 1_000 - 0.2 * 500)
    assert c.backpressured  # 900/s admitted, the stage just did 1000/s: draining a backlog
    assert c.changed_ms == 2_000

    clock.advance(1_000)
    c.on_batch(BatchSample(900, 900.0, 0.0, 900.0))
    assert c.rate == pytest.approx(1_000)  # error -100, no delay: 900 + 100
    assert not c.backpressured


def test_pid_matches_reference_with_all_gains() -> None:
    p = PidConfig(proportional=0.8, integral=0.3, derived=0.5, min_rate=50.0)
    samples = [
        (1_000, 5_000, 400.0, 0.0),
        (1_700, 4_000, 500.0, 120.0),  # 0.7 s since the last update: dError is per second
        (1_700, 9_999, 1.0, 0.0),  # same time: skipped
        (2_900, 0, 300.0, 0.0),  # no events: skipped
        (3_400, 3_000, 0.0, 0.0),  # no processing time: skipped
        (4_000, 3_500, 650.0, 300.0),  # 2.3 s since the last *update*
        (4_600, 6_000, 450.0, 0.0),
    ]
    clock = ManualClock()
    c = Pid(BackpressureConfig(pid=p), TRIGGER_MS, clock, None)
    expected = pid_reference(samples, TRIGGER_MS, p)
    got = drive(c, clock, samples)
    assert expected[0] is None and expected[1] is not None
    last: float | None = None
    for e, g in zip(expected, got, strict=True):
        last = e if e is not None else last  # a skipped batch keeps the previous rate
        assert g == pytest.approx(last)


def test_pid_skips_leave_state_alone() -> None:
    clock = ManualClock(5_000)
    c = Pid(BackpressureConfig(), TRIGGER_MS, clock, None)
    c.on_batch(BatchSample(1_000, 100.0, 0.0, 100.0))
    before = c.snapshot()
    assert c.on_batch(BatchSample(1_000, 100.0, 0.0, 100.0)) is False  # time did not advance
    clock.advance(500)
    assert c.on_batch(BatchSample(0, 100.0, 0.0, 100.0)) is False
    assert c.on_batch(BatchSample(1_000, 0.0, 0.0, 0.0)) is False
    assert c.on_overload(1.0) is False and c.on_underload() is False
    assert c.snapshot() == before


def test_pid_floor_and_restore() -> None:
    clock = ManualClock()
    c = Pid(BackpressureConfig(pid=PidConfig(min_rate=250.0)), TRIGGER_MS, clock, None)
    clock.advance(500)
    c.on_batch(BatchSample(1_000, 500.0, 0.0, 500.0))
    clock.advance(500)
    c.on_batch(BatchSample(1_000, 500.0, 60_000.0, 500.0))  # a minute behind
    assert c.rate == 250.0
    assert c.batch_limit() == 125

    resumed = Pid(BackpressureConfig(pid=PidConfig(min_rate=250.0)), TRIGGER_MS, clock, None)
    resumed.restore(roundtrip(c))
    assert resumed.snapshot() == c.snapshot()
    clock.advance(500)
    sample = BatchSample(1_000, 400.0, 0.0, 400.0)
    c.on_batch(sample)
    resumed.on_batch(sample)
    assert resumed.rate == c.rate != 250.0  # it continues, instead of re-seeding


# --- fixed, none, dispatch -------------------------------------------------------------------


def test_fixed_rate_sources() -> None:
    clock = ManualClock()
    c = Fixed(BackpressureConfig(fixed_rate=2_500.0), TRIGGER_MS, clock, 1_000_000)
    assert (c.rate, c.batch_limit(), c.backpressured) == (2_500.0, 1_250, False)
    assert not (c.on_overload(10.0) or c.on_underload() or c.on_batch(batch(1e9, ok=False)))
    assert c.rate == 2_500.0

    from_cap = Fixed(BackpressureConfig(), 300, clock, 7)
    assert from_cap.rate == pytest.approx(7 * 1000 / 300)
    assert from_cap.batch_limit() == 7  # not 6 from float round-off

    assert Fixed(BackpressureConfig(), TRIGGER_MS, clock, None).batch_limit() is None


def test_unlimited() -> None:
    c = Unlimited(BackpressureConfig(), TRIGGER_MS, ManualClock(), None)
    assert not c.on_overload(10.0)
    assert (c.rate, c.batch_limit(), c.backpressured, c.origin_rate) == (None, None, False, None)
    assert Unlimited(BackpressureConfig(), TRIGGER_MS, ManualClock(), 42).batch_limit() == 42
    assert c.snapshot()["controller"] == "none"


@pytest.mark.parametrize("kind", sorted(CONTROLLERS))
def test_make_controller_dispatch(kind: str) -> None:
    from_cfg = make_controller(BackpressureConfig(controller=kind), TRIGGER_MS, ManualClock(), 10)
    overridden = make_controller(BackpressureConfig(), TRIGGER_MS, ManualClock(), 10, kind=kind)
    assert type(from_cfg) is type(overridden) is CONTROLLERS[kind]
    assert from_cfg.name == kind


def test_make_controller_errors() -> None:
    clock = ManualClock()
    with pytest.raises(ConfigError, match=r"unknown controller 'bogus'; expected one of stepwise"):
        make_controller(BackpressureConfig(), TRIGGER_MS, clock, None, kind="bogus")
    with pytest.raises(ConfigError, match=r"`trigger_ms` must be positive, got 0"):
        make_controller(BackpressureConfig(), 0, clock, None)
    with pytest.raises(ConfigError, match=r"`max_batch_events` must be at least 1, got 0"):
        make_controller(BackpressureConfig(), TRIGGER_MS, clock, 0)
