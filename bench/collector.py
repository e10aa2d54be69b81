"""Python's cyclic garbage collector on two hot paths, with and without what `sluice.collector`
does about it.

    .venv/bin/python bench/collector.py            # 9 alternating runs of each, about 1 minute
    .venv/bin/python bench/collector.py --quick    # 3 runs of each

1. The walk (`source.walk.read_entries`): the planner reads a shard's entries in XRANGE chunks
   parsed by hiredis, some 20,000 lists per 10,000 `fields` entries. CPU time of one walk over
   a shard of `--entries` `fields` entries (the ingest benchmark's zipf events, on an embedded
   Redis) with the collector paused while each chunk lives, as the code does, and with the
   pause taken out (`sluice.collector.paused` replaced by a no-op in this process), alternating.
2. A Spark Python worker's full collection: a fresh process that imports what a worker running
   Sluice's tasks imports (pyspark's worker, pyarrow, pandas, the source's reader, the fold's
   writer) times `gc.collect()` before and after `sluice.collector.settle()`, which freezes
   what the process holds (a worker settles at its first task).

Writes bench/results/collector[.quick].json.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lib.load import bench_config, build_pool, now_ms, prefill
from lib.results import Run, log, parser

# A worker's imports: what `pyspark.worker` and Sluice's executor side bring in.
WORKER_IMPORTS = ("pyspark.worker", "pyarrow", "pandas", "sluice.source.reader",
                  "sluice.pipeline.writer", "sluice.pipeline.stage")  # fmt: skip
FULL_COLLECTIONS = """
import gc, json, statistics, sys, time
for m in sys.argv[1:]:
    __import__(m)
from sluice import collector

def full(n):
    out = []
    for _ in range(n):
        t0 = time.thread_time()
        gc.collect()
        out.append((time.thread_time() - t0) * 1000)
    return out

n = 9
tracked = len(gc.get_objects())
before = full(n)
collector.settle()
after = full(n)
print(json.dumps({"tracked": tracked, "frozen": gc.get_freeze_count(),
                  "before_ms": before, "after_ms": after}))
"""


def walk_cpu(url: str, shard: str, entries: int, pause: bool) -> float:
    """CPU ms of one walk of `entries` entries of `shard`, with the collector's pause or not."""
    import sluice.source.walk as walk_mod
    import sluice.source.xrange as xrange_mod
    from sluice.collector import paused
    from sluice.source.xrange import raw_client

    off = paused if pause else contextlib.nullcontext
    walk_mod.paused = xrange_mod.paused = off  # type: ignore[assignment]
    try:
        client = raw_client(url)
        t0 = time.process_time()
        got = walk_mod.read_entries(client, shard, "0-0", entries, "fields", 1 << 20)
        spent = (time.process_time() - t0) * 1000
    finally:
        walk_mod.paused = xrange_mod.paused = paused  # type: ignore[assignment]
    if len(got) != entries:
        raise SystemExit(f"the walk read {len(got)} entries, not {entries}")
    return spent


def walks(entries: int, runs: int) -> dict[str, Any]:
    from sluice.redis.embedded import EmbeddedRedis

    with tempfile.TemporaryDirectory() as d:
        server = EmbeddedRedis(Path(d) / "redis").start()
        try:
            cfg = bench_config("fields", Path(d), entries)
            pool = build_pool(cfg, entries, 11, now_ms())
            shard = cfg.source.shard_keys()[0]
            prefill(server.url, pool.only(shard), entries)
            walk_cpu(server.url, shard, entries, True)  # warm-up: connections, caches
            on: list[float] = []
            off: list[float] = []
            for i in range(runs):
                for pause in (True, False) if i % 2 == 0 else (False, True):
                    (on if pause else off).append(walk_cpu(server.url, shard, entries, pause))
                log(f"walk {i + 1}/{runs}: paused {on[-1]:.0f} ms, not paused {off[-1]:.0f} ms")
        finally:
            server.stop()
    return {"entries": entries, "paused_ms": on, "not_paused_ms": off,
            "paused_median_ms": statistics.median(on),
            "not_paused_median_ms": statistics.median(off),
            "ratio": statistics.median(off) / statistics.median(on)}  # fmt: skip


def full_collections() -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", FULL_COLLECTIONS, *WORKER_IMPORTS],
                         check=True, capture_output=True, text=True)  # fmt: skip
    got: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    got["before_median_ms"] = statistics.median(got["before_ms"])
    got["after_median_ms"] = statistics.median(got["after_ms"])
    log(f"full collection: {got['before_median_ms']:.1f} ms, settled {got['after_median_ms']:.1f}")
    return got


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--entries", type=int, default=50_000, help="entries per walk")
    p.add_argument("--runs", type=int, help="alternating runs of each (default 9, quick 3)")
    a = p.parse_args()
    runs = a.runs or (3 if a.quick else 9)
    run = Run("collector", a)
    results = {"walk": walks(a.entries, runs), "worker": full_collections()}
    run.write({"entries": a.entries, "runs": runs, "imports": list(WORKER_IMPORTS)}, results)


if __name__ == "__main__":
    main()
