"""The offline benchmark's backfill side: archives of the ingest workloads as Parquet, the
bare engine's batch fold of them, the CPU each process takes, Spark's stages' times, and the
store's count check."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from lib.load import HIGHCARD, HIGHCARD_METRICS, METRICS, KeySpace, bench_config, highcard_frame
from lib.procs import CLK_TCK, CpuSnapshot, children
from sluice.config import Config
from sluice.offline.backfill import seam_of
from sluice.offline.events import TimeBounds, archive_events, read_archive
from sluice.offline.fold import fold, offline_config, plan_specs, select_metrics
from sluice.redis.keys import SLICE_PREFIX
from sluice.source.loadgen import EventGenerator

ARCHIVE_FILES = 8  # an archive is many files; Spark reads them as one task or more each
RETENTION = "1d"  # the ingest metrics keep 1 h: an archive of hours needs longer


def workload_config(workload: str, state_dir: Path) -> Config:
    """The ingest benchmark's metrics of `workload` (`highcard`: lib.load.HIGHCARD_METRICS;
    `zipf`: lib.load.METRICS), each kept for RETENTION."""
    metrics = HIGHCARD_METRICS if workload == "highcard" else METRICS
    kept = [{**m, "retention": RETENTION} for m in metrics]
    return bench_config("jsonl", state_dir, 1000, metrics=kept)


def archive_frame(cfg: Config, workload: str, n_events: int, seed: int, until_ms: int,
                  span_ms: int) -> pd.DataFrame:  # fmt: skip
    """`n_events` events of `workload` with times uniform over [until_ms - span_ms, until_ms),
    in time order, as an archive is written: `highcard` keys uniform over HIGHCARD's cards and
    merchants (`lib.load.highcard_frame`), `zipf` the throughput benchmark's Zipf keys
    (`EventGenerator`, its times replaced)."""
    if workload == "highcard":
        space = KeySpace(HIGHCARD.cards, HIGHCARD.merchants, span_ms)
        df = highcard_frame(n_events, seed, until_ms - 1, space)
    else:
        df = EventGenerator(cfg, seed=seed).frame(n_events, until_ms)
        rng = np.random.default_rng([seed, 99])
        df["ts"] = until_ms - 1 - rng.integers(0, span_ms, n_events).astype(np.int64)
    return df.sort_values("ts", kind="stable").reset_index(drop=True)


def write_archive(df: pd.DataFrame, where: Path, files: int = ARCHIVE_FILES) -> int:
    """`df` as `files` Parquet files under `where` (consecutive runs of rows); the bytes."""
    where.mkdir(parents=True, exist_ok=True)
    step = -(-len(df) // files)
    for i in range(files):
        df.iloc[i * step : (i + 1) * step].to_parquet(where / f"part-{i:03d}.parquet", index=False)
    return sum(p.stat().st_size for p in where.glob("*.parquet"))


def bare_fold(spark: Any, cfg: Config, path: str, until_ms: int, ref_ms: int,
              partitions: int) -> None:  # fmt: skip
    """What `offline.backfill` computes before its write, with a no-op write instead: the
    archive read, `archive_events` bounded by the same seams, the plan's explode and fold, over
    `partitions` shuffle partitions (as the backfill sets them)."""
    chosen = select_metrics(cfg, None)
    cfg_off = offline_config(cfg, chosen)
    specs = plan_specs(spark, cfg_off)
    bounds = TimeBounds(None, max(seam_of(until_ms, m) for m in chosen))
    events = archive_events(read_archive(spark, path, None, cfg.source.schema_), cfg_off, bounds,
                            ref_ms=ref_ms)  # fmt: skip
    _, folded = fold(events, cfg_off, specs)
    before = spark.conf.get("spark.sql.shuffle.partitions")
    spark.conf.set("spark.sql.shuffle.partitions", str(partitions))
    try:
        folded.write.format("noop").mode("overwrite").save()
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", before)


def parties(redis_pid: int | None) -> dict[str, list[int]]:
    """Pids per component: Redis, the JVM (a `java` child of this process), the Python workers
    (the JVM's descendants), the driver (this process)."""
    jvms = []
    for p in children(os.getpid()):
        try:
            exe = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0", 1)[0]
        except OSError:
            continue
        if exe.endswith(b"java"):
            jvms.append(p)
    workers, todo = [], [c for j in jvms for c in children(j)]
    while todo:
        workers.append(p := todo.pop())
        todo += children(p)
    return {"redis": [redis_pid] if redis_pid else [], "jvm": jvms, "python_workers": workers,
            "driver": [os.getpid()]}  # fmt: skip


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and of the children it has reaped: Redis's AOF
    rewrites, the Python workers that exited (0 if it is gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    return sum(int(x) for x in text[text.rindex(")") + 2 :].split()[11:15]) / CLK_TCK


def snapshot(redis_pid: int | None) -> CpuSnapshot:
    """`lib.procs.CpuSnapshot` of `parties`, each counted with its reaped children (`cpu_s`)."""
    pids = parties(redis_pid)
    snap = CpuSnapshot.take(pids)
    snap.parties = {k: sum(map(cpu_s, v)) for k, v in pids.items()}
    return snap


class StageClock(threading.Thread):
    """Spark's stages while it runs: each stage's name and the span it was seen active, from
    the status tracker polled every `every_s` (so a stage's time is good to about that)."""

    def __init__(self, spark: Any, every_s: float = 0.1) -> None:
        super().__init__(name="bench-stage-clock", daemon=True)
        self.tracker, self.every_s = spark.sparkContext.statusTracker(), every_s
        self.seen: dict[int, list[Any]] = {}  # stage -> [name, first, last]
        self._stop_evt = threading.Event()

    def run(self) -> None:
        while not self._stop_evt.wait(self.every_s):
            now = time.monotonic()
            for sid in self.tracker.getActiveStageIds():
                if sid in self.seen:
                    self.seen[sid][2] = now
                elif info := self.tracker.getStageInfo(sid):
                    self.seen[sid] = [info.name, now, now]

    def stop(self) -> list[dict[str, Any]]:
        """Stop; the stages in order, each with its name and seconds."""
        self._stop_evt.set()
        self.join()
        return [{"stage": k, "name": v[0], "s": round(v[2] - v[1], 2)}
                for k, v in sorted(self.seen.items())]  # fmt: skip


def timed(spark: Any, fn: Callable[[], Any], redis_pid: int | None = None
          ) -> tuple[Any, float, dict[str, float], list[dict[str, Any]]]:  # fmt: skip
    """(fn(), wall seconds, cores per component over the call, Spark's stages meanwhile)."""
    clock = StageClock(spark)
    snap, load, t0 = snapshot(redis_pid), os.getloadavg()[0], time.perf_counter()
    clock.start()
    try:
        out = fn()
    finally:
        stages = clock.stop()
    wall = time.perf_counter() - t0
    cores = snapshot(redis_pid).cores_since(snap)
    return out, wall, cores | {"load_1m": load}, stages


def stored_count(client: Any, metric: str) -> int:
    """A count metric summed over every key and slice of its finest resolution: each slice field
    holds `<token>:<count>` (a backfill's token is `b<seam>`); fields `_m`, `_b` are the hash's
    own."""
    keys = [k for k in client.scan_iter(match=f"{SLICE_PREFIX}{{{metric}|*", count=5000)
            if b":r" not in k.rsplit(b"}", 1)[1]]  # fmt: skip
    total = 0
    for i in range(0, len(keys), 1000):
        pipe = client.pipeline(transaction=False)
        for key in keys[i : i + 1000]:
            pipe.hgetall(key)
        for fields in pipe.execute():
            total += sum(int(v.split(b":")[1]) for f, v in fields.items() if not f.startswith(b"_"))
    return total
