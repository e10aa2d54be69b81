"""Sluice on a local Spark standalone cluster: 1 worker against 2, and 1 worker joined by a 2nd
while the pipeline runs.

    .venv/bin/python bench/spark_cluster.py            # full: 2M events, 2 runs per mode
    .venv/bin/python bench/spark_cluster.py --quick    # 1M events, 1 run per mode

`sluice run` drains the same pre-filled input on `local[2]`, on a cluster of 1 and of 2 workers
(`sluice.testing.standalone`), and on a cluster of 1 worker that gets a second
(`StandaloneCluster.add_worker`) once a third of the input is folded; modes interleaved. For
that mode: the batch rate before the add and after the new executor's first task, the time
from the add to that task, and the cores each party used in both windows. Writes
bench/results/spark_cluster[.quick].json.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import yaml

from lib.load import LoadPool, bench_config, bench_config_data, build_pool, now_ms, prefill
from lib.procs import CpuSampler, SluiceProcess, descendants, stat_counter
from lib.results import Run, log, parser
from lib.stats import batch_rate, median
from sluice.redis.connection import RedisHandle, open_redis
from sluice.redis.keys import BATCHES_KEY
from sluice.testing.standalone import StandaloneCluster

MAX_BATCH = 50_000
# (mode, workers at the start, whether a worker joins mid-run)
MODES = (
    ("local[2] (no cluster)", 0, False),
    ("1 worker, 1 core", 1, False),
    ("2 workers, 1 core each", 2, False),
    ("1 worker, a 2nd added mid-run", 1, True),
)
ADD_AT = 1 / 3  # the share of the input folded when the second worker is added


def parties(proc: SluiceProcess, cluster: StandaloneCluster,
            redis_pid: int | None) -> dict[str, list[int]]:  # fmt: skip
    """Pids per party: the driver (`sluice run` and its JVM), the Spark daemons (master and
    workers), the executors (the workers' descendants: executor JVMs and their Python workers),
    Redis. A process that exits between two samples takes its CPU with it (an undercount)."""
    daemons = [p.pid for p in cluster.procs]
    return {"driver": proc.pids(), "spark daemons": daemons,
            "executors": [d for p in daemons for d in descendants(p)],
            "redis": [redis_pid] if redis_pid else []}  # fmt: skip


def window(records: Sequence[dict[str, Any]], sampler: CpuSampler) -> dict[str, Any] | None:
    """The rate of `records` (`batch_rate`: the first one's end to the last one's) and the cores
    each party used over the same span; None for fewer than 2 records."""
    rate = batch_rate(records)
    if rate is None:
        return None
    cores = sampler.cores_between(records[0]["done_ms"], records[-1]["done_ms"])
    return {"per_s": rate["per_s"], "batches": rate["batches"], "events": rate["events"],
            "cores": cores and {k: round(v, 2) for k, v in cores.items()}}  # fmt: skip


def run_once(workers: int, grow: bool, handle: RedisHandle, pool: LoadPool, n_events: int,
             work: Path) -> dict[str, Any]:  # fmt: skip
    """Pre-fill, start the cluster (if any) and `sluice run`, wait for the drain (with `grow`,
    adding a worker once ADD_AT of the input is in), stop both."""
    handle.client.flushall()
    sent = prefill(handle.url, pool, n_events)
    cluster = StandaloneCluster(work / "spark", workers=workers, cores=1)
    spark: dict[str, Any] = {"master": "local[2]", "trigger": "200ms"}
    if workers:
        cluster.start()
        spark["master"] = cluster.master
        spark["conf"] = {
            "spark.executor.memory": "768m", "spark.cores.max": str(workers + grow),
            "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
        }  # fmt: skip
    data = {**bench_config_data("jsonl", work / "state", MAX_BATCH), "redis": handle.url}
    (work / "sluice.yaml").write_text(yaml.safe_dump({**data, "spark": spark}))
    proc = SluiceProcess(["run", "-c", str(work / "sluice.yaml")], work / "run.log",
                         env={"SPARK_LOCAL_IP": "127.0.0.1"}).start()  # fmt: skip
    redis_pid = handle.embedded.pid if handle.embedded else None
    sampler = CpuSampler(lambda: parties(proc, cluster, redis_pid))
    sampler.start()
    added: int | None = None
    # epoch ms, as in the batch records: the add called, the worker alive, its first task seen
    add_ms: float | None = None
    alive_ms: float | None = None
    first_task_ms: float | None = None
    t0, drained = time.monotonic(), False
    try:
        while not drained and time.monotonic() < t0 + 600 and proc.alive():
            time.sleep(0.2)
            folded = stat_counter(handle.client, "events_in")
            drained = folded >= sent
            if grow and added is None and folded >= ADD_AT * sent:
                add_ms = time.time() * 1000
                added = cluster.add_worker()
                alive_ms = time.time() * 1000
            if added is not None and first_task_ms is None and cluster.tasks_started(added):
                first_task_ms = time.time() * 1000
    finally:
        time.sleep(2 * sampler.every_s)  # so that a sample follows the last batch's end
        sampler.stop()
        proc.stop(timeout_s=120)
        cluster.stop()
    if not drained:
        log(f"  not drained; run log tail: {proc.tail()}")
    records = sorted((orjson.loads(x) for x in handle.client.lrange(BATCHES_KEY, 0, -1)),
                     key=lambda r: r["batch"])  # fmt: skip
    records = [r for r in records if r["events"]]
    rate = batch_rate(records)
    counted = stat_counter(handle.client, "events_in")
    whole = window(records, sampler)
    out: dict[str, Any] = {
        "drained": drained, "per_s": rate and rate["per_s"], "batches": rate and rate["batches"],
        "seconds": time.monotonic() - t0, "sent": sent, "events_in": counted,
        "exact": counted == sent, "cores": whole and whole["cores"],
    }  # fmt: skip
    if grow and add_ms is not None:
        # Before: the batches done before the add. After: those started once the new executor
        # had started a task (both executors at work). The batches in between are left out.
        before = [r for r in records if r["done_ms"] <= add_ms]
        after = [r for r in records if first_task_ms and r["started_ms"] >= first_task_ms]
        rates = {"before": window(before, sampler), "after": window(after, sampler)}
        out["grow"] = {
            **rates, "alive_s": alive_ms and (alive_ms - add_ms) / 1000,
            "first_task_s": first_task_ms and (first_task_ms - add_ms) / 1000,
            "after_vs_before": rates["after"]["per_s"] / rates["before"]["per_s"]
            if rates["after"] and rates["before"] and rates["before"]["per_s"] else None,
        }  # fmt: skip
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--events", type=int, help="events per run (2M full)")
    ap.add_argument("--runs", type=int, help="runs per mode (2 full)")
    args = ap.parse_args()
    # The mode that adds a worker needs a drain long enough to outlast the new worker's start.
    events = args.events or (1_000_000 if args.quick else 2_000_000)
    runs = args.runs or (1 if args.quick else 2)
    run = Run("spark_cluster", args)
    by_mode: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in MODES}
    with tempfile.TemporaryDirectory(prefix="sluice-bench-cluster-") as tmp:
        handle = open_redis(None, Path(tmp) / "redis-state")
        try:
            cfg = bench_config("jsonl", Path(tmp) / "pool", MAX_BATCH)
            pool = build_pool(cfg, min(events, 200_000), seed=1, at_ms=now_ms())
            for i in range(runs):
                for m, (name, workers, grow) in enumerate(MODES):
                    work = Path(tmp) / f"run-{i}-{m}"
                    work.mkdir()
                    log(f"run {i + 1}/{runs}: {name}, {events:,} events")
                    by_mode[name].append(run_once(workers, grow, handle, pool, events, work))
                    log(f"  {by_mode[name][-1]}")
        finally:
            handle.close()
    rows: list[dict[str, Any]] = []
    for name, rs in by_mode.items():
        rates = [r["per_s"] for r in rs if r["per_s"]]
        rows.append({"mode": name, "runs": len(rs), "drained": all(r["drained"] for r in rs),
                     "exact": all(r["exact"] for r in rs), "per_s": median(rates), "each": rates,
                     "batches": median([r["batches"] for r in rs if r["batches"]])})  # fmt: skip
    base = rows[1]["per_s"]
    for row in rows:
        row["vs_1_worker"] = row["per_s"] / base if row["per_s"] and base else None
    grown = [{**r.get("grow", {}), "exact": r["exact"], "sent": r["sent"],
              "events_in": r["events_in"]} for r in by_mode[MODES[-1][0]]]  # fmt: skip
    run.write({"events": events, "runs": runs, "max_batch": MAX_BATCH, "add_at": ADD_AT},
              {"modes": rows, "grown": grown})  # fmt: skip


if __name__ == "__main__":
    main()
