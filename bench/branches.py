"""Hop-by-hop backpressure against Heron-style source throttling, on two branches.

Two branches read one source stream; the left branch's store is slowed for a while (see
sluice/testing/branches.py for the graph and how latency is measured). Each propagation mode runs
the same schedule in turn, in one process, on one Spark session and one embedded Redis.
Writes a table to docs/benchmarks.md and a plot to docs/branches.png.

    python bench/branches.py            # 2 runs per mode: 25 s warm, 40 s slow, 20 s after
    python bench/branches.py --quick    # 1 run per mode, 25/25/10 s
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _util import log, machine_note, replace_section  # noqa: E402
from sluice.logs import setup_logging  # noqa: E402
from sluice.pipeline.spark import build_spark  # noqa: E402
from sluice.redis.embedded import EmbeddedRedis  # noqa: E402
from sluice.testing.branches import BRANCHES, Result, branch_config, run_experiment  # noqa: E402

HEADING = "## Multi-stage branches: hop-by-hop against source throttling (bench/branches.py)"
MODES = ("hop", "source")


def plot(results: list[Result], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    firsts = {r.propagation: r for r in reversed(results)}
    fig, axes = plt.subplots(2, len(MODES), figsize=(11, 6), sharex=True)
    for col, mode in enumerate(MODES):
        r = firsts[mode]
        ts = [s.t_s for s in r.samples]
        for b, colour in zip(BRANCHES, ("tab:red", "tab:blue"), strict=True):
            lat = [r.latency_s(s, b) for s in r.samples]
            axes[0][col].plot(ts, lat, label=f"{b} branch", color=colour)
            rates = [0.0] + [
                (s2.folded[b] - s1.folded[b]) / (s2.t_s - s1.t_s)
                for s1, s2 in zip(r.samples, r.samples[1:], strict=False)
            ]
            smooth = [statistics.mean(rates[max(0, i - 5) : i + 1]) for i in range(len(rates))]
            axes[1][col].plot(ts, smooth, label=f"{b} branch", color=colour)
        for ax in (axes[0][col], axes[1][col]):
            ax.axvspan(r.slow_from_s, r.slow_until_s, color="0.9", label="left store slowed")
            ax.grid(alpha=0.3)
        axes[0][col].set_title(f"propagation: {mode}")
        axes[0][col].set_ylabel("latency, s (event due → folded)")
        axes[1][col].set_ylabel("events folded / s (3 s mean)")
        axes[1][col].set_xlabel("seconds since the producer started")
        axes[0][col].legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=90)


def section(results: list[Result], args: argparse.Namespace, load: tuple[float, float]) -> str:
    cmd = "python bench/branches.py" + (" --quick" if args.quick else "")
    lines = [
        f"`{cmd}`; {machine_note(*load)}.",
        "",
        f"Two branches (`SELECT * FROM input` each, into their own stream, then folded) read one"
        f" source at {args.rate:,.0f} events/s. The left branch's store is slowed (each write"
        f" partition sleeps, so its write time passes `store.latency_high`) from"
        f" {args.warm:.0f} s to {args.warm + args.slow:.0f} s. Branch streams have watermarks"
        " 300 KB / 30 KB, the source 100 MB / 1 MB. Latency is from the time an event was due at"
        " the producer to the time its branch had folded it, so it counts time held back in the"
        " producer as well as in the streams. Medians over the runs; each run's values are in"
        " brackets.",
        "",
        "| propagation | branch | folded/s before | folded/s while slowed | latency p50 while"
        " slowed | latency max while slowed | stages throttled |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for mode in MODES:
        rs = [r.summary() for r in results if r.propagation == mode]
        if not rs:
            continue
        flagged = sorted({f for s in rs for f in s["flagged"]})
        for b in BRANCHES:
            cells = []
            for key in ("rate_before", "rate_slow", "latency_p50_s", "latency_max_s"):
                vals = [s[b][key] for s in rs if s[b][key] is not None]
                med = statistics.median(vals) if vals else None
                unit = " s" if "latency" in key else ""
                each = ", ".join(f"{v:g}" for v in vals)
                cells.append("–" if med is None else f"{med:,.1f}{unit} ({each})")
            lines.append(f"| {mode} | {b} | " + " | ".join(cells) + f" | {', '.join(flagged)} |")
    lines += ["", "![branch latency and rate](branches.png)", ""]
    lines.append(
        "Hop by hop, the slow store throttles `fold:left`, whose stream then fills and throttles"
        " `left`; the backlog waits on the source stream, which only the left branch still has"
        " to read, and the right branch keeps the producer's rate. Under source throttling the"
        " same overloads slow the producer, and both branches wait."
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--md", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--no-docs", action="store_true")
    args = ap.parse_args()
    args.runs = args.runs or (1 if args.quick else 2)
    args.warm, args.slow, args.tail = (25.0, 25.0, 10.0) if args.quick else (25.0, 40.0, 20.0)
    setup_logging("warning")
    load0 = os.getloadavg()[0]
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="sluice-bench-branches-") as tmp:
        server = EmbeddedRedis(Path(tmp) / "redis").start()
        spark: Any = None
        try:
            spark = build_spark(branch_config(server.url, Path(tmp) / "s", "hop"))
            for i in range(args.runs):
                for mode in MODES:
                    log(f"run {i + 1}/{args.runs}: propagation {mode}")
                    r = run_experiment(
                        server.url, spark, Path(tmp) / f"{mode}-{i}", mode, rate=args.rate,
                        warm_s=args.warm, slow_s=args.slow, tail_s=args.tail, progress=True,
                    )  # fmt: skip
                    log(f"  {r.summary()}")
                    results.append(r)
        finally:
            if spark is not None:
                spark.stop()
            server.stop()
    body = section(results, args, (load0, os.getloadavg()[0]))
    print(body)
    if not args.no_docs:
        plot(results, args.md.parent / "branches.png")
        replace_section(args.md, HEADING, body)
        log(f"wrote {args.md} ({shlex.quote(HEADING)})")


if __name__ == "__main__":
    main()
