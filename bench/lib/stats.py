"""Statistics of benchmark runs: percentiles, batch rates, step verdicts, per-second rates."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]); None for no values."""
    if not values:
        return None
    vs = sorted(values)
    return vs[max(0, min(len(vs) - 1, math.ceil(q * len(vs)) - 1))]


def median(values: Sequence[float]) -> float | None:
    """The median (mean of the middle two for an even count); None for no values."""
    return statistics.median(values) if values else None


def batch_rate(records: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The rate of batch records (batch, events, started_ms, done_ms) without the first, the
    warm-up batch: `per_s` = events of batches 2..n over the time from batch 1's end to batch
    n's end (`wall_s`), so the gaps between batches (planning, offsets, trigger waits) count;
    `busy_per_s` over the batches' own durations (`busy_s`). None with fewer than 2 batches."""
    rs = sorted(records, key=lambda r: r["batch"])
    if len(rs) < 2:
        return None
    events = sum(r["events"] for r in rs[1:])
    wall_s = (rs[-1]["done_ms"] - rs[0]["done_ms"]) / 1000
    busy_s = sum(r["done_ms"] - r["started_ms"] for r in rs[1:]) / 1000
    return {"batches": len(rs) - 1, "events": events, "wall_s": wall_s, "busy_s": busy_s,
            "per_s": events / wall_s if wall_s > 0 else 0.0,
            "busy_per_s": events / busy_s if busy_s > 0 else 0.0}  # fmt: skip


def judge_step(samples: Sequence[tuple[float, int]], rate_per_s: float, max_lag_s: float,
               batch_events: Sequence[int], cap_events: int) -> tuple[bool, str]:  # fmt: skip
    """Did the pipeline keep up with a fixed-rate step? (bounded, reason). `samples` are (t_s,
    backlog events) over the step, `batch_events` the batches admitted in its last two thirds.
    Bounded iff (1) none of them filled 95 % of the admission cap (input left waiting); (2) the
    backlog's peak in the last third is at most 1.2 x the middle third's plus 0.25 s of input
    (a sawtooth is fine, a rising trend is not); (3) the final backlog is under `max_lag_s` of
    input. The first third is the transient."""
    if len(samples) < 6:
        return False, "too few samples"
    if not batch_events:
        return False, "no batch started in the last two thirds of the step"
    full = sum(1 for e in batch_events if e >= 0.95 * cap_events)
    if full:
        return False, f"{full} of {len(batch_events)} batches hit the admission cap"
    n = len(samples)
    mid = [b for _, b in samples[n // 3 : 2 * n // 3]]
    last = [b for _, b in samples[2 * n // 3 :]]
    if samples[-1][1] / rate_per_s > max_lag_s:
        return False, f"final backlog {samples[-1][1] / rate_per_s:.1f} s of input"
    if max(last) > 1.2 * max(mid) + 0.25 * rate_per_s:
        return False, f"backlog rising: peak {max(mid):,} -> {max(last):,} events"
    return True, f"peak backlog {max(mid + last):,} events, largest batch {max(batch_events):,}"


def admitted_per_s(batches: Sequence[Mapping[str, Any]], t0_ms: int, end_s: float, trigger_ms: int,
                   restarts_s: Sequence[float] = ()) -> list[float]:  # fmt: skip
    """Events/s admitted in each whole second of [0, end_s), from batch records: a batch's
    events are spread evenly from the previous batch's start to its own (one trigger interval
    for the first, and for the first after a restart in `restarts_s`). Whole batches per second
    would alias: one batch every 0.8 s makes seconds of one and two, a swing nobody caused."""
    n_bins = max(0, math.floor(end_s))
    bins = [0.0] * n_bins
    prev: float | None = None
    for b in sorted(batches, key=lambda b: b["started_ms"]):
        hi = (b["started_ms"] - t0_ms) / 1000
        restarted = prev is not None and any(prev < r <= hi for r in restarts_s)
        lo = hi - trigger_ms / 1000 if prev is None or restarted else prev
        prev = hi
        if b["events"] <= 0 or hi <= lo:
            continue
        density = b["events"] / (hi - lo)
        for k in range(max(0, math.floor(lo)), min(n_bins, math.ceil(hi))):
            bins[k] += density * max(0.0, min(hi, k + 1) - max(lo, k))
    return bins


def coefficient_of_variation(values: Sequence[float]) -> float | None:
    """Population std / mean; None for fewer than 2 values or a zero mean."""
    if len(values) < 2 or statistics.fmean(values) <= 0:
        return None
    return statistics.pstdev(values) / statistics.fmean(values)


def rises(flags: Sequence[bool]) -> int:
    """How many times `flags` goes from False to True (a start already True counts once)."""
    return sum(1 for i, f in enumerate(flags) if f and (i == 0 or not flags[i - 1]))


def settle_time_s(samples: Sequence[tuple[float, float]], from_s: float, until_s: float,
                  threshold: float) -> float | None:  # fmt: skip
    """Seconds from `from_s` until the value is at or under `threshold` and stays there up to
    `until_s`; None if it is still over at the last sample before `until_s`. `samples` are
    (t_s, value), in time order."""
    settled: float | None = None
    seen = False
    for t, v in samples:
        if from_s <= t <= until_s:
            seen = True
            settled = None if v > threshold else (t if settled is None else settled)
    return None if not seen or settled is None else settled - from_s


def batch_freshness(batches: Sequence[Mapping[str, Any]], t0_ms: int, lo_s: float,
                    hi_s: float) -> dict[str, Any]:  # fmt: skip
    """Like `sluice status`, over the batches done in [lo_s, hi_s): per batch, done − newest and
    done − oldest event time; p50 over both, p99 over the oldest. Per batch, not per event, so
    with tens of batches p99 is about the worst batch."""
    rs = [b for b in batches if lo_s * 1000 <= b["done_ms"] - t0_ms < hi_s * 1000]
    newest = [b["done_ms"] - b["max_ems"] for b in rs if b.get("max_ems") is not None]
    oldest = [b["done_ms"] - b["min_ems"] for b in rs if b.get("min_ems") is not None]
    p50, p99 = percentile(newest + oldest, 0.5), percentile(oldest, 0.99)
    return {"batches": len(rs), "p50_ms": p50, "p99_ms": p99}


def time_calls_us(fn: Callable[..., object], args_list: Sequence[tuple[Any, ...]]) -> list[float]:
    """Wall time of `fn(*args)` for each args tuple, in microseconds."""
    out = []
    for args in args_list:
        t0 = time.perf_counter_ns()
        fn(*args)
        out.append((time.perf_counter_ns() - t0) / 1000)
    return out
