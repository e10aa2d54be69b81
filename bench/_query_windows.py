"""Window length, for bench/query.py: a 5 min and a 24 h window, each served with 1 m slices
only and with coarser resolutions too, on the same data. The request mix of the main scenarios
has every window at once; here each run has a single window, so the cost of a long window shows
on its own: per request at one connection, and as throughput at 100."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from _query_util import (
    SLICE_MS,
    LookupSpec,
    ServeProcess,
    WrkJob,
    WrkResult,
    config_dict,
    draw_lookups,
    free_port,
    get_path,
    log,
    run_wrk,
    write_request_file,
)
from sluice.slices.window import cover
from sluice.units import format_duration_ms

WINDOWS = {"5m": 300_000, "24h": 86_400_000}
REQUESTS = 20_000  # distinct GETs per window file


@dataclass(frozen=True)
class WindowRow:
    resolutions: tuple[int, ...]
    window: str
    slices: int  # slices one lookup of this window merges
    one: WrkResult  # 1 connection: the cost of a request, no queueing
    many: WrkResult  # `connections` connections: throughput, and latency with queueing


def resolutions_text(res: Sequence[int]) -> str:
    return ", ".join(format_duration_ms(r) for r in res)


def compare_windows(
    env: Any,
    plan: Any,
    rng: np.random.Generator,
    coarse: tuple[int, ...],
    measure: Callable[[Any, WrkJob], WrkResult],
    duration_s: float,
) -> list[WindowRow]:
    """Serve the loaded data with `[1m]` and with `coarse` resolutions (the data must hold
    both), and run GETs of each window at 1 and at `plan.connections` connections. `env.serve`
    points at the server being measured while `measure` runs, then goes back to what it was."""
    files = {}
    for window in WINDOWS:
        lookups = draw_lookups(env.spec, REQUESTS, rng)
        files[window] = env.tmp / f"get-{window}.txt"
        write_request_file(
            files[window], (get_path(LookupSpec(lk.metric, lk.key, window)) for lk in lookups)
        )
    main_serve, rows = env.serve, []
    try:
        for res in ((SLICE_MS,), coarse):
            path = _config_file(env.tmp, env.redis_server.url, res)
            env.serve = ServeProcess(path, free_port(), plan.workers, env.tmp / "serve-w.log")
            env.serve.start()
            try:
                for window, ms in WINDOWS.items():
                    rows.append(
                        _measure_window(
                            env, plan, res, window, ms, files[window], measure, duration_s
                        )
                    )
            finally:
                env.serve.stop()
    finally:
        env.serve = main_serve
    return rows


def _config_file(tmp: Path, url: str, res: tuple[int, ...]) -> Path:
    path = tmp / f"sluice-{len(res)}-resolutions.yaml"
    data = config_dict(url, tmp / f"state-{len(res)}", res)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _measure_window(
    env: Any,
    plan: Any,
    res: tuple[int, ...],
    window: str,
    window_ms: int,
    requests: Path,
    measure: Callable[[Any, WrkJob], WrkResult],
    duration_s: float,
) -> WindowRow:
    def job(connections: int, seconds: float) -> WrkJob:
        return WrkJob(
            base_url=env.serve.base_url,
            script=env.files["lua"],
            requests_file=requests,
            mode="get",
            connections=connections,
            threads=min(plan.wrk_threads, connections),
            duration_s=seconds,
        )

    run_wrk(job(plan.connections, 1.0))  # warm-up
    one = measure(env, job(1, duration_s))
    many = measure(env, job(plan.connections, duration_s))
    slices = cover(env.spec.now_ms, window_ms, list(res)).n_slices
    log(
        f"window {window}, resolutions [{resolutions_text(res)}] ({slices} slices):"
        f" 1 connection p50 {one.pct_ms[50.0]:.2f} ms; {plan.connections} connections"
        f" {many.rate_per_s:,.0f} req/s, p99 {many.pct_ms[99.0]:.1f} ms"
    )
    return WindowRow(res, window, slices, one, many)


def windows_table(rows: Sequence[WindowRow], connections: int) -> str:
    out = [
        "| resolutions | window | slices merged | 1 connection: p50 / p99 ms |"
        f" {connections} connections: requests/s | p50 / p99 ms | Redis µs/lookup |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| [{resolutions_text(r.resolutions)}] | {r.window} | {r.slices:,} |"
            f" {r.one.pct_ms[50.0]:.2f} / {r.one.pct_ms[99.0]:.2f} | {r.many.rate_per_s:,.0f} |"
            f" {r.many.pct_ms[50.0]:.1f} / {r.many.pct_ms[99.0]:.1f} |"
            f" {r.many.redis_us_per_lookup(1):,.0f} |"
        )
    return "\n".join(out)


def windows_text(rows: Sequence[WindowRow], connections: int, duration_s: float) -> str:
    """The table and what it shows: the 24 h / 5 min ratio with and without coarser slices."""

    def ratio(res_len: int, pick: Callable[[WindowRow], float]) -> float:
        by_window = {r.window: pick(r) for r in rows if (len(r.resolutions) > 1) == (res_len > 1)}
        return by_window["24h"] / by_window["5m"] if by_window.get("5m") else float("nan")

    fine = ratio(1, lambda r: r.one.pct_ms[50.0])
    coarse = ratio(2, lambda r: r.one.pct_ms[50.0])
    fine_rate = ratio(1, lambda r: r.many.rate_per_s)
    coarse_rate = ratio(2, lambda r: r.many.rate_per_s)
    return (
        f"Each row: one window for every request (metric and key drawn as above), one run of"
        f" {duration_s:g} s at 1 connection and one at {connections}, after a 1 s warm-up; the"
        " server is restarted with the row's `resolutions`, on the same data.\n\n"
        + windows_table(rows, connections)
        + "\n\n"
        + f"24 h against 5 min, at one connection: p50 {fine:.1f}× with 1 m slices only, and"
        f" {coarse:.1f}× with coarser resolutions too. Throughput at {connections} connections:"
        f" {fine_rate:.2f}× and {coarse_rate:.2f}×. With coarser resolutions a lookup merges at"
        " most window / coarsest + 2 + 2·Σ(r₍ᵢ₊₁₎/rᵢ − 1) slices, so its cost stops growing with"
        " the window's length; with 1 m slices only it grows with the window."
    )
