"""`sluice backfill`: fold archived events into the slice store with the live fold's plan.

    archive ─▶ archive_events ─▶ explode_updates ─▶ fold_updates ─▶ write (mapInArrow)
    (Spark reads it)  (bad rows flagged)   (the live fold's plan, one batch)   (write_slices.lua)

The seam. Per metric, `seam = until` rounded down to the metric's coarsest slice, so every slice
of every resolution lies wholly before or wholly after it:

- a slice before the seam belongs to the backfill. Its state is folded from every archived
  event of that slice and *replaces* what the store holds (token `b<seam>` in write_slices.lua),
  so running a backfill again, or after a kill, writes the same states: idempotent, and a
  re-run ends exact. The hash's `_b` rises to the seam, and from then on the live fold skips
  its updates of slices before it (`updates_before_seam`): they are the archive's events.
- a slice at or after the seam belongs to the live fold; the backfill never writes it.

So no event is counted twice, whatever the order of the two, and a nightly re-run with a later
`--until` moves the seam on and rewrites the slices up to it from the fuller archive. Events
that reach neither: those of slices at or after the seam that the live fold never read (it
started after the seam: `warnings` says so, with the metric and when it started folding it).

A re-run of the same backfill (same input files, metrics, bounds and config) skips the
partitions the last one wrote (`sluice:{backfill}:<run>:done`); they would write the same.

`distinct` slices are HyperLogLogs, which a backfill adds to (PFADD is a union, so adding an
event twice changes nothing); the seam does not apply to them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
from pyspark.sql import SparkSession

from sluice.config import Config, MetricConfig
from sluice.errors import SluiceError
from sluice.offline.events import (
    TimeBounds,
    archive_events,
    outside,
    read_archive,
    read_failures,
)
from sluice.offline.fold import fold, offline_config, plan_specs, select_metrics
from sluice.offline.progress import Progress, TaskProgress, Watcher, tasks_key
from sluice.pipeline.definitions import check_definitions
from sluice.pipeline.plan import DEAD_G, MetricSpec
from sluice.pipeline.slice_writes import REPLY_COUNTS, run_write_script
from sluice.pipeline.spark import expression_semantics
from sluice.pipeline.writer import PartitionRows, WriterContext, apply_hll, apply_lua
from sluice.redis.connection import client_for, server_now_ms
from sluice.redis.dump import ZIPLIST_LIMITS, ziplist_limits
from sluice.redis.keys import (
    BACKFILL_PREFIX,
    BACKFILL_RUNS_KEY,
    FOLDING_KEY,
    SEAMS_KEY,
    SPANS_KEY,
    STARTS_KEY,
    slice_hash_key,
)
from sluice.redis.scripts import SWAP_FIELD, script_source
from sluice.slices.aggs import AGGS, BLOB, HLL
from sluice.slices.window import slice_start
from sluice.status.coverage import merged, spans_text, stored_spans
from sluice.units import iso_ms

log = logging.getLogger(__name__)

DONE_TTL_S = 7 * 86_400
RUNS_KEPT = 50
SAMPLES_PER_REASON = 3
RESULT_SCHEMA = pa.schema(
    [
        ("kind", pa.string()),  # "stats", or "dead" (one row per reason)
        ("reason", pa.string()),
        ("rows", pa.int64()),
        ("samples", pa.list_(pa.string())),
        ("events", pa.int64()),
        ("slices", pa.int64()),
        ("expired", pa.int64()),
        ("after_seam", pa.int64()),
        ("skipped", pa.int64()),
    ]
)


RESULT_DDL = (
    "kind string, reason string, rows long, samples array<string>, events long, slices long,"
    " expired long, after_seam long, skipped long"
)


class BackfillError(SluiceError):
    """A backfill that cannot run, or a partition whose writes the store did not take."""


@dataclass
class BackfillReport:
    """What a backfill did. `seams` and `first_slices` are per metric (ms); `dead` counts bad
    rows per reason, `samples` a few of each (the dead-letter record as JSON)."""

    run: str
    metrics: list[str]
    seams: dict[str, int]
    first_slices: dict[str, int | None]
    until_ms: int = 0  # `--until` as given, or the store's clock when it was left out
    events: int = 0
    slices: int = 0
    expired: int = 0
    after_seam: int = 0
    before_start: int = 0  # rows not read: their time is before `--start`
    after_until: int = 0  # ... or at or after the newest seam
    partitions: int = 0
    partitions_skipped: int = 0
    dead: dict[str, int] = field(default_factory=dict)
    samples: dict[str, list[str]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def seam_of(until_ms: int, m: MetricConfig) -> int:
    """`until` rounded down to `m`'s coarsest slice: the first slice the live fold owns."""
    return slice_start(until_ms, max(m.slice_lengths()))


@dataclass(frozen=True)
class _Task:
    """What each write task needs: plain, picklable values."""

    url: str
    cluster: bool
    specs: tuple[MetricSpec, ...]
    bounds: tuple[tuple[int, int], ...]  # per spec: [first slice, seam)
    run_key: str
    restore_new: bool = True
    ziplist: tuple[int, int] = ZIPLIST_LIMITS  # the server's hash-max-ziplist-entries, -value
    ref_ms: int | None = None  # the run's time (`WriterContext.ref_ms`)


class _BoundedRows(PartitionRows):
    """A partition's folded cells, each spec's rows limited to its [first slice, seam)."""

    def __init__(self, batches: Iterator[pa.RecordBatch], task: _Task) -> None:
        super().__init__(batches)
        self.task = task
        self.after_seam = 0

    def rows_of(self, sp: MetricSpec) -> np.ndarray:
        idx = super().rows_of(sp)
        if not len(idx):
            return idx
        lo, seam = self.task.bounds[sp.index]
        s = self.col("s").to_numpy(zero_copy_only=False)[idx]
        self.after_seam += int((s >= seam).sum())
        return idx[(s >= lo) & (s < seam)]


def _replace_blobs(client: Any, task: _Task, rows: _BoundedRows, sp: MetricSpec) -> list[int]:
    """Blob states (sketches): each slice's folded blob replaces the stored one."""
    idx = rows.rows_of(sp)
    if not len(idx):
        return [0] * REPLY_COUNTS
    take = pa.array(idx)
    folded = rows.col(sp.column(AGGS[sp.agg].folds[0].column)).take(take).to_pylist()
    cells: dict[str, list[Any]] = {}
    for k, s, value in zip(rows.col("k").take(take).to_pylist(),
                           rows.col("s").take(take).to_pylist(), folded, strict=True):  # fmt: skip
        cells.setdefault(k, []).extend([str(s), bytes(value)])
    calls = []
    for k, flat in cells.items():
        head = [BLOB, str(sp.slice_ms), str(sp.retention_ms), str(len(flat) // 2), "1"]
        calls.append((slice_hash_key(sp.name, k, sp.resolution_ms), [*head, *flat], (k,)))
    failed: set[tuple[Any, ...]] = set()
    seam = task.bounds[sp.index][1]
    totals = run_write_script(client, f"b{seam}", calls, failed, task.cluster, task.ref_ms)
    if failed:
        raise BackfillError(f"the store did not take {len(failed)} of {sp.name!r}'s sketch calls")
    return totals


def _write_partition(task: _Task, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: write one partition's cells below the seams, yield its counters."""
    from pyspark import TaskContext

    ctx_task = TaskContext.get()
    part = ctx_task.partitionId() if ctx_task is not None else 0
    client = client_for(task.url, timeout_s=60, connect_timeout_s=10)
    try:
        said = TaskProgress(client, task.run_key, part, DONE_TTL_S)
        if client.sismember(f"{task.run_key}:done", part):
            for _ in batches:  # the input must still be drained
                pass
            said.ended(skipped=True)
            yield pa.RecordBatch.from_pylist([{"kind": "stats", "skipped": 1}], RESULT_SCHEMA)
            return
        rows = _BoundedRows(batches, task)
        stats = rows.stats()
        said.took_in(stats["events"])
        totals = [0] * REPLY_COUNTS
        out: list[dict[str, Any]] = []
        if rows.table is not None:
            parts: list[list[int]] = []
            with ThreadPoolExecutor(1, thread_name_prefix="sluice-send") as sender:
                pending = []
                for sp in task.specs:
                    if AGGS[sp.agg].lua:
                        seam = task.bounds[sp.index][1]
                        ctx = WriterContext(task.url, 0, task.specs, "", 0, task.cluster,
                                            script_token=f"b{seam}",
                                            restore_new=task.restore_new,
                                            ziplist=task.ziplist, ref_ms=task.ref_ms)  # fmt: skip
                        pending.append(apply_lua(client, ctx, rows, sp, sender))
                for done in pending:
                    parts.append(done())
                    said.wrote(parts[-1][0], sum(p[0] for p in parts) / rows.n)
            for sp in task.specs:
                if AGGS[sp.agg].state == HLL:
                    parts.append([apply_hll(client, rows, sp), 0, 0, 0])
                elif AGGS[sp.agg].state == BLOB:
                    parts.append(_replace_blobs(client, task, rows, sp))
                else:
                    continue
                said.wrote(parts[-1][0], sum(p[0] for p in parts) / rows.n)
            if rows.failed.any():
                raise BackfillError(
                    f"the store did not take {int(rows.failed.sum())} slice writes; the task"
                    " runs again (a backfill's writes replace, so a retry is exact)"
                )
            totals = [sum(p[j] for p in parts) for j in range(REPLY_COUNTS)]
            # Identical bad rows fold into one record: its `cnt` says how many there were.
            is_dead = pa.array(rows.g == DEAD_G)
            dead = rows.col("k").filter(is_dead).to_pylist()
            counts = rows.col("cnt").filter(is_dead).to_pylist()
            by_reason: dict[str, int] = {}
            samples: dict[str, list[str]] = {}
            for rec, cnt in zip(dead, counts, strict=True):
                reason = orjson.loads(rec)["reason"]
                by_reason[reason] = by_reason.get(reason, 0) + cnt
                kept = samples.setdefault(reason, [])
                if len(kept) < SAMPLES_PER_REASON:
                    kept.append(rec)
            out += [
                {"kind": "dead", "reason": r, "rows": n, "samples": samples[r]}
                for r, n in by_reason.items()
            ]
        head = {"kind": "stats", "events": stats["events"], "slices": totals[0],
                "expired": totals[2], "after_seam": rows.after_seam, "skipped": 0}  # fmt: skip
        out.insert(0, head)
        pipe = client.pipeline(transaction=False)
        pipe.hincrby(task.run_key, "events", stats["events"])
        pipe.hincrby(task.run_key, "slices", totals[0])
        pipe.sadd(f"{task.run_key}:done", part)
        pipe.expire(f"{task.run_key}:done", DONE_TTL_S)
        pipe.expire(task.run_key, DONE_TTL_S)
        pipe.execute()
        said.ended()
    finally:
        client.close()
    yield pa.RecordBatch.from_pylist(out, RESULT_SCHEMA)


def file_versions(spark: SparkSession, files: Sequence[str]) -> list[tuple[str, int, int]]:
    """Each input file (`DataFrame.inputFiles()`) with its size and modification time (ms): what
    tells a file rewritten in place (a re-export, an appended file) from the one read before.
    Local files are stat'ed here; others through their Hadoop filesystem."""
    out = []
    conf = None
    for f in files:
        if f.startswith("file:"):
            st = os.stat(urllib.parse.unquote(urllib.parse.urlparse(f).path))
            out.append((f, st.st_size, st.st_mtime_ns // 1_000_000))
            continue
        jvm = spark.sparkContext._jvm
        assert jvm is not None
        conf = conf or spark.sparkContext._jsc.hadoopConfiguration()
        path = jvm.org.apache.hadoop.fs.Path(f)
        status = path.getFileSystem(conf).getFileStatus(path)
        out.append((f, int(status.getLen()), int(status.getModificationTime())))
    return out


def run_fingerprint(files: Sequence[Any], parts: dict[str, Any]) -> str:
    """A backfill's identity: what it reads (each file with its size and modification time,
    `file_versions`) and what it writes, for skipping done partitions on a re-run. Any change
    (a new file, a file rewritten, other bounds, another metric definition) is a new run."""
    text = json.dumps({"files": sorted(files), **parts}, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=10).hexdigest()


@expression_semantics
def backfill(
    spark: SparkSession,
    cfg: Config,
    input_path: str | Sequence[str],
    fmt: str | None = None,
    metrics: Sequence[str] | None = None,
    start_ms: int | None = None,
    until_ms: int | None = None,
    *,
    url: str | None = None,
    fresh: bool = False,
    progress: Progress | None = None,
    progress_every_s: float = 2.0,
    restore_new: bool = True,
) -> BackfillReport:
    """Fold the archive at `input_path` into the store at `url` (default `cfg.redis`) for
    `metrics` (default all), events with `start_ms <= ts < until_ms` (default: all, up to the
    store's clock now). Blocks until done; calls `progress` every `progress_every_s` from a
    thread of its own. `fresh` writes every partition again, even those a same run already
    wrote. `restore_new` creates the slice hashes that do not exist yet with one RESTORE each
    (`sluice.pipeline.slice_restore`); False sends every hash through the slice script (the
    same store, at more of Redis's time). Raises ArchiveError (path, format, schema),
    ConfigError (metrics) or BackfillError; bad rows are counted in the report, never raised."""
    t0 = time.monotonic()
    chosen = select_metrics(cfg, metrics)
    target = url or cfg.redis
    if target is None:
        raise BackfillError("no Redis to write to: set `redis:` or pass `url`")
    client = client_for(target)
    check_definitions(client, cfg, [m.name for m in chosen])
    now_ms = server_now_ms(client)
    until = now_ms if until_ms is None else until_ms
    if until > now_ms:
        raise BackfillError(
            f"`--until` {until} ({iso_ms(until)}) is after the store's clock ({iso_ms(now_ms)}):"
            " the slices from now on belong to the live fold; leave `--until` out to backfill"
            " up to now"
        )
    seams = {m.name: seam_of(until, m) for m in chosen}
    if all(seams[m.name] <= now_ms - m.retention for m in chosen):
        raise BackfillError(
            f"`--until` {until} ({iso_ms(until)}) is older than the retention of every metric"
            " chosen: nothing before it would be kept. Times are epoch ms or ISO 8601 (epoch"
            " seconds would be this far back)"
        )
    firsts = {
        m.name: None if start_ms is None else slice_start(start_ms, max(m.slice_lengths()))
        for m in chosen
    }
    cfg_off = offline_config(cfg, chosen)
    specs = plan_specs(spark, cfg_off)
    read_from = min((v for v in firsts.values() if v is not None), default=None)
    bounds = TimeBounds(read_from, max(seams.values()))
    raw = read_archive(spark, input_path, fmt, cfg.source.schema_)
    events = archive_events(raw, cfg_off, bounds, ref_ms=now_ms)
    parts = max(cfg.spark.shuffle_partitions, 2 * spark.sparkContext.defaultParallelism)
    # Each slice hash's cells in one partition, so that one call writes all of them.
    _, by_hash = fold(events, cfg_off, specs, by_hash=parts)
    run = run_fingerprint(file_versions(spark, raw.inputFiles()), {
        "metrics": [m.model_dump(mode="json") for m in chosen], "seams": seams,
        "firsts": firsts, "fmt": fmt, "partitions": parts, "schema": cfg.source.schema_,
        "source": cfg.source.model_dump(mode="json", include={"time_field", "max_future",
                                                              "max_string_bytes"}),
    })  # fmt: skip
    run_key = f"{BACKFILL_PREFIX}:{run}"
    if fresh:
        client.delete(run_key, f"{run_key}:done")
    client.delete(run_key, tasks_key(run_key))  # the progress counts this run's writes only
    task = _Task(
        url=target,
        cluster=cfg.redis_cluster,
        specs=tuple(specs),
        bounds=tuple((_or(firsts[sp.name], -(2**62)), seams[sp.name]) for sp in specs),
        run_key=run_key,
        restore_new=restore_new,
        ziplist=ziplist_limits(client),
        ref_ms=now_ms,
    )
    report = BackfillReport(run, [m.name for m in chosen], seams, firsts, until)
    report.warnings += _seam_warnings(client, seams)
    if not fresh and client.scard(f"{run_key}:done") >= parts:  # nothing to read or write
        report.partitions = report.partitions_skipped = parts
        report.warnings.append("this run wrote every partition already: nothing was read"
                               " (--fresh writes them all again)")  # fmt: skip
        report.elapsed_s = round(time.monotonic() - t0, 2)
        _record(client, report)
        client.close()
        return report
    group = f"sluice-backfill-{run}"
    sc = spark.sparkContext
    sc.setJobGroup(group, f"sluice backfill {run}", interruptOnCancel=True)
    watcher = None
    if progress is not None:
        watcher = Watcher(spark, group, client, run_key, parts, progress, progress_every_s)
        watcher.start()
    previous = spark.conf.get("spark.sql.shuffle.partitions") or str(parts)
    spark.conf.set("spark.sql.shuffle.partitions", str(parts))
    try:
        # Every file is read before the shuffle, so before the first write.
        with read_failures(". Nothing was written: fix or remove the file and run again"):
            rows = by_hash.mapInArrow(partial(_write_partition, task), RESULT_DDL).collect()
            report.before_start, report.after_until = outside(raw, cfg, bounds)
    finally:
        if watcher is not None:  # first: the calls below raise once the JVM is gone (Ctrl-C)
            watcher.stopped.set()
        spark.conf.set("spark.sql.shuffle.partitions", previous)
        sc.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]
    for r in rows:
        if r["kind"] == "stats":
            report.partitions += 1
            report.partitions_skipped += r["skipped"] or 0
            report.events += r["events"] or 0
            report.slices += r["slices"] or 0
            report.expired += r["expired"] or 0
            report.after_seam += r["after_seam"] or 0
        else:
            report.dead[r["reason"]] = report.dead.get(r["reason"], 0) + r["rows"]
            kept = report.samples.setdefault(r["reason"], [])
            kept += list(r["samples"])[: SAMPLES_PER_REASON - len(kept)]
    report.elapsed_s = round(time.monotonic() - t0, 2)
    _record(client, report)
    client.close()
    return report


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def _seam_warnings(client: Any, seams: dict[str, int]) -> list[str]:
    """A metric the live fold began folding after its seam may have a gap: the events between
    the seam and that start that the log no longer (or not yet) held when the fold began are in
    neither the backfill's slices nor the live fold's. Those it held, it read."""
    started = client.hmget(FOLDING_KEY, list(seams))
    late: dict[tuple[int, int], list[str]] = {}  # (began, seam) -> the metrics, one line each
    for (name, seam), since in zip(seams.items(), started, strict=True):
        if since is not None and int(since) > seam:
            late.setdefault((int(since), seam), []).append(repr(name))
    out = []
    for (since, seam), names in late.items():
        at, cut = iso_ms(since), iso_ms(seam)
        out.append(
            f"the live fold began folding {', '.join(names)} at {at}, after this backfill's seam"
            f" {cut}: an event of [{cut}, {at}) is in neither side unless the log still held it"
            f" when the fold began (it reads the log from its start); if the log was trimmed,"
            f" or a metric added to a running pipeline, run the backfill again with `--until`"
            f" after {at}"
        )
    return out


def _record(client: Any, report: BackfillReport) -> None:
    """Add the span this run wrote of each metric, [its first slice, its seam) (from 0 for a
    run without `--start`, which wrote the whole archive), to the metric's spans; raise its
    seam, which never moves back (the live fold leaves the slices before it to backfills); keep
    the summary. Each field changes by compare and swap: backfills that end together all
    count."""
    swap = client.register_script(script_source(SWAP_FIELD))
    for name, seam in report.seams.items():
        first = report.first_slices.get(name) or 0
        while True:
            pipe = client.pipeline(transaction=False)
            for key in (SPANS_KEY, SEAMS_KEY, STARTS_KEY):
                pipe.hget(key, name)
            raw, old_seam, start = pipe.execute()
            now = merged([*stored_spans(raw, old_seam, start), (first, seam)])
            if swap(keys=[SPANS_KEY], args=[name, raw or b"", spans_text(now)]):
                break
        while True:
            (old,) = client.hmget(SEAMS_KEY, name)
            if old is not None and int(old) >= seam:
                break
            if swap(keys=[SEAMS_KEY], args=[name, old or b"", seam]):
                break
    pipe = client.pipeline(transaction=False)
    pipe.lpush(BACKFILL_RUNS_KEY, orjson.dumps(report.as_dict()))
    pipe.ltrim(BACKFILL_RUNS_KEY, 0, RUNS_KEPT - 1)
    pipe.execute()


__all__ = ["BackfillError", "BackfillReport", "backfill", "seam_of"]
