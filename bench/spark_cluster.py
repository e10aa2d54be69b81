"""Sluice on a local Spark standalone cluster: 1 worker against 2 workers, side by side.

Each run pre-fills the input with the same events, starts a standalone cluster (a master and
W workers, separate JVMs from the pip-installed Spark's `spark-class`, on loopback), runs
`sluice run` against it as a separate process, and measures how fast it drains the input (the
first batch, which pays for JVM and Python worker start-up, is left out). Modes run
interleaved, so slow spells of the shared machine hit every mode alike; the table gives
medians. A `local[2]` run (no cluster) is the reference.

    .venv/bin/python bench/spark_cluster.py            # full: 600k events, 2 runs per mode
    .venv/bin/python bench/spark_cluster.py --quick    # 150k events, 1 run per mode
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _util import (  # noqa: E402
    BatchRate,
    batch_rate,
    bench_config,
    bench_config_data,
    build_pool,
    log,
    machine_note,
    prefill,
    replace_section,
)
from sluice.redis.connection import open_redis  # noqa: E402
from sluice.redis.keys import BATCHES_KEY, STATS_KEY  # noqa: E402
from sluice.testing.standalone import StandaloneCluster  # noqa: E402

HEADING = "## Spark standalone cluster: 1 worker against 2 (bench/spark_cluster.py)"
MAX_BATCH = 50_000


@dataclass(frozen=True)
class Mode:
    name: str
    workers: int  # 0: local[2], no cluster
    cores: int = 1


MODES = [
    Mode("local[2] (no cluster)", 0),
    Mode("1 worker, 1 core", 1),
    Mode("2 workers, 1 core each", 2),
]


@dataclass
class Run:
    mode: Mode
    rate: BatchRate | None
    drained: bool
    seconds: float


def run_once(mode: Mode, handle: Any, pool: Any, n_events: int, work: Path) -> Run:
    """Pre-fill, start the cluster (if any) and `sluice run`, wait for the drain, stop both."""
    handle.client.flushall()
    sent = prefill(handle.url, pool, n_events)
    cluster = StandaloneCluster(work / "spark", workers=mode.workers, cores=mode.cores)
    spark: dict[str, Any] = {"master": "local[2]", "trigger": "200ms"}
    if mode.workers:
        cluster.start()
        spark = {
            "master": cluster.master,
            "trigger": "200ms",
            "conf": {
                "spark.executor.memory": "768m",
                "spark.cores.max": str(mode.workers * mode.cores),
                "spark.driver.host": "127.0.0.1",
                "spark.driver.bindAddress": "127.0.0.1",
            },
        }
    cfg = {**bench_config_data("jsonl", work / "state", MAX_BATCH), "redis": handle.url}
    cfg["spark"] = spark
    path = work / "sluice.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log_file = (work / "run.log").open("wb")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice.cli", "run", "-c", str(path)],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"},
    )
    drained = False
    try:
        deadline = t0 + 600
        while time.monotonic() < deadline and proc.poll() is None:
            if int(handle.client.hget(STATS_KEY, "events_in") or 0) >= sent:
                drained = True
                break
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        cluster.stop()
    records = [orjson.loads(x) for x in handle.client.lrange(BATCHES_KEY, 0, -1)]
    return Run(
        mode, batch_rate([r for r in records if r["events"]]), drained, time.monotonic() - t0
    )


def section(runs: list[Run], args: argparse.Namespace, loads: tuple[float, float]) -> str:
    cmd = "python bench/spark_cluster.py" + (" --quick" if args.quick else "")
    lines = [
        f"Command: `.venv/bin/{cmd}` (from the repository root). Date:"
        f" {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC. Machine: {machine_note(*loads)}.",
        "",
        f"Setup: {args.events:,} jsonl events (500 per entry, 2 shards, the throughput"
        " benchmark's 3 metrics) pre-filled into an embedded Redis, then drained by `sluice run`"
        f" (trigger 200 ms, at most {MAX_BATCH:,} events per batch). On a cluster, a master and"
        " the workers are separate JVMs started from the pip-installed Spark's `spark-class` on"
        " loopback; executors get 768 MB and Sluice's code as the shipped zip. Rate = events of"
        " batches 2..n over the time from the end of batch 1 to the end of the last (the first"
        f" batch pays for start-up). {args.runs} run(s) per mode, interleaved; medians.",
        "",
        "| mode | runs | drained | events/s (median) | runs' events/s | batches | vs 1 worker |",
        "|---|---:|---|---:|---|---:|---:|",
    ]
    by_mode: dict[str, list[Run]] = {}
    for r in runs:
        by_mode.setdefault(r.mode.name, []).append(r)
    medians = {
        name: statistics.median(r.rate.wall_per_s for r in rs if r.rate) if any(
            r.rate for r in rs) else None
        for name, rs in by_mode.items()
    }  # fmt: skip
    base = medians.get(MODES[1].name)
    for mode in MODES:
        rs = by_mode.get(mode.name, [])
        med = medians.get(mode.name)
        each = ", ".join(f"{r.rate.wall_per_s:,.0f}" for r in rs if r.rate) or "–"
        batches = statistics.median(r.rate.batches for r in rs if r.rate) if med else 0
        ratio = f"{med / base:.2f}×" if med and base else "–"
        drained = "yes" if rs and all(r.drained for r in rs) else "**no**"
        med_s = f"{med:,.0f}" if med else "–"
        lines.append(
            f"| {mode.name} | {len(rs)} | {drained} | {med_s} | {each} | {batches:.0f} | {ratio} |"
        )
    lines += [
        "",
        "What this can and cannot show. The machine has 2 cores, and every process shares them:"
        " the driver (planning, the audit, Redis calls), Redis, the Spark master and workers, and"
        " the executors' Python workers. A second worker adds a second executor, and so a second"
        " task slot, but no CPU. The table therefore shows that the pipeline spreads its"
        " micro-batches over executors on separate JVMs, and what the cluster's extra hops cost"
        " against `local[2]`. It does not show how throughput grows when each worker brings its"
        " own cores.",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="150k events, 1 run per mode")
    ap.add_argument("--events", type=int, default=None, help="events per run (600k full)")
    ap.add_argument("--runs", type=int, default=None, help="runs per mode (2 full)")
    ap.add_argument("--md", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--no-docs", action="store_true", help="print the section only")
    args = ap.parse_args()
    args.events = args.events or (150_000 if args.quick else 600_000)
    args.runs = args.runs or (1 if args.quick else 2)
    load0 = os.getloadavg()[0]
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="sluice-bench-cluster-") as tmp:
        handle = open_redis(None, Path(tmp) / "redis-state")
        try:
            cfg = bench_config("jsonl", Path(tmp) / "pool", MAX_BATCH)
            pool = build_pool(
                cfg, min(args.events, 200_000), seed=1, now_ms=time.time_ns() // 10**6
            )
            for i in range(args.runs):
                for mode in MODES:
                    work = Path(tmp) / f"run-{i}-{mode.workers}"
                    work.mkdir()
                    log(f"run {i + 1}/{args.runs}: {mode.name}, {args.events:,} events")
                    run = run_once(mode, handle, pool, args.events, work)
                    rate = f"{run.rate.wall_per_s:,.0f} events/s" if run.rate else "no rate"
                    log(f"  {rate}, drained: {run.drained}, {run.seconds:.0f} s in all")
                    if not run.drained:
                        log("  run log tail: " + (work / "run.log").read_text()[-1500:])
                    runs.append(run)
        finally:
            handle.close()
    body = section(runs, args, (load0, os.getloadavg()[0]))
    print(body)
    if not args.no_docs:
        replace_section(args.md, HEADING, body)
        log(f"wrote {args.md} ({shlex.quote(HEADING)})")


if __name__ == "__main__":
    main()
