"""Rates from the per-second history's counters, and the freshness histogram's buckets."""

from __future__ import annotations

from typing import Any

from sluice.status.freshness import BUCKETS_MS, increments, observation
from sluice.status.history import RATE_WINDOW, with_rates_of


def _sample(t: int, produced: int, events_in: int, admitted: int | None = None) -> dict[str, Any]:
    stages = {} if admitted is None else {"spark": {"emitted": admitted}}
    return {"t": t, "produced": produced, "in": events_in, "stages": stages}


def test_rates_are_counter_differences_over_the_last_samples() -> None:
    samples = [_sample(1000 * i, 100 * i, 50 * i, 80 * i) for i in range(6)]
    out = with_rates_of(samples)
    assert out[0]["input_per_s"] is None and out[0]["processed_per_s"] is None
    assert out[1]["input_per_s"] == 100.0 and out[1]["processed_per_s"] == 50.0
    assert all(s["input_per_s"] == 100.0 for s in out[1:])
    assert all(s["admitted_per_s"] == 80.0 for s in out[1:])
    assert out[5]["stages"]["spark"]["emitted_per_s"] == 80.0
    assert out[5]["produced"] == 500  # the counters stay


def test_a_lump_is_spread_over_the_rate_window() -> None:
    """A batch that lands once every few seconds reads as a steady rate, not 0, 0, 3x."""
    counts = [0, 0, 0, 300, 300, 300, 600]
    out = with_rates_of([_sample(1000 * i, 0, n) for i, n in enumerate(counts)])
    assert out[RATE_WINDOW]["processed_per_s"] == 100.0
    assert out[6]["processed_per_s"] == 100.0


def test_a_gap_or_a_reset_gives_no_rate() -> None:
    samples = [_sample(0, 0, 0), _sample(1000, 10, 10), _sample(60_000, 20, 20)]
    out = with_rates_of(samples)
    assert out[1]["input_per_s"] == 10.0
    assert out[2]["input_per_s"] is None  # the samples before it are a minute old
    restarted = with_rates_of([_sample(0, 0, 0, 500), _sample(1000, 10, 10, 20)])
    assert restarted[1]["admitted_per_s"] is None  # the spark task restarted: its counter fell
    assert restarted[1]["input_per_s"] == 10.0


def test_freshness_observes_each_batch_once_in_one_bucket() -> None:
    rec = {"done_ms": 10_000, "min_ems": 8_800, "max_ems": 9_900}
    assert observation(rec) == 1_200
    assert observation({"done_ms": 5, "min_ems": None}) is None
    assert increments(1_200) == ["count", 1, "sum_ms", 1_200, "le_2500", 1]
    assert increments(BUCKETS_MS[-1] + 1) == ["count", 1, "sum_ms", BUCKETS_MS[-1] + 1]
    assert increments(50)[-2:] == ["le_50", 1]  # a bound is inclusive, as Prometheus's `le`
