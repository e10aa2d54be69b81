"""Sluice on a local Spark standalone cluster: 1 worker against 2 workers, side by side.

    .venv/bin/python bench/spark_cluster.py            # full: 600k events, 2 runs per mode
    .venv/bin/python bench/spark_cluster.py --quick    # 150k events, 1 run per mode

`sluice run` drains the same pre-filled input on `local[2]` and on a cluster of 1 and of 2
workers (`sluice.testing.standalone`), modes interleaved. Writes
bench/results/spark_cluster[.quick].json.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import yaml

from lib.load import LoadPool, bench_config, bench_config_data, build_pool, now_ms, prefill
from lib.procs import SluiceProcess, stat_counter
from lib.results import Run, log, parser
from lib.stats import batch_rate, median
from sluice.redis.connection import RedisHandle, open_redis
from sluice.redis.keys import BATCHES_KEY
from sluice.testing.standalone import StandaloneCluster

MAX_BATCH = 50_000
MODES = (("local[2] (no cluster)", 0), ("1 worker, 1 core", 1), ("2 workers, 1 core each", 2))


def run_once(workers: int, handle: RedisHandle, pool: LoadPool, n_events: int,
             work: Path) -> dict[str, Any]:  # fmt: skip
    """Pre-fill, start the cluster (if any) and `sluice run`, wait for the drain, stop both."""
    handle.client.flushall()
    sent = prefill(handle.url, pool, n_events)
    cluster = StandaloneCluster(work / "spark", workers=workers, cores=1)
    spark: dict[str, Any] = {"master": "local[2]", "trigger": "200ms"}
    if workers:
        cluster.start()
        spark["master"] = cluster.master
        spark["conf"] = {
            "spark.executor.memory": "768m", "spark.cores.max": str(workers),
            "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
        }  # fmt: skip
    data = {**bench_config_data("jsonl", work / "state", MAX_BATCH), "redis": handle.url}
    (work / "sluice.yaml").write_text(yaml.safe_dump({**data, "spark": spark}))
    proc = SluiceProcess(["run", "-c", str(work / "sluice.yaml")], work / "run.log",
                         env={"SPARK_LOCAL_IP": "127.0.0.1"}).start()  # fmt: skip
    t0, drained = time.monotonic(), False
    try:
        while not drained and time.monotonic() < t0 + 600 and proc.alive():
            time.sleep(0.2)
            drained = stat_counter(handle.client, "events_in") >= sent
    finally:
        proc.stop(timeout_s=120)
        cluster.stop()
    if not drained:
        log(f"  not drained; run log tail: {proc.tail()}")
    records = [orjson.loads(x) for x in handle.client.lrange(BATCHES_KEY, 0, -1)]
    rate = batch_rate([r for r in records if r["events"]])
    return {"drained": drained, "per_s": rate and rate["per_s"],
            "batches": rate and rate["batches"], "seconds": time.monotonic() - t0}  # fmt: skip


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--events", type=int, help="events per run (600k full)")
    ap.add_argument("--runs", type=int, help="runs per mode (2 full)")
    args = ap.parse_args()
    events = args.events or (150_000 if args.quick else 600_000)
    runs = args.runs or (1 if args.quick else 2)
    run = Run("spark_cluster", args)
    by_mode: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in MODES}
    with tempfile.TemporaryDirectory(prefix="sluice-bench-cluster-") as tmp:
        handle = open_redis(None, Path(tmp) / "redis-state")
        try:
            cfg = bench_config("jsonl", Path(tmp) / "pool", MAX_BATCH)
            pool = build_pool(cfg, min(events, 200_000), seed=1, at_ms=now_ms())
            for i in range(runs):
                for name, workers in MODES:
                    work = Path(tmp) / f"run-{i}-{workers}"
                    work.mkdir()
                    log(f"run {i + 1}/{runs}: {name}, {events:,} events")
                    by_mode[name].append(run_once(workers, handle, pool, events, work))
                    log(f"  {by_mode[name][-1]}")
        finally:
            handle.close()
    rows = []
    for name, rs in by_mode.items():
        rates = [r["per_s"] for r in rs if r["per_s"]]
        rows.append({"mode": name, "runs": len(rs), "drained": all(r["drained"] for r in rs),
                     "per_s": median(rates), "each": rates,
                     "batches": median([r["batches"] for r in rs if r["batches"]])})  # fmt: skip
    base = rows[1]["per_s"]
    for row in rows:
        row["vs_1_worker"] = row["per_s"] / base if row["per_s"] and base else None
    run.write({"events": events, "runs": runs, "max_batch": MAX_BATCH}, {"modes": rows})


if __name__ == "__main__":
    main()
